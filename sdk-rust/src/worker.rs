//! The worker: registers with the shard of its pools and runs their tasks over one
//! bidirectional `WorkerService.Work` stream.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;
use serde::Serialize;
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

use crate::checks::is_refused_in_text;
use crate::client::{DependencyResult, JSON_CONTENT_TYPE, Task, TaskRef, TaskSpec};
use crate::error::Error;
use crate::otel::{Ended, TaskSpan};
use crate::proto;
use crate::proto::task_outcome::Outcome;
use crate::proto::worker_service_client::WorkerServiceClient;
use crate::transport::{
    Connection, Endpoint, FailureRow, HEALTHY_STREAM, MAX_MESSAGE_BYTES, MAX_REDIRECTS, Options,
};

const MAX_FINISH_BATCH: usize = 1000;
/// The most tasks a worker holds (concurrency + prefetch): the credits a Work stream may carry.
const MAX_HELD: usize = 100_000;
/// A worker's default prefetch, in tasks a slot (at concurrency 64 on PostgreSQL, no-op tasks:
/// prefetch 64 drains at 0.8x prefetch 256, and 1,024 no faster than 256).
const PREFETCH_PER_SLOT: usize = 4;

/// A worker's prefetch when none is given: PREFETCH_PER_SLOT tasks a slot (fewer when both
/// would pass MAX_HELD). The server sends it beyond its free slots only what it starts within
/// about a step (WorkRequest.slots), so a worker with slow handlers holds nothing.
pub(crate) fn default_prefetch(concurrency: usize) -> usize {
    PREFETCH_PER_SLOT
        .saturating_mul(concurrency)
        .min(MAX_HELD.saturating_sub(concurrency))
}
const MIB: u64 = 1 << 20;
const DEFAULT_MAX_RESULT_BYTES: u64 = 4 * MIB;
const DEFAULT_MAX_LEASE_BYTES: u64 = 16 * MIB;
/// An older server's (it sends no max_checkpoint_bytes).
const DEFAULT_MAX_CHECKPOINT_BYTES: u64 = 256 * 1024;
const MAX_PROGRESS_MESSAGE_BYTES: usize = 1024;
/// Room left under the message limit for what a message carries besides tasks or outcomes.
const MAX_REQUEST_BYTES: u64 = MAX_MESSAGE_BYTES as u64 - MIB;
const MIN_LEASE_BYTES: u64 = MIB;
/// An outcome's or a report's tag and length prefix, and the message's.
const FRAMING: u64 = 16;
const RELEASE_REASON: &str = "worker shut down";
/// After the shutdown grace: how long cancelled handlers get to return.
const UNWIND_TIME: Duration = Duration::from_secs(1);
/// After the shutdown grace: the time left for the last reports.
const STOP_EXTRA_TIME: Duration = Duration::from_secs(3);
const DEREGISTER_TIMEOUT: Duration = Duration::from_secs(2);

/// What a handler returns on success: stored as the task's result.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskResult {
    /// The result, as stored.
    pub data: Vec<u8>,
    /// Its content type (`application/json` for JSON, empty for none).
    pub content_type: String,
}

impl TaskResult {
    /// No result.
    pub fn none() -> TaskResult {
        TaskResult::default()
    }

    /// A JSON result.
    pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<TaskResult, TaskError> {
        let data = serde_json::to_vec(value)
            .map_err(|e| TaskError::non_retryable(format!("result: {e}")))?;
        Ok(TaskResult {
            data,
            content_type: JSON_CONTENT_TYPE.to_string(),
        })
    }

    /// Bytes stored as they are.
    pub fn bytes(data: impl Into<Vec<u8>>, content_type: impl Into<String>) -> TaskResult {
        TaskResult {
            data: data.into(),
            content_type: content_type.into(),
        }
    }
}

impl From<serde_json::Value> for TaskResult {
    fn from(value: serde_json::Value) -> TaskResult {
        TaskResult {
            data: value.to_string().into_bytes(),
            content_type: JSON_CONTENT_TYPE.to_string(),
        }
    }
}

impl From<()> for TaskResult {
    fn from(_: ()) -> TaskResult {
        TaskResult::none()
    }
}

/// A handler's failure: the attempt fails, retried with backoff while attempts remain
/// unless it is non-retryable. Any `std::error::Error` converts into a retryable one, so
/// `?` works in handlers. Or a snooze ([`TaskError::snooze`]): not now, the task runs again
/// later, and the attempt does not count.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskError {
    /// Stored as the task's error (a snooze's reason).
    pub message: String,
    /// False ends the task FAILED whatever attempts remain.
    pub retryable: bool,
    /// Overrides the pool's backoff before the next attempt.
    pub retry_after: Option<Duration>,
    /// Set: the task is snoozed for this long (whole milliseconds, at most `u32::MAX`: a
    /// longer one fails the attempt instead) rather than failed; `retryable` and
    /// `retry_after` are not used.
    pub snooze: Option<Duration>,
}

impl TaskError {
    /// A failure retried while attempts remain.
    pub fn retryable(message: impl fmt::Display) -> TaskError {
        TaskError {
            message: message.to_string(),
            retryable: true,
            retry_after: None,
            snooze: None,
        }
    }

    /// A failure that ends the task whatever attempts remain.
    pub fn non_retryable(message: impl fmt::Display) -> TaskError {
        TaskError {
            retryable: false,
            ..TaskError::retryable(message)
        }
    }

    /// A failure whose next attempt starts no sooner than after `delay`.
    pub fn retry_after(message: impl fmt::Display, delay: Duration) -> TaskError {
        TaskError {
            retry_after: Some(delay),
            ..TaskError::retryable(message)
        }
    }

    /// Not now: the task is PENDING again, due after `delay` (rounded down to whole
    /// milliseconds; zero: at once), and the attempt does not count (the task's `snoozes`
    /// grows by one). A delay over `u32::MAX` milliseconds (about 49.7 days) fails the
    /// attempt instead, saying so.
    pub fn snooze(delay: Duration, reason: impl fmt::Display) -> TaskError {
        TaskError {
            snooze: Some(delay),
            ..TaskError::retryable(reason)
        }
    }
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E: std::error::Error> From<E> for TaskError {
    fn from(err: E) -> TaskError {
        TaskError::retryable(err)
    }
}

/// What a handler gets: the task as leased (through `Deref`: `ctx.id`, `ctx.attempt`,
/// `cronoq::decode_payload(&ctx)`) with its dependencies' results, and the reports it makes
/// while it runs: its progress and its checkpoint, which the worker's next heartbeat carries
/// (the last of each; what no heartbeat got acknowledged goes with the outcome), and the
/// tasks it spawns, sent with its success. Cheap to clone; usable from any thread or task
/// while the handler runs (a report or spawn made after it returned is not sent).
#[derive(Debug, Clone)]
pub struct TaskContext {
    task: Arc<Task>,
    max_checkpoint_bytes: u64,
    pending: Arc<Mutex<Pending>>,
}

impl TaskContext {
    fn new(task: Task, max_checkpoint_bytes: u64) -> TaskContext {
        TaskContext {
            task: Arc::new(task),
            max_checkpoint_bytes,
            pending: Arc::default(),
        }
    }

