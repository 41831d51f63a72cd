//! The client: submit, read, wait for, cancel and list tasks; retry, delete and act in bulk
//! on them; pause and resume pools; put, list and delete cron schedules; list workers, read
//! the cluster's snapshot and the server's info.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures_core::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use rand::Rng;
use serde::Serialize;

use crate::error::Error;
use crate::proto;
use crate::proto::admin_service_client::AdminServiceClient;
use crate::proto::schedule_service_client::ScheduleServiceClient;
use crate::proto::task_service_client::TaskServiceClient;
use crate::transport::{Connection, Endpoint, HEALTHY_STREAM, MAX_MESSAGE_BYTES, Options};
use crate::worker::workers;

/// A task as the server holds it (the generated cronoq.v1.Task).
pub type Task = proto::Task;
/// A task's lifecycle state.
pub use proto::TaskState;
/// One attempt of a task (the generated cronoq.v1.Attempt).
pub type Attempt = proto::Attempt;
/// How an attempt ended.
pub use proto::AttemptOutcome;
/// Whether a pool is paused, since when and by whom (the generated cronoq.v1.PoolPause).
pub type PoolPause = proto::PoolPause;
/// A cron schedule as the server holds it, with its next_fire_at (the generated
/// cronoq.v1.Schedule).
pub type Schedule = proto::Schedule;
/// A server's role in its shard (`GetServerInfoResponse.role()`): leader or standby.
pub use proto::Role;
/// What a bulk action did in one shard (the generated cronoq.v1.BulkShardResult).
pub type BulkShardResult = proto::BulkShardResult;
/// How one dependency of a task ended (the generated cronoq.v1.DependencyResult): its id,
/// key, state (`dep.state()`), result and content type, and error.
pub type DependencyResult = proto::DependencyResult;
/// What a submission whose key already names a task does: `Unspecified` takes the pool's
/// default_key_mode; `ReturnExisting` returns that task unchanged (deduplicated);
/// `ReplacePending` replaces its payload, content type, priority and run_at while it is
/// PENDING or BLOCKED (replaced); `Debounce` does so and makes it due a debounce after each
/// submission.
pub use proto::KeyMode;
/// When a task with dependencies runs: once all succeeded (the default), or once all ended
/// whatever their outcome (`RunWhen::DependenciesEnded`: a finalizer).
pub use proto::RunWhen;

/// Marks payloads and results stored as JSON.
pub const JSON_CONTENT_TYPE: &str = "application/json";

/// Names one task, by id or by key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskRef {
    /// By id (all 64 bits).
    Id(u64),
    /// By key (unique within a shard).
    Key(String),
}

impl From<u64> for TaskRef {
    fn from(id: u64) -> TaskRef {
        TaskRef::Id(id)
    }
}

/// A key.
impl From<&str> for TaskRef {
    fn from(key: &str) -> TaskRef {
        TaskRef::Key(key.to_string())
    }
}

/// A key.
impl From<String> for TaskRef {
    fn from(key: String) -> TaskRef {
        TaskRef::Key(key)
    }
}

impl TaskRef {
    fn proto(&self) -> proto::TaskRef {
        proto::TaskRef {
            r#ref: Some(match self {
                TaskRef::Id(id) => proto::task_ref::Ref::Id(*id),
                TaskRef::Key(key) => proto::task_ref::Ref::Key(key.clone()),
            }),
        }
    }
}

/// One task to submit: `TaskSpec::new("pool").json(&payload)?` and the setters.
#[derive(Debug, Clone, Default)]
pub struct TaskSpec {
    /// The pool it runs in (required).
    pub pool: String,
    /// The payload, as stored.
    pub payload: Vec<u8>,
    /// The payload's content type (`application/json` for JSON).
    pub content_type: String,
    /// Deduplicates within a shard: a known key returns the existing task (or, by
    /// `key_mode`, replaces it while it waits).
    pub key: String,
    /// Higher runs first.
    pub priority: i32,
    /// Not before this time.
    pub run_at: Option<SystemTime>,
    /// 0 takes the pool's default.
    pub max_attempts: i32,
    /// Tasks of the same shard (a batch may name its own keys).
    pub depends_on: Vec<TaskRef>,
    /// When it runs, given its dependencies: `Unspecified` (once all succeeded) or
    /// `DependenciesEnded` (once all ended, whatever their outcome).
    pub run_when: RunWhen,
    /// Units of named resources an attempt holds while it runs.
    pub resources: HashMap<String, i64>,
    /// The timeout of each attempt (capped by the pool's); None: the pool's.
    pub timeout: Option<Duration>,
    /// The task's group (a tenant, a user; empty: none): in a pool with
    /// max_running_per_group, at most that many tasks of one group run at once.
    pub group_key: String,
    /// What a submission whose key already names a task does: `Unspecified` (the pool's
    /// default_key_mode), `ReturnExisting`, `ReplacePending` or `Debounce` (needs a key).
    pub key_mode: KeyMode,
    /// With `KeyMode::Debounce` (1 ms to 7 days; None: the pool's debounce, which a pool
    /// without one refuses): the task is due this long after the latest submission of its
    /// key; run_at may not be given with it.
    pub debounce: Option<Duration>,
    /// With `KeyMode::Debounce` (None: no bound; else debounce to 7 days): the task is due at
    /// most this long after the submission that created it, however long the burst lasts.
    pub max_debounce: Option<Duration>,
    /// Unique for a period: once the task has ended and this long has passed, its key is free
    /// for a new task (at most 366 days; needs a key). None: held until the task is deleted.
    pub key_ttl: Option<Duration>,
    /// A deadline to start: not started by then, the task ends EXPIRED without running. After
    /// run_at when both are given.
    pub start_by: Option<SystemTime>,
    /// The W3C trace context sent with the task (its handler's span continues that trace).
    /// None: with the `otel` feature, the caller's current span context
    /// (`opentelemetry::Context::current()`) when it is valid; without it, none.
    pub trace: Option<proto::TraceContext>,
}

