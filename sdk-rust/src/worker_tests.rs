//! The worker against an in-process fake WorkerService (real gRPC over loopback TCP).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::proto;
use crate::proto::worker_service_server::{WorkerService, WorkerServiceServer};
use crate::{
    CancellationToken, Options, RetryConfig, Task, TaskError, TaskResult, Worker, WorkerOptions,
};

#[derive(Default)]
struct Recorded {
    /// Every WorkRequest received, per stream.
    streams: Vec<Vec<proto::WorkRequest>>,
    registrations: usize,
    deregistered: bool,
}

/// Hands out `tasks` as credits allow, answering heartbeats that name an id of `cancel` or
/// `lose` with it cancelled or lost; the first stream ends with UNAVAILABLE, unanswered,
/// once it has received `break_first_after_outcomes` outcomes (0: never). With
/// `refuse_streams`, every stream is answered UNAVAILABLE on its first message; with
/// `redirect_to`, RegisterWorker is refused with that shard endpoint.
#[derive(Default)]
struct FakeShard {
    tasks: Mutex<Vec<Task>>,
    cancel: Vec<u64>,
    lose: Vec<u64>,
    break_first_after_outcomes: usize,
    refuse_streams: bool,
    redirect_to: Option<String>,
    recorded: Arc<Mutex<Recorded>>,
}

type WorkStream = Pin<Box<dyn Stream<Item = Result<proto::WorkResponse, Status>> + Send>>;

#[tonic::async_trait]
impl WorkerService for FakeShard {
    async fn register_worker(
        &self,
        _: Request<proto::RegisterWorkerRequest>,
    ) -> Result<Response<proto::RegisterWorkerResponse>, Status> {
        self.recorded.lock().unwrap().registrations += 1;
        if let Some(target) = &self.redirect_to {
            let mut metadata = tonic::metadata::MetadataMap::new();
            metadata.insert("cronoq-shard", "gpu".parse().unwrap());
            metadata.insert("cronoq-shard-endpoint", target.parse().unwrap());
            return Err(Status::with_metadata(
                tonic::Code::FailedPrecondition,
                "pool default is on shard gpu",
                metadata,
            ));
        }
        Ok(Response::new(proto::RegisterWorkerResponse {
            worker_id: "w1".into(),
            heartbeat_interval_ms: 100,
            shard: "default".into(),
            ..Default::default()
        }))
    }

