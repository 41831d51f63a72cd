//! The conformance driver of the Rust SDK: one case's input as JSON on stdin, one result as
//! JSON on stdout (the protocol: conformance/README.md in the cronoq repository). It uses
//! the SDK's public API only.

use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cronoq::{
    Client, Error, KeepaliveConfig, Options, RetryConfig, TaskError, TaskSpec, Worker,
    WorkerOptions, code_name,
};
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
    timeout_ms: u64,
    #[serde(default)]
    pools: Vec<String>,
    #[serde(default)]
    concurrency: usize,
    #[serde(default)]
    until_handled: usize,
    #[serde(default)]
    stop_after_started: usize,
    shutdown_grace_ms: Option<u64>,
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

async fn client_step(client: &Client, step: &Step) -> Value {
    if step.op == "submit" {
        let spec = match TaskSpec::new(&step.pool).json(&step.payload) {
            Ok(spec) => spec,
            Err(err) => return json!({"error": error_of(&err)}),
        };
        return match client.submit(spec).await {
            Ok(sub) => json!({"id": sub.task.id.to_string(), "error": null}),
            Err(err) => json!({"error": error_of(&err)}),
        };
    }
    let id: u64 = match step.id.parse() {
        Ok(id) => id,
        Err(e) => return json!({"error": other(format!("id {:?}: {e}", step.id))}),
    };
    let task = match step.op.as_str() {
        "get" => client.get(id).await,
        "cancel" => client.cancel(id).await,
        "wait" => {
            let timeout = if step.timeout_ms > 0 {
                step.timeout_ms
            } else {
                10_000
            };
            client.wait(id, ms(timeout)).await.map(|w| w.task)
        }
        op => {
            return json!({"error": {"code": "", "kind": "unsupported", "message": format!("unknown op {op:?}")}});
        }
    };
    match task {
        Ok(task) => json!({
            "id": task.id.to_string(),
            "state": task.state().as_str_name(),
            "error": null,
        }),
        Err(err) => json!({"error": error_of(&err)}),
    }
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
        move |task: cronoq::Task, cancelled: cronoq::CancellationToken| {
            let seen = seen.clone();
            let enough = enough.clone();
            async move {
                let id = task.id.to_string();
                let raw: Value = cronoq::decode_payload(&task).unwrap_or(Value::Null);
                {
                    let mut s = seen.lock().unwrap();
                    s.started.push(id.clone());
                    s.running += 1;
                    s.most = s.most.max(s.running);
                    if s.started.len() == stop_after_started {
                        enough.notify_one();
                    }
                }
                let mut end = "cancelled";
                let result = run_handler(&raw, &cancelled, &mut end).await;
                let mut s = seen.lock().unwrap();
                s.running -= 1;
                s.handled
                    .push(json!({"id": id, "attempt": task.attempt, "payload": raw, "end": end}));
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
    let opts = WorkerOptions::new(options(input), step.pools.clone())
        .concurrency(concurrency)
        .shutdown_grace(ms(step.shutdown_grace_ms.unwrap_or(5000)));
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

/// The handler the protocol describes: sleep_ms (until cancelled), fail, or result.
async fn run_handler(
    payload: &Value,
    cancelled: &cronoq::CancellationToken,
    end: &mut &'static str,
) -> Result<Value, TaskError> {
    if let Some(n) = payload
        .get("sleep_ms")
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
    {
        tokio::select! {
            _ = tokio::time::sleep(ms(n)) => {}
            _ = cancelled.cancelled() => return Err(TaskError::retryable("cancelled")),
        }
    }
    if let Some(message) = payload.get("fail") {
        *end = "raised";
        let message = message
            .as_str()
            .map_or_else(|| message.to_string(), str::to_string);
        if payload.get("retryable").and_then(Value::as_bool) == Some(false) {
            return Err(TaskError::non_retryable(message));
        }
        return Err(TaskError::retryable(message));
    }
    *end = "returned";
    Ok(payload.get("result").cloned().unwrap_or(Value::Null))
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
            (Ok(client), _) => client_step(client, step).await,
        };
        result["op"] = json!(step.op);
        results.push(result);
    }
    println!("{}", json!({"steps": results}));
}
