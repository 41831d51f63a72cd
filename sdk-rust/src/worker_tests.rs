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
    CancellationToken, Code, Options, RetryConfig, RunWhen, Task, TaskContext, TaskError,
    TaskResult, TaskSpec, TaskState, Worker, WorkerOptions,
};

#[derive(Default)]
pub(crate) struct Recorded {
    /// Every WorkRequest received, per stream.
    streams: Vec<Vec<proto::WorkRequest>>,
    registrations: usize,
    deregistered: bool,
    /// The answers sent with `heartbeat` set.
    beats_answered: usize,
    /// The ListWorkers requests received.
    pub(crate) listed: Vec<proto::ListWorkersRequest>,
}

/// Hands out `tasks` as credits allow, answering heartbeats that name an id of `cancel` or
/// `lose` with it cancelled or lost, and refusing the outcomes of the ids of `refuse`; the first stream ends with UNAVAILABLE, unanswered,
/// once it has received `break_first_after_outcomes` outcomes (0: never), or with
/// `break_first_on_report` a heartbeat carrying a report. With `refuse_streams`, every
/// stream is answered UNAVAILABLE on its first message; with `redirect_to`, RegisterWorker
/// is refused with that shard endpoint. A heartbeat is answered after `beat_delay`, or never
/// with `silent_beats` (its message is answered without it).
#[derive(Default)]
pub(crate) struct FakeShard {
    tasks: Mutex<Vec<Task>>,
    cancel: Vec<u64>,
    lose: Vec<u64>,
    refuse: Vec<u64>,
    break_first_after_outcomes: usize,
    break_first_on_report: bool,
    refuse_streams: bool,
    redirect_to: Option<String>,
    max_checkpoint_bytes: u64,
    beat_delay: Duration,
    silent_beats: bool,
    pub(crate) recorded: Arc<Mutex<Recorded>>,
}

