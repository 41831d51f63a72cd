use std::time::{Duration, SystemTime};

use crate::checks::check_submit;
use crate::{KeyMode, RunWhen, TaskSpec};

fn refusal(spec: TaskSpec) -> String {
    check_submit(&spec.proto(), "tasks[2].", 1 << 20)
        .expect_err("refused")
        .to_string()
}

#[test]
fn a_valid_task_passes() {
    let spec = TaskSpec::new("emails")
        .json(&serde_json::json!({"to": "a@example.com"}))
        .unwrap()
        .key("k".repeat(256))
        .group_key("g".repeat(256))
        .max_attempts(1000)
        .timeout(Duration::from_millis(604_800_000))
        .depends_on(7u64)
        .depends_on("other")
        .run_when(RunWhen::DependenciesEnded)
        .key_ttl(Duration::from_millis(31_622_400_000))
        .start_by(SystemTime::now() + Duration::from_secs(60));
    check_submit(&spec.proto(), "", 1 << 20).unwrap();
}

#[test]
fn key_options_the_server_takes_pass() {
    let day = Duration::from_secs(86_400);
    let debounced = TaskSpec::new("p")
        .key("k")
        .key_mode(KeyMode::Debounce)
        .debounce(Duration::from_millis(604_800_000))
        .max_debounce(7 * day)
        .start_by(SystemTime::now() + day);
    let replacing = TaskSpec::new("p")
        .key("k")
        .key_mode(KeyMode::ReplacePending)
        .delay(day)
        .start_by(SystemTime::now() + 2 * day);
    // Unspecified takes the pool's default_key_mode, which may be a debounce, with its own
    // debounce.
    let pool_default = TaskSpec::new("p").key("k").debounce(Duration::from_secs(1));
    let pool_debounce = TaskSpec::new("p").key("k").key_mode(KeyMode::Debounce);
    let keyless = TaskSpec::new("p").key_mode(KeyMode::ReturnExisting);
    for spec in [debounced, replacing, pool_default, pool_debounce, keyless] {
        check_submit(&spec.proto(), "", 1 << 20).unwrap();
    }
}

#[test]
fn each_key_option_rule_names_the_field_and_value() {
    let keyed = || TaskSpec::new("p").key("k");
    let debounced = || keyed().key_mode(KeyMode::Debounce);
    let ms = Duration::from_millis;
    let cases = [
        (
            debounced().debounce(ms(604_800_001)),
            "INVALID_ARGUMENT: tasks[2].debounce_ms: 604800001 is not between 0 and 604800000 (at most 7 days)",
        ),
        (
            debounced().debounce(ms(5)).max_debounce(ms(604_800_001)),
            "tasks[2].max_debounce_ms: 604800001 is not between 0 and 604800000",
        ),
        (
            keyed().key_ttl(ms(31_622_400_001)),
            "tasks[2].key_ttl_ms: 31622400001 is not between 0 and 31622400000",
        ),
        (
            TaskSpec::new("p").key_mode(KeyMode::ReplacePending),
            "tasks[2].key: required with key_mode KEY_MODE_REPLACE_PENDING",
        ),
        (
            TaskSpec::new("p")
                .key_mode(KeyMode::Debounce)
                .debounce(ms(5)),
            "tasks[2].key: required with key_mode KEY_MODE_DEBOUNCE",
        ),
        (
            TaskSpec::new("p").key_ttl(ms(60_000)),
            "tasks[2].key: required with key_ttl_ms 60000",
        ),
        (
            TaskSpec::new("p").debounce(ms(5)),
            "tasks[2].key: required with debounce_ms 5",
        ),
        (
            TaskSpec::new("p").max_debounce(ms(5)),
            "tasks[2].key: required with max_debounce_ms 5",
        ),
        (
            keyed().key_mode(KeyMode::ReplacePending).debounce(ms(5)),
            "tasks[2].debounce_ms: 5 applies only with KEY_MODE_DEBOUNCE, not KEY_MODE_REPLACE_PENDING",
        ),
        (
            keyed()
                .key_mode(KeyMode::ReturnExisting)
                .max_debounce(ms(9)),
            "tasks[2].max_debounce_ms: 9 applies only with KEY_MODE_DEBOUNCE, not KEY_MODE_RETURN_EXISTING",
        ),
        (
            debounced().debounce(ms(10)).max_debounce(ms(9)),
            "tasks[2].max_debounce_ms: 9 is less than debounce_ms 10",
        ),
        (
            keyed().debounce(ms(10)).max_debounce(ms(9)),
            "tasks[2].max_debounce_ms: 9 is less than debounce_ms 10",
        ),
        (
            debounced().debounce(ms(10)).delay(ms(1000)),
            "tasks[2].run_at: not with KEY_MODE_DEBOUNCE",
        ),
    ];
    for (spec, expected) in cases {
        let message = refusal(spec);
        assert!(
            message.contains(expected),
            "{message:?} does not contain {expected:?}"
        );
    }
}