    /// The task as leased.
    pub fn task(&self) -> &Task {
        &self.task
    }

    /// How many times a handler snoozed the task ([`TaskError::snooze`]).
    pub fn snoozes(&self) -> i32 {
        self.task.snoozes
    }

    /// How each task it depends on ended, in the order it named them: id, key, state,
    /// result (`dep.json::<T>()` reads a JSON one; `dep.result` holds the bytes of any other
    /// content type) and error. A finalizer (`RunWhen::DependenciesEnded`) sees failed and
    /// cancelled ones too.
    pub fn dependency_results(&self) -> &[DependencyResult] {
        &self.task.dependency_results
    }

    /// The dependency named by key (`ctx.dependency("extract")`) or by id; an
    /// `Error::InvalidArgument` naming it when the task does not depend on it.
    pub fn dependency(&self, dependency: impl Into<TaskRef>) -> Result<&DependencyResult, Error> {
        let dependency = dependency.into();
        self.task
            .dependency_results
            .iter()
            .find(|d| match &dependency {
                TaskRef::Id(id) => d.id == *id,
                TaskRef::Key(key) => d.key == *key,
            })
            .ok_or_else(|| {
                let named = match &dependency {
                    TaskRef::Id(id) => format!("id {id}"),
                    TaskRef::Key(key) => format!("key {key:?}"),
                };
                Error::InvalidArgument(format!(
                    "dependency: task {} has no dependency of {named}",
                    self.task.id
                ))
            })
    }

    /// Spawns a task, submitted with this attempt's success in the same transaction (none is
    /// created unless the handler succeeds; nothing is sent when it fails or snoozes). It
    /// must be in a pool of this task's shard. Its parent is this task (`Task.parent_id`);
    /// it may depend on this task (`.depends_on(ctx.id)`) and, by key, on the other tasks
    /// spawned with it (a join: `.depends_on("part-1")`). The server fails the attempt
    /// (not retryable), creating none, when one cannot be submitted. With the `otel`
    /// feature and no trace of its own, it carries the handler's trace context. Once the
    /// handler has returned, FAILED_PRECONDITION: its outcome is gone without it.
    pub fn spawn(&self, mut spec: TaskSpec) -> Result<(), Error> {
        if spec.trace.is_none() {
            spec.trace = crate::otel::current_trace();
        }
        let mut pending = self.pending.lock().unwrap();
        if pending.ended {
            return Err(Error::rpc_code(
                Code::FailedPrecondition,
                format!(
                    "spawn: task {}'s handler has returned; its outcome went without this task",
                    self.task.id
                ),
            ));
        }
        pending.spawned.push(spec);
        Ok(())
    }

    /// The tasks spawned so far, in order (what a success sends; for a handler's tests).
    pub fn spawned(&self) -> Vec<TaskSpec> {
        self.pending.lock().unwrap().spawned.clone()
    }

    /// The task's checkpoint: the last one saved, by this handler or else by an earlier
    /// attempt's (as leased); None when it has none (empty).
    pub fn checkpoint(&self) -> Option<Vec<u8>> {
        let pending = self.pending.lock().unwrap();
        let current = pending.saved.as_ref().unwrap_or(&self.task.checkpoint);
        (!current.is_empty()).then(|| current.clone())
    }

    /// Reports the handler's progress: a finite `value` (commonly a fraction from 0 to 1) and
    /// a message of at most 1,024 bytes with no control character, line separator or bidi
    /// control (one line, shown as stored), else
    /// `Error::InvalidArgument` and nothing is recorded. Kept with the task (`Task.progress`) once a heartbeat carries it.
    pub fn report_progress(&self, value: f64, message: &str) -> Result<(), Error> {
        if !value.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "progress: value {value} is not a finite number"
            )));
        }
        if message.len() > MAX_PROGRESS_MESSAGE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "progress: message of {} bytes, more than {MAX_PROGRESS_MESSAGE_BYTES}",
                message.len()
            )));
        }
        if let Some(bad) = message.chars().find(|&c| is_refused_in_text(c)) {
            // The server refuses them (they forge log lines): refused here, where it is seen.
            return Err(Error::InvalidArgument(format!(
                "progress: control character {bad:?} in the message"
            )));
        }
        let mut pending = self.pending.lock().unwrap();
        pending.version += 1;
        let progress = proto::TaskProgress {
            value,
            message: message.to_string(),
            updated_at: None,
        };
        pending.progress = Some((progress, pending.version));
        Ok(())
    }

    /// Saves the task's checkpoint (empty: none), which the next attempt gets if this one
    /// does not end the task: at most the server's max_checkpoint_bytes (256 KiB by
    /// default), else `Error::InvalidArgument` and nothing is recorded.
    pub fn save_checkpoint(&self, data: impl Into<Vec<u8>>) -> Result<(), Error> {
        let data = data.into();
        if data.len() as u64 > self.max_checkpoint_bytes {
            return Err(Error::InvalidArgument(format!(
                "checkpoint: {} bytes, more than max_checkpoint_bytes {}",
                data.len(),
                self.max_checkpoint_bytes
            )));
        }
        let mut pending = self.pending.lock().unwrap();
        pending.version += 1;
        pending.saved = Some(data);
        pending.saved_version = Some(pending.version);
        Ok(())
    }
}

/// A context outside a worker, as a handler's tests need: its reports go nowhere (the last
/// checkpoint saved is still its `checkpoint()`), and a checkpoint may have up to 256 KiB.
impl From<Task> for TaskContext {
    fn from(task: Task) -> TaskContext {
        TaskContext::new(task, DEFAULT_MAX_CHECKPOINT_BYTES)
    }
}

impl Deref for TaskContext {
    type Target = Task;

    fn deref(&self) -> &Task {
        &self.task
    }
}

/// A running handler's reports the server has not acknowledged: the latest of each, with
/// the version it was made at.
#[derive(Debug, Default)]
struct Pending {
    /// Counts the reports: a heartbeat's answer drops what it carried only when no newer
    /// report replaced it since.
    version: u64,
    progress: Option<(proto::TaskProgress, u64)>,
    /// The checkpoint last saved (None: none saved, the one leased holds).
    saved: Option<Vec<u8>>,
    /// The version of `saved` while it is not acknowledged.
    saved_version: Option<u64>,
    /// The tasks spawned, sent with the success.
    spawned: Vec<TaskSpec>,
    /// The handler returned: a spawn now would be lost.
    ended: bool,
}

impl Pending {
    /// The report a heartbeat carries, and what it carried; None when nothing is pending.
    fn to_send(
        &self,
        task_id: u64,
        attempt: i32,
        seq: u64,
    ) -> Option<(proto::TaskReport, Carried)> {
        if self.progress.is_none() && self.saved_version.is_none() {
            return None;
        }
        let report = proto::TaskReport {
            task_id,
            attempt,
            progress: self.progress.as_ref().map(|(p, _)| p.clone()),
            checkpoint: self.saved_version.and(self.saved.clone()),
        };
        let carried = Carried {
            task_id,
            seq,
            progress: self.progress.as_ref().map(|(_, v)| *v),
            checkpoint: self.saved_version,
        };
        Some((report, carried))
    }