impl FakeShard {
    /// A shard that hands out these tasks and accepts everything.
    pub(crate) fn with_tasks(tasks: Vec<Task>) -> FakeShard {
        FakeShard {
            tasks: Mutex::new(tasks),
            ..Default::default()
        }
    }
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
            max_checkpoint_bytes: self.max_checkpoint_bytes,
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
        let refuse = self.refuse.clone();
        if self.refuse_streams {
            let _ = incoming.next().await;
            return Err(Status::unavailable("going away"));
        }
        let (break_after, break_on_report) = if stream_index == 0 {
            (self.break_first_after_outcomes, self.break_first_on_report)
        } else {
            (0, false)
        };
        let (beat_delay, silent_beats) = (self.beat_delay, self.silent_beats);
        tokio::spawn(async move {
            let mut pending = pending.into_iter();
            let mut outcomes_seen = 0;
            while let Some(Ok(msg)) = incoming.next().await {
                recorded.lock().unwrap().streams[stream_index].push(msg.clone());
                outcomes_seen += msg.outcomes.len();
                let reported = msg
                    .heartbeat
                    .as_ref()
                    .is_some_and(|b| !b.reports.is_empty());
                if (break_after > 0 && outcomes_seen >= break_after)
                    || (break_on_report && reported)
                {
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
                        .map(|o| {
                            let refused = refuse.contains(&o.task_id);
                            proto::FinishTaskResult {
                                task_id: o.task_id,
                                accepted: !refused,
                                code: if refused { "FAILED_PRECONDITION" } else { "" }.into(),
                                message: if refused { "fake: stale attempt" } else { "" }.into(),
                            }
                        })
                        .collect(),
                    heartbeat: None,
                };
                if let Some(beat) = msg.heartbeat.as_ref().filter(|_| !silent_beats) {
                    tokio::time::sleep(beat_delay).await;
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
                let beat_answered = answer.heartbeat.is_some();
                if tx.send(Ok(answer)).await.is_err() {
                    return;
                }
                if beat_answered {
                    recorded.lock().unwrap().beats_answered += 1;
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

    /// One worker, of the pool asked for (none: of "default"); shard gpu is down.
    async fn list_workers(
        &self,
        request: Request<proto::ListWorkersRequest>,
    ) -> Result<Response<proto::ListWorkersResponse>, Status> {
        let req = request.into_inner();
        self.recorded.lock().unwrap().listed.push(req.clone());
        let pool = if req.pool.is_empty() {
            "default".to_string()
        } else {
            req.pool
        };
        Ok(Response::new(proto::ListWorkersResponse {
            workers: vec![proto::Worker {
                id: "w-1".into(),
                pools: vec![pool],
                concurrency: 4,
                running: 1,
                shard: "cpu".into(),
                ..Default::default()
            }],
            unavailable_shards: vec!["gpu".into()],
        }))
    }
}

pub(crate) fn task(id: u64, sleep_ms: u64) -> Task {
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
pub(crate) async fn serve(shard: FakeShard) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerServiceServer::new(shard))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    format!("http://{addr}")
}

pub(crate) fn options(endpoint: &str) -> Options {
    Options::new(endpoint).retry(RetryConfig {
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        max_elapsed: Some(Duration::from_secs(2)),
    })
}

/// Sleeps the payload's milliseconds (stopping when cancelled), then returns it.
async fn sleeper(task: TaskContext, cancelled: CancellationToken) -> Result<TaskResult, TaskError> {
    let ms: u64 = crate::decode_payload(&task).map_err(TaskError::non_retryable)?;
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(ms)) => TaskResult::json(&ms),
        _ = cancelled.cancelled() => Err(TaskError::retryable("cancelled")),
    }
}

/// Runs the worker until `done` says so (or 10 s), then stops it; what the fake recorded.
pub(crate) async fn run_until(
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

pub(crate) fn outcomes(rec: &Recorded) -> Vec<proto::TaskOutcome> {
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
        WorkerOptions::new(options(&endpoint), ["default"])
            .concurrency(2)
            .prefetch(0),
        sleeper,
    )
    .unwrap();
    let rec = run_until(worker, recorded, |r| outcomes(r).len() >= 3).await;
    let rec = rec.lock().unwrap();
    let first = &rec.streams[0][0];
    assert_eq!(first.worker_id, "w1");
    assert_eq!(first.slots, 2, "the first message gives the concurrency");
    assert_eq!(first.credits, 2, "prefetch 0: the free slots alone");
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
) -> impl Fn(TaskContext, CancellationToken) -> BoxedResult + Send + Sync + 'static {
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
                Some(Outcome::Snoozed(_)) => "snoozed",
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
    assert_eq!(rec.streams[0][0].slots, 2, "the concurrency alone");
    assert!(
        rec.streams[0][1..].iter().all(|m| m.slots == 0),
        "slots in the first message only"
    );
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

#[test]
fn the_default_prefetch_is_four_tasks_a_slot_within_max_held() {
    for (concurrency, prefetch) in [(1, 4), (16, 64), (20_000, 80_000), (99_000, 1_000)] {
        assert_eq!(
            crate::worker::default_prefetch(concurrency),
            prefetch,
            "concurrency {concurrency}"
        );
    }
    assert_eq!(crate::worker::default_prefetch(100_000), 0);
    assert_eq!(
        crate::worker::default_prefetch(usize::MAX),
        0,
        "no overflow"
    );
}

#[tokio::test]
async fn no_prefetch_given_holds_the_default_and_every_stream_s_first_message_gives_slots() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let endpoint = serve(FakeShard {
        tasks: Mutex::new(vec![task(1, 0), task(2, 300)]),
        break_first_after_outcomes: 1,
        recorded: recorded.clone(),
        ..Default::default()
    })
    .await;
    let opts = WorkerOptions::new(options(&endpoint), ["default"]).concurrency(2);
    let worker = Worker::new(opts, sleeper).unwrap();
    let rec = run_until(worker, recorded, |r| {
        r.streams.len() >= 2 && outcomes(r).iter().any(|o| o.task_id == 2)
    })
    .await;
    let rec = rec.lock().unwrap();
    let firsts: Vec<(u32, u32)> = rec
        .streams
        .iter()
        .map(|s| (s[0].credits, s[0].slots))
        .collect();
    assert_eq!(
        firsts[..2],
        [(2 + 8, 2), (2 + 8 - 1, 2)],
        "concurrency + 4 a slot; the second stream's less task 2 running"
    );
    assert!(
        rec.streams
            .iter()
            .flat_map(|s| &s[1..])
            .all(|m| m.slots == 0),
        "slots in each stream's first message only"
    );
    let big = WorkerOptions::new(options(&endpoint), ["default"]).concurrency(99_000);
    assert!(
        Worker::new(big, sleeper).is_ok(),
        "the default stays within 100,000"
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

/// Runs `handler` for the shard's tasks until each has an outcome; what the fake recorded.
async fn run_tasks<F, Fut>(shard: FakeShard, handler: F) -> Arc<Mutex<Recorded>>
where
    F: Fn(TaskContext, CancellationToken) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<TaskResult, TaskError>> + Send + 'static,
{
    let n = shard.tasks.lock().unwrap().len();
    let recorded = shard.recorded.clone();
    let endpoint = serve(shard).await;
    let worker = Worker::new(WorkerOptions::new(options(&endpoint), ["default"]), handler).unwrap();
    run_until(worker, recorded, move |r| {
        let ids: std::collections::HashSet<u64> = outcomes(r).iter().map(|o| o.task_id).collect();
        ids.len() >= n
    })
    .await
}

/// The last outcome reported for the task.
fn outcome_of(rec: &Recorded, task_id: u64) -> proto::TaskOutcome {
    outcomes(rec)
        .into_iter()
        .rfind(|o| o.task_id == task_id)
        .expect("an outcome")
}

/// The task's reports the heartbeats of these streams carried, in the order sent.
fn beat_reports<'a>(
    streams: impl IntoIterator<Item = &'a Vec<proto::WorkRequest>>,
    task_id: u64,
) -> Vec<proto::TaskReport> {
    streams
        .into_iter()
        .flatten()
        .filter_map(|m| m.heartbeat.as_ref())
        .flat_map(|b| b.reports.iter().filter(|r| r.task_id == task_id).cloned())
        .collect()
}

fn progress(value: f64, message: &str) -> Option<proto::TaskProgress> {
    Some(proto::TaskProgress {
        value,
        message: message.into(),
        updated_at: None,
    })
}

fn report(
    task_id: u64,
    progress: Option<proto::TaskProgress>,
    checkpoint: Option<&[u8]>,
) -> Option<proto::TaskReport> {
    Some(proto::TaskReport {
        task_id,
        attempt: 1,
        progress,
        checkpoint: checkpoint.map(<[u8]>::to_vec),
    })
}

#[tokio::test]
async fn a_snooze_is_reported_with_its_whole_milliseconds_and_reason() {
    use proto::task_outcome::Outcome;
    let tasks = (1..=4).map(|id| task(id, 0)).collect();
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(tasks),
            ..Default::default()
        },
        |ctx: TaskContext, _| async move {
            let delay = match ctx.id {
                1 => Duration::from_micros(1_500_999),
                2 => Duration::ZERO,
                3 => Duration::from_millis(u64::from(u32::MAX)),
                _ => Duration::from_millis(u64::from(u32::MAX) + 1),
            };
            Err(TaskError::snooze(delay, "later"))
        },
    )
    .await;
    let rec = rec.lock().unwrap();
    let snoozed = |snooze_ms| {
        Some(Outcome::Snoozed(proto::TaskSnoozed {
            snooze_ms,
            reason: "later".into(),
        }))
    };
    assert_eq!(outcome_of(&rec, 1).outcome, snoozed(1500), "rounded down");
    assert_eq!(outcome_of(&rec, 2).outcome, snoozed(0), "due at once");
    assert_eq!(outcome_of(&rec, 3).outcome, snoozed(u32::MAX));
    let Some(Outcome::Failure(f)) = outcome_of(&rec, 4).outcome else {
        panic!("a snooze over u32::MAX ms fails the attempt");
    };
    assert!(
        f.retryable
            && f.error
                .contains("snooze of 4294967296 ms: at most 4294967295 ms"),
        "{f:?}"
    );
}

