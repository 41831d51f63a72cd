//! The conformance driver of the Rust SDK: one case's input as JSON on stdin, one result as
//! JSON on stdout (the protocol: conformance/README.md in the cronoq repository). It uses
//! the SDK's public API only, and OpenTelemetry's API (built with `--features otel,outbox`;
//! no tracer provider is installed; `outbox_enqueue` uses tokio-postgres).

use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cronoq::{
    BulkResult, Client, DependencyResult, Error, GetTaskOptions, JSON_CONTENT_TYPE,
    KeepaliveConfig, KeyMode, Options, PoolPause, RetryConfig, RetryTaskOptions, RunWhen, Schedule,
    ScheduleSpec, Task, TaskContext, TaskError, TaskFilter, TaskRef, TaskResult, TaskSpec,
    TaskState, Worker, WorkerOptions, code_name,
};
use opentelemetry::context::FutureExt as _;
use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::Notify;

#[derive(Deserialize)]
struct Input {
    endpoints: Vec<String>,
    token: Option<String>,
    tls: Option<Tls>,
    #[serde(default)]
    insecure_redirect_http: bool,
    retry: Retry,
    #[serde(default)]
    timeout_ms: u64,
    keepalive: Option<Keepalive>,
    steps: Vec<Step>,
    /// The outbox deployment: the application's PostgreSQL and the schema its outbox is in.
    #[serde(default)]
    database_url: String,
    #[serde(default)]
    outbox_schema: String,
}

#[derive(Deserialize)]
struct Keepalive {
    time_ms: u64,
    timeout_ms: u64,
}

