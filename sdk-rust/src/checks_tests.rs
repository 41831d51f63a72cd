use std::time::{Duration, SystemTime};

use crate::checks::check_submit;
use crate::{RunWhen, TaskSpec};

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
        .run_when(RunWhen::DependenciesEnded);
    check_submit(&spec.proto(), "", 1 << 20).unwrap();
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