    /// A heartbeat that carried these versions was answered: they are the server's.
    fn acknowledged(&mut self, carried: &Carried) {
        if self.progress.as_ref().map(|(_, v)| *v) == carried.progress {
            self.progress = None;
        }
        if self.saved_version == carried.checkpoint {
            self.saved_version = None;
        }
    }

    /// Everything pending, for the outcome (nothing is pending after).
    fn take(&mut self, task_id: u64, attempt: i32) -> Option<proto::TaskReport> {
        let progress = self.progress.take().map(|(p, _)| p);
        let checkpoint = self.saved_version.take().and(self.saved.clone());
        if progress.is_none() && checkpoint.is_none() {
            return None;
        }
        Some(proto::TaskReport {
            task_id,
            attempt,
            progress,
            checkpoint,
        })
    }
}

/// The versions of one task's report a heartbeat carried.
struct Carried {
    task_id: u64,
    /// The handler's (Running.seq).
    seq: u64,
    progress: Option<u64>,
    checkpoint: Option<u64>,
}

type HandlerFuture = Pin<Box<dyn Future<Output = Result<TaskResult, TaskError>> + Send>>;
type Handler = Arc<dyn Fn(TaskContext, CancellationToken) -> HandlerFuture + Send + Sync>;

/// Configures a [`Worker`]: `WorkerOptions::new(options, ["pool"])` and the setters.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    options: Options,
    pools: Vec<String>,
    concurrency: usize,
    /// None: [`default_prefetch`] of the concurrency.
    prefetch: Option<usize>,
    name: String,
    labels: HashMap<String, String>,
    shutdown_grace: Duration,
    finish_linger: Duration,
}

impl WorkerOptions {
    /// A worker of `pools`, connecting as `options` say.
    pub fn new<I, S>(options: Options, pools: I) -> WorkerOptions
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".to_string());
        WorkerOptions {
            options,
            pools: pools.into_iter().map(Into::into).collect(),
            concurrency: 16,
            prefetch: None,
            name: format!("{host}-{}", std::process::id()),
            labels: HashMap::new(),
            shutdown_grace: Duration::from_secs(30),
            finish_linger: Duration::from_millis(2),
        }
    }

    /// The most handlers running at once: 16 by default.
    pub fn concurrency(mut self, n: usize) -> WorkerOptions {
        self.concurrency = n;
        self
    }

    /// How many leased tasks the worker may hold beyond the ones its handlers run, so a slot
    /// that frees starts the next task at once instead of after a round trip to the server:
    /// 4 tasks a slot by default (at most 100,000 - concurrency), 0 for none. The server sends
    /// beyond the free slots only what the worker starts within about a step, so a worker with
    /// slow handlers holds nothing another worker could start. A held task's lease and timeout
    /// run from its lease, not from its start.
    pub fn prefetch(mut self, n: usize) -> WorkerOptions {
        self.prefetch = Some(n);
        self
    }

    /// Shown by ListWorkers; hostname-pid by default.
    pub fn name(mut self, name: impl Into<String>) -> WorkerOptions {
        self.name = name.into();
        self
    }

    /// A label shown by ListWorkers.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> WorkerOptions {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// How long running tasks may go on once the worker stops; those still running then are
    /// cancelled and given back to the server. 30 s by default.
    pub fn shutdown_grace(mut self, grace: Duration) -> WorkerOptions {
        self.shutdown_grace = grace;
        self
    }

    /// How long an outcome waits for others to join its report while handlers run: 2 ms by
    /// default; zero: none.
    pub fn finish_linger(mut self, linger: Duration) -> WorkerOptions {
        self.finish_linger = linger;
        self
    }
}

struct Running {
    seq: u64,
    attempt: i32,
    pool: String,
    token: CancellationToken,
    /// The server asked: report it cancelled.
    cancel_requested: bool,
    /// Cancelled at shutdown: give it back.
    releasing: bool,
    /// No longer ours: report nothing.
    lost: bool,
    /// The handler's reports (its TaskContext's).
    pending: Arc<Mutex<Pending>>,
}

/// A task received while every slot was taken (prefetched): it starts when a handler ends.
struct Held {
    task: Task,
    /// Its timeout counts from its lease, so from here rather than from its start.
    received: Instant,
}

/// A task to start once the state's lock is released.
struct Start {
    ctx: TaskContext,
    token: CancellationToken,
    seq: u64,
    /// When its handler is cancelled as timed out.
    deadline: Option<Instant>,
}

struct State {
    worker_id: String,
    heartbeat: Duration,
    max_result_bytes: u64,
    lease_bytes: u64,
    max_checkpoint_bytes: u64,
    running: HashMap<u64, Running>,
    /// Received, not started: oldest first. Never empty while a slot is free (unless stopping).
    held: VecDeque<Held>,
    /// Reported, not yet answered.
    unacked: HashMap<u64, Unacked>,
    /// Handlers that ended and left `running`, their outcomes not yet reported: a stop must
    /// not close the stream before they are (the server would release their tasks).
    reporting: usize,
    /// Not yet sent on the current stream.
    outcomes: Vec<proto::TaskOutcome>,
    /// The reports each heartbeat on the current stream carried, oldest first, until answered.
    beats: VecDeque<Vec<Carried>>,
    /// Tasks that left the worker's hands (handler ended, held task dropped), not yet given
    /// back as credits.
    freed: u32,
    beat_due: bool,
    stopping: bool,
    /// The current stream's side is closed: nothing more can be reported on it.
    closed: bool,
    processed: u64,
}

/// An outcome reported and not yet answered, and its task's pool (for the logs).
struct Unacked {
    outcome: proto::TaskOutcome,
    pool: String,
}

impl State {
    /// Stopping, and nothing left to run or to report.
    fn finished(&self) -> bool {
        self.stopping
            && self.running.is_empty()
            && self.held.is_empty()
            && self.reporting == 0
            && self.unacked.is_empty()
    }

    fn report(&mut self, outcome: proto::TaskOutcome, pool: &str) {
        let unacked = Unacked {
            outcome: outcome.clone(),
            pool: pool.to_string(),
        };
        self.unacked.insert(outcome.task_id, unacked);
        self.outcomes.push(outcome);
    }

    /// Drops the held tasks the server cancelled (reported CANCELLED) or says are lost
    /// (reported nothing): their handlers never run, and their credits are given back.
    fn drop_held(&mut self, cancelled: &[u64], lost: &[u64]) {
        if self.held.is_empty() || (cancelled.is_empty() && lost.is_empty()) {
            return;
        }
        let cancelled: HashSet<u64> = cancelled.iter().copied().collect();
        let lost: HashSet<u64> = lost.iter().copied().collect();
        let (dropped, kept): (VecDeque<Held>, VecDeque<Held>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| cancelled.contains(&h.task.id) || lost.contains(&h.task.id));
        self.held = kept;
        for h in dropped {
            self.freed += 1;
            if lost.contains(&h.task.id) {
                tracing::warn!(
                    worker_id = %self.worker_id,
                    task_id = %h.task.id,
                    attempt = h.task.attempt,
                    pool = %h.task.pool,
                    "cronoq: held task lost its lease before it started; it is not run"
                );
                continue;
            }
            self.report(
                proto::TaskOutcome {
                    task_id: h.task.id,
                    attempt: h.task.attempt,
                    outcome: Some(Outcome::Cancelled(proto::TaskCancelled {
                        reason: "cancelled".to_string(),
                    })),
                    report: None,
                },
                &h.task.pool,
            );
        }
    }