#[tokio::test]
async fn invalid_reports_are_refused_and_record_nothing() {
    let tasks = vec![task(1, 0), task(2, 0)];
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(tasks),
            max_checkpoint_bytes: 8,
            ..Default::default()
        },
        |ctx: TaskContext, _| async move {
            if ctx.id == 2 {
                ctx.report_progress(1.0, &"é".repeat(512))?; // 1,024 bytes: the most
                ctx.save_checkpoint(*b"12345678")?; // max_checkpoint_bytes
                return Ok(TaskResult::none());
            }
            ctx.report_progress(0.5, "half")?;
            ctx.save_checkpoint("kept")?;
            let mut refused = Vec::new();
            for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                refused.push(ctx.report_progress(value, "bad").unwrap_err());
            }
            refused.push(ctx.report_progress(1.0, &"x".repeat(1025)).unwrap_err());
            refused.push(ctx.save_checkpoint(vec![0; 9]).unwrap_err());
            for control in ["line one\nline two", "tab\t", "del\u{7f}", "c1\u{85}"] {
                refused.push(ctx.report_progress(1.0, control).unwrap_err());
            }
            // Line separators and bidi controls, each named as an escape.
            let separators_and_bidi = "\u{2028}\u{2029}\u{200e}\u{200f}\u{202a}\u{202b}\u{202c}\u{202d}\u{202e}\u{2066}\u{2067}\u{2068}\u{2069}\u{61c}";
            for bad in separators_and_bidi.chars() {
                let err = ctx
                    .report_progress(1.0, &format!("report{bad}fdp.exe"))
                    .unwrap_err();
                let named = format!("control character '\\u{{{:x}}}'", bad as u32);
                assert!(err.to_string().contains(&named), "{err} (want {named})");
                refused.push(err);
            }
            let messages: Vec<String> = refused.iter().map(ToString::to_string).collect();
            assert!(
                refused
                    .iter()
                    .all(|e| matches!(e, crate::Error::InvalidArgument(_))),
                "{refused:?}"
            );
            assert!(messages[0].contains("value NaN is not a finite number"));
            assert!(messages[1].contains("value inf is not"));
            assert!(messages[3].contains("message of 1025 bytes, more than 1024"));
            assert!(messages[4].contains("9 bytes, more than max_checkpoint_bytes 8"));
            assert!(
                messages[5].contains(r"progress: control character '\n' in the message"),
                "{}",
                messages[5]
            );
            assert_eq!(ctx.checkpoint().as_deref(), Some(&b"kept"[..]));
            Ok(TaskResult::none())
        },
    )
    .await;
    let rec = rec.lock().unwrap();
    assert_eq!(
        outcome_kinds(&rec),
        vec![(1, "success"), (2, "success")],
        "no assertion failed in the handler"
    );
    assert_eq!(
        outcome_of(&rec, 1).report,
        report(1, progress(0.5, "half"), Some(b"kept")),
        "the last valid reports, those refused not recorded"
    );
    assert_eq!(
        outcome_of(&rec, 2).report,
        report(2, progress(1.0, &"é".repeat(512)), Some(b"12345678"))
    );
}

