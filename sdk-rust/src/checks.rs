//! The server's rules for what a caller sends, checked client-side where a refusal could not
//! come from the server in time (a progress message, a task inserted into an outbox table).

// The submission checks serve the outbox features only (their tests run without them too).
#![cfg_attr(
    not(any(feature = "outbox", feature = "outbox-sqlx")),
    allow(dead_code)
)]

use crate::error::Error;
use crate::proto;

/// The longest pool name, key or content type, in characters.
const MAX_NAME_CHARS: usize = 256;
/// The longest group key, in UTF-8 bytes.
const MAX_GROUP_KEY_BYTES: usize = 256;
/// Keys starting with it belong to schedules' tasks (a submission could suppress a future fire).
const SCHEDULE_KEY_PREFIX: &str = "schedule:";
const MAX_ATTEMPTS: i64 = 1000;
/// 7 days, as a pool's `timeout` is bounded.
const MAX_TIMEOUT_MS: i64 = 7 * 86_400_000;
/// 7 days: a debounce (debounce_ms, max_debounce_ms) is bounded as a timeout is.
const MAX_DEBOUNCE_MS: i64 = 7 * 86_400_000;
/// 366 days: how long a key may stay held after its task ended.
const MAX_KEY_TTL_MS: i64 = 366 * 86_400_000;
/// A Timestamp's range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z.
const MIN_TIMESTAMP_S: i64 = -62_135_596_800;
const MAX_TIMESTAMP_S: i64 = 253_402_300_799;