    /// The graceful stop gives the held tasks back at once: none of them has started.
    fn release_held(&mut self) {
        if !self.held.is_empty() {
            tracing::info!(
                worker_id = %self.worker_id,
                tasks = self.held.len(),
                "cronoq: releasing held tasks that have not started"
            );
        }
        while let Some(h) = self.held.pop_front() {
            self.freed += 1;
            self.report(released(h.task.id, h.task.attempt), &h.task.pool);
        }
    }
}

struct Shared {
    opts: WorkerOptions,
    /// The tasks held beyond the running ones: the options' or the default.
    prefetch: usize,
    handler: Handler,
    conn: Connection,
    started: AtomicBool,
    next_seq: AtomicU64,
    stop: CancellationToken,
    /// The sender has something to send.
    wake: Notify,
    st: Mutex<State>,
}

/// Runs tasks of its pools over one Work stream: credits for its free slots and its
/// prefetch (never more tasks than concurrency + prefetch, never more handlers running than
/// its concurrency), outcomes batched, heartbeats naming the attempts it holds,
/// the stream opened again after a failure, and a graceful stop that gives unfinished tasks
/// back. Cheap to clone: clones are the same worker (call [`Worker::stop`] from one while
/// another runs).
#[derive(Clone)]
pub struct Worker {
    shared: Arc<Shared>,
}