impl TaskSpec {
    /// A task of `pool` with no payload.
    pub fn new(pool: impl Into<String>) -> TaskSpec {
        TaskSpec {
            pool: pool.into(),
            ..TaskSpec::default()
        }
    }

    /// The payload as JSON.
    pub fn json<T: Serialize + ?Sized>(mut self, payload: &T) -> Result<TaskSpec, Error> {
        self.payload = json_payload(payload)?;
        self.content_type = JSON_CONTENT_TYPE.to_string();
        Ok(self)
    }

    /// The payload as bytes, stored as they are.
    pub fn bytes(
        mut self,
        payload: impl Into<Vec<u8>>,
        content_type: impl Into<String>,
    ) -> TaskSpec {
        self.payload = payload.into();
        self.content_type = content_type.into();
        self
    }

    /// Deduplicates within a shard.
    pub fn key(mut self, key: impl Into<String>) -> TaskSpec {
        self.key = key.into();
        self
    }

    /// What a submission whose key already names a task does: `KeyMode::ReturnExisting`
    /// returns it unchanged; `KeyMode::ReplacePending` replaces its payload, content type,
    /// priority and run_at while it is PENDING or BLOCKED (once it runs or has ended, as
    /// ReturnExisting); `KeyMode::Debounce` also makes it due [`TaskSpec::debounce`] after
    /// each submission. Needs a key.
    pub fn key_mode(mut self, key_mode: KeyMode) -> TaskSpec {
        self.key_mode = key_mode;
        self
    }

    /// With `KeyMode::Debounce` (1 ms to 7 days; unset: the pool's debounce, refused where
    /// the pool has none): the task is due this long after the latest submission of its key,
    /// so a burst of submissions runs once, after it.
    pub fn debounce(mut self, debounce: Duration) -> TaskSpec {
        self.debounce = Some(debounce);
        self
    }

    /// With `KeyMode::Debounce`: the task is due at most this long after the submission that
    /// created it, however long the burst lasts (debounce to 7 days).
    pub fn max_debounce(mut self, max_debounce: Duration) -> TaskSpec {
        self.max_debounce = Some(max_debounce);
        self
    }

    /// Unique for a period: once the task has ended and this long has passed, a submission
    /// with its key creates a new task (the old one stays readable by id). At most 366 days;
    /// needs a key.
    pub fn key_ttl(mut self, key_ttl: Duration) -> TaskSpec {
        self.key_ttl = Some(key_ttl);
        self
    }

    /// A deadline to start: a task none of whose attempts has started by then ends EXPIRED
    /// without running (after run_at when both are given).
    pub fn start_by(mut self, start_by: SystemTime) -> TaskSpec {
        self.start_by = Some(start_by);
        self
    }

    /// Higher runs first.
    pub fn priority(mut self, priority: i32) -> TaskSpec {
        self.priority = priority;
        self
    }

    /// Not before now + `delay`.
    pub fn delay(mut self, delay: Duration) -> TaskSpec {
        self.run_at = Some(SystemTime::now() + delay);
        self
    }

    /// The most attempts (0: the pool's default).
    pub fn max_attempts(mut self, n: i32) -> TaskSpec {
        self.max_attempts = n;
        self
    }

    /// Runs only once `task` has succeeded (same shard; see [`TaskSpec::run_when`]). Its
    /// result reaches the handler (`ctx.dependency_results()`).
    pub fn depends_on(mut self, task: impl Into<TaskRef>) -> TaskSpec {
        self.depends_on.push(task.into());
        self
    }

    /// When it runs, given its dependencies: `RunWhen::DependenciesEnded` makes it a
    /// finalizer, run once every dependency has ended whatever its outcome (its handler
    /// sees their states and errors).
    pub fn run_when(mut self, run_when: RunWhen) -> TaskSpec {
        self.run_when = run_when;
        self
    }

    /// The timeout of each attempt (capped by the pool's).
    pub fn timeout(mut self, timeout: Duration) -> TaskSpec {
        self.timeout = Some(timeout);
        self
    }

    /// The task's group (a tenant, a user): in a pool with max_running_per_group, at most
    /// that many tasks of one group run at once.
    pub fn group_key(mut self, group_key: impl Into<String>) -> TaskSpec {
        self.group_key = group_key.into();
        self
    }

    /// The W3C trace context to send with the task, whatever the caller's current context:
    /// a `traceparent` (`00-{trace id}-{span id}-{flags}`, lowercase hex) and a
    /// `tracestate` (empty: none; at most 512 bytes). The server refuses a malformed one
    /// with INVALID_ARGUMENT.
    pub fn trace(
        mut self,
        traceparent: impl Into<String>,
        tracestate: impl Into<String>,
    ) -> TaskSpec {
        self.trace = Some(trace_context(traceparent, tracestate));
        self
    }

    pub(crate) fn proto(&self) -> proto::SubmitTaskRequest {
        proto::SubmitTaskRequest {
            pool: self.pool.clone(),
            key: self.key.clone(),
            payload: self.payload.clone(),
            content_type: self.content_type.clone(),
            priority: self.priority,
            run_at: self.run_at.map(prost_types::Timestamp::from),
            max_attempts: self.max_attempts,
            depends_on: self.depends_on.iter().map(TaskRef::proto).collect(),
            resources: self.resources.clone(),
            request_id: String::new(),
            timeout_ms: millis(self.timeout),
            group_key: self.group_key.clone(),
            trace: self.trace.clone().or_else(crate::otel::current_trace),
            run_when: self.run_when as i32,
            key_mode: self.key_mode as i32,
            debounce_ms: millis(self.debounce),
            max_debounce_ms: millis(self.max_debounce),
            key_ttl_ms: millis(self.key_ttl),
            start_by: self.start_by.map(prost_types::Timestamp::from),
        }
    }
}