    async fn lease_tasks(
        &self,
        _: Request<proto::LeaseTasksRequest>,
    ) -> Result<Response<proto::LeaseTasksResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn heartbeat(
        &self,
        _: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn finish_tasks(
        &self,
        _: Request<proto::FinishTasksRequest>,
    ) -> Result<Response<proto::FinishTasksResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type WorkStream = WorkStream;

    async fn work(
        &self,
        request: Request<Streaming<proto::WorkRequest>>,
    ) -> Result<Response<WorkStream>, Status> {
        let mut incoming = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let stream_index = {
            let mut rec = self.recorded.lock().unwrap();
            rec.streams.push(Vec::new());
            rec.streams.len() - 1
        };
        let recorded = self.recorded.clone();
        let pending: Vec<Task> = std::mem::take(&mut *self.tasks.lock().unwrap());
        let cancel = self.cancel.clone();
        let lose = self.lose.clone();
        if self.refuse_streams {
            let _ = incoming.next().await;
            return Err(Status::unavailable("going away"));
        }
        let break_after = if stream_index == 0 {
            self.break_first_after_outcomes
        } else {
            0
        };
        tokio::spawn(async move {
            let mut pending = pending.into_iter();
            let mut outcomes_seen = 0;
            while let Some(Ok(msg)) = incoming.next().await {
                recorded.lock().unwrap().streams[stream_index].push(msg.clone());
                outcomes_seen += msg.outcomes.len();
                if break_after > 0 && outcomes_seen >= break_after {
                    let _ = tx
                        .send(Err(Status::unavailable("fake: stream broken")))
                        .await;
                    return;
                }
                let mut answer = proto::WorkResponse {
                    tasks: pending.by_ref().take(msg.credits as usize).collect(),
                    results: msg
                        .outcomes
                        .iter()
                        .map(|o| proto::FinishTaskResult {
                            task_id: o.task_id,
                            accepted: true,
                            ..Default::default()
                        })
                        .collect(),
                    heartbeat: None,
                };
                if let Some(beat) = &msg.heartbeat {
                    answer.heartbeat = Some(proto::HeartbeatResponse {
                        cancelled_task_ids: beat
                            .tasks
                            .iter()
                            .map(|t| t.task_id)
                            .filter(|id| cancel.contains(id))
                            .collect(),
                        lost_task_ids: beat
                            .tasks
                            .iter()
                            .map(|t| t.task_id)
                            .filter(|id| lose.contains(id))
                            .collect(),
                    });
                }
                if tx.send(Ok(answer)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn deregister_worker(
        &self,
        _: Request<proto::DeregisterWorkerRequest>,
    ) -> Result<Response<proto::DeregisterWorkerResponse>, Status> {
        self.recorded.lock().unwrap().deregistered = true;
        Ok(Response::new(proto::DeregisterWorkerResponse::default()))
    }

    async fn list_workers(
        &self,
        _: Request<proto::ListWorkersRequest>,
    ) -> Result<Response<proto::ListWorkersResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

fn task(id: u64, sleep_ms: u64) -> Task {
    Task {
        id,
        attempt: 1,
        pool: "default".into(),
        payload: sleep_ms.to_string().into_bytes(),
        content_type: "application/json".into(),
        ..Default::default()
    }
}

/// Starts the fake on a free loopback port; its endpoint.
async fn serve(shard: FakeShard) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerServiceServer::new(shard))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    format!("http://{addr}")
}

fn options(endpoint: &str) -> Options {
    Options::new(endpoint).retry(RetryConfig {
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        max_elapsed: Some(Duration::from_secs(2)),
    })
}

/// Sleeps the payload's milliseconds (stopping when cancelled), then returns it.
async fn sleeper(task: Task, cancelled: CancellationToken) -> Result<TaskResult, TaskError> {
    let ms: u64 = crate::decode_payload(&task).map_err(TaskError::non_retryable)?;
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(ms)) => TaskResult::json(&ms),
        _ = cancelled.cancelled() => Err(TaskError::retryable("cancelled")),
    }
}

/// Runs the worker until `done` says so (or 10 s), then stops it; what the fake recorded.
async fn run_until(
    worker: Worker,
    recorded: Arc<Mutex<Recorded>>,
    done: impl Fn(&Recorded) -> bool,
) -> Arc<Mutex<Recorded>> {
    let runner = worker.clone();
    let run = tokio::spawn(async move { runner.run().await });
    for _ in 0..1000 {
        if done(&recorded.lock().unwrap()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    worker.stop();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    recorded
}

fn outcomes(rec: &Recorded) -> Vec<proto::TaskOutcome> {
    rec.streams
        .iter()
        .flatten()
        .flat_map(|m| m.outcomes.clone())
        .collect()
}

#[tokio::test]
async fn runs_tasks_within_credits_batches_outcomes_and_deregisters() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let endpoint = serve(FakeShard {
        tasks: Mutex::new(vec![task(1, 30), task(2, 30), task(3, 30)]),
        cancel: Vec::new(),
        break_first_after_outcomes: 0,
        recorded: recorded.clone(),
        ..Default::default()
    })
    .await;
    let worker = Worker::new(
        WorkerOptions::new(options(&endpoint), ["default"]).concurrency(2),
        sleeper,
    )
    .unwrap();
    let rec = run_until(worker, recorded, |r| outcomes(r).len() >= 3).await;
    let rec = rec.lock().unwrap();
    let first = &rec.streams[0][0];
    assert_eq!(first.worker_id, "w1");
    assert_eq!(first.credits, 2, "the first message gives the free slots");
    let credits: u32 = rec.streams[0].iter().map(|m| m.credits).sum();
    assert!(credits <= 2 + 3, "credits only for slots freed: {credits}");
    let done = outcomes(&rec);
    assert_eq!(done.len(), 3);
    assert!(
        done.iter()
            .all(|o| matches!(o.outcome, Some(proto::task_outcome::Outcome::Success(_))))
    );
    assert!(
        rec.streams[0].iter().any(|m| m.outcomes.len() >= 2),
        "tasks 1 and 2 end together: one message"
    );
    assert!(rec.deregistered);
}

#[tokio::test]
async fn outcomes_a_broken_stream_did_not_answer_are_sent_again() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let endpoint = serve(FakeShard {
        tasks: Mutex::new(vec![task(7, 0)]),
        cancel: Vec::new(),
        break_first_after_outcomes: 1,
        recorded: recorded.clone(),
        ..Default::default()
    })
    .await;
    let worker = Worker::new(WorkerOptions::new(options(&endpoint), ["default"]), sleeper).unwrap();
    let rec = run_until(worker, recorded, |r| {
        r.streams.len() >= 2 && !r.streams[1].is_empty() && outcomes(r).len() >= 2
    })
    .await;
    let rec = rec.lock().unwrap();
    let resent: Vec<u64> = rec.streams[1]
        .iter()
        .flat_map(|m| m.outcomes.iter().map(|o| o.task_id))
        .collect();
    assert_eq!(resent, vec![7]);
}

#[tokio::test]
async fn a_cancelled_id_cancels_the_handler_and_reports_it_cancelled() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let endpoint = serve(FakeShard {
        tasks: Mutex::new(vec![task(9, 5000)]),
        cancel: vec![9],
        break_first_after_outcomes: 0,
        recorded: recorded.clone(),
        ..Default::default()
    })
    .await;
    let worker = Worker::new(WorkerOptions::new(options(&endpoint), ["default"]), sleeper).unwrap();
    let rec = run_until(worker, recorded, |r| !outcomes(r).is_empty()).await;
    let rec = rec.lock().unwrap();
    let beats: Vec<_> = rec.streams[0]
        .iter()
        .filter_map(|m| m.heartbeat.as_ref())
        .collect();
    assert!(
        beats.iter().any(|b| b.tasks.iter().any(|t| t.task_id == 9)),
        "a heartbeat names task 9"
    );
    assert!(matches!(
        outcomes(&rec)[0].outcome,
        Some(proto::task_outcome::Outcome::Cancelled(_))
    ));
}

#[tokio::test]
async fn graceful_stop_releases_what_outlives_the_grace() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let endpoint = serve(FakeShard {
        tasks: Mutex::new(vec![task(4, 20), task(5, 5000)]),
        cancel: Vec::new(),
        break_first_after_outcomes: 0,
        recorded: recorded.clone(),
        ..Default::default()
    })
    .await;
    let opts = WorkerOptions::new(options(&endpoint), ["default"])
        .shutdown_grace(Duration::from_millis(100));
    let worker = Worker::new(opts, sleeper).unwrap();
    let rec = run_until(worker, recorded, |r| !outcomes(r).is_empty()).await;
    let rec = rec.lock().unwrap();
    let kinds: Vec<(u64, bool)> = outcomes(&rec)
        .iter()
        .map(|o| {
            (
                o.task_id,
                matches!(o.outcome, Some(proto::task_outcome::Outcome::Released(_))),
            )
        })
        .collect();
    assert_eq!(kinds, vec![(4, false), (5, true)]);
    assert!(rec.deregistered);
}

// Timing-sensitive (generous margins): 10 ms doubling to 400 ms with equal jitter waits at
// least 5, 10, 20, 40, 80, 160, 200, 200 ms: at most 10 streams in 1 s.
#[tokio::test]
async fn a_stream_refused_every_time_is_opened_again_with_backoff() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let endpoint = serve(FakeShard {
        refuse_streams: true,
        recorded: recorded.clone(),
        ..Default::default()
    })
    .await;
    let opts = Options::new(&endpoint).retry(RetryConfig {
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(400),
        max_elapsed: None,
    });
    let worker = Worker::new(WorkerOptions::new(opts, ["default"]), sleeper).unwrap();
    let runner = worker.clone();
    let run = tokio::spawn(async move { runner.run().await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let opened = recorded.lock().unwrap().streams.len();
    worker.stop();
    let _ = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap();
    assert!((4..=10).contains(&opened), "{opened} streams in 1 s");
}

#[tokio::test]
async fn a_worker_follows_three_redirects_in_a_row_and_refuses_the_fourth() {
    // e <- d <- c <- b <- a: a worker given a is sent to b, c, d, and refused at d.
    let mut records = Vec::new();
    let mut next = "http://127.0.0.1:1".to_string(); // e: never reached
    for _ in 0..4 {
        let recorded = Arc::new(Mutex::new(Recorded::default()));
        next = serve(FakeShard {
            redirect_to: Some(next),
            recorded: recorded.clone(),
            ..Default::default()
        })
        .await;
        records.insert(0, recorded);
    }
    let worker = Worker::new(WorkerOptions::new(options(&next), ["default"]), sleeper).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), worker.run())
        .await
        .expect("run() went on: the 4th redirect in a row must end it")
        .unwrap_err();
    assert!(
        matches!(err, crate::Error::TooManyRedirects(_)),
        "{err:?}, want TooManyRedirects"
    );
    assert!(
        err.to_string().contains("more than 3 times in a row"),
        "{err}"
    );
    let calls: Vec<usize> = records
        .iter()
        .map(|r| r.lock().unwrap().registrations)
        .collect();
    assert_eq!(calls, vec![1, 1, 1, 1], "each of a, b, c, d asked once");
}