#[derive(Deserialize)]
struct Tls {
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

#[derive(Deserialize)]
struct Retry {
    #[serde(default)]
    initial_backoff_ms: u64,
    #[serde(default)]
    max_backoff_ms: u64,
    max_elapsed_ms: Option<u64>,
}

#[derive(Deserialize)]
struct Step {
    op: String,
    #[serde(default)]
    pool: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    id: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    group_key: String,
    traceparent: Option<String>,
    tracestate: Option<String>,
    #[serde(default)]
    include_attempts: bool,
    #[serde(default)]
    include_children: bool,
    #[serde(default)]
    include_dependency_results: bool,
    #[serde(default)]
    include_descendants: bool,
    /// Submit's dependencies: {"key": ".."} or {"id": "<decimal>"}.
    #[serde(default)]
    depends_on: Vec<Value>,
    /// A RunWhen enum name.
    run_when: Option<String>,
    /// Submit's key options: a KeyMode enum name, milliseconds, and start_by as now + this
    /// many ms.
    key_mode: Option<String>,
    #[serde(default)]
    debounce_ms: u64,
    #[serde(default)]
    max_debounce_ms: u64,
    #[serde(default)]
    key_ttl_ms: u64,
    start_by_in_ms: Option<i64>,
    /// sleep: how long.
    #[serde(default)]
    ms: u64,
    #[serde(default)]
    filter: serde_json::Map<String, Value>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    timeout_ms: u64,
    #[serde(default)]
    pools: Vec<String>,
    #[serde(default)]
    concurrency: usize,
    /// None: the SDK's default; 0: none.
    prefetch: Option<usize>,
    #[serde(default)]
    until_handled: usize,
    #[serde(default)]
    stop_after_started: usize,
    shutdown_grace_ms: Option<u64>,
    /// outbox_enqueue: commit (else roll back), then look the task up by key for this long.
    #[serde(default)]
    commit: bool,
    #[serde(default)]
    relay_within_ms: u64,
    /// put_schedule and delete_schedule: the schedule's name; put_schedule: its cron,
    /// timezone and paused flag (and pool, payload, group_key).
    #[serde(default)]
    name: String,
    #[serde(default)]
    cron: String,
    #[serde(default)]
    timezone: String,
    #[serde(default)]
    paused: bool,
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn options(input: &Input) -> Options {
    let mut opts = Options::new(input.endpoints.join(","))
        .insecure_redirect_http(input.insecure_redirect_http)
        .timeout(ms(input.timeout_ms))
        .retry(RetryConfig {
            initial_backoff: ms(input.retry.initial_backoff_ms.max(1)),
            max_backoff: ms(input.retry.max_backoff_ms.max(1)),
            max_elapsed: input.retry.max_elapsed_ms.map(ms),
        });
    if let Some(token) = &input.token {
        opts = opts.token(token);
    }
    if let Some(k) = &input.keepalive {
        opts = opts.keepalive(KeepaliveConfig {
            time: ms(k.time_ms),
            timeout: ms(k.timeout_ms),
        });
    }
    if let Some(tls) = &input.tls {
        if let Some(ca) = &tls.ca {
            opts = opts.ca_file(ca);
        }
        if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
            opts = opts.client_cert(cert, key);
        }
    }
    opts
}

/// The protocol's form of an error.
fn error_of(err: &Error) -> Value {
    let kind = match err {
        Error::TooManyRedirects(_) => "too_many_redirects",
        Error::RedirectRefused(_) => "redirect_refused",
        Error::Tls(_) => "tls",
        _ => "",
    };
    json!({
        "code": code_name(err.code()),
        "kind": kind,
        "message": err.message(),
        "shard": err.shard(),
        "shard_endpoint": err.shard_endpoint(),
        "leader": err.leader(),
        "reason": err.reason(),
    })
}

fn other(message: String) -> Value {
    json!({"code": "", "kind": "other", "message": message})
}

async fn client_step(client: &Client, input: &Input, step: &Step) -> Value {
    let done = match step.op.as_str() {
        "outbox_enqueue" => outbox_enqueue(client, input, step).await,
        _ => client_op(client, step).await,
    };
    match done {
        Ok(result) => result,
        Err(Failed::Sdk(err)) => json!({"error": error_of(&err)}),
        Err(Failed::Input(message)) => json!({"error": other(message)}),
        Err(Failed::Unsupported(op)) => {
            json!({"error": {"code": "", "kind": "unsupported", "message": format!("unknown op {op:?}")}})
        }
    }
}

/// Why a client step failed: the SDK's error, or a step the driver could not read.
enum Failed {
    Sdk(Error),
    Input(String),
    Unsupported(String),
}

impl From<Error> for Failed {
    fn from(err: Error) -> Failed {
        Failed::Sdk(err)
    }
}

/// Enqueues one task with the outbox helper in a tokio-postgres transaction of the
/// application's database, commits or rolls it back; with relay_within_ms, looks the task up
/// by key until it exists.
async fn outbox_enqueue(client: &Client, input: &Input, step: &Step) -> Result<Value, Failed> {
    let postgres = |e: tokio_postgres::Error| Failed::Input(format!("PostgreSQL: {e}"));
    let (mut db, connection) = tokio_postgres::connect(&input.database_url, tokio_postgres::NoTls)
        .await
        .map_err(postgres)?;
    let connection = tokio::spawn(connection);
    let tx = db.transaction().await.map_err(postgres)?;
    let spec = TaskSpec::new(&step.pool)
        .json(&step.payload)?
        .key(&step.key);
    let id = match cronoq::outbox::Outbox::new()
        .schema(&input.outbox_schema)
        .enqueue(&tx, spec)
        .await
    {
        Ok(id) => id,
        Err(cronoq::outbox::Error::Invalid(err)) => return Err(Failed::Sdk(err)),
        Err(err) => return Err(Failed::Input(err.to_string())),
    };
    if step.commit {
        tx.commit().await.map_err(postgres)?;
    } else {
        tx.rollback().await.map_err(postgres)?;
    }
    drop(db);
    let _ = connection.await;
    let committed = Instant::now();
    let within = ms(step.relay_within_ms);
    let mut relayed = false;
    while !within.is_zero() && !relayed && committed.elapsed() < within {
        match client.get(TaskRef::Key(step.key.clone())).await {
            Ok(_) => relayed = true,
            Err(err) if err.code() == cronoq::Code::NotFound => tokio::time::sleep(ms(5)).await,
            Err(err) => return Err(Failed::Sdk(err)),
        }
    }
    let relay_ms = if within.is_zero() {
        0.0
    } else {
        committed.elapsed().as_secs_f64() * 1000.0
    };
    Ok(json!({"id": id.to_string(), "relayed": relayed, "relay_ms": relay_ms, "error": null}))
}

/// One client step's result (without "op").
async fn client_op(client: &Client, step: &Step) -> Result<Value, Failed> {
    Ok(match step.op.as_str() {
        "submit" => {
            let mut spec = TaskSpec::new(&step.pool)
                .json(&step.payload)?
                .key(&step.key)
                .group_key(&step.group_key)
                .run_when(run_when(step.run_when.as_deref())?)
                .key_mode(key_mode(step.key_mode.as_deref())?);
            for dependency in &step.depends_on {
                spec = spec.depends_on(dependency_ref(dependency, None)?);
            }
            // 0 leaves an option unset, as the protocol's absent field does.
            let given = |n: u64| (n > 0).then(|| ms(n));
            spec.debounce = given(step.debounce_ms);
            spec.max_debounce = given(step.max_debounce_ms);
            spec.key_ttl = given(step.key_ttl_ms);
            spec.start_by = step.start_by_in_ms.map(in_ms);
            // In the context whose current span is the remote one the step gives (none: the
            // driver's, outside any trace).
            let submitted = client
                .submit(spec)
                .with_context(remote_context(step))
                .await?;
            let task = submitted.task;
            json!({
                "id": task.id.to_string(),
                "group_key": task.group_key,
                "replaced": submitted.replaced,
                "deduplicated": submitted.deduplicated,
                "error": null,
            })
        }
        "sleep" => {
            tokio::time::sleep(ms(step.ms)).await;
            json!({"error": null})
        }
        "get" => {
            let opts = GetTaskOptions {
                include_attempts: step.include_attempts,
                include_children: step.include_children,
                include_dependency_results: step.include_dependency_results,
                ..GetTaskOptions::default()
            };
            let mut got = client.get_with(task_ref(step)?, opts).await?;
            let mut result = task_result(&got.task);
            if step.include_attempts {
                let attempts: Vec<Value> = got
                    .attempts
                    .iter()
                    .map(|a| json!({"attempt": a.attempt, "outcome": a.outcome().as_str_name(), "error": a.error}))
                    .collect();
                result["attempts"] = json!(attempts);
            }
            if step.include_children {
                got.children.sort_by_key(|c| c.id);
                let children: Vec<Value> = got
                    .children
                    .iter()
                    .map(|c| json!({"id": c.id.to_string(), "pool": c.pool, "state": c.state().as_str_name(), "parent_id": c.parent_id.to_string()}))
                    .collect();
                result["children"] = json!(children);
            }
            if step.include_dependency_results {
                result["dependency_results"] = dependencies_of(&got.task.dependency_results);
            }
            result
        }
        "cancel" if step.include_descendants => {
            let cancelled = client.cancel_with_descendants(task_ref(step)?).await?;
            let mut result = task_result(&cancelled.task);
            result["descendants_cancelled"] = json!(cancelled.descendants_cancelled);
            result
        }
        "cancel" => task_result(&client.cancel(task_ref(step)?).await?),
        "wait" => {
            let timeout = if step.timeout_ms > 0 {
                step.timeout_ms
            } else {
                10_000
            };
            task_result(&client.wait(task_ref(step)?, ms(timeout)).await?.task)
        }
        "retry" => {
            let retried = client
                .retry(task_ref(step)?, RetryTaskOptions::default())
                .await?;
            task_result(&retried.task)
        }
        "delete" => json!({"id": client.delete(task_ref(step)?).await?.to_string(), "error": null}),
        "pause_pool" => pause_result(&client.pause_pool(&step.pool).await?),
        "resume_pool" => pause_result(&client.resume_pool(&step.pool).await?),
        "bulk_cancel" => bulk_output(&client.cancel_tasks(&filter(step)?, step.dry_run).await?),
        "bulk_retry" => {
            let done = client
                .retry_tasks(&filter(step)?, step.dry_run, RetryTaskOptions::default())
                .await?;
            bulk_output(&done)
        }
        "bulk_delete" => bulk_output(&client.delete_tasks(&filter(step)?, step.dry_run).await?),
        "put_schedule" => {
            let mut spec = ScheduleSpec::new(&step.pool, &step.name, &step.cron)
                .timezone(&step.timezone)
                .group_key(&step.group_key)
                .paused(step.paused);
            if !step.payload.is_null() {
                spec = spec.json(&step.payload)?;
            }
            let mut result = schedule_json(&client.put_schedule(spec).await?);
            result["error"] = Value::Null;
            result
        }
        "delete_schedule" => {
            client.delete_schedule(&step.pool, &step.name).await?;
            json!({"error": null})
        }
        "list_schedules" => {
            let listed = client.list_schedules(step_pool(step)).await?;
            let mut schedules: Vec<&Schedule> = listed.schedules.iter().collect();
            schedules.sort_by(|a, b| (&a.pool, &a.name).cmp(&(&b.pool, &b.name)));
            let schedules: Vec<Value> = schedules.into_iter().map(schedule_json).collect();
            json!({"schedules": schedules, "unavailable_shards": listed.unavailable_shards, "error": null})
        }
        "list_workers" => {
            let listed = client.list_workers(step_pool(step)).await?;
            json!({"count": listed.workers.len(), "unavailable_shards": listed.unavailable_shards, "error": null})
        }
        "server_info" => {
            let info = client.server_info().await?;
            json!({"shard": info.shard, "role": info.role().as_str_name(), "version": info.version, "error": null})
        }
        "snapshot" => {
            let snapshot = client.snapshot().await?;
            let mut shards: Vec<&str> = snapshot.shards.iter().map(|s| s.shard.as_str()).collect();
            shards.sort_unstable();
            json!({"shards": shards, "unavailable_shards": snapshot.unavailable_shards, "error": null})
        }
        op => return Err(Failed::Unsupported(op.to_string())),
    })
}

/// A list call's pool: the step's, or none (every pool) when it gives none.
fn step_pool(step: &Step) -> Option<&str> {
    Some(step.pool.as_str()).filter(|p| !p.is_empty())
}

/// A schedule as the protocol shows it (without its payload and fire times).
fn schedule_json(schedule: &Schedule) -> Value {
    json!({
        "pool": schedule.pool,
        "name": schedule.name,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "paused": schedule.paused,
        "group_key": schedule.group_key,
        "next_fire_set": schedule.next_fire_at.is_some(),
    })
}

/// The context the W3C propagator extracts from the step's traceparent and tracestate: its
/// current span is the remote one they name (an empty context without them).
fn remote_context(step: &Step) -> opentelemetry::Context {
    let mut carrier = HashMap::new();
    if let Some(traceparent) = &step.traceparent {
        carrier.insert("traceparent".to_string(), traceparent.clone());
    }
    if let Some(tracestate) = &step.tracestate {
        carrier.insert("tracestate".to_string(), tracestate.clone());
    }
    TraceContextPropagator::new().extract(&carrier)
}

/// The trace id of the span current here (32 hex digits), or null when there is none.
fn current_trace_id() -> Value {
    let cx = opentelemetry::Context::current();
    let span = cx.span();
    let sc = span.span_context();
    if sc.is_valid() {
        json!(sc.trace_id().to_string())
    } else {
        Value::Null
    }
}

/// A RunWhen by its enum name (absent: the default).
fn run_when(name: Option<&str>) -> Result<RunWhen, Failed> {
    name.map_or(Ok(RunWhen::Unspecified), |name| {
        RunWhen::from_str_name(name).ok_or_else(|| Failed::Input(format!("run_when {name:?}")))
    })
}

/// A KeyMode by its enum name (absent: the default).
fn key_mode(name: Option<&str>) -> Result<KeyMode, Failed> {
    name.map_or(Ok(KeyMode::Unspecified), |name| {
        KeyMode::from_str_name(name).ok_or_else(|| Failed::Input(format!("key_mode {name:?}")))
    })
}

/// Now plus `n` milliseconds (minus, when negative).
fn in_ms(n: i64) -> SystemTime {
    let offset = ms(n.unsigned_abs());
    if n < 0 {
        SystemTime::now() - offset
    } else {
        SystemTime::now() + offset
    }
}

/// A dependency as the protocol names it: {"key": ".."}, {"id": "<decimal>"}, or (in a
/// spawn, given the spawning task's id) {"parent": true}.
fn dependency_ref(dependency: &Value, parent: Option<u64>) -> Result<TaskRef, Failed> {
    if let Some(key) = dependency.get("key").and_then(Value::as_str) {
        return Ok(TaskRef::Key(key.to_string()));
    }
    let id = match dependency.get("id") {
        Some(Value::String(id)) => id.parse().ok(),
        Some(id) => id.as_u64(),
        None => None,
    };
    let parent = parent.filter(|_| dependency.get("parent") == Some(&Value::Bool(true)));
    id.or(parent)
        .map(TaskRef::Id)
        .ok_or_else(|| Failed::Input(format!("depends_on item {dependency}")))
}

/// A result as the protocol shows it: a JSON value, {"bytes_b64": ..} for another content
/// type, null when there is none.
fn value_of(data: &[u8], content_type: &str) -> Value {
    if content_type == JSON_CONTENT_TYPE {
        return serde_json::from_slice(data).unwrap_or(Value::Null);
    }
    if data.is_empty() && content_type.is_empty() {
        return Value::Null;
    }
    json!({"bytes_b64": BASE64.encode(data)})
}

fn dependency_value(dependency: &DependencyResult) -> Value {
    if dependency.content_type == JSON_CONTENT_TYPE {
        // Through the SDK's own decoding, as a handler reads it.
        return dependency.json().unwrap_or(Value::Null);
    }
    value_of(&dependency.result, &dependency.content_type)
}

fn dependencies_of(dependencies: &[DependencyResult]) -> Value {
    let entries: Vec<Value> = dependencies
        .iter()
        .map(|d| {
            json!({
                "id": d.id.to_string(),
                "key": d.key,
                "state": d.state().as_str_name(),
                "value": dependency_value(d),
                "error": d.error,
            })
        })
        .collect();
    json!(entries)
}

/// The task a step names: by "id" (a decimal string) or by "key".
fn task_ref(step: &Step) -> Result<TaskRef, Failed> {
    if !step.key.is_empty() {
        return Ok(TaskRef::Key(step.key.clone()));
    }
    step.id
        .parse()
        .map(TaskRef::Id)
        .map_err(|e| Failed::Input(format!("id {:?}: {e}", step.id)))
}

fn task_result(task: &Task) -> Value {
    let progress = task
        .progress
        .as_ref()
        .map(|p| json!({"value": p.value, "message": p.message}));
    json!({
        "id": task.id.to_string(),
        "state": task.state().as_str_name(),
        "snoozes": task.snoozes,
        "progress": progress,
        "checkpoint": checkpoint_text(&task.checkpoint),
        "parent_id": task.parent_id.to_string(),
        "task_error": task.error,
        "result": value_of(&task.result, &task.result_content_type),
        "error": null,
    })
}

/// A checkpoint as the protocol shows it: UTF-8 text, or null when empty.
fn checkpoint_text(checkpoint: &[u8]) -> Value {
    if checkpoint.is_empty() {
        return Value::Null;
    }
    json!(String::from_utf8_lossy(checkpoint))
}

fn pause_result(pause: &PoolPause) -> Value {
    json!({"pool": pause.pool, "paused": pause.paused, "error": null})
}

fn bulk_output(done: &BulkResult) -> Value {
    json!({
        "matched": done.matched,
        "changed": done.changed,
        "unavailable_shards": done.unavailable_shards,
        "error": null,
    })
}

/// A TaskFilter from its proto JSON form (snake_case or lowerCamelCase names; states by enum
/// name; times as RFC 3339; ids as decimal strings or numbers).
fn filter(step: &Step) -> Result<TaskFilter, Failed> {
    let bad = |name: &str, value: &Value| Failed::Input(format!("filter.{name}: {value}"));
    let text = |name: &str, value: &Value| {
        value
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| bad(name, value))
    };
    let time = |name: &str, value: &Value| -> Result<Option<SystemTime>, Failed> {
        let stamp: prost_types::Timestamp =
            text(name, value)?.parse().map_err(|_| bad(name, value))?;
        SystemTime::try_from(stamp)
            .map(Some)
            .map_err(|_| bad(name, value))
    };
    let list =
        |name: &str, value: &Value| value.as_array().cloned().ok_or_else(|| bad(name, value));
    let mut out = TaskFilter::default();
    for (name, value) in &step.filter {
        match name.as_str() {
            "pool" => out.pool = text(name, value)?,
            "states" => {
                for state in list(name, value)? {
                    let parsed = state.as_str().and_then(TaskState::from_str_name);
                    out.states.push(parsed.ok_or_else(|| bad(name, &state))?);
                }
            }
            "created_after" | "createdAfter" => out.created_after = time(name, value)?,
            "created_before" | "createdBefore" => out.created_before = time(name, value)?,
            "finished_after" | "finishedAfter" => out.finished_after = time(name, value)?,
            "finished_before" | "finishedBefore" => out.finished_before = time(name, value)?,
            "key_prefix" | "keyPrefix" => out.key_prefix = text(name, value)?,
            "error_contains" | "errorContains" => out.error_contains = text(name, value)?,
            "parent_id" | "parentId" => {
                let parsed = match value {
                    Value::String(s) => s.parse().ok(),
                    other => other.as_u64(),
                };
                out.parent_id = parsed.ok_or_else(|| bad(name, value))?;
            }
            "ids" => {
                for id in list(name, value)? {
                    let parsed = match &id {
                        Value::String(s) => s.parse().ok(),
                        other => other.as_u64(),
                    };
                    out.ids.push(parsed.ok_or_else(|| bad(name, &id))?);
                }
            }
            _ => return Err(bad(name, value)),
        }
    }
    Ok(out)
}

