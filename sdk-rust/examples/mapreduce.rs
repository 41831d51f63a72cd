//! A map-reduce as a workflow: a root task spawns 100 map tasks (each returns a number) and a
//! join that depends on them all and returns their sum. It submits the root, runs a worker
//! until the join has ended, prints the sum and exits (0 when the join succeeded).
//!
//!     cargo run --example mapreduce -- http://127.0.0.1:7070 default
//!
//! The endpoint and token also come from CRONOQ_ENDPOINT and CRONOQ_TOKEN.

use std::time::Duration;

use cronoq::{
    CancellationToken, Client, GetTaskOptions, Options, TaskContext, TaskError, TaskRef,
    TaskResult, TaskSpec, TaskState, Worker, WorkerOptions,
};
use serde::{Deserialize, Serialize};

const MAPS: i64 = 100;

#[derive(Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
enum Step {
    Root { maps: i64 },
    Map { n: i64 },
    Join,
}

/// The join's key: unique to its root, so that a second run's tasks never match the first's.
fn join_key(root: u64) -> String {
    format!("mapreduce-{root}-join")
}

async fn handle(task: TaskContext, _: CancellationToken) -> Result<TaskResult, TaskError> {
    match cronoq::decode_payload(&task).map_err(TaskError::non_retryable)? {
        Step::Root { maps } => {
            // Spawned with this task's success, in one transaction: all or none.
            let mut join = TaskSpec::new(&task.pool)
                .json(&Step::Join)?
                .key(join_key(task.id));
            for n in 1..=maps {
                let key = format!("mapreduce-{}-map-{n}", task.id);
                task.spawn(TaskSpec::new(&task.pool).json(&Step::Map { n })?.key(&key))?;
                join = join.depends_on(key);
            }
            task.spawn(join)?;
            TaskResult::json(&maps)
        }
        Step::Map { n } => TaskResult::json(&n),
        Step::Join => {
            let mut sum = 0;
            for map in task.dependency_results() {
                sum += map.json::<i64>()?;
            }
            TaskResult::json(&sum)
        }
    }
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
    let root = TaskSpec::new(&pool).json(&Step::Root { maps: MAPS })?;
    let root = client.submit(root).await?.task.id;
    println!("submitted root task {root}");

    let worker = Worker::new(
        WorkerOptions::new(opts, [pool.as_str()]).concurrency(16),
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

    let ended = client.wait(root, Duration::from_secs(60)).await?.task;
    let join = if ended.state() == TaskState::Succeeded {
        let opts = GetTaskOptions {
            include_children: true,
            ..GetTaskOptions::default()
        };
        let spawned = client.get_with(root, opts).await?.children.len();
        println!("root task {root} spawned {spawned} tasks");
        let join = TaskRef::Key(join_key(root));
        Some(client.wait(join, Duration::from_secs(120)).await?.task)
    } else {
        println!(
            "root task {root}: {} ({})",
            ended.state().as_str_name(),
            ended.error
        );
        None
    };
    worker.stop();
    running.await??;

    match join {
        Some(join) if join.state() == TaskState::Succeeded => {
            let sum: i64 = cronoq::decode_result(&join)?;
            println!("sum of {MAPS} map tasks: {sum}");
            Ok(())
        }
        Some(join) => Err(format!(
            "join task {}: {} ({})",
            join.id,
            join.state().as_str_name(),
            join.error
        )
        .into()),
        None => Err(format!("root task {root} did not succeed").into()),
    }
}