/// What the handlers of [`tracking`] did.
#[derive(Default)]
struct Seen {
    started: Vec<u64>,
    running: usize,
    most: usize,
}

type BoxedResult = Pin<Box<dyn std::future::Future<Output = Result<TaskResult, TaskError>> + Send>>;

/// `sleeper`, recording which tasks started and the most handlers running at once.
fn tracking(
    seen: Arc<Mutex<Seen>>,
) -> impl Fn(Task, CancellationToken) -> BoxedResult + Send + Sync + 'static {
    move |task, cancelled| {
        let seen = seen.clone();
        Box::pin(async move {
            {
                let mut s = seen.lock().unwrap();
                s.started.push(task.id);
                s.running += 1;
                s.most = s.most.max(s.running);
            }
            let result = sleeper(task, cancelled).await;
            seen.lock().unwrap().running -= 1;
            result
        })
    }
}

/// Each task's outcome, in the order reported: "success", "failure", "cancelled" or "released".
fn outcome_kinds(rec: &Recorded) -> Vec<(u64, &'static str)> {
    use proto::task_outcome::Outcome;
    outcomes(rec)
        .iter()
        .map(|o| {
            let kind = match o.outcome {
                Some(Outcome::Success(_)) => "success",
                Some(Outcome::Failure(_)) => "failure",
                Some(Outcome::Cancelled(_)) => "cancelled",
                Some(Outcome::Released(_)) => "released",
                None => "none",
            };
            (o.task_id, kind)
        })
        .collect()
}