/// A character the server refuses in a caller's text: a control character (C0, DEL, C1), a line
/// separator or a bidi control (they forge log lines, or show a text in another order than stored).
pub(crate) fn is_refused_in_text(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// A caller-chosen name: at most `limit` characters (or UTF-8 bytes), no refused character.
fn check_text(field: &str, value: &str, limit: usize, in_bytes: bool) -> Result<(), Error> {
    let (size, unit) = if in_bytes {
        (value.len(), "bytes")
    } else {
        (value.chars().count(), "characters")
    };
    if size > limit {
        let shown: String = value.chars().take(64).collect();
        return Err(Error::InvalidArgument(format!(
            "{field}: {size} {unit}, more than {limit}: {shown:?}"
        )));
    }
    if let Some(bad) = value.chars().find(|&c| is_refused_in_text(c)) {
        return Err(Error::InvalidArgument(format!(
            "{field}: control character {bad:?} in {value:?}"
        )));
    }
    Ok(())
}

fn check_range(field: &str, value: i64, low: i64, high: i64, meaning: &str) -> Result<(), Error> {
    if !(low..=high).contains(&value) {
        return Err(Error::InvalidArgument(format!(
            "{field}: {value} is not between {low} and {high} ({meaning})"
        )));
    }
    Ok(())
}

fn check_timestamp(field: &str, ts: Option<&prost_types::Timestamp>) -> Result<(), Error> {
    if let Some(ts) = ts
        && !((MIN_TIMESTAMP_S..=MAX_TIMESTAMP_S).contains(&ts.seconds)
            && (0..1_000_000_000).contains(&ts.nanos))
    {
        return Err(Error::InvalidArgument(format!(
            "{field}: seconds {}, nanos {} is outside the Timestamp range (0001-01-01 to 9999-12-31)",
            ts.seconds, ts.nanos
        )));
    }
    Ok(())
}

/// A Timestamp as the server compares it: in whole microseconds.
fn micros(ts: &prost_types::Timestamp) -> (i64, i32) {
    (ts.seconds, ts.nanos / 1000)
}

/// The key options (key_mode, debounce_ms, max_debounce_ms, key_ttl_ms) as the server checks
/// them. Unspecified key_mode takes the pool's default_key_mode (and a debounce pool's default
/// debounce), unknown here: only what every pool refuses is refused then.
fn check_key_options(req: &proto::SubmitTaskRequest, at: &str) -> Result<(), Error> {
    let debounce_meaning = "at most 7 days";
    let debounce = format!("{at}debounce_ms");
    check_range(
        &debounce,
        req.debounce_ms,
        0,
        MAX_DEBOUNCE_MS,
        debounce_meaning,
    )?;
    let max_debounce_meaning = "at most 7 days; 0: no bound";
    let max_debounce = format!("{at}max_debounce_ms");
    check_range(
        &max_debounce,
        req.max_debounce_ms,
        0,
        MAX_DEBOUNCE_MS,
        max_debounce_meaning,
    )?;
    let key_ttl_meaning = "at most 366 days; 0: the key is held until the task is deleted";
    let key_ttl = format!("{at}key_ttl_ms");
    check_range(&key_ttl, req.key_ttl_ms, 0, MAX_KEY_TTL_MS, key_ttl_meaning)?;
    let Ok(mode) = proto::KeyMode::try_from(req.key_mode) else {
        return Err(Error::InvalidArgument(format!(
            "{at}key_mode: unknown value {}",
            req.key_mode
        )));
    };
    if req.key.is_empty() {
        if matches!(
            mode,
            proto::KeyMode::ReplacePending | proto::KeyMode::Debounce
        ) {
            return Err(Error::InvalidArgument(format!(
                "{at}key: required with key_mode {}",
                mode.as_str_name()
            )));
        }
        let options = [
            ("key_ttl_ms", req.key_ttl_ms),
            ("debounce_ms", req.debounce_ms),
            ("max_debounce_ms", req.max_debounce_ms),
        ];
        if let Some((field, value)) = options.iter().find(|(_, value)| *value != 0) {
            return Err(Error::InvalidArgument(format!(
                "{at}key: required with {field} {value}"
            )));
        }
        return Ok(());
    }
    match mode {
        proto::KeyMode::ReturnExisting | proto::KeyMode::ReplacePending => {
            let debounces = [
                ("debounce_ms", req.debounce_ms),
                ("max_debounce_ms", req.max_debounce_ms),
            ];
            if let Some((field, value)) = debounces.iter().find(|(_, value)| *value != 0) {
                return Err(Error::InvalidArgument(format!(
                    "{at}{field}: {value} applies only with KEY_MODE_DEBOUNCE, not {}",
                    mode.as_str_name()
                )));
            }
        }
        proto::KeyMode::Debounce | proto::KeyMode::Unspecified => {
            if req.debounce_ms != 0
                && req.max_debounce_ms != 0
                && req.max_debounce_ms < req.debounce_ms
            {
                return Err(Error::InvalidArgument(format!(
                    "{at}max_debounce_ms: {} is less than debounce_ms {}",
                    req.max_debounce_ms, req.debounce_ms
                )));
            }
        }
    }
    if mode == proto::KeyMode::Debounce && req.run_at.is_some() {
        return Err(Error::InvalidArgument(format!(
            "{at}run_at: not with KEY_MODE_DEBOUNCE (debounce_ms says when it runs)"
        )));
    }
    Ok(())
}

/// What the server checks of a submission without its configuration (pools, resources): each
/// refusal names the field (after `at`, e.g. `tasks[3].`) and the value, as the server's does.
pub(crate) fn check_submit(
    req: &proto::SubmitTaskRequest,
    at: &str,
    max_payload_bytes: usize,
) -> Result<(), Error> {
    if req.pool.is_empty() {
        return Err(Error::InvalidArgument(format!("{at}pool: required")));
    }
    check_text(&format!("{at}pool"), &req.pool, MAX_NAME_CHARS, false)?;
    check_text(&format!("{at}key"), &req.key, MAX_NAME_CHARS, false)?;
    if req.key.starts_with(SCHEDULE_KEY_PREFIX) {
        return Err(Error::InvalidArgument(format!(
            "{at}key: {:?}: keys starting with {SCHEDULE_KEY_PREFIX:?} are reserved for schedules",
            req.key
        )));
    }
    let content_type = format!("{at}content_type");
    check_text(&content_type, &req.content_type, MAX_NAME_CHARS, false)?;
    let group_key = format!("{at}group_key");
    check_text(&group_key, &req.group_key, MAX_GROUP_KEY_BYTES, true)?;
    if req.payload.len() > max_payload_bytes {
        return Err(Error::InvalidArgument(format!(
            "{at}payload: {} bytes exceeds max_payload_bytes {max_payload_bytes}",
            req.payload.len()
        )));
    }
    let attempts = i64::from(req.max_attempts);
    let attempts_meaning = "0 takes the pool's default";
    check_range(
        &format!("{at}max_attempts"),
        attempts,
        0,
        MAX_ATTEMPTS,
        attempts_meaning,
    )?;
    let timeout_meaning = "at most 7 days; 0 takes the pool's timeout";
    let timeout = format!("{at}timeout_ms");
    check_range(&timeout, req.timeout_ms, 0, MAX_TIMEOUT_MS, timeout_meaning)?;
    check_timestamp(&format!("{at}run_at"), req.run_at.as_ref())?;
    check_timestamp(&format!("{at}start_by"), req.start_by.as_ref())?;
    if proto::RunWhen::try_from(req.run_when).is_err() {
        return Err(Error::InvalidArgument(format!(
            "{at}run_when: unknown value {}",
            req.run_when
        )));
    }
    if let (Some(start_by), Some(run_at)) = (&req.start_by, &req.run_at)
        && micros(start_by) <= micros(run_at)
    {
        return Err(Error::InvalidArgument(format!(
            "{at}start_by: {start_by} is not after run_at {run_at}"
        )));
    }
    check_key_options(req, at)?;
    for (i, dependency) in req.depends_on.iter().enumerate() {
        match &dependency.r#ref {
            Some(proto::task_ref::Ref::Id(0)) => {
                return Err(Error::InvalidArgument(format!(
                    "{at}depends_on[{i}].id: 0 is not a task id"
                )));
            }
            Some(proto::task_ref::Ref::Id(_)) => {}
            Some(proto::task_ref::Ref::Key(key)) => {
                let field = format!("{at}depends_on[{i}].key");
                check_text(&field, key, MAX_NAME_CHARS, false)?;
                if !req.key.is_empty() && *key == req.key {
                    return Err(Error::InvalidArgument(format!(
                        "{at}depends_on: task depends on its own key {key:?}"
                    )));
                }
            }
            None => {
                return Err(Error::InvalidArgument(format!(
                    "{at}depends_on[{i}]: give an id or a key"
                )));
            }
        }
    }
    Ok(())
}