pub(crate) fn workers(ch: Channel) -> WorkerServiceClient<Channel> {
    WorkerServiceClient::new(ch)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

fn released(id: u64, attempt: i32) -> proto::TaskOutcome {
    proto::TaskOutcome {
        task_id: id,
        attempt,
        outcome: Some(Outcome::Released(proto::TaskReleased {
            reason: RELEASE_REASON.to_string(),
        })),
        report: None,
    }
}

/// Failures of a Work stream that say nothing about the request.
fn transient_stream(err: &Error) -> bool {
    matches!(err, Error::Rpc(e) if matches!(
        e.code,
        Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded | Code::Internal | Code::Unknown
    ))
}

impl Worker {
    /// Checks the options and returns a worker that runs `handler` for each task, given as a
    /// [`TaskContext`]. The handler's token is cancelled when the task's cancellation is
    /// requested (the task ends CANCELLED), when its timeout passes, when its lease is lost,
    /// or when the worker stops and the shutdown grace has passed (the task is given back to
    /// the server).
    pub fn new<F, Fut, R>(opts: WorkerOptions, handler: F) -> Result<Worker, Error>
    where
        F: Fn(TaskContext, CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, TaskError>> + Send + 'static,
        R: Into<TaskResult>,
    {
        if opts.pools.is_empty() {
            return Err(Error::InvalidArgument(
                "pools: give at least one pool".into(),
            ));
        }
        if opts.concurrency == 0 {
            return Err(Error::InvalidArgument(
                "concurrency: 0 must be at least 1".into(),
            ));
        }
        let prefetch = opts
            .prefetch
            .unwrap_or_else(|| default_prefetch(opts.concurrency));
        if opts
            .concurrency
            .checked_add(prefetch)
            .is_none_or(|held| held > MAX_HELD)
        {
            return Err(Error::InvalidArgument(format!(
                "prefetch: {prefetch} with concurrency {}: concurrency + prefetch must be at most {MAX_HELD}",
                opts.concurrency
            )));
        }
        let conn = Connection::new(&opts.options)?;
        let handler: Handler = Arc::new(move |ctx, token| {
            let fut = handler(ctx, token);
            Box::pin(async move { fut.await.map(Into::into) })
        });
        Ok(Worker {
            shared: Arc::new(Shared {
                opts,
                prefetch,
                handler,
                conn,
                started: AtomicBool::new(false),
                next_seq: AtomicU64::new(1),
                stop: CancellationToken::new(),
                wake: Notify::new(),
                st: Mutex::new(State {
                    worker_id: String::new(),
                    heartbeat: Duration::from_secs(10),
                    max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
                    lease_bytes: DEFAULT_MAX_LEASE_BYTES,
                    max_checkpoint_bytes: DEFAULT_MAX_CHECKPOINT_BYTES,
                    running: HashMap::new(),
                    held: VecDeque::new(),
                    unacked: HashMap::new(),
                    reporting: 0,
                    outcomes: Vec::new(),
                    beats: VecDeque::new(),
                    freed: 0,
                    beat_due: false,
                    stopping: false,
                    closed: false,
                    processed: 0,
                }),
            }),
        })
    }

    /// The server the worker talks to now.
    pub fn endpoint(&self) -> Endpoint {
        self.shared.conn.endpoint()
    }

    /// The worker id the server gave at registration ("" before).
    pub fn id(&self) -> String {
        self.shared.st.lock().unwrap().worker_id.clone()
    }

    /// The number of outcomes the server has acknowledged.
    pub fn processed(&self) -> u64 {
        self.shared.st.lock().unwrap().processed
    }

    /// Asks the worker to stop taking tasks; [`Worker::run`] returns once running tasks have
    /// finished (within the shutdown grace; the others are given back) and every outcome is
    /// reported.
    pub fn stop(&self) {
        self.shared.stop.cancel();
    }

    /// Registers and runs tasks until [`Worker::stop`], then stops gracefully and returns
    /// Ok. It returns an error when the worker cannot go on: a refusal of its credentials, a
    /// TLS failure, a redirect refused or too many redirects. It runs at most once.
    pub async fn run(&self) -> Result<(), Error> {
        let w = &self.shared;
        if w.started.swap(true, Ordering::SeqCst) {
            return Err(Error::rpc_code(
                Code::FailedPrecondition,
                "worker: run was called already",
            ));
        }
        // The worker's own calls outlive the stop request, for the bounded time of a graceful stop.
        let calls = CancellationToken::new();
        if !w.register().await? {
            return Ok(()); // stopped while registering
        }
        tracing::info!(worker_id = %self.id(), endpoint = %self.endpoint(), pools = ?w.opts.pools, "cronoq: worker registered");
        let heartbeats = calls.child_token();
        tokio::spawn(w.clone().heartbeat_loop(heartbeats.clone()));
        let mut work = tokio::spawn(w.clone().work_loop(calls.clone()));
        let mut work_result = tokio::select! {
            r = &mut work => Some(r),
            _ = w.stop.cancelled() => None,
        };
        // Also when the stream failed for good: unfinished tasks are released, held ones
        // at once, running ones after the grace.
        {
            let mut st = w.st.lock().unwrap();
            st.stopping = true;
            st.release_held();
        }
        w.wake.notify_one();
        let deadline = Instant::now() + w.opts.shutdown_grace + STOP_EXTRA_TIME;
        w.finish_running().await;
        w.wake.notify_one(); // the stream closes its side once every outcome is answered
        if work_result.is_none() {
            work_result = Some(tokio::select! {
                r = &mut work => r,
                _ = tokio::time::sleep_until(deadline.into()) => {
                    calls.cancel();
                    work.await
                }
            });
        }
        calls.cancel();
        heartbeats.cancel();
        let left = w.st.lock().unwrap().unacked.len();
        if left > 0 {
            tracing::warn!(worker_id = %self.id(), outcomes = left, "cronoq: outcomes not acknowledged at shutdown; their leases will expire");
        }
        w.deregister().await;
        match work_result {
            Some(Ok(result)) => result,
            Some(Err(join)) => Err(Error::rpc_code(
                Code::Internal,
                format!("worker: the work loop failed: {join}"),
            )),
            None => Ok(()),
        }
    }
}

impl Shared {
    fn id(&self) -> String {
        self.st.lock().unwrap().worker_id.clone()
    }

    /// Registers with the shard of the worker's pools, following up to 3 redirects in a
    /// row; UNAVAILABLE is retried (on the leader named, or the next configured endpoint)
    /// until stop. Ok(false): stopped first.
    async fn register(&self) -> Result<bool, Error> {
        let mut redirects = 0;
        let mut row = FailureRow::new(self.conn.retry, "worker registration");
        let mut chain = vec![self.conn.endpoint().to_string()];
        let req = proto::RegisterWorkerRequest {
            name: self.opts.name.clone(),
            pools: self.opts.pools.clone(),
            concurrency: self.opts.concurrency as i32,
            labels: self.opts.labels.clone(),
        };
        let timeout = self.conn.timeout;
        loop {
            let call = self.conn.once(Some(timeout), |ch| {
                let r = self.conn.request(req.clone(), Some(timeout));
                async move { workers(ch).register_worker(r).await }
            });
            let result = tokio::select! {
                r = call => r,
                _ = self.stop.cancelled() => return Ok(false),
            };
            match result {
                Ok(resp) => {
                    row.succeeded(&self.id());
                    self.registered(resp);
                    return Ok(true);
                }
                Err(err @ Error::Rpc(_))
                    if err.code() == Code::FailedPrecondition
                        && !err.shard_endpoint().is_empty() =>
                {
                    redirects += 1;
                    let shard = if err.shard().is_empty() {
                        "?"
                    } else {
                        err.shard()
                    };
                    chain.push(format!("shard {shard} at {}", err.shard_endpoint()));
                    if redirects > MAX_REDIRECTS {
                        return Err(Error::TooManyRedirects(format!(
                            "worker for {:?} was redirected more than {MAX_REDIRECTS} times in a row: {}: check the [[shards]] endpoints",
                            self.opts.pools,
                            chain.join(" -> ")
                        )));
                    }
                    tracing::info!(worker_id = %self.id(), shard = err.shard(), endpoint = err.shard_endpoint(), pools = ?self.opts.pools,
                        "cronoq: reconnecting to the shard of the worker's pools");
                    self.conn.follow(err.shard_endpoint())?;
                }
                Err(err @ Error::Rpc(_)) if err.code() == Code::Unavailable => {
                    // The leader a standby names, or else the next configured endpoint (so a
                    // redirect target that is down sends the worker back to its configured one).
                    self.conn.on_unavailable(&err);
                    if self.conn.is_configured(&self.conn.endpoint()) {
                        redirects = 0;
                        chain = vec![self.conn.endpoint().to_string()];
                    }
                    let delay = row.failed(&err, &self.conn.endpoint(), &self.id());
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = self.stop.cancelled() => return Ok(false),
                    }
                }
                Err(err) => return Err(err),
            }
        }
    }

    fn registered(&self, resp: proto::RegisterWorkerResponse) {
        let mut st = self.st.lock().unwrap();
        st.worker_id = resp.worker_id;
        st.heartbeat = Duration::from_millis(u64::from(resp.heartbeat_interval_ms))
            .max(Duration::from_millis(100));
        let or_default = |v: u64, d: u64| if v == 0 { d } else { v };
        st.max_result_bytes =
            or_default(resp.max_result_bytes, DEFAULT_MAX_RESULT_BYTES).min(MAX_REQUEST_BYTES);
        st.lease_bytes =
            or_default(resp.max_lease_bytes, DEFAULT_MAX_LEASE_BYTES).min(MAX_REQUEST_BYTES);
        st.max_checkpoint_bytes =
            or_default(resp.max_checkpoint_bytes, DEFAULT_MAX_CHECKPOINT_BYTES)
                .min(MAX_REQUEST_BYTES);
    }

    async fn deregister(&self) {
        let id = self.id();
        if id.is_empty() {
            return;
        }
        let req = proto::DeregisterWorkerRequest {
            worker_id: id.clone(),
        };
        let result = self
            .conn
            .once(Some(DEREGISTER_TIMEOUT), |ch| {
                let r = self.conn.request(req, Some(DEREGISTER_TIMEOUT));
                async move { workers(ch).deregister_worker(r).await }
            })
            .await;
        if let Err(err) = result {
            tracing::debug!(worker_id = %id, error = %err, "cronoq: deregister failed");
        }
    }

    fn is_finished(&self) -> bool {
        self.st.lock().unwrap().finished()
    }

    /// Marks the stream's side closed when the worker is finished: a task that arrives from
    /// then on cannot be reported, so it is dropped (the server releases it).
    fn close_if_finished(&self) -> bool {
        let mut st = self.st.lock().unwrap();
        st.closed = st.finished();
        st.closed
    }

    /// The graceful stop: running tasks finish within the grace, the others are cancelled
    /// and released.
    async fn finish_running(&self) {
        let running: Vec<(u64, u64)> = {
            let st = self.st.lock().unwrap();
            st.running.iter().map(|(id, r)| (*id, r.seq)).collect()
        };
        if running.is_empty() {
            return;
        }
        tracing::info!(worker_id = %self.id(), running = running.len(), "cronoq: waiting for running tasks");
        let pending = self.wait_for(&running, self.opts.shutdown_grace).await;
        if pending.is_empty() {
            return;
        }
        tracing::warn!(worker_id = %self.id(), tasks = pending.len(), grace = ?self.opts.shutdown_grace,
            "cronoq: releasing tasks still running after the shutdown grace");
        {
            let mut st = self.st.lock().unwrap();
            for (id, seq) in &pending {
                if let Some(r) = st.running.get_mut(id).filter(|r| r.seq == *seq) {
                    r.releasing = true;
                    r.token.cancel();
                }
            }
        }
        let stuck = self.wait_for(&pending, UNWIND_TIME).await;
        let mut st = self.st.lock().unwrap();
        for (id, seq) in stuck {
            // The handler ignores its token: release the task anyway, and report nothing later.
            if let Some(r) = st.running.remove(&id) {
                if r.seq != seq {
                    st.running.insert(id, r);
                    continue;
                }
                tracing::warn!(
                    worker_id = %st.worker_id,
                    task_id = %id,
                    attempt = r.attempt,
                    pool = %r.pool,
                    "cronoq: handler ignores cancellation; releasing the task"
                );
                let outcome = proto::TaskOutcome {
                    report: r.pending.lock().unwrap().take(id, r.attempt),
                    ..released(id, r.attempt)
                };
                st.report(outcome, &r.pool);
            }
        }
    }

    /// Waits up to `limit` for these handlers to return; the ones still running.
    async fn wait_for(&self, tasks: &[(u64, u64)], limit: Duration) -> Vec<(u64, u64)> {
        let deadline = Instant::now() + limit;
        loop {
            let pending: Vec<(u64, u64)> = {
                let st = self.st.lock().unwrap();
                tasks
                    .iter()
                    .filter(|(id, seq)| st.running.get(id).is_some_and(|r| r.seq == *seq))
                    .copied()
                    .collect()
            };
            if pending.is_empty() || Instant::now() >= deadline {
                return pending;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Opens Work streams one after the other until the worker is finished: a stream that
    /// fails is opened again (on the server an UNAVAILABLE names) after a backoff that grows
    /// with the failures in a row and starts over after a healthy stream (one that delivered a
    /// message or stayed open HEALTHY_STREAM); the outcomes it did not answer are sent again on
    /// the next (fenced by attempt: safe).
    async fn work_loop(self: Arc<Self>, calls: CancellationToken) -> Result<(), Error> {
        let mut row = FailureRow::new(self.conn.retry, "work stream");
        while !self.is_finished() {
            let opened = Instant::now();
            let (answered, result) = self.work_stream(&calls).await;
            if calls.is_cancelled() {
                return Ok(()); // the graceful stop's time is up
            }
            if answered || opened.elapsed() >= HEALTHY_STREAM {
                row.succeeded(&self.id());
            }
            if self.is_finished() {
                return Ok(());
            }
            let err = match result {
                // The server ended it cleanly: opened again, but not in a tight loop.
                Ok(()) => Error::rpc_code(Code::Unavailable, "the server ended the stream"),
                Err(
                    err @ (Error::Tls(_) | Error::TooManyRedirects(_) | Error::RedirectRefused(_)),
                ) => return Err(err),
                Err(err)
                    if matches!(err.code(), Code::PermissionDenied | Code::Unauthenticated) =>
                {
                    return Err(err);
                }
                Err(err)
                    if err.code() == Code::FailedPrecondition
                        && !err.shard_endpoint().is_empty() =>
                {
                    return Err(err); // the pools moved to another shard
                }
                Err(err) if err.code() == Code::Unavailable && matches!(err, Error::Rpc(_)) => {
                    self.conn.on_unavailable(&err); // to the leader a standby names, or the next endpoint
                    err
                }
                Err(err)
                    if transient_stream(&err)
                        || (err.code() == Code::NotFound && matches!(err, Error::Rpc(_))) =>
                {
                    err
                }
                Err(err) => {
                    // e.g. RESOURCE_EXHAUSTED, an answer over the receive limit: smaller answers.
                    {
                        let mut st = self.st.lock().unwrap();
                        st.lease_bytes = (st.lease_bytes / 2).max(MIN_LEASE_BYTES);
                    }
                    tracing::error!(worker_id = %self.id(), error = %err, "cronoq: work stream failed; opening it again with a smaller max_bytes");
                    err
                }
            };
            let pause = row.failed(&err, &self.conn.endpoint(), &self.id());
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = calls.cancelled() => return Ok(()),
            }
            if err.code() == Code::NotFound && matches!(err, Error::Rpc(_)) {
                tracing::warn!(worker_id = %self.id(), "cronoq: worker unknown to the server; registering again");
                if !self.register().await? {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// One Work stream: the first message gives the slots (the concurrency) and, as credits,
    /// what the worker can take (concurrency + prefetch - held); the sender sends outcomes,
    /// freed slots and heartbeats; answers are read here until the server ends it. The bool:
    /// the server sent a message on it.
    async fn work_stream(self: &Arc<Self>, calls: &CancellationToken) -> (bool, Result<(), Error>) {
        let (ch, ep) = match self.conn.channel() {
            Ok(channel) => channel,
            Err(err) => return (false, Err(err)),
        };
        let mut answered = false;
        let (first, resend) = {
            let mut st = self.st.lock().unwrap();
            let unanswered: Vec<_> = st.unacked.values().map(|u| u.outcome.clone()).collect(); // what an earlier stream did not answer
            st.outcomes = unanswered;
            st.beats.clear(); // their reports are still pending: the next heartbeat carries them
            st.freed = 0;
            st.closed = false;
            let free = if st.stopping {
                0
            } else {
                (self.opts.concurrency + self.prefetch)
                    .saturating_sub(st.running.len() + st.held.len())
            };
            let first = proto::WorkRequest {
                worker_id: st.worker_id.clone(),
                credits: free as u32,
                max_bytes: st.lease_bytes,
                slots: self.opts.concurrency as u32,
                ..Default::default()
            };
            (first, !st.outcomes.is_empty())
        };
        if resend {
            self.wake.notify_one(); // sent right after the first message
        }
        let (tx, rx) = mpsc::channel::<proto::WorkRequest>(16);
        let stream_done = calls.child_token();
        let sender = tokio::spawn(self.clone().send_loop(tx, first, stream_done.clone()));
        let request = self.conn.request(ReceiverStream::new(rx), None);
        let result: Result<(), tonic::Status> = async {
            let mut client = workers(ch);
            let mut stream = tokio::select! {
                r = client.work(request) => r?.into_inner(),
                _ = calls.cancelled() => return Ok(()),
            };
            loop {
                tokio::select! {
                    m = stream.message() => match m? {
                        Some(answer) => {
                            answered = true;
                            self.answered(answer);
                        }
                        None => return Ok(()),
                    },
                    _ = calls.cancelled() => return Ok(()),
                }
            }
        }
        .await;
        stream_done.cancel();
        let _ = sender.await;
        match result {
            Ok(()) => (answered, Ok(())),
            Err(status) => (answered, Err(self.conn.diagnose(&ep, status).await)),
        }
    }

    /// Sends the stream's messages: outcomes (lingering a moment while handlers run, so more
    /// join), the slots handlers freed, heartbeats; closes its side once stopping and every
    /// outcome is answered.
    async fn send_loop(
        self: Arc<Self>,
        tx: mpsc::Sender<proto::WorkRequest>,
        first: proto::WorkRequest,
        done: CancellationToken,
    ) {
        let mut message = Some(first);
        loop {
            if let Some(m) = message.take()
                && tx.send(m).await.is_err()
            {
                return; // the stream ended: the reader sees why
            }
            if self.close_if_finished() {
                // Closing: every outcome is answered; a task sent from now on is dropped, and
                // the server, told so, releases it as the stream ends.
                let closing = proto::WorkRequest {
                    closing: true,
                    ..Default::default()
                };
                let _ = tx.send(closing).await;
                return; // dropping tx closes the send side
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = done.cancelled() => return,
            }
            let linger = {
                let st = self.st.lock().unwrap();
                !self.opts.finish_linger.is_zero()
                    && !st.outcomes.is_empty()
                    && !st.running.is_empty()
                    && st.outcomes.len() < MAX_FINISH_BATCH
                    && !st.stopping
            };
            if linger && !self.linger(&done).await {
                return;
            }
            message = self.next_message();
        }
    }

    /// Waits for more outcomes to join the pending ones: until every running handler has
    /// returned, the batch is full, or finish_linger passes. False when the stream ends first.
    async fn linger(&self, done: &CancellationToken) -> bool {
        let timer = tokio::time::sleep(self.opts.finish_linger);
        tokio::pin!(timer);
        loop {
            tokio::select! {
                _ = self.wake.notified() => {
                    let st = self.st.lock().unwrap();
                    if st.running.is_empty() || st.outcomes.len() >= MAX_FINISH_BATCH {
                        return true;
                    }
                }
                _ = &mut timer => return true,
                _ = done.cancelled() => return false,
            }
        }
    }

    /// The next message to send, or None when there is nothing to say.
    fn next_message(&self) -> Option<proto::WorkRequest> {
        let mut st = self.st.lock().unwrap();
        let mut m = proto::WorkRequest {
            outcomes: next_batch(&mut st.outcomes),
            ..Default::default()
        };
        if !st.stopping {
            m.credits = std::mem::take(&mut st.freed);
        }
        if std::mem::take(&mut st.beat_due) {
            let mut beat = proto::WorkHeartbeat::default();
            let mut carried = Vec::new();
            // The reports the message has room for; the others wait for the next heartbeat.
            let mut room = MAX_REQUEST_BYTES.saturating_sub(m.encoded_len() as u64);
            for (id, r) in &st.running {
                beat.tasks.push(proto::TaskAttempt {
                    task_id: *id,
                    attempt: r.attempt,
                });
                let Some((report, c)) = r.pending.lock().unwrap().to_send(*id, r.attempt, r.seq)
                else {
                    continue;
                };
                let size = report.encoded_len() as u64 + FRAMING;
                if size <= room {
                    room -= size;
                    beat.reports.push(report);
                    carried.push(c);
                }
            }
            // Held tasks too: their leases must not expire while they wait.
            for h in &st.held {
                beat.tasks.push(proto::TaskAttempt {
                    task_id: h.task.id,
                    attempt: h.task.attempt,
                });
            }
            for (id, u) in &st.unacked {
                if !st.running.contains_key(id) {
                    beat.tasks.push(proto::TaskAttempt {
                        task_id: *id,
                        attempt: u.outcome.attempt,
                    });
                }
            }
            st.beats.push_back(carried);
            m.heartbeat = Some(beat);
        }
        if !st.outcomes.is_empty() {
            self.wake.notify_one(); // the rest in the next message
        }
        if m.outcomes.is_empty() && m.credits == 0 && m.heartbeat.is_none() {
            return None;
        }
        Some(m)
    }

    /// Handles what the server sent: tasks to run, the results of outcomes, a heartbeat's answer.
    fn answered(self: &Arc<Self>, answer: proto::WorkResponse) {
        let to_start;
        {
            let mut st = self.st.lock().unwrap();
            for r in &answer.results {
                let unacked = st.unacked.remove(&r.task_id);
                if unacked.is_some() {
                    st.processed += 1;
                }
                if !r.accepted {
                    let (attempt, pool) = unacked
                        .as_ref()
                        .map_or((None, None), |u| (Some(u.outcome.attempt), Some(&u.pool)));
                    tracing::warn!(
                        worker_id = %st.worker_id,
                        task_id = %r.task_id,
                        attempt,
                        pool = pool.map(String::as_str),
                        code = %r.code,
                        error = %r.message,
                        "cronoq: outcome refused"
                    );
                }
            }
            for task in answer.tasks {
                if st.closed {
                    // Sent as the stream closed: the server releases it, as nothing can be sent.
                    tracing::debug!(
                        worker_id = %st.worker_id,
                        task_id = %task.id,
                        attempt = task.attempt,
                        pool = %task.pool,
                        "cronoq: task arrived after the work stream closed; the server releases it"
                    );
                    continue;
                }
                if st.stopping {
                    // Sent for slots given before the stop: give it back.
                    st.freed += 1;
                    st.report(released(task.id, task.attempt), &task.pool);
                    continue;
                }
                st.held.push_back(Held {
                    task,
                    received: Instant::now(),
                });
            }
            to_start = self.fill_slots(&mut st);
            if let Some(beat) = &answer.heartbeat {
                // It answers the oldest heartbeat unanswered, or a later one (the server may
                // answer several at once), which carried the same reports or newer ones.
                for c in st.beats.pop_front().unwrap_or_default() {
                    if let Some(r) = st.running.get(&c.task_id).filter(|r| r.seq == c.seq) {
                        r.pending.lock().unwrap().acknowledged(&c);
                    }
                }
                for id in &beat.cancelled_task_ids {
                    if let Some(r) = st.running.get_mut(id) {
                        r.cancel_requested = true;
                        r.token.cancel();
                    }
                }
                let State {
                    worker_id, running, ..
                } = &mut *st;
                for id in &beat.lost_task_ids {
                    if let Some(r) = running.get_mut(id) {
                        tracing::warn!(
                            worker_id = %worker_id,
                            task_id = %id,
                            attempt = r.attempt,
                            pool = %r.pool,
                            "cronoq: task lost its lease; its outcome will not be reported"
                        );
                        r.lost = true;
                        r.token.cancel();
                    }
                }
                st.drop_held(&beat.cancelled_task_ids, &beat.lost_task_ids);
            }
        }
        self.start(to_start);
        self.wake.notify_one();
    }

    /// Starts the oldest held tasks in the free slots (none once stopping: they are
    /// released). A task whose timeout ran out while it was held is not started: it fails as
    /// timed out, and its credit is given back. What to start once the lock is released.
    fn fill_slots(&self, st: &mut State) -> Vec<Start> {
        let mut to_start = Vec::new();
        while !st.stopping && st.running.len() < self.opts.concurrency {
            let Some(Held { task, received }) = st.held.pop_front() else {
                break;
            };
            let timeout_ms = task.timeout_ms;
            let deadline = if timeout_ms > 0 {
                received.checked_add(Duration::from_millis(timeout_ms as u64))
            } else {
                None
            };
            if deadline.is_some_and(|d| d <= Instant::now()) {
                st.freed += 1;
                let outcome = proto::TaskOutcome {
                    task_id: task.id,
                    attempt: task.attempt,
                    outcome: Some(failure(
                        format!("timed out after {timeout_ms} ms, before it could start"),
                        true,
                        None,
                    )),
                    report: None,
                };
                st.report(outcome, &task.pool);
                continue;
            }
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let token = CancellationToken::new();
            let ctx = TaskContext::new(task, st.max_checkpoint_bytes);
            st.running.insert(
                ctx.id,
                Running {
                    seq,
                    attempt: ctx.attempt,
                    pool: ctx.pool.clone(),
                    token: token.clone(),
                    cancel_requested: false,
                    releasing: false,
                    lost: false,
                    pending: ctx.pending.clone(),
                },
            );
            to_start.push(Start {
                ctx,
                token,
                seq,
                deadline,
            });
        }
        to_start
    }

    fn start(self: &Arc<Self>, tasks: Vec<Start>) {
        for s in tasks {
            tokio::spawn(self.clone().execute(s));
        }
    }

    /// Runs one attempt and reports its outcome; the oldest held task takes its slot.
    async fn execute(self: Arc<Self>, start: Start) {
        let Start {
            ctx,
            token,
            seq,
            deadline,
        } = start;
        let (id, attempt, timeout_ms) = (ctx.id, ctx.attempt, ctx.timeout_ms);
        let pool = ctx.pool.clone();
        // The handler runs with the task's span current (with the `otel` feature).
        let span = TaskSpan::start(&ctx);
        let handler = span.in_scope(|| (self.handler)(ctx, token.clone()));
        let mut handle = tokio::spawn(span.instrument(handler));
        let mut timed_out = false;
        let joined = if let Some(deadline) = deadline {
            // The server never extends the lease past the attempt's deadline, which counts
            // from the lease (a held task's wait included): cancel it there.
            tokio::select! {
                r = &mut handle => r,
                _ = tokio::time::sleep_until(deadline.into()) => {
                    timed_out = true;
                    token.cancel();
                    handle.await
                }
            }
        } else {
            handle.await
        };
        let (running, report, spawned, max_result, to_start, worker_id, stopping) = {
            let mut st = self.st.lock().unwrap();
            let running = match st.running.get(&id) {
                Some(r) if r.seq == seq => st.running.remove(&id),
                _ => None,
            };
            // What no heartbeat's answer acknowledged goes with the outcome.
            let report = running
                .as_ref()
                .and_then(|r| r.pending.lock().unwrap().take(id, attempt));
            let spawned = running.as_ref().map_or_else(Vec::new, |r| {
                let mut pending = r.pending.lock().unwrap();
                pending.ended = true;
                std::mem::take(&mut pending.spawned)
            });
            if let Some(r) = &running {
                st.freed += 1;
                if !r.lost {
                    st.reporting += 1; // reported below (report_ended)
                }
            }
            // In the same lock as the slot frees: a task arriving now is held or started,
            // never both, and never beyond concurrency.
            let to_start = self.fill_slots(&mut st);
            let worker_id = st.worker_id.clone();
            (
                running,
                report,
                spawned,
                st.max_result_bytes,
                to_start,
                worker_id,
                st.stopping,
            )
        };
        self.start(to_start);
        let running = match running {
            Some(r) if !r.lost => r,
            lost => {
                // No longer ours: its lease was lost, or the graceful stop released it already
                // (its handler ignored the cancellation).
                span.end(if lost.is_none() && stopping {
                    Ended::Released
                } else {
                    Ended::Lost
                });
                self.wake.notify_one();
                return;
            }
        };
        let outcome = match joined {
            Ok(Ok(result)) if result.data.len() as u64 > max_result => failure(
                format!(
                    "result of {} bytes exceeds max_result_bytes {max_result}",
                    result.data.len()
                ),
                false,
                None,
            ),
            Ok(Ok(result)) => success(result, &spawned),
            _ if running.cancel_requested => Outcome::Cancelled(proto::TaskCancelled {
                reason: "cancelled".to_string(),
            }),
            _ if running.releasing => Outcome::Released(proto::TaskReleased {
                reason: RELEASE_REASON.to_string(),
            }),
            _ if timed_out => failure(format!("timed out after {timeout_ms} ms"), true, None),
            Ok(Err(TaskError {
                message,
                snooze: Some(delay),
                ..
            })) => snoozed(delay, message),
            Ok(Err(e)) => failure(e.message, e.retryable, e.retry_after),
            Err(join) => {
                tracing::error!(worker_id = %worker_id, task_id = %id, attempt, pool = %pool, error = %join,
                    "cronoq: handler panicked");
                failure(format!("panic: {join}"), true, None)
            }
        };
        span.end(match &outcome {
            Outcome::Success(_) => Ended::Success,
            Outcome::Failure(f) => Ended::Failure(&f.error),
            Outcome::Snoozed(_) => Ended::Snoozed,
            Outcome::Cancelled(_) => Ended::Cancelled,
            Outcome::Released(_) => Ended::Released,
        });
        let outcome = proto::TaskOutcome {
            task_id: id,
            attempt,
            outcome: Some(outcome),
            report,
        };
        {
            let mut st = self.st.lock().unwrap();
            st.reporting -= 1;
            st.report(outcome, &pool);
        }
        self.wake.notify_one();
    }

    /// Asks the sender for a heartbeat of the attempts held, every interval (the one the
    /// server gave at the latest registration).
    async fn heartbeat_loop(self: Arc<Self>, done: CancellationToken) {
        loop {
            let interval = self.st.lock().unwrap().heartbeat;
            tokio::select! {
                _ = tokio::time::sleep(interval) => {
                    self.st.lock().unwrap().beat_due = true;
                    self.wake.notify_one();
                }
                _ = done.cancelled() => return,
            }
        }
    }
}

/// A success with the tasks its handler spawned (each with the trace it was spawned in), or a
/// failure when they are more than one message carries (it would be refused again and again).
fn success(result: TaskResult, spawned: &[TaskSpec]) -> Outcome {
    let spawn: Vec<proto::SubmitTaskRequest> = spawned
        .iter()
        .map(|spec| proto::SubmitTaskRequest {
            trace: spec.trace.clone(),
            ..spec.proto()
        })
        .collect();
    let outcome = proto::TaskSuccess {
        result: result.data,
        content_type: result.content_type,
        spawn,
    };
    let size = outcome.encoded_len() as u64 + FRAMING;
    if size > MAX_REQUEST_BYTES {
        return failure(
            format!(
                "spawn: {} tasks and the result take {size} bytes, more than a message carries ({MAX_REQUEST_BYTES})",
                spawned.len()
            ),
            false,
            None,
        );
    }
    Outcome::Success(outcome)
}

/// A failed attempt: retried while attempts remain if `retryable`, no sooner than `after`.
fn failure(message: String, retryable: bool, after: Option<Duration>) -> Outcome {
    Outcome::Failure(proto::TaskFailure {
        error: message,
        retryable,
        retry_after_ms: after.map_or(0, |d| d.as_millis().clamp(1, 1 << 31) as u32),
    })
}

/// A snoozed attempt: due again after `delay`, or failed when it is longer than a snooze may be.
fn snoozed(delay: Duration, reason: String) -> Outcome {
    match u32::try_from(delay.as_millis()) {
        Ok(snooze_ms) => Outcome::Snoozed(proto::TaskSnoozed { snooze_ms, reason }),
        Err(_) => failure(
            format!(
                "snooze of {} ms: at most {} ms ({reason})",
                delay.as_millis(),
                u32::MAX
            ),
            true,
            None,
        ),
    }
}

/// The oldest outcomes that fit one message: at most MAX_FINISH_BATCH and
/// MAX_REQUEST_BYTES serialized (one always goes, alone if need be).
fn next_batch(outcomes: &mut Vec<proto::TaskOutcome>) -> Vec<proto::TaskOutcome> {
    let mut size = FRAMING;
    let mut n = 0;
    for o in outcomes.iter() {
        if n == MAX_FINISH_BATCH {
            break;
        }
        size += o.encoded_len() as u64 + FRAMING;
        if n > 0 && size > MAX_REQUEST_BYTES {
            break;
        }
        n += 1;
    }
    outcomes.drain(..n).collect()
}
