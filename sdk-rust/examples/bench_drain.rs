//! The Rust SDK's side of the burn-down: one worker drains N no-op tasks that
//! `bench/burndown.py --worker rust` submitted, and prints one JSON line. Timed from the
//! worker's start to the last task's start, as the Python worker and the anchors time it.
//!
//!     cargo run --release --example bench_drain -- ENDPOINT [TASKS] [CONCURRENCY] [PREFETCH]
//!
//! Without PREFETCH, the SDK's default (4 tasks a slot); 0: none.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cronoq::{Options, Worker, WorkerOptions};
use tokio::sync::Notify;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let endpoint = args
        .next()
        .ok_or("usage: bench_drain ENDPOINT [TASKS] [CONCURRENCY] [PREFETCH]")?;
    let total: u64 = args.next().map_or(Ok(20_000), |a| a.parse())?;
    let concurrency: usize = args.next().map_or(Ok(64), |a| a.parse())?;
    let prefetch: Option<usize> = args.next().map(|a| a.parse()).transpose()?;
    let handled = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let worker = {
        let (handled, done) = (handled.clone(), done.clone());
        let mut opts =
            WorkerOptions::new(Options::new(endpoint), ["default"]).concurrency(concurrency);
        if let Some(prefetch) = prefetch {
            opts = opts.prefetch(prefetch);
        }
        Worker::new(opts, move |_task, _cancelled| {
            if handled.fetch_add(1, Ordering::SeqCst) + 1 == total {
                done.notify_one();
            }
            async { Ok::<(), cronoq::TaskError>(()) }
        })?
    };
    let started = Instant::now();
    let running = {
        let worker = worker.clone();
        tokio::spawn(async move { worker.run().await })
    };
    tokio::select! {
        _ = done.notified() => {}
        result = tokio::time::sleep(std::time::Duration::from_secs(600)) => {
            let () = result;
            return Err(format!("handled {} of {total} tasks in 10 minutes", handled.load(Ordering::SeqCst)).into());
        }
    }
    let drained = started.elapsed().as_secs_f64();
    worker.stop();
    running.await??;
    println!("{{\"tasks\": {total}, \"drain_s\": {drained}}}");
    Ok(())
}