/// A worker of this concurrency and prefetch against the fake shard, and what its handlers saw.
async fn prefetching(
    shard: FakeShard,
    concurrency: usize,
    prefetch: usize,
) -> (Worker, Arc<Mutex<Seen>>) {
    let endpoint = serve(shard).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let opts = WorkerOptions::new(options(&endpoint), ["default"])
        .concurrency(concurrency)
        .prefetch(prefetch);
    (Worker::new(opts, tracking(seen.clone())).unwrap(), seen)
}

#[tokio::test]
async fn prefetch_gives_concurrency_plus_prefetch_credits_and_runs_at_most_concurrency() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let (worker, seen) = prefetching(
        FakeShard {
            tasks: Mutex::new((1..=6).map(|id| task(id, 300)).collect()),
            recorded: recorded.clone(),
            ..Default::default()
        },
        2,
        3,
    )
    .await;
    let rec = run_until(worker, recorded, |r| outcomes(r).len() >= 6).await;
    let rec = rec.lock().unwrap();
    assert_eq!(rec.streams[0][0].credits, 5, "concurrency + prefetch");
    let credits: u32 = rec.streams[0].iter().map(|m| m.credits).sum();
    assert!(credits <= 5 + 6, "a credit back per task done: {credits}");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.most, 2, "at most concurrency handlers at once");
    assert_eq!(
        seen.started,
        vec![1, 2, 3, 4, 5, 6],
        "held tasks start in arrival order"
    );
    assert!(outcome_kinds(&rec).iter().all(|(_, k)| *k == "success"));
    let first_beat = rec.streams[0]
        .iter()
        .find_map(|m| m.heartbeat.as_ref())
        .expect("a heartbeat");
    let mut named: Vec<u64> = first_beat.tasks.iter().map(|t| t.task_id).collect();
    named.sort();
    assert_eq!(
        named,
        vec![1, 2, 3, 4, 5],
        "at 100 ms: tasks 1 and 2 running, 3 to 5 held, all named"
    );
}

#[tokio::test]
async fn an_invalid_prefetch_is_refused() {
    let opts = |concurrency, prefetch| {
        WorkerOptions::new(options("http://127.0.0.1:1"), ["default"])
            .concurrency(concurrency)
            .prefetch(prefetch)
    };
    for (concurrency, prefetch) in [(1, 100_000), (100_001, 0), (2, usize::MAX)] {
        let err = Worker::new(opts(concurrency, prefetch), sleeper)
            .err()
            .expect("refused");
        assert!(matches!(err, crate::Error::InvalidArgument(_)), "{err:?}");
        assert!(
            err.to_string().contains(&format!("prefetch: {prefetch}")),
            "{err}"
        );
    }
    assert!(Worker::new(opts(1, 99_999), sleeper).is_ok());
}