#[tokio::test]
async fn an_older_server_s_checkpoint_limit_is_256_kib() {
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 0)]),
            max_checkpoint_bytes: 0,
            ..Default::default()
        },
        |ctx: TaskContext, _| async move {
            let err = ctx.save_checkpoint(vec![7; 262_145]).unwrap_err();
            if !err.message().contains("max_checkpoint_bytes 262144") {
                return Err(TaskError::non_retryable(err));
            }
            ctx.save_checkpoint(vec![7; 262_144])?;
            Ok(TaskResult::none())
        },
    )
    .await;
    let rec = rec.lock().unwrap();
    let done = outcome_of(&rec, 1);
    assert_eq!(outcome_kinds(&rec), vec![(1, "success")], "{done:?}");
    assert_eq!(done.report.unwrap().checkpoint.unwrap().len(), 262_144);
}

#[tokio::test]
async fn a_leased_task_s_checkpoint_and_snoozes_reach_its_handler() {
    let resumed = Task {
        snoozes: 3,
        checkpoint: b"step-7".to_vec(),
        ..task(1, 0)
    };
    let seen = Arc::new(Mutex::new(Vec::new()));
    let saw = seen.clone();
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(vec![resumed, task(2, 0)]),
            ..Default::default()
        },
        move |ctx: TaskContext, _| {
            let saw = saw.clone();
            async move {
                let leased = ctx.checkpoint();
                ctx.save_checkpoint("step-8")?;
                let saved = ctx.checkpoint();
                ctx.save_checkpoint("")?;
                let cleared = ctx.checkpoint();
                saw.lock()
                    .unwrap()
                    .push((ctx.id, ctx.snoozes(), leased, saved, cleared));
                Ok(TaskResult::none())
            }
        },
    )
    .await;
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    let step = |s: &str| Some(s.as_bytes().to_vec());
    assert_eq!(
        seen,
        vec![
            (1, 3, step("step-7"), step("step-8"), None),
            (2, 0, None, step("step-8"), None),
        ]
    );
    let rec = rec.lock().unwrap();
    assert_eq!(
        outcome_of(&rec, 1).report,
        report(1, None, Some(b"")),
        "an empty checkpoint clears the task's"
    );
}