/// A payload's JSON encoding (the content type is [`JSON_CONTENT_TYPE`]).
fn json_payload<T: Serialize + ?Sized>(payload: &T) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(payload).map_err(|e| Error::InvalidArgument(format!("payload: {e}")))
}

/// A W3C trace context given by the caller (not a link).
fn trace_context(
    traceparent: impl Into<String>,
    tracestate: impl Into<String>,
) -> proto::TraceContext {
    proto::TraceContext {
        traceparent: traceparent.into(),
        tracestate: tracestate.into(),
        link: false,
    }
}

/// A cron schedule to put ([`Client::put_schedule`]):
/// `ScheduleSpec::new(pool, name, cron).json(&payload)?` and the setters. The options other
/// than the cron, its timezone and the flags are those of each task it fires, as a
/// [`TaskSpec`]'s (0 or unset: the pool's default).
#[derive(Debug, Clone, Default)]
pub struct ScheduleSpec {
    /// The pool its tasks run in (required).
    pub pool: String,
    /// Names the schedule within its pool: a put with the same (pool, name) replaces it.
    pub name: String,
    /// Five fields (minute hour day-of-month month day-of-week), or six with seconds first
    /// (`*/5 * * * * *` is every five seconds); the server refuses a malformed one with
    /// INVALID_ARGUMENT.
    pub cron: String,
    /// An IANA zone name the cron is read in (empty: UTC).
    pub timezone: String,
    /// The payload of each task it fires, as stored.
    pub payload: Vec<u8>,
    /// The payload's content type (`application/json` for JSON).
    pub content_type: String,
    /// Higher runs first.
    pub priority: i32,
    /// 0 takes the pool's default.
    pub max_attempts: i32,
    /// Units of named resources an attempt of each task holds while it runs.
    pub resources: HashMap<String, i64>,
    /// The timeout of each attempt (capped by the pool's); None: the pool's.
    pub timeout: Option<Duration>,
    /// The group of each task it fires (see [`TaskSpec::group_key`]; empty: none).
    pub group_key: String,
    /// Kept but not fired until put again unpaused.
    pub paused: bool,
    /// After downtime, fire every missed slot rather than only the latest.
    pub fire_all_missed: bool,
    /// The W3C trace context each fired task links to. None: as [`TaskSpec::trace`], the
    /// caller's current span context with the `otel` feature.
    pub trace: Option<proto::TraceContext>,
}

impl ScheduleSpec {
    /// The schedule `name` of `pool`, firing by `cron`, with no payload.
    pub fn new(
        pool: impl Into<String>,
        name: impl Into<String>,
        cron: impl Into<String>,
    ) -> ScheduleSpec {
        ScheduleSpec {
            pool: pool.into(),
            name: name.into(),
            cron: cron.into(),
            ..ScheduleSpec::default()
        }
    }

    /// The payload of each task, as JSON.
    pub fn json<T: Serialize + ?Sized>(mut self, payload: &T) -> Result<ScheduleSpec, Error> {
        self.payload = json_payload(payload)?;
        self.content_type = JSON_CONTENT_TYPE.to_string();
        Ok(self)
    }

    /// The payload of each task as bytes, stored as they are.
    pub fn bytes(
        mut self,
        payload: impl Into<Vec<u8>>,
        content_type: impl Into<String>,
    ) -> ScheduleSpec {
        self.payload = payload.into();
        self.content_type = content_type.into();
        self
    }

    /// The IANA zone the cron is read in (`Europe/Paris`; unset: UTC).
    pub fn timezone(mut self, timezone: impl Into<String>) -> ScheduleSpec {
        self.timezone = timezone.into();
        self
    }

    /// Higher runs first.
    pub fn priority(mut self, priority: i32) -> ScheduleSpec {
        self.priority = priority;
        self
    }

    /// The most attempts of each task (0: the pool's default).
    pub fn max_attempts(mut self, n: i32) -> ScheduleSpec {
        self.max_attempts = n;
        self
    }

    /// The timeout of each attempt (capped by the pool's).
    pub fn timeout(mut self, timeout: Duration) -> ScheduleSpec {
        self.timeout = Some(timeout);
        self
    }

    /// The group of each task it fires (see [`TaskSpec::group_key`]).
    pub fn group_key(mut self, group_key: impl Into<String>) -> ScheduleSpec {
        self.group_key = group_key.into();
        self
    }

    /// Kept but not fired (true) until put again unpaused.
    pub fn paused(mut self, paused: bool) -> ScheduleSpec {
        self.paused = paused;
        self
    }

    /// After downtime, fire every missed slot (true) rather than only the latest.
    pub fn fire_all_missed(mut self, fire_all_missed: bool) -> ScheduleSpec {
        self.fire_all_missed = fire_all_missed;
        self
    }

    /// The W3C trace context each fired task links to, whatever the caller's current
    /// context (the forms of [`TaskSpec::trace`]).
    pub fn trace(
        mut self,
        traceparent: impl Into<String>,
        tracestate: impl Into<String>,
    ) -> ScheduleSpec {
        self.trace = Some(trace_context(traceparent, tracestate));
        self
    }