#[test]
fn start_by_must_be_after_run_at_and_in_the_timestamp_range() {
    let at = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
    let mut spec = TaskSpec::new("p").start_by(at(1_800_000_000));
    spec.run_at = Some(at(1_800_000_000));
    assert!(refusal(spec).contains(
        "tasks[2].start_by: 2027-01-15T08:00:00Z is not after run_at 2027-01-15T08:00:00Z"
    ));
    let mut spec = TaskSpec::new("p").start_by(at(1_800_000_001));
    spec.run_at = Some(at(1_800_000_000));
    check_submit(&spec.proto(), "", 1 << 20).unwrap();
    let spec = TaskSpec::new("p").start_by(at(253_402_300_800));
    assert!(refusal(spec).contains("tasks[2].start_by: seconds 253402300800, nanos 0 is outside"));
    let mut request = TaskSpec::new("p").key("k").proto();
    request.key_mode = 9;
    let refused = check_submit(&request, "", 1 << 20).unwrap_err().to_string();
    assert!(refused.contains("key_mode: unknown value 9"), "{refused}");
}

#[test]
fn each_rule_names_the_field_and_value() {
    let cases = [
        (
            TaskSpec::new(""),
            "INVALID_ARGUMENT: tasks[2].pool: required",
        ),
        (
            TaskSpec::new("p".repeat(257)),
            "tasks[2].pool: 257 characters, more than 256",
        ),
        (
            TaskSpec::new("a\u{7f}b"),
            "tasks[2].pool: control character '\\u{7f}' in \"a\\u{7f}b\"",
        ),
        (
            TaskSpec::new("p").key("é".repeat(257)),
            "tasks[2].key: 257 characters, more than 256",
        ),
        (
            TaskSpec::new("p").key("a\u{2028}"),
            "tasks[2].key: control character '\\u{2028}'",
        ),
        (
            TaskSpec::new("p").key("schedule:x"),
            "tasks[2].key: \"schedule:x\": keys starting with \"schedule:\" are reserved",
        ),
        (
            TaskSpec::new("p").bytes(b"x".to_vec(), "t\u{202e}"),
            "tasks[2].content_type: control character '\\u{202e}'",
        ),
        (
            TaskSpec::new("p").group_key("é".repeat(129)),
            "tasks[2].group_key: 258 bytes, more than 256",
        ),
        (
            TaskSpec::new("p").group_key("\u{2066}"),
            "tasks[2].group_key: control character '\\u{2066}'",
        ),
        (
            TaskSpec::new("p").bytes(vec![0; (1 << 20) + 1], ""),
            "tasks[2].payload: 1048577 bytes exceeds max_payload_bytes 1048576",
        ),
        (
            TaskSpec::new("p").max_attempts(1001),
            "tasks[2].max_attempts: 1001 is not between 0 and 1000",
        ),
        (
            TaskSpec::new("p").max_attempts(-1),
            "tasks[2].max_attempts: -1 is not between 0 and 1000",
        ),
        (
            TaskSpec::new("p").timeout(Duration::from_millis(604_800_001)),
            "tasks[2].timeout_ms: 604800001 is not between 0 and 604800000",
        ),
        (
            TaskSpec::new("p").depends_on(0u64),
            "tasks[2].depends_on[0].id: 0 is not a task id",
        ),
        (
            TaskSpec::new("p").depends_on(1u64).depends_on("a\n"),
            "tasks[2].depends_on[1].key: control character '\\n'",
        ),
        (
            TaskSpec::new("p").key("me").depends_on("me"),
            "tasks[2].depends_on: task depends on its own key \"me\"",
        ),
    ];
    for (spec, expected) in cases {
        let message = refusal(spec);
        assert!(
            message.contains(expected),
            "{message:?} does not contain {expected:?}"
        );
    }
}

#[test]
fn run_at_outside_the_timestamp_range_is_refused() {
    let mut spec = TaskSpec::new("p");
    spec.run_at = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(253_402_300_800));
    assert!(refusal(spec).contains("tasks[2].run_at: seconds 253402300800, nanos 0 is outside"));
    let mut request = TaskSpec::new("p").proto();
    request.run_when = 9;
    let refused = check_submit(&request, "", 1 << 20).unwrap_err().to_string();
    assert!(refused.contains("run_when: unknown value 9"), "{refused}");
}

#[test]
fn a_raised_payload_bound_admits_more() {
    let spec = TaskSpec::new("p").bytes(vec![0; (1 << 20) + 1], "");
    check_submit(&spec.proto(), "", 2 << 20).unwrap();
}