#[tokio::test]
async fn reports_between_heartbeats_coalesce_into_one_with_the_last_of_each() {
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 0)]),
            ..Default::default()
        },
        |ctx: TaskContext, _| async move {
            ctx.report_progress(0.25, "a quarter")?;
            ctx.save_checkpoint("step-1")?;
            ctx.report_progress(0.5, "half")?;
            ctx.save_checkpoint("step-2")?;
            tokio::time::sleep(Duration::from_millis(350)).await; // 3 heartbeats
            Ok(TaskResult::none())
        },
    )
    .await;
    let rec = rec.lock().unwrap();
    let beats = rec.streams[0]
        .iter()
        .filter(|m| m.heartbeat.is_some())
        .count();
    assert!(beats >= 3, "{beats} heartbeats");
    assert_eq!(
        beat_reports(&rec.streams, 1),
        vec![report(1, progress(0.5, "half"), Some(b"step-2")).unwrap()],
        "one report, in one heartbeat: answered, it is not sent again"
    );
    assert_eq!(
        outcome_of(&rec, 1).report,
        None,
        "nothing left for the outcome"
    );
}

#[tokio::test]
async fn a_report_pending_when_the_handler_ends_rides_its_outcome() {
    use proto::task_outcome::Outcome;
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 0), task(2, 0)]),
            ..Default::default()
        },
        |ctx: TaskContext, _| async move {
            // From another thread than the handler's.
            let other = ctx.clone();
            std::thread::spawn(move || other.report_progress(0.9, "nearly"))
                .join()
                .unwrap()?;
            ctx.save_checkpoint("almost")?;
            if ctx.id == 1 {
                return Err(TaskError::retryable("crash"));
            }
            Err(TaskError::snooze(Duration::from_secs(1), "not now"))
        },
    )
    .await;
    let rec = rec.lock().unwrap();
    assert!(beat_reports(&rec.streams, 1).is_empty() && beat_reports(&rec.streams, 2).is_empty());
    for id in [1, 2] {
        let done = outcome_of(&rec, id);
        assert_eq!(
            done.report,
            report(id, progress(0.9, "nearly"), Some(b"almost"))
        );
        assert!(
            matches!(
                (id, done.outcome),
                (1, Some(Outcome::Failure(_))) | (2, Some(Outcome::Snoozed(_)))
            ),
            "task {id}"
        );
    }
}