    fn proto(&self) -> proto::Schedule {
        proto::Schedule {
            pool: self.pool.clone(),
            name: self.name.clone(),
            cron: self.cron.clone(),
            timezone: self.timezone.clone(),
            payload: self.payload.clone(),
            content_type: self.content_type.clone(),
            priority: self.priority,
            max_attempts: self.max_attempts,
            resources: self.resources.clone(),
            paused: self.paused,
            next_fire_at: None,
            last_fire_at: None,
            timeout_ms: millis(self.timeout),
            fire_all_missed: self.fire_all_missed,
            group_key: self.group_key.clone(),
            trace: self.trace.clone().or_else(crate::otel::current_trace),
        }
    }
}

/// A duration option in whole milliseconds, rounded up to 1 (0 means unset to the server);
/// None: 0.
fn millis(duration: Option<Duration>) -> i64 {
    duration.map_or(0, |d| {
        i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
    })
}

/// Reads a task's JSON payload.
pub fn decode_payload<T: serde::de::DeserializeOwned>(task: &Task) -> Result<T, Error> {
    decode_json(&task.payload, &task.content_type, "payload", task.id)
}

/// Reads a task's JSON result.
pub fn decode_result<T: serde::de::DeserializeOwned>(task: &Task) -> Result<T, Error> {
    decode_json(&task.result, &task.result_content_type, "result", task.id)
}

fn decode_json<T: serde::de::DeserializeOwned>(
    data: &[u8],
    content_type: &str,
    what: &str,
    id: u64,
) -> Result<T, Error> {
    if content_type != JSON_CONTENT_TYPE {
        return Err(Error::InvalidArgument(format!(
            "task {id}: the {what} is not JSON (content type {content_type:?})"
        )));
    }
    let data = if data.is_empty() {
        b"null".as_slice()
    } else {
        data
    };
    serde_json::from_slice(data)
        .map_err(|e| Error::InvalidArgument(format!("task {id}: decoding the {what}: {e}")))
}

impl DependencyResult {
    /// Reads the dependency's JSON result (null when empty), as [`decode_result`] reads a
    /// task's: an error when its content type is not JSON (it has no result unless it
    /// succeeded; `result` holds any other content type's bytes).
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, Error> {
        decode_json(&self.result, &self.content_type, "result", self.id)
    }
}

/// Whether a task in this state will not change again.
pub fn is_terminal(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled | TaskState::Expired
    )
}