#[derive(Default)]
struct Seen {
    started: Vec<String>,
    handled: Vec<Value>,
    running: usize,
    most: usize,
}

/// Runs a worker until it has handled `until_handled` tasks (or started
/// `stop_after_started`), then stops it gracefully; or until it fails.
async fn worker_step(input: &Input, step: &Step) -> Value {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let enough = Arc::new(Notify::new());
    let (until_handled, stop_after_started) = (step.until_handled, step.stop_after_started);
    let handler = {
        let seen = seen.clone();
        let enough = enough.clone();
        move |ctx: TaskContext, cancelled: cronoq::CancellationToken| {
            let seen = seen.clone();
            let enough = enough.clone();
            async move {
                let id = ctx.id.to_string();
                let trace_id = current_trace_id();
                let raw: Value = cronoq::decode_payload(&ctx).unwrap_or(Value::Null);
                let checkpoint = checkpoint_text(&ctx.checkpoint().unwrap_or_default());
                {
                    let mut s = seen.lock().unwrap();
                    s.started.push(id.clone());
                    s.running += 1;
                    s.most = s.most.max(s.running);
                    if s.started.len() == stop_after_started {
                        enough.notify_one();
                    }
                }
                let mut end = "raised"; // unless run_handler says otherwise
                let mut looked_up = None;
                let result = run_handler(&ctx, &raw, &cancelled, &mut end, &mut looked_up).await;
                let mut s = seen.lock().unwrap();
                s.running -= 1;
                let mut entry = json!({
                    "id": id,
                    "attempt": ctx.attempt,
                    "snoozes": ctx.snoozes(),
                    "checkpoint": checkpoint,
                    "payload": raw,
                    "trace_id": trace_id,
                    "end": end,
                    "dependencies": dependencies_of(ctx.dependency_results()),
                });
                if let Some(looked_up) = looked_up {
                    entry["looked_up"] = looked_up;
                }
                s.handled.push(entry);
                if s.handled.len() == until_handled {
                    enough.notify_one();
                }
                result
            }
        }
    };
    let concurrency = if step.concurrency > 0 {
        step.concurrency
    } else {
        4
    };
    let timeout = if step.timeout_ms > 0 {
        step.timeout_ms
    } else {
        15_000
    };
    let mut opts = WorkerOptions::new(options(input), step.pools.clone())
        .concurrency(concurrency)
        .shutdown_grace(ms(step.shutdown_grace_ms.unwrap_or(5000)));
    if let Some(prefetch) = step.prefetch {
        opts = opts.prefetch(prefetch);
    }
    let worker = match Worker::new(opts, handler) {
        Ok(w) => w,
        Err(err) => {
            return json!({"started": [], "handled": [], "max_running": 0, "endpoint": "", "error": error_of(&err)});
        }
    };
    let runner = worker.clone();
    let mut run = tokio::spawn(async move { runner.run().await });
    let mut failure = Value::Null;
    let mut finished = false;
    tokio::select! {
        _ = enough.notified() => {}
        r = &mut run => {
            finished = true;
            if let Ok(Err(err)) = r {
                failure = error_of(&err);
            }
        }
        _ = tokio::time::sleep(ms(timeout)) => {
            failure = json!({"code": "", "kind": "timeout", "message": format!("the worker did not finish in {timeout} ms")});
        }
    }
    worker.stop();
    if !finished {
        match tokio::time::timeout(Duration::from_secs(30), &mut run).await {
            Ok(Ok(Err(err))) if failure.is_null() => failure = error_of(&err),
            Err(_) if failure.is_null() => {
                failure = json!({"code": "", "kind": "timeout", "message": "the worker did not stop in 30 s"});
            }
            _ => {}
        }
    }
    let s = seen.lock().unwrap();
    json!({
        "started": s.started,
        "handled": s.handled,
        "max_running": s.most,
        "endpoint": worker.endpoint().to_string(),
        "error": failure,
    })
}