#[tokio::test]
async fn a_report_sent_and_not_answered_rides_the_outcome() {
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 0)]),
            silent_beats: true,
            ..Default::default()
        },
        |ctx: TaskContext, _| async move {
            ctx.report_progress(0.5, "half")?;
            tokio::time::sleep(Duration::from_millis(250)).await;
            Ok(TaskResult::none())
        },
    )
    .await;
    let rec = rec.lock().unwrap();
    let sent = beat_reports(&rec.streams, 1);
    assert!(
        sent.len() >= 2,
        "every heartbeat carries it while unanswered: {sent:?}"
    );
    assert_eq!(
        outcome_of(&rec, 1).report,
        report(1, progress(0.5, "half"), None)
    );
}

#[tokio::test]
async fn a_report_a_broken_stream_did_not_answer_is_sent_again_on_the_next() {
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 0)]),
            break_first_on_report: true,
            ..Default::default()
        },
        |ctx: TaskContext, _| async move {
            ctx.save_checkpoint("step-3")?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            Ok(TaskResult::none())
        },
    )
    .await;
    let rec = rec.lock().unwrap();
    let checkpoint = report(1, None, Some(b"step-3")).unwrap();
    assert_eq!(beat_reports(&rec.streams[..1], 1), vec![checkpoint.clone()]);
    assert_eq!(
        beat_reports(&rec.streams[1..], 1),
        vec![checkpoint],
        "sent again, once: answered"
    );
    assert_eq!(outcome_of(&rec, 1).report, None);
}

#[tokio::test]
async fn a_report_made_after_a_heartbeat_was_sent_outlives_its_answer() {
    let recorded = Arc::new(Mutex::new(Recorded::default()));
    let watched = recorded.clone();
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(vec![task(1, 0)]),
            beat_delay: Duration::from_millis(150),
            recorded,
            ..Default::default()
        },
        move |ctx: TaskContext, _| {
            let watched = watched.clone();
            async move {
                ctx.report_progress(0.25, "first")?;
                // Until a heartbeat carried it (the n-th), then a newer one until it is answered.
                let mut n = 0;
                while n == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let rec = watched.lock().unwrap();
                    let mut beats = rec.streams[0].iter().filter_map(|m| m.heartbeat.as_ref());
                    n = beats
                        .position(|b| !b.reports.is_empty())
                        .map_or(0, |i| i + 1);
                }
                ctx.report_progress(0.5, "second")?;
                while watched.lock().unwrap().beats_answered < n {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(30)).await; // the worker reads the answer
                Ok(TaskResult::none())
            }
        },
    )
    .await;
    let rec = rec.lock().unwrap();
    assert_eq!(
        outcome_of(&rec, 1).report,
        report(1, progress(0.5, "second"), None),
        "the answer acknowledged the first, not the second (unanswered yet)"
    );
}

#[tokio::test]
async fn a_handler_runs_outside_a_worker_with_a_context_made_from_a_task() {
    let ctx = TaskContext::from(Task {
        checkpoint: b"step-1".to_vec(),
        ..task(1, 0)
    });
    assert_eq!(ctx.id, 1);
    assert_eq!(ctx.checkpoint(), Some(b"step-1".to_vec()));
    ctx.save_checkpoint(vec![0; 262_144]).unwrap();
    assert!(ctx.save_checkpoint(vec![0; 262_145]).is_err());
    let result = sleeper(ctx, CancellationToken::new()).await.unwrap();
    assert_eq!(result, TaskResult::json(&0).unwrap());
}