/// A fresh request id: the server answers a repeated one with what the first call created.
pub fn new_request_id() -> String {
    let bytes: [u8; 16] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A submission's answer.
#[derive(Debug, Clone)]
pub struct Submitted {
    /// The task created (or the one its key named).
    pub task: Task,
    /// The key already named a task; nothing was created or changed.
    pub deduplicated: bool,
    /// The key named a PENDING or BLOCKED task whose payload, content type, priority and
    /// run_at this submission replaced (`KeyMode::ReplacePending`, `KeyMode::Debounce`);
    /// nothing was created.
    pub replaced: bool,
}

/// A wait's answer: the task, and whether it is terminal.
#[derive(Debug, Clone)]
pub struct Waited {
    /// The task as it is now.
    pub task: Task,
    /// Whether it is terminal (false: the wait timed out).
    pub done: bool,
}

/// Selects a page of tasks.
#[derive(Debug, Clone, Default)]
pub struct ListOptions {
    /// Empty: every pool the caller may read.
    pub pool: String,
    /// None: every state.
    pub state: Option<TaskState>,
    /// 100 when 0.
    pub page_size: i32,
    /// The previous page's next_page_token.
    pub page_token: String,
    /// Only the tasks that match it, as a bulk action matches them (any state may be named).
    pub filter: Option<TaskFilter>,
}

/// What [`Client::get_with`] reads besides the task.
#[derive(Debug, Clone, Default)]
pub struct GetTaskOptions {
    /// Its attempts, oldest first.
    pub include_attempts: bool,
    /// The tasks its handler spawned (at most 1,000; a [`TaskFilter`]'s parent_id lists
    /// them all).
    pub include_children: bool,
    /// Its dependencies' results, as its handler sees them (`task.dependency_results`).
    pub include_dependency_results: bool,
    /// The ids of the tasks waiting for it (at most 100).
    pub include_dependents: bool,
}

/// A task and what [`GetTaskOptions`] asked for ([`Client::get_with`]).
#[derive(Debug, Clone, Default)]
pub struct TaskDetails {
    /// The task as it is now.
    pub task: Task,
    /// Its attempts, oldest first (with include_attempts).
    pub attempts: Vec<Attempt>,
    /// The tasks its handler spawned, in id order, without payload, result or checkpoint
    /// (with include_children).
    pub children: Vec<Task>,
    /// The ids of the tasks waiting for it, in id order (with include_dependents).
    pub dependents: Vec<u64>,
}

/// A cancellation's answer ([`Client::cancel_with_descendants`]).
#[derive(Debug, Clone)]
pub struct Cancelled {
    /// The task, CANCELLED (or asked to stop, when running).
    pub task: Task,
    /// How many of the tasks it spawned (transitively) and their dependents were cancelled
    /// (or asked to stop).
    pub descendants_cancelled: i64,
}

/// A task and its attempts, oldest first ([`Client::get_with_attempts`]).
#[derive(Debug, Clone)]
pub struct TaskAttempts {
    /// The task as it is now.
    pub task: Task,
    /// Its attempts, oldest first.
    pub attempts: Vec<Attempt>,
}

/// A retry's answer ([`Client::retry`]).
#[derive(Debug, Clone)]
pub struct Retried {
    /// The task, PENDING again.
    pub task: Task,
    /// How many of its dependents, ended because it ended, wait for it again (BLOCKED).
    pub dependents_restored: i64,
}

/// How [`Client::retry`] and [`Client::retry_tasks`] retry a task.
#[derive(Debug, Clone, Default)]
pub struct RetryTaskOptions {
    /// When it may run again; None: now.
    pub run_at: Option<SystemTime>,
    /// 0 to 1000 (0: 1): how many more attempts a task that used all of its attempts gets.
    /// A task with attempts left keeps them.
    pub extra_attempts: i32,
}

/// Which tasks a bulk action applies to: those that match every field set.
#[derive(Debug, Clone, Default)]
pub struct TaskFilter {
    /// Empty: every pool the caller may act on.
    pub pool: String,
    /// Empty: every state the action applies to (cancel: PENDING, BLOCKED, RUNNING; retry:
    /// FAILED, CANCELLED; delete: SUCCEEDED, FAILED, CANCELLED, EXPIRED).
    pub states: Vec<TaskState>,
    /// Created after this time.
    pub created_after: Option<SystemTime>,
    /// Created before this time.
    pub created_before: Option<SystemTime>,
    /// Ended after this time.
    pub finished_after: Option<SystemTime>,
    /// Ended before this time.
    pub finished_before: Option<SystemTime>,
    /// Tasks whose key starts with this.
    pub key_prefix: String,
    /// Tasks whose error contains this text (case-sensitive).
    pub error_contains: String,
    /// Only these tasks (at most 1000).
    pub ids: Vec<u64>,
    /// Only the tasks this task's handler spawned (0: any).
    pub parent_id: u64,
}

impl TaskFilter {
    fn proto(&self) -> proto::TaskFilter {
        let at = |t: &Option<SystemTime>| t.map(prost_types::Timestamp::from);
        proto::TaskFilter {
            pool: self.pool.clone(),
            states: self.states.iter().map(|s| *s as i32).collect(),
            created_after: at(&self.created_after),
            created_before: at(&self.created_before),
            finished_after: at(&self.finished_after),
            finished_before: at(&self.finished_before),
            key_prefix: self.key_prefix.clone(),
            error_contains: self.error_contains.clone(),
            ids: self.ids.clone(),
            parent_id: self.parent_id,
        }
    }
}

/// A bulk action's answer ([`Client::cancel_tasks`], [`Client::retry_tasks`],
/// [`Client::delete_tasks`]).
#[derive(Debug, Clone, Default)]
pub struct BulkResult {
    /// Tasks that matched the filter, in every shard that answered.
    pub matched: i64,
    /// Tasks changed (0 on a dry run).
    pub changed: i64,
    /// What the action did in each shard.
    pub shards: Vec<BulkShardResult>,
    /// Shards that did not answer: their tasks were not acted on.
    pub unavailable_shards: Vec<String>,
    /// Some shard stopped at its time bound before the end of the matching tasks: the same
    /// call again continues (it changes only what is left).
    pub incomplete: bool,
}

/// A BulkResult from any of the three bulk responses (they have the same fields).
macro_rules! bulk_result {
    ($resp:expr) => {{
        let resp = $resp;
        BulkResult {
            matched: resp.matched,
            changed: resp.changed,
            shards: resp.shards,
            unavailable_shards: resp.unavailable_shards,
            incomplete: resp.incomplete,
        }
    }};
}

/// Selects the events of [`Client::watch`].
#[derive(Debug, Clone, Default)]
pub struct WatchOptions {
    /// Empty: every pool the caller may read.
    pub pool: String,
    /// Start after that event (a TaskEvent's cursor) instead of live.
    pub cursor: String,
    /// Events carry tasks' payloads and results.
    pub include_payloads: bool,
    /// End with the stream (and its error) instead of opening it again.
    pub no_resume: bool,
}

/// A sharded server's initial metadata (and trailers) name where a live stream starts.
const WATCH_START_KEY: &str = "cronoq-watch-cursor";

/// Calls cronoq: any shard's server, or several servers (commas in the endpoint).
/// UNAVAILABLE moves it to the leader a standby names, or to the next endpoint, and is
/// retried with backoff. Cheap to clone; clones share the connections.
#[derive(Clone)]
pub struct Client {
    conn: Arc<Connection>,
}

fn tasks(ch: tonic::transport::Channel) -> TaskServiceClient<tonic::transport::Channel> {
    TaskServiceClient::new(ch)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

fn admin(ch: tonic::transport::Channel) -> AdminServiceClient<tonic::transport::Channel> {
    AdminServiceClient::new(ch)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

fn schedules(ch: tonic::transport::Channel) -> ScheduleServiceClient<tonic::transport::Channel> {
    ScheduleServiceClient::new(ch)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

impl Client {
    /// Checks the options (endpoints, TLS files); the client connects on its first call.
    pub fn new(opts: Options) -> Result<Client, Error> {
        Ok(Client {
            conn: Arc::new(Connection::new(&opts)?),
        })
    }

    /// The server the client talks to now.
    pub fn endpoint(&self) -> Endpoint {
        self.conn.endpoint()
    }

    /// Submits one task. Every transport retry carries the same request id, so a retry
    /// after UNAVAILABLE returns the task the first attempt created. With the `otel`
    /// feature, the task carries the caller's current trace context (unless its spec sets
    /// one), which its handler's span continues.
    pub async fn submit(&self, spec: TaskSpec) -> Result<Submitted, Error> {
        let mut req = spec.proto();
        req.request_id = new_request_id();
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("SubmitTask", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).submit_task(r).await }
            })
            .await?;
        Ok(Submitted {
            task: resp.task.unwrap_or_default(),
            deduplicated: resp.deduplicated,
            replaced: resp.replaced,
        })
    }

    /// Admits every task or none; tasks may depend on the batch's own keys. The answer
    /// lists the tasks in the order given, the ids that already existed (deduplicated_ids)
    /// and those whose pending task a submission replaced (replaced_ids). Each task
    /// carries the trace context as [`Client::submit`] says.
    pub async fn submit_batch(
        &self,
        specs: &[TaskSpec],
    ) -> Result<proto::SubmitBatchResponse, Error> {
        let req = proto::SubmitBatchRequest {
            tasks: specs.iter().map(TaskSpec::proto).collect(),
            request_id: new_request_id(),
        };
        let timeout = self.conn.timeout;
        self.conn
            .invoke("SubmitBatch", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).submit_batch(r).await }
            })
            .await
    }

    /// Reads one task.
    pub async fn get(&self, task: impl Into<TaskRef>) -> Result<Task, Error> {
        Ok(self.get_with(task, GetTaskOptions::default()).await?.task)
    }

    /// Reads one task with its attempts, oldest first.
    pub async fn get_with_attempts(&self, task: impl Into<TaskRef>) -> Result<TaskAttempts, Error> {
        let opts = GetTaskOptions {
            include_attempts: true,
            ..GetTaskOptions::default()
        };
        let got = self.get_with(task, opts).await?;
        Ok(TaskAttempts {
            task: got.task,
            attempts: got.attempts,
        })
    }

    /// Reads one task with what `opts` asks for: its attempts, the tasks its handler
    /// spawned, its dependencies' results, the tasks waiting for it.
    pub async fn get_with(
        &self,
        task: impl Into<TaskRef>,
        opts: GetTaskOptions,
    ) -> Result<TaskDetails, Error> {
        let req = proto::GetTaskRequest {
            task: Some(task.into().proto()),
            include_dependents: opts.include_dependents,
            include_attempts: opts.include_attempts,
            include_children: opts.include_children,
            include_dependency_results: opts.include_dependency_results,
        };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("GetTask", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).get_task(r).await }
            })
            .await?;
        Ok(TaskDetails {
            task: resp.task.unwrap_or_default(),
            attempts: resp.attempts,
            children: resp.children,
            dependents: resp.dependents,
        })
    }

    /// Blocks until the task is terminal or `timeout` passes (then `done` is false).
    pub async fn wait(&self, task: impl Into<TaskRef>, timeout: Duration) -> Result<Waited, Error> {
        let req = proto::WaitTaskRequest {
            task: Some(task.into().proto()),
            timeout_ms: timeout.as_millis().clamp(1, 1 << 31) as u32,
        };
        let call_timeout = timeout + self.conn.timeout;
        let resp = self
            .conn
            .invoke("WaitTask", call_timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(call_timeout));
                async move { tasks(ch).wait_task(r).await }
            })
            .await?;
        Ok(Waited {
            task: resp.task.unwrap_or_default(),
            done: resp.done,
        })
    }

    /// Requests the task's cancellation and returns it.
    pub async fn cancel(&self, task: impl Into<TaskRef>) -> Result<Task, Error> {
        Ok(self.cancel_task(task.into(), false).await?.task)
    }

    /// Requests the cancellation of the task, of the tasks its handler spawned, theirs and
    /// so on, and of the tasks that depend on any of them, at once (those in pools the
    /// caller may not cancel are left as they are).
    pub async fn cancel_with_descendants(
        &self,
        task: impl Into<TaskRef>,
    ) -> Result<Cancelled, Error> {
        self.cancel_task(task.into(), true).await
    }

    async fn cancel_task(
        &self,
        task: TaskRef,
        include_descendants: bool,
    ) -> Result<Cancelled, Error> {
        let req = proto::CancelTaskRequest {
            task: Some(task.proto()),
            include_descendants,
        };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("CancelTask", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).cancel_task(r).await }
            })
            .await?;
        Ok(Cancelled {
            task: resp.task.unwrap_or_default(),
            descendants_cancelled: resp.descendants_cancelled,
        })
    }

    /// Makes a FAILED, CANCELLED or EXPIRED task PENDING again, keeping its attempts and their
    /// history; its dependents that ended because it ended wait for it again.
    pub async fn retry(
        &self,
        task: impl Into<TaskRef>,
        opts: RetryTaskOptions,
    ) -> Result<Retried, Error> {
        let req = proto::RetryTaskRequest {
            task: Some(task.into().proto()),
            run_at: opts.run_at.map(prost_types::Timestamp::from),
            extra_attempts: opts.extra_attempts,
        };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("RetryTask", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).retry_task(r).await }
            })
            .await?;
        Ok(Retried {
            task: resp.task.unwrap_or_default(),
            dependents_restored: resp.dependents_restored,
        })
    }

    /// Deletes an ended task (SUCCEEDED, FAILED, CANCELLED or EXPIRED) with its attempts and events;
    /// returns its id.
    pub async fn delete(&self, task: impl Into<TaskRef>) -> Result<u64, Error> {
        let req = proto::DeleteTaskRequest {
            task: Some(task.into().proto()),
        };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("DeleteTask", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).delete_task(r).await }
            })
            .await?;
        Ok(resp.id)
    }

    /// Cancels the unfinished tasks that match `filter`, in every shard (with `dry_run`:
    /// only counts them).
    pub async fn cancel_tasks(
        &self,
        filter: &TaskFilter,
        dry_run: bool,
    ) -> Result<BulkResult, Error> {
        let req = proto::CancelTasksRequest {
            filter: Some(filter.proto()),
            dry_run,
        };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("CancelTasks", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).cancel_tasks(r).await }
            })
            .await?;
        Ok(bulk_result!(resp))
    }

    /// Retries the FAILED and CANCELLED tasks that match `filter`, as [`Client::retry`]
    /// does, in every shard (with `dry_run`: only counts them).
    pub async fn retry_tasks(
        &self,
        filter: &TaskFilter,
        dry_run: bool,
        opts: RetryTaskOptions,
    ) -> Result<BulkResult, Error> {
        let req = proto::RetryTasksRequest {
            filter: Some(filter.proto()),
            dry_run,
            run_at: opts.run_at.map(prost_types::Timestamp::from),
            extra_attempts: opts.extra_attempts,
        };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("RetryTasks", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).retry_tasks(r).await }
            })
            .await?;
        Ok(bulk_result!(resp))
    }

    /// Deletes the ended tasks that match `filter`, as [`Client::delete`] does, in every
    /// shard (with `dry_run`: only counts them).
    pub async fn delete_tasks(
        &self,
        filter: &TaskFilter,
        dry_run: bool,
    ) -> Result<BulkResult, Error> {
        let req = proto::DeleteTasksRequest {
            filter: Some(filter.proto()),
            dry_run,
        };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("DeleteTasks", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).delete_tasks(r).await }
            })
            .await?;
        Ok(bulk_result!(resp))
    }

    /// Stops leasing the pool's tasks, across restarts and failovers, until
    /// [`Client::resume_pool`]. The pool still accepts submissions; running tasks finish.
    pub async fn pause_pool(&self, pool: impl Into<String>) -> Result<PoolPause, Error> {
        let req = proto::PausePoolRequest { pool: pool.into() };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("PausePool", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { admin(ch).pause_pool(r).await }
            })
            .await?;
        Ok(resp.pause.unwrap_or_default())
    }

    /// Leases the pool's tasks again.
    pub async fn resume_pool(&self, pool: impl Into<String>) -> Result<PoolPause, Error> {
        let req = proto::ResumePoolRequest { pool: pool.into() };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("ResumePool", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { admin(ch).resume_pool(r).await }
            })
            .await?;
        Ok(resp.pause.unwrap_or_default())
    }

    /// Creates or replaces the schedule (pool, name); returns it as stored, with its
    /// next_fire_at. A malformed cron or timezone is the server's INVALID_ARGUMENT. With the
    /// `otel` feature, the schedule keeps the caller's current trace context (unless its spec
    /// sets one), and each task it fires links to it.
    pub async fn put_schedule(&self, spec: ScheduleSpec) -> Result<Schedule, Error> {
        let req = proto::PutScheduleRequest {
            schedule: Some(spec.proto()),
        };
        let timeout = self.conn.timeout;
        let resp = self
            .conn
            .invoke("PutSchedule", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { schedules(ch).put_schedule(r).await }
            })
            .await?;
        Ok(resp.schedule.unwrap_or_default())
    }

    /// Deletes the schedule (pool, name); NOT_FOUND when there is none. The tasks it fired stay.
    pub async fn delete_schedule(
        &self,
        pool: impl Into<String>,
        name: impl Into<String>,
    ) -> Result<(), Error> {
        let req = proto::DeleteScheduleRequest {
            pool: pool.into(),
            name: name.into(),
        };
        let timeout = self.conn.timeout;
        self.conn
            .invoke("DeleteSchedule", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { schedules(ch).delete_schedule(r).await }
            })
            .await?;
        Ok(())
    }

    /// The schedules of `pool`, or (None) of every pool the caller may read, in every shard
    /// that answered (the others are in unavailable_shards).
    pub async fn list_schedules(
        &self,
        pool: Option<&str>,
    ) -> Result<proto::ListSchedulesResponse, Error> {
        let req = proto::ListSchedulesRequest {
            pool: pool.unwrap_or_default().to_string(),
        };
        let timeout = self.conn.timeout;
        self.conn
            .invoke("ListSchedules", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { schedules(ch).list_schedules(r).await }
            })
            .await
    }

    /// The registered workers of `pool`, or (None) of every pool the caller may read, in
    /// every shard that answered (the others are in unavailable_shards).
    pub async fn list_workers(
        &self,
        pool: Option<&str>,
    ) -> Result<proto::ListWorkersResponse, Error> {
        let req = proto::ListWorkersRequest {
            pool: pool.unwrap_or_default().to_string(),
        };
        let timeout = self.conn.timeout;
        self.conn
            .invoke("ListWorkers", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { workers(ch).list_workers(r).await }
            })
            .await
    }

    /// Per shard: its leader and term, standbys, task counts by pool and state, resources,
    /// workers, recent activity and outboxes (the shards that did not answer are in
    /// unavailable_shards). Needs the read or the admin permission.
    pub async fn snapshot(&self) -> Result<proto::GetSnapshotResponse, Error> {
        let req = proto::GetSnapshotRequest {};
        let timeout = self.conn.timeout;
        self.conn
            .invoke("GetSnapshot", timeout, |ch| {
                let r = self.conn.request(req, Some(timeout));
                async move { admin(ch).get_snapshot(r).await }
            })
            .await
    }

    /// The server this client talks to: its version, shard, role (a standby answers too),
    /// leader and term, and who the caller is and what it may do.
    pub async fn server_info(&self) -> Result<proto::GetServerInfoResponse, Error> {
        let req = proto::GetServerInfoRequest {};
        let timeout = self.conn.timeout;
        self.conn
            .invoke("GetServerInfo", timeout, |ch| {
                let r = self.conn.request(req, Some(timeout));
                async move { admin(ch).get_server_info(r).await }
            })
            .await
    }

    /// Streams task events as they happen. Unless `no_resume`, a stream that ends or breaks
    /// (a restart, a new leader, UNAVAILABLE, ABORTED because the watcher fell behind) is
    /// opened again from the last event's cursor: the events in between are replayed, and
    /// one seen already is skipped. A row of failures with no event is given up after the
    /// retry's max_elapsed; other errors end the stream at once (its last item). Drop the
    /// stream to stop watching.
    pub fn watch(
        &self,
        opts: WatchOptions,
    ) -> impl Stream<Item = Result<proto::TaskEvent, Error>> + Send + 'static {
        let (tx, rx) = mpsc::channel(64);
        let conn = self.conn.clone();
        tokio::spawn(async move {
            let mut cursor = opts.cursor.clone();
            let mut last_seq: HashMap<String, u64> = HashMap::new();
            let mut failing_since: Option<Instant> = None;
            let mut failures = 0;
            loop {
                let opened = Instant::now();
                let ended = watch_once(
                    &conn,
                    &opts,
                    &mut cursor,
                    &mut last_seq,
                    &tx,
                    &mut failing_since,
                    &mut failures,
                )
                .await;
                let err = match ended {
                    WatchEnd::Dropped => return,
                    WatchEnd::Ended(err) => err,
                };
                let transient = err.as_ref().is_none_or(|e| {
                    matches!(e, Error::Rpc(r) if matches!(r.code, Code::Unavailable | Code::Cancelled | Code::Aborted | Code::Internal))
                });
                if opts.no_resume || !transient {
                    if let Some(err) = err {
                        let _ = tx.send(Err(err)).await;
                    }
                    return;
                }
                if opened.elapsed() >= HEALTHY_STREAM {
                    failing_since = None;
                    failures = 0;
                }
                let since = *failing_since.get_or_insert_with(Instant::now);
                if conn.retry.max_elapsed.is_some_and(|m| since.elapsed() >= m) {
                    let err = err.unwrap_or_else(|| {
                        Error::rpc_code(
                            Code::Unavailable,
                            "watch: the server kept ending the stream",
                        )
                    });
                    let _ = tx.send(Err(err)).await;
                    return;
                }
                if let Some(err) = &err
                    && err.is_retryable()
                {
                    conn.on_unavailable(err); // to the leader a standby names, or the next endpoint
                }
                tracing::info!(error = ?err, endpoint = %conn.endpoint(), "cronoq: watch stream ended; reconnecting");
                tokio::select! {
                    _ = tokio::time::sleep(conn.retry.backoff(failures)) => {}
                    _ = tx.closed() => return,
                }
                failures += 1;
            }
        });
        ReceiverStream::new(rx)
    }

    /// One page of tasks in id order; pass its next_page_token for the next.
    pub async fn list(&self, opts: ListOptions) -> Result<proto::ListTasksResponse, Error> {
        let req = proto::ListTasksRequest {
            pool: opts.pool,
            state: opts.state.map_or(0, |s| s as i32),
            page_size: if opts.page_size == 0 {
                100
            } else {
                opts.page_size
            },
            page_token: opts.page_token,
            filter: opts.filter.as_ref().map(TaskFilter::proto),
            ..Default::default()
        };
        let timeout = self.conn.timeout;
        self.conn
            .invoke("ListTasks", timeout, |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { tasks(ch).list_tasks(r).await }
            })
            .await
    }
}