/// The handler the protocol describes: lookup_keys (each through ctx.dependency, into
/// `looked_up`), checkpoint, progress, sleep_ms (until cancelled), snooze_ms (while the task's
/// snoozes are fewer than snooze_times), spawn, fail, or sum_dependencies, result_bytes_b64 or
/// result.
async fn run_handler(
    ctx: &TaskContext,
    payload: &Value,
    cancelled: &cronoq::CancellationToken,
    end: &mut &'static str,
    looked_up: &mut Option<Value>,
) -> Result<TaskResult, TaskError> {
    if let Some(keys) = payload.get("lookup_keys").and_then(Value::as_array) {
        let mut found = serde_json::Map::new();
        for key in keys.iter().filter_map(Value::as_str) {
            found.insert(key.to_string(), dependency_value(ctx.dependency(key)?));
        }
        *looked_up = Some(Value::Object(found));
    }
    if let Some(text) = payload.get("checkpoint").and_then(Value::as_str) {
        ctx.save_checkpoint(text)?;
    }
    let progress = payload.get("progress").and_then(Value::as_array);
    for p in progress.into_iter().flatten() {
        let value = p.get("value").and_then(Value::as_f64).unwrap_or(0.0);
        let message = p.get("message").and_then(Value::as_str).unwrap_or("");
        ctx.report_progress(value, message)?;
    }
    if let Some(n) = payload
        .get("sleep_ms")
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
    {
        tokio::select! {
            _ = tokio::time::sleep(ms(n)) => {}
            _ = cancelled.cancelled() => {
                *end = "cancelled";
                return Err(TaskError::retryable("cancelled"));
            }
        }
    }
    if let Some(n) = payload.get("snooze_ms").and_then(Value::as_u64) {
        let times = payload
            .get("snooze_times")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        if i64::from(ctx.snoozes()) < times {
            *end = "snoozed";
            return Err(TaskError::snooze(ms(n), "driver"));
        }
    }
    for spawn in payload
        .get("spawn")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        ctx.spawn(spawn_spec(spawn, ctx.id)?)?;
    }
    if let Some(message) = payload.get("fail") {
        let message = message
            .as_str()
            .map_or_else(|| message.to_string(), str::to_string);
        if payload.get("retryable").and_then(Value::as_bool) == Some(false) {
            return Err(TaskError::non_retryable(message));
        }
        return Err(TaskError::retryable(message));
    }
    *end = "returned";
    if payload.get("sum_dependencies") == Some(&Value::Bool(true)) {
        return Ok(sum_of(ctx.dependency_results())?.into());
    }
    if let Some(text) = payload.get("result_bytes_b64").and_then(Value::as_str) {
        let data = BASE64.decode(text).map_err(TaskError::non_retryable)?;
        return Ok(TaskResult::bytes(data, "application/octet-stream"));
    }
    Ok(payload.get("result").cloned().unwrap_or(Value::Null).into())
}