#[tokio::test]
async fn a_handler_reads_its_dependencies_by_key_or_id_decoded_as_payloads_are() {
    let dependency = |id, key: &str, state, result: &[u8], content_type: &str, error: &str| {
        proto::DependencyResult {
            id,
            key: key.into(),
            state: state as i32,
            result: result.to_vec(),
            content_type: content_type.into(),
            error: error.into(),
        }
    };
    let ctx = TaskContext::from(Task {
        dependency_results: vec![
            dependency(
                u64::MAX,
                "wf-a",
                TaskState::Succeeded,
                b"[1,2]",
                "application/json",
                "",
            ),
            dependency(
                5,
                "",
                TaskState::Succeeded,
                b"\x00\xff",
                "application/octet-stream",
                "",
            ),
            dependency(6, "wf-c", TaskState::Failed, b"", "", "boom"),
        ],
        ..task(9, 0)
    });
    let in_order: Vec<u64> = ctx.dependency_results().iter().map(|d| d.id).collect();
    assert_eq!(in_order, vec![u64::MAX, 5, 6], "depends_on order");
    let by_key = ctx.dependency("wf-a").unwrap();
    assert_eq!(by_key.json::<Vec<i64>>().unwrap(), vec![1, 2]);
    assert_eq!(ctx.dependency(u64::MAX).unwrap(), by_key);
    let raw = ctx.dependency(5).unwrap();
    assert_eq!(raw.result, b"\x00\xff");
    let err = raw.json::<serde_json::Value>().unwrap_err();
    assert!(
        err.message().contains("task 5: the result is not JSON"),
        "{err}"
    );
    let failed = ctx.dependency(String::from("wf-c")).unwrap();
    assert_eq!(
        (failed.state(), failed.error.as_str()),
        (TaskState::Failed, "boom")
    );
    for (missing, named) in [
        (ctx.dependency("wf-x").unwrap_err(), "key \"wf-x\""),
        (ctx.dependency(7).unwrap_err(), "id 7"),
    ] {
        assert_eq!(missing.code(), Code::InvalidArgument);
        assert!(
            missing
                .message()
                .contains(&format!("task 9 has no dependency of {named}")),
            "{missing}"
        );
    }
}

#[tokio::test]
async fn spawned_tasks_ride_the_success_and_nothing_else() {
    use proto::task_outcome::Outcome;
    let tasks = (1..=3).map(|id| task(id, 0)).collect();
    let kept: Arc<Mutex<Option<TaskContext>>> = Arc::default();
    let keep = kept.clone();
    let rec = run_tasks(
        FakeShard {
            tasks: Mutex::new(tasks),
            ..Default::default()
        },
        move |ctx: TaskContext, _| {
            keep.lock().unwrap().get_or_insert_with(|| ctx.clone());
            async move {
                ctx.spawn(
                    TaskSpec::new("default")
                        .json(&serde_json::json!({"n": 1}))?
                        .key("part-1"),
                )?;
                ctx.spawn(
                    TaskSpec::new("default")
                        .key("join")
                        .depends_on("part-1")
                        .depends_on(ctx.id)
                        .run_when(RunWhen::DependenciesEnded),
                )?;
                assert_eq!(ctx.spawned().len(), 2);
                match ctx.id {
                    1 => TaskResult::json(&"spawned"),
                    2 => Err(TaskError::non_retryable("failed after spawning")),
                    _ => Err(TaskError::snooze(Duration::ZERO, "later")),
                }
            }
        },
    )
    .await;
    let late = kept.lock().unwrap().take().unwrap();
    let err = late.spawn(TaskSpec::new("default")).unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("handler has returned"), "{err}");
    let rec = rec.lock().unwrap();
    let Some(Outcome::Success(success)) = outcome_of(&rec, 1).outcome else {
        panic!("task 1 succeeds");
    };
    let by_key = |key: &str| proto::TaskRef {
        r#ref: Some(proto::task_ref::Ref::Key(key.into())),
    };
    let expected = vec![
        proto::SubmitTaskRequest {
            pool: "default".into(),
            key: "part-1".into(),
            payload: br#"{"n":1}"#.to_vec(),
            content_type: "application/json".into(),
            ..Default::default()
        },
        proto::SubmitTaskRequest {
            pool: "default".into(),
            key: "join".into(),
            depends_on: vec![
                by_key("part-1"),
                proto::TaskRef {
                    r#ref: Some(proto::task_ref::Ref::Id(1)),
                },
            ],
            run_when: RunWhen::DependenciesEnded as i32,
            ..Default::default()
        },
    ];
    // Traces are otel_tests' (with the feature, another test's tracer provider may be the process's).
    let spawn: Vec<_> = (success.spawn.iter())
        .map(|s| proto::SubmitTaskRequest {
            trace: None,
            ..s.clone()
        })
        .collect();
    assert_eq!(spawn, expected);
    assert_eq!(success.result, br#""spawned""#);
    assert!(matches!(
        outcome_of(&rec, 2).outcome,
        Some(Outcome::Failure(_))
    ));
    assert!(matches!(
        outcome_of(&rec, 3).outcome,
        Some(Outcome::Snoozed(_))
    ));
}

