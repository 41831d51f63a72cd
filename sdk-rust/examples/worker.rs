//! A Rust worker and client against a cronoq server: it submits a few tasks to a pool, runs a
//! worker for them, waits for each and prints how it ended; Ctrl-C stops it gracefully.
//!
//!     cargo run --example worker -- http://127.0.0.1:7070 default
//!
//! The endpoint and token also come from CRONOQ_ENDPOINT and CRONOQ_TOKEN.

use std::time::Duration;

use cronoq::{
    CancellationToken, Client, Options, TaskContext, TaskError, TaskResult, TaskSpec, TaskState,
    Worker, WorkerOptions,
};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Job {
    kind: String,
    n: i64,
}

/// Doubles n; "broken" fails for good, "flaky" fails its first two attempts.
async fn handle(task: TaskContext, cancelled: CancellationToken) -> Result<TaskResult, TaskError> {
    let job: Job = cronoq::decode_payload(&task).map_err(TaskError::non_retryable)?;
    match job.kind.as_str() {
        "broken" => return Err(TaskError::non_retryable("broken input: will not retry")),
        "flaky" if task.attempt < 3 => {
            return Err(TaskError::retry_after(
                format!("flaky failure on attempt {}", task.attempt),
                Duration::from_millis(200),
            ));
        }
        _ => {}
    }
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(50)) => {} // some work
        _ = cancelled.cancelled() => return Err(TaskError::retryable("cancelled")),
    }
    TaskResult::json(&serde_json::json!({"doubled": job.n * 2}))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let endpoint = args
        .next()
        .or_else(|| std::env::var("CRONOQ_ENDPOINT").ok())
        .unwrap_or_else(|| cronoq::DEFAULT_ENDPOINT.to_string());
    let pool = args.next().unwrap_or_else(|| "default".to_string());
    let mut opts = Options::new(endpoint);
    if let Ok(token) = std::env::var("CRONOQ_TOKEN") {
        opts = opts.token(token);
    }

    let client = Client::new(opts.clone())?;
    let mut ids = Vec::new();
    for (kind, n) in [("double", 21), ("flaky", 4), ("broken", 0)] {
        let spec = TaskSpec::new(&pool)
            .json(&Job {
                kind: kind.into(),
                n,
            })?
            .max_attempts(5);
        let submitted = client.submit(spec).await?;
        println!("submitted task {} ({kind})", submitted.task.id);
        ids.push(submitted.task.id);
    }

    let worker = Worker::new(
        WorkerOptions::new(opts, [pool.as_str()]).concurrency(8),
        handle,
    )?;
    let running = {
        let worker = worker.clone();
        tokio::spawn(async move { worker.run().await })
    };
    let stopper = worker.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            stopper.stop(); // a graceful stop: running tasks finish, the others are given back
        }
    });

    for id in ids {
        let task = client.wait(id, Duration::from_secs(30)).await?.task;
        if task.state() == TaskState::Succeeded {
            let result = String::from_utf8_lossy(&task.result);
            println!(
                "task {id}: SUCCEEDED after {} attempt(s): {result}",
                task.attempt
            );
        } else {
            println!(
                "task {id}: {} after {} attempt(s): {}",
                task.state().as_str_name().trim_start_matches("TASK_STATE_"),
                task.attempt,
                task.error
            );
        }
    }
    worker.stop();
    running.await??;
    Ok(())
}