#[tokio::test]
async fn a_held_task_cancelled_is_reported_cancelled_and_never_runs() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let (worker, seen) = prefetching(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 500), task(2, 0)]),
            cancel: vec![2],
            recorded: recorded.clone(),
            ..Default::default()
        },
        1,
        1,
    )
    .await;
    let rec = run_until(worker, recorded, |r| outcomes(r).len() >= 2).await;
    let rec = rec.lock().unwrap();
    assert_eq!(outcome_kinds(&rec), vec![(2, "cancelled"), (1, "success")]);
    assert_eq!(seen.lock().unwrap().started, vec![1]);
}

#[tokio::test]
async fn a_graceful_stop_releases_held_tasks_at_once() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let (worker, seen) = prefetching(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 300), task(2, 300), task(3, 300)]),
            recorded: recorded.clone(),
            ..Default::default()
        },
        1,
        2,
    )
    .await;
    let started = seen.clone();
    let rec = run_until(worker, recorded, move |_| {
        !started.lock().unwrap().started.is_empty()
    })
    .await;
    let rec = rec.lock().unwrap();
    assert_eq!(
        outcome_kinds(&rec),
        vec![(2, "released"), (3, "released"), (1, "success")],
        "released before the running one ends"
    );
    assert_eq!(seen.lock().unwrap().started, vec![1]);
}

#[tokio::test]
async fn a_held_task_whose_timeout_ran_out_fails_without_starting() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let short = Task {
        timeout_ms: 100,
        ..task(2, 0)
    };
    let (worker, seen) = prefetching(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 300), short]),
            recorded: recorded.clone(),
            ..Default::default()
        },
        1,
        1,
    )
    .await;
    let rec = run_until(worker, recorded, |r| outcomes(r).len() >= 2).await;
    let rec = rec.lock().unwrap();
    let mut kinds = outcome_kinds(&rec);
    kinds.sort();
    assert_eq!(kinds, vec![(1, "success"), (2, "failure")]);
    let done = outcomes(&rec);
    let Some(proto::task_outcome::Outcome::Failure(f)) =
        &done.iter().find(|o| o.task_id == 2).unwrap().outcome
    else {
        unreachable!()
    };
    assert!(
        f.retryable && f.error.contains("timed out after 100 ms"),
        "{f:?}"
    );
    assert_eq!(seen.lock().unwrap().started, vec![1]);
}

#[tokio::test]
async fn a_broken_stream_keeps_held_tasks_and_subtracts_them_from_its_credits() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let (worker, seen) = prefetching(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 0), task(2, 300), task(3, 300)]),
            break_first_after_outcomes: 1,
            recorded: recorded.clone(),
            ..Default::default()
        },
        1,
        2,
    )
    .await;
    let rec = run_until(worker, recorded, |r| {
        r.streams.len() >= 2
            && r.streams[1]
                .iter()
                .flat_map(|m| &m.outcomes)
                .any(|o| o.task_id == 3)
    })
    .await;
    let rec = rec.lock().unwrap();
    assert_eq!(
        rec.streams[1][0].credits, 1,
        "task 2 running and task 3 held: one credit of three"
    );
    assert_eq!(seen.lock().unwrap().started, vec![1, 2, 3], "each once");
    let on_second: Vec<_> = rec.streams[1]
        .iter()
        .flat_map(|m| m.outcomes.iter().map(|o| o.task_id))
        .collect();
    assert_eq!(
        on_second,
        vec![1, 2, 3],
        "1 sent again, 2 and 3 as they end"
    );
}

#[tokio::test]
async fn a_held_task_lost_is_dropped_unreported_and_its_credit_given_back() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let (worker, seen) = prefetching(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 400), task(2, 0)]),
            lose: vec![2],
            recorded: recorded.clone(),
            ..Default::default()
        },
        1,
        1,
    )
    .await;
    let rec = run_until(worker, recorded, |r| !outcomes(r).is_empty()).await;
    let rec = rec.lock().unwrap();
    assert_eq!(outcome_kinds(&rec), vec![(1, "success")]);
    assert_eq!(seen.lock().unwrap().started, vec![1]);
    let credits: Vec<u32> = rec.streams[0]
        .iter()
        .map(|m| m.credits)
        .filter(|c| *c > 0)
        .collect();
    assert_eq!(
        credits,
        vec![2, 1, 1],
        "2 at first, then one for 2 lost, one for 1 done"
    );
}