/// A field's value as a log record carried it: text (a string, or a value formatted with `%`
/// or `?`) or a number.
#[derive(Debug, Clone, PartialEq)]
enum Field {
    Text(String),
    Int(i64),
}

/// Every event of the SDK's (its target is the crate's), with its fields (its message as
/// "message").
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<std::collections::HashMap<String, Field>>>>);

struct Fields<'a>(&'a mut std::collections::HashMap<String, Field>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), Field::Text(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0
            .insert(field.name().into(), Field::Text(value.into()));
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.insert(field.name().into(), Field::Int(value));
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().into(), Field::Int(value as i64));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Captured {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if !event.metadata().target().starts_with("cronoq") {
            return;
        }
        let mut fields = std::collections::HashMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().push(fields);
    }
}

impl Captured {
    /// The fields of the one event whose message is `message`.
    fn line(&self, message: &str) -> std::collections::HashMap<String, Field> {
        let events = self.0.lock().unwrap();
        let found: Vec<_> = events
            .iter()
            .filter(|e| e.get("message") == Some(&Field::Text(message.into())))
            .collect();
        assert_eq!(found.len(), 1, "{message:?} in {events:?}");
        found[0].clone()
    }
}

#[tokio::test]
async fn task_log_lines_name_the_worker_task_attempt_and_pool() {
    use tracing_subscriber::layer::SubscriberExt as _;
    // This test's thread only: the runtime is current-thread, so the worker's tasks log here.
    // A second dispatcher stays registered meanwhile: with one alone, tracing decides whether
    // a log line is wanted by the default dispatcher of the thread that first reaches it, and
    // the other tests' threads have none.
    let _second = tracing::Dispatch::new(tracing_subscriber::registry());
    let captured = Captured::default();
    let _logs =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(captured.clone()));
    let lost = Task {
        attempt: 3,
        ..task(7, 10_000)
    };
    let refused = Task {
        pool: "default".into(),
        ..task(8, 0)
    };
    let shard = FakeShard {
        lose: vec![7],
        refuse: vec![8],
        ..FakeShard::with_tasks(vec![lost, refused])
    };
    let recorded = shard.recorded.clone();
    let endpoint = serve(shard).await;
    let worker = Worker::new(WorkerOptions::new(options(&endpoint), ["default"]), sleeper).unwrap();
    run_until(worker, recorded, |r| {
        outcomes(r).iter().any(|o| o.task_id == 8) && r.beats_answered > 0
    })
    .await;
    let text = |s: &str| Field::Text(s.into());
    let line = captured.line("cronoq: task lost its lease; its outcome will not be reported");
    assert_eq!(line["worker_id"], text("w1"));
    assert_eq!(line["task_id"], text("7"), "a decimal string");
    assert_eq!(line["attempt"], Field::Int(3));
    assert_eq!(line["pool"], text("default"));
    let line = captured.line("cronoq: outcome refused");
    assert_eq!(line["worker_id"], text("w1"));
    assert_eq!(line["task_id"], text("8"));
    assert_eq!(line["attempt"], Field::Int(1));
    assert_eq!(line["pool"], text("default"));
    assert_eq!(line["code"], text("FAILED_PRECONDITION"));
    assert_eq!(
        line["error"],
        text("fake: stale attempt"),
        "not the line's message"
    );
    assert_eq!(line["message"], text("cronoq: outcome refused"));
    let line = captured.line("cronoq: worker registered");
    assert_eq!(line["worker_id"], text("w1"));
}