enum WatchEnd {
    /// The caller dropped the stream.
    Dropped,
    /// The server ended it (None: cleanly), or it broke.
    Ended(Option<Error>),
}

/// Runs one Watch stream, forwarding its events.
async fn watch_once(
    conn: &Connection,
    opts: &WatchOptions,
    cursor: &mut String,
    last_seq: &mut HashMap<String, u64>,
    tx: &mpsc::Sender<Result<proto::TaskEvent, Error>>,
    failing_since: &mut Option<Instant>,
    failures: &mut u32,
) -> WatchEnd {
    let (ch, ep) = match conn.channel() {
        Ok(c) => c,
        Err(e) => return WatchEnd::Ended(Some(e)),
    };
    let req = conn.request(
        proto::WatchRequest {
            pool: opts.pool.clone(),
            include_payloads: opts.include_payloads,
            cursor: cursor.clone(),
        },
        None,
    );
    let mut client = tasks(ch);
    let response = tokio::select! {
        r = client.watch(req) => r,
        _ = tx.closed() => return WatchEnd::Dropped,
    };
    let response = match response {
        Ok(r) => r,
        Err(status) => {
            if cursor.is_empty()
                && let Some(v) = status
                    .metadata()
                    .get(WATCH_START_KEY)
                    .and_then(|v| v.to_str().ok())
            {
                *cursor = v.to_string();
            }
            return WatchEnd::Ended(Some(conn.diagnose(&ep, status).await));
        }
    };
    if cursor.is_empty()
        && let Some(v) = response
            .metadata()
            .get(WATCH_START_KEY)
            .and_then(|v| v.to_str().ok())
    {
        *cursor = v.to_string();
    }
    let mut stream = response.into_inner();
    loop {
        let message = tokio::select! {
            m = stream.message() => m,
            _ = tx.closed() => return WatchEnd::Dropped,
        };
        let event = match message {
            Ok(Some(resp)) => match resp.event {
                Some(event) => event,
                None => continue,
            },
            Ok(None) => return WatchEnd::Ended(None),
            Err(status) => return WatchEnd::Ended(Some(Error::from(status))),
        };
        *failing_since = None;
        *failures = 0;
        if !event.cursor.is_empty() {
            cursor.clone_from(&event.cursor);
        }
        if event.seq != 0 {
            let last = last_seq.entry(event.shard.clone()).or_insert(0);
            if event.seq <= *last {
                continue; // replayed after a reconnect, and sent before it
            }
            *last = event.seq;
        }
        if tx.send(Ok(event)).await.is_err() {
            return WatchEnd::Dropped;
        }
    }
}