/// A spawn of the protocol: {"pool", "payload", "key"?, "depends_on"?, "run_when"?}.
fn spawn_spec(spawn: &Value, parent: u64) -> Result<TaskSpec, TaskError> {
    let text = |name: &str| spawn.get(name).and_then(Value::as_str).unwrap_or("");
    let failed = |f: Failed| match f {
        Failed::Sdk(err) => TaskError::non_retryable(err),
        Failed::Input(m) | Failed::Unsupported(m) => TaskError::non_retryable(m),
    };
    let payload = spawn.get("payload").cloned().unwrap_or(Value::Null);
    let mut spec = TaskSpec::new(text("pool"))
        .json(&payload)
        .map_err(TaskError::non_retryable)?
        .key(text("key"))
        .run_when(run_when(spawn.get("run_when").and_then(Value::as_str)).map_err(failed)?);
    for dependency in spawn
        .get("depends_on")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        spec = spec.depends_on(dependency_ref(dependency, Some(parent)).map_err(failed)?);
    }
    Ok(spec)
}

/// The sum of the dependencies' JSON numbers: an integer when every one is.
fn sum_of(dependencies: &[DependencyResult]) -> Result<Value, TaskError> {
    let mut values = Vec::new();
    for dependency in dependencies {
        values.push(dependency.json::<serde_json::Number>()?);
    }
    let integers: Option<Vec<i64>> = values.iter().map(serde_json::Number::as_i64).collect();
    Ok(match integers {
        Some(integers) => json!(integers.iter().sum::<i64>()),
        None => json!(
            values
                .iter()
                .filter_map(serde_json::Number::as_f64)
                .sum::<f64>()
        ),
    })
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "debug,h2=info,hyper=info,tower=info,rustls=info",
        ))
        .init();
    let mut text = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut text) {
        eprintln!("conformance-driver: reading the case: {e}");
        std::process::exit(2);
    }
    let input: Input = match serde_json::from_str(&text) {
        Ok(input) => input,
        Err(e) => {
            eprintln!("conformance-driver: reading the case: {e}");
            std::process::exit(2);
        }
    };
    let client = Client::new(options(&input));
    let mut results = Vec::new();
    for step in &input.steps {
        let mut result = match (&client, step.op.as_str()) {
            (_, "worker") => worker_step(&input, step).await,
            (Err(err), _) => json!({"error": error_of(err)}),
            (Ok(client), _) => client_step(client, &input, step).await,
        };
        result["op"] = json!(step.op);
        results.push(result);
    }
    println!("{}", json!({"steps": results}));
}
