//! The client against an in-process fake TaskService (real gRPC over loopback TCP).

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

use crate::proto;
use crate::proto::admin_service_server::{AdminService, AdminServiceServer};
use crate::proto::schedule_service_server::{ScheduleService, ScheduleServiceServer};
use crate::proto::task_service_server::{TaskService, TaskServiceServer};
use crate::worker_tests::{self, FakeShard};
use crate::{
    AttemptOutcome, Client, Code, GetTaskOptions, KeyMode, Options, RetryConfig, RetryTaskOptions,
    Role, RunWhen, ScheduleSpec, TaskFilter, TaskRef, TaskSpec, TaskState,
};

/// A request of the calls that read or change existing tasks and pools, as the fake got it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Call {
    Submit(proto::SubmitTaskRequest),
    SubmitBatch(proto::SubmitBatchRequest),
    Get(proto::GetTaskRequest),
    Cancel(proto::CancelTaskRequest),
    Retry(proto::RetryTaskRequest),
    Delete(proto::DeleteTaskRequest),
    CancelTasks(proto::CancelTasksRequest),
    RetryTasks(proto::RetryTasksRequest),
    DeleteTasks(proto::DeleteTasksRequest),
    Pause(proto::PausePoolRequest),
    Resume(proto::ResumePoolRequest),
    PutSchedule(proto::PutScheduleRequest),
    DeleteSchedule(proto::DeleteScheduleRequest),
    ListSchedules(proto::ListSchedulesRequest),
    Snapshot,
    ServerInfo,
}

/// Refuses the first `unavailable` submissions, retries (RetryTask) and schedule puts with
/// UNAVAILABLE, then accepts (a submission replacing by its key_mode answers replaced);
/// records the submissions' request ids (a put's schedule name) and authorization headers,
/// and every call's request. Task 1 and the schedules named "missing" do not exist; an empty
/// cron is refused.
#[derive(Clone, Default)]
pub(crate) struct Fake {
    unavailable: Arc<Mutex<usize>>,
    seen: Arc<Mutex<Vec<(String, String)>>>,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl Fake {
    fn refuse(&self) -> Result<(), Status> {
        let mut left = self.unavailable.lock().unwrap();
        if *left > 0 {
            *left -= 1;
            return Err(Status::unavailable("fake: not yet"));
        }
        Ok(())
    }

    fn record(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
    }

    pub(crate) fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn authorized<M>(&self, request: &Request<M>, id: String) {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        self.seen.lock().unwrap().push((id, auth));
    }
}

/// Whether the fake answers the submission as one that replaced its key's pending task.
fn replaces(req: &proto::SubmitTaskRequest) -> bool {
    matches!(req.key_mode(), KeyMode::ReplacePending | KeyMode::Debounce)
}

fn id_of(task: &Option<proto::TaskRef>) -> u64 {
    match task.as_ref().and_then(|t| t.r#ref.as_ref()) {
        Some(proto::task_ref::Ref::Id(id)) => *id,
        _ => 42,
    }
}

/// Counts the filter's ids as matched (all changed unless a dry run) in shard cpu, which stops
/// at its time bound on a real run; gpu is down.
fn bulk_counts(
    filter: &Option<proto::TaskFilter>,
    dry_run: bool,
) -> (i64, i64, Vec<proto::BulkShardResult>) {
    let matched = filter.as_ref().map_or(0, |f| f.ids.len() as i64);
    let changed = if dry_run { 0 } else { matched };
    let shards = vec![proto::BulkShardResult {
        shard: "cpu".into(),
        matched,
        changed,
        incomplete: !dry_run,
    }];
    (matched, changed, shards)
}

#[tonic::async_trait]
impl TaskService for Fake {
    async fn submit_task(
        &self,
        request: Request<proto::SubmitTaskRequest>,
    ) -> Result<Response<proto::SubmitTaskResponse>, Status> {
        self.authorized(&request, request.get_ref().request_id.clone());
        let req = request.into_inner();
        self.record(Call::Submit(req.clone()));
        self.refuse()?;
        let replaced = replaces(&req);
        Ok(Response::new(proto::SubmitTaskResponse {
            task: Some(proto::Task {
                id: u64::MAX - 1,
                pool: req.pool,
                group_key: req.group_key,
                ..Default::default()
            }),
            deduplicated: false,
            replaced,
        }))
    }

    async fn submit_batch(
        &self,
        request: Request<proto::SubmitBatchRequest>,
    ) -> Result<Response<proto::SubmitBatchResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::SubmitBatch(req.clone()));
        let replaced_ids = (req.tasks.iter().zip(10..))
            .filter(|(t, _)| replaces(t))
            .map(|(_, id)| id)
            .collect();
        let tasks = (req.tasks.iter().zip(10..))
            .map(|(t, id)| proto::Task {
                id,
                pool: t.pool.clone(),
                group_key: t.group_key.clone(),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(proto::SubmitBatchResponse {
            tasks,
            replaced_ids,
            ..Default::default()
        }))
    }

    async fn get_task(
        &self,
        request: Request<proto::GetTaskRequest>,
    ) -> Result<Response<proto::GetTaskResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::Get(req.clone()));
        let id = id_of(&req.task);
        if id == 1 {
            return Err(Status::not_found("fake: no such task"));
        }
        let attempts = if req.include_attempts {
            vec![
                proto::Attempt {
                    attempt: 1,
                    outcome: AttemptOutcome::Lost as i32,
                    ..Default::default()
                },
                proto::Attempt {
                    attempt: 2,
                    outcome: AttemptOutcome::Failed as i32,
                    error: "boom".into(),
                    ..Default::default()
                },
            ]
        } else {
            Vec::new()
        };
        let children = if req.include_children {
            (id + 1..=id + 2)
                .map(|child| proto::Task {
                    id: child,
                    parent_id: id,
                    ..Default::default()
                })
                .collect()
        } else {
            Vec::new()
        };
        let dependency_results = if req.include_dependency_results {
            vec![proto::DependencyResult {
                id: 3,
                key: "extract".into(),
                state: TaskState::Succeeded as i32,
                result: b"7".to_vec(),
                content_type: "application/json".into(),
                error: String::new(),
            }]
        } else {
            Vec::new()
        };
        Ok(Response::new(proto::GetTaskResponse {
            task: Some(proto::Task {
                id,
                state: TaskState::Failed as i32,
                dependency_results,
                ..Default::default()
            }),
            attempts,
            children,
            dependents: if req.include_dependents {
                vec![u64::MAX]
            } else {
                Vec::new()
            },
            ..Default::default()
        }))
    }

    async fn wait_task(
        &self,
        _: Request<proto::WaitTaskRequest>,
    ) -> Result<Response<proto::WaitTaskResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn cancel_task(
        &self,
        request: Request<proto::CancelTaskRequest>,
    ) -> Result<Response<proto::CancelTaskResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::Cancel(req.clone()));
        Ok(Response::new(proto::CancelTaskResponse {
            task: Some(proto::Task {
                id: id_of(&req.task),
                state: TaskState::Cancelled as i32,
                ..Default::default()
            }),
            descendants_cancelled: if req.include_descendants { 5 } else { 0 },
        }))
    }

    async fn retry_task(
        &self,
        request: Request<proto::RetryTaskRequest>,
    ) -> Result<Response<proto::RetryTaskResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::Retry(req.clone()));
        self.refuse()?;
        Ok(Response::new(proto::RetryTaskResponse {
            task: Some(proto::Task {
                id: id_of(&req.task),
                state: TaskState::Pending as i32,
                ..Default::default()
            }),
            dependents_restored: 2,
        }))
    }

    async fn delete_task(
        &self,
        request: Request<proto::DeleteTaskRequest>,
    ) -> Result<Response<proto::DeleteTaskResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::Delete(req.clone()));
        Ok(Response::new(proto::DeleteTaskResponse {
            id: id_of(&req.task),
        }))
    }

    async fn cancel_tasks(
        &self,
        request: Request<proto::CancelTasksRequest>,
    ) -> Result<Response<proto::CancelTasksResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::CancelTasks(req.clone()));
        let (matched, changed, shards) = bulk_counts(&req.filter, req.dry_run);
        Ok(Response::new(proto::CancelTasksResponse {
            matched,
            changed,
            shards,
            unavailable_shards: vec!["gpu".into()],
            incomplete: !req.dry_run,
        }))
    }

    async fn retry_tasks(
        &self,
        request: Request<proto::RetryTasksRequest>,
    ) -> Result<Response<proto::RetryTasksResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::RetryTasks(req.clone()));
        let (matched, changed, shards) = bulk_counts(&req.filter, req.dry_run);
        Ok(Response::new(proto::RetryTasksResponse {
            matched,
            changed,
            shards,
            unavailable_shards: vec!["gpu".into()],
            incomplete: !req.dry_run,
        }))
    }

    async fn delete_tasks(
        &self,
        request: Request<proto::DeleteTasksRequest>,
    ) -> Result<Response<proto::DeleteTasksResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::DeleteTasks(req.clone()));
        let (matched, changed, shards) = bulk_counts(&req.filter, req.dry_run);
        Ok(Response::new(proto::DeleteTasksResponse {
            matched,
            changed,
            shards,
            unavailable_shards: vec!["gpu".into()],
            incomplete: !req.dry_run,
        }))
    }

    async fn list_tasks(
        &self,
        _: Request<proto::ListTasksRequest>,
    ) -> Result<Response<proto::ListTasksResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type WatchStream = tokio_stream::Empty<Result<proto::WatchResponse, Status>>;

    async fn watch(
        &self,
        _: Request<proto::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

#[tonic::async_trait]
impl AdminService for Fake {
    /// Shard cpu answers; gpu is down.
    async fn get_snapshot(
        &self,
        _: Request<proto::GetSnapshotRequest>,
    ) -> Result<Response<proto::GetSnapshotResponse>, Status> {
        self.record(Call::Snapshot);
        Ok(Response::new(proto::GetSnapshotResponse {
            shards: vec![proto::ShardSnapshot {
                shard: "cpu".into(),
                leader: "cpu-1:7070".into(),
                term: 3,
                pools: vec![proto::PoolCounts {
                    pool: "llm".into(),
                    pending: 5,
                    ..Default::default()
                }],
                ..Default::default()
            }],
            unavailable_shards: vec!["gpu".into()],
        }))
    }

    async fn pause_pool(
        &self,
        request: Request<proto::PausePoolRequest>,
    ) -> Result<Response<proto::PausePoolResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::Pause(req.clone()));
        Ok(Response::new(proto::PausePoolResponse {
            pause: Some(proto::PoolPause {
                pool: req.pool,
                paused: true,
                paused_at: Some(prost_types::Timestamp {
                    seconds: 1000,
                    nanos: 0,
                }),
                paused_by: "ops".into(),
            }),
        }))
    }

    async fn resume_pool(
        &self,
        request: Request<proto::ResumePoolRequest>,
    ) -> Result<Response<proto::ResumePoolResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::Resume(req.clone()));
        Ok(Response::new(proto::ResumePoolResponse {
            pause: Some(proto::PoolPause {
                pool: req.pool,
                ..Default::default()
            }),
        }))
    }

    async fn get_server_info(
        &self,
        _: Request<proto::GetServerInfoRequest>,
    ) -> Result<Response<proto::GetServerInfoResponse>, Status> {
        self.record(Call::ServerInfo);
        Ok(Response::new(proto::GetServerInfoResponse {
            version: "0.2.0".into(),
            shard: "cpu".into(),
            shard_number: 1,
            role: Role::Leader as i32,
            leader: "cpu-1:7070".into(),
            term: 3,
            caller: Some(proto::Caller {
                name: "ops".into(),
                all_pools: true,
                permissions: vec!["read".into(), "admin".into()],
                ..Default::default()
            }),
            ..Default::default()
        }))
    }
}

#[tonic::async_trait]
impl ScheduleService for Fake {
    /// Stores nothing: answers the schedule with its next fire at 3000 s.
    async fn put_schedule(
        &self,
        request: Request<proto::PutScheduleRequest>,
    ) -> Result<Response<proto::PutScheduleResponse>, Status> {
        let schedule = request.get_ref().schedule.clone().unwrap_or_default();
        self.authorized(&request, schedule.name.clone());
        self.record(Call::PutSchedule(request.into_inner()));
        self.refuse()?;
        if schedule.cron.is_empty() {
            return Err(Status::invalid_argument(
                "schedule.cron: \"\" is not a cron expression",
            ));
        }
        Ok(Response::new(proto::PutScheduleResponse {
            schedule: Some(proto::Schedule {
                next_fire_at: timestamp(3000),
                ..schedule
            }),
        }))
    }

    async fn delete_schedule(
        &self,
        request: Request<proto::DeleteScheduleRequest>,
    ) -> Result<Response<proto::DeleteScheduleResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::DeleteSchedule(req.clone()));
        if req.name == "missing" {
            return Err(Status::not_found(format!(
                "no schedule {:?} in pool {:?}",
                req.name, req.pool
            )));
        }
        Ok(Response::new(proto::DeleteScheduleResponse {}))
    }

    /// Schedule "nightly" of the pool asked for (none: of "default"); shard gpu is down.
    async fn list_schedules(
        &self,
        request: Request<proto::ListSchedulesRequest>,
    ) -> Result<Response<proto::ListSchedulesResponse>, Status> {
        let req = request.into_inner();
        self.record(Call::ListSchedules(req.clone()));
        let pool = if req.pool.is_empty() {
            "default".to_string()
        } else {
            req.pool
        };
        Ok(Response::new(proto::ListSchedulesResponse {
            schedules: vec![proto::Schedule {
                pool,
                name: "nightly".into(),
                cron: "0 2 * * *".into(),
                next_fire_at: timestamp(3000),
                ..Default::default()
            }],
            unavailable_shards: vec!["gpu".into()],
        }))
    }
}

/// The fake's TaskService and AdminService on loopback: its endpoint, and the fake.
pub(crate) async fn serve(unavailable: usize) -> (String, Fake) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = Fake {
        unavailable: Arc::new(Mutex::new(unavailable)),
        ..Fake::default()
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TaskServiceServer::new(fake.clone()))
            .add_service(AdminServiceServer::new(fake.clone()))
            .add_service(ScheduleServiceServer::new(fake.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), fake)
}

pub(crate) fn options(endpoint: &str, max_elapsed: Duration) -> Options {
    Options::new(endpoint).token("secret").retry(RetryConfig {
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
        max_elapsed: Some(max_elapsed),
    })
}

#[tokio::test]
async fn submit_retries_unavailable_with_the_same_request_id_and_the_token() {
    let (endpoint, fake) = serve(2).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let submitted = client.submit(TaskSpec::new("default")).await.unwrap();
    assert_eq!(submitted.task.id, u64::MAX - 1, "all 64 bits survive");
    let seen = fake.seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter()
            .all(|(id, auth)| id == &seen[0].0 && auth == "Bearer secret")
    );
    assert_eq!(seen[0].0.len(), 32);
}

#[tokio::test]
async fn submit_and_submit_batch_send_each_tasks_group_key() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let submitted = client
        .submit(TaskSpec::new("default").group_key("tenant-a"))
        .await
        .unwrap();
    assert_eq!(submitted.task.group_key, "tenant-a");
    let specs = [
        TaskSpec::new("default").group_key("tenant-b"),
        TaskSpec::new("default"),
    ];
    client.submit_batch(&specs).await.unwrap();
    let calls = fake.calls();
    let [Call::Submit(one), Call::SubmitBatch(batch)] = calls.as_slice() else {
        panic!("calls {calls:?}");
    };
    assert_eq!(one.group_key, "tenant-a");
    let keys: Vec<&str> = batch.tasks.iter().map(|t| t.group_key.as_str()).collect();
    assert_eq!(keys, ["tenant-b", ""], "none given: no group");
}

#[tokio::test]
async fn a_spec_s_trace_is_sent_and_none_outside_a_trace() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    client
        .submit(TaskSpec::new("default").trace(traceparent, "vendor=abc"))
        .await
        .unwrap();
    let specs = [
        TaskSpec::new("default"),
        TaskSpec::new("default").trace(traceparent, ""),
    ];
    client.submit_batch(&specs).await.unwrap();
    client.submit(TaskSpec::new("default")).await.unwrap();
    let calls = fake.calls();
    let [
        Call::Submit(one),
        Call::SubmitBatch(batch),
        Call::Submit(untraced),
    ] = calls.as_slice()
    else {
        panic!("calls {calls:?}");
    };
    let trace = |tracestate: &str| {
        Some(proto::TraceContext {
            traceparent: traceparent.into(),
            tracestate: tracestate.into(),
            link: false,
        })
    };
    assert_eq!(one.trace, trace("vendor=abc"));
    assert_eq!(batch.tasks[0].trace, None, "no current span: no trace");
    assert_eq!(batch.tasks[1].trace, trace(""));
    assert_eq!(untraced.trace, None);
}

#[tokio::test]
async fn unavailable_is_raised_once_the_retries_are_spent() {
    let (endpoint, _) = serve(usize::MAX).await;
    let client = Client::new(options(&endpoint, Duration::from_millis(100))).unwrap();
    let err = client.submit(TaskSpec::new("default")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(err.message(), "fake: not yet");
}

#[tokio::test]
async fn other_codes_are_not_retried() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let err = client.get(1).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(err.to_string(), "NOT_FOUND: fake: no such task");
    assert_eq!(fake.calls().len(), 1);
}

fn key(key: &str) -> Option<proto::TaskRef> {
    Some(proto::TaskRef {
        r#ref: Some(proto::task_ref::Ref::Key(key.into())),
    })
}

fn at(seconds: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)
}

fn timestamp(seconds: i64) -> Option<prost_types::Timestamp> {
    Some(prost_types::Timestamp { seconds, nanos: 0 })
}

#[tokio::test]
async fn retry_by_key_sends_its_options_and_is_retried_on_unavailable_as_cancel_is() {
    let (endpoint, fake) = serve(2).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let opts = RetryTaskOptions {
        run_at: Some(at(1000)),
        extra_attempts: 3,
    };
    let retried = client
        .retry(TaskRef::Key("nightly".into()), opts)
        .await
        .unwrap();
    assert_eq!(retried.task.state(), TaskState::Pending);
    assert_eq!(retried.dependents_restored, 2);
    let sent = Call::Retry(proto::RetryTaskRequest {
        task: key("nightly"),
        run_at: timestamp(1000),
        extra_attempts: 3,
    });
    assert_eq!(fake.calls(), vec![sent.clone(), sent.clone(), sent]);
}

#[tokio::test]
async fn delete_answers_the_id_deleted() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    assert_eq!(client.delete(u64::MAX).await.unwrap(), u64::MAX);
    assert_eq!(client.delete(TaskRef::Key("old".into())).await.unwrap(), 42);
    assert_eq!(
        fake.calls()[1],
        Call::Delete(proto::DeleteTaskRequest { task: key("old") })
    );
}

#[tokio::test]
async fn get_with_attempts_asks_for_them_and_get_does_not() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let got = client.get_with_attempts(7).await.unwrap();
    assert_eq!(got.task.id, 7);
    let outcomes: Vec<_> = got
        .attempts
        .iter()
        .map(|a| (a.attempt, a.outcome(), a.error.as_str()))
        .collect();
    assert_eq!(
        outcomes,
        vec![
            (1, AttemptOutcome::Lost, ""),
            (2, AttemptOutcome::Failed, "boom")
        ]
    );
    client.get(7).await.unwrap();
    let asked: Vec<bool> = fake
        .calls()
        .iter()
        .map(|c| matches!(c, Call::Get(r) if r.include_attempts))
        .collect();
    assert_eq!(asked, vec![true, false]);
}

#[tokio::test]
async fn submit_sends_run_when_and_dependencies_by_key_and_id() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let finalizer = TaskSpec::new("default")
        .depends_on("extract")
        .depends_on(u64::MAX)
        .run_when(RunWhen::DependenciesEnded);
    client.submit(finalizer).await.unwrap();
    client.submit(TaskSpec::new("default")).await.unwrap();
    let sent: Vec<_> = fake
        .calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::Submit(r) => Some((r.run_when(), r.depends_on)),
            _ => None,
        })
        .collect();
    let by_id = proto::TaskRef {
        r#ref: Some(proto::task_ref::Ref::Id(u64::MAX)),
    };
    assert_eq!(
        sent,
        vec![
            (
                RunWhen::DependenciesEnded,
                vec![key("extract").unwrap(), by_id]
            ),
            (RunWhen::Unspecified, vec![]),
        ]
    );
}

#[tokio::test]
async fn submit_and_submit_batch_send_key_options_and_start_by_and_answer_replaced() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let debounced = TaskSpec::new("default")
        .key("reindex-7")
        .key_mode(KeyMode::Debounce)
        .debounce(Duration::from_secs(5))
        .max_debounce(Duration::from_secs(60))
        .key_ttl(Duration::from_micros(1))
        .start_by(at(2000));
    let submitted = client.submit(debounced.clone()).await.unwrap();
    assert!(submitted.replaced && !submitted.deduplicated);
    let plain = client.submit(TaskSpec::new("default")).await.unwrap();
    assert!(!plain.replaced);
    let specs = [
        TaskSpec::new("default").key("a"),
        TaskSpec::new("default")
            .key("b")
            .key_mode(KeyMode::ReplacePending),
    ];
    let batch = client.submit_batch(&specs).await.unwrap();
    assert_eq!(batch.replaced_ids, vec![11]);
    let calls = fake.calls();
    let [
        Call::Submit(one),
        Call::Submit(none),
        Call::SubmitBatch(sent),
    ] = calls.as_slice()
    else {
        panic!("calls {calls:?}");
    };
    let options = |r: &proto::SubmitTaskRequest| {
        (
            r.key_mode(),
            r.debounce_ms,
            r.max_debounce_ms,
            r.key_ttl_ms,
            r.start_by,
        )
    };
    assert_eq!(
        options(one),
        (KeyMode::Debounce, 5000, 60_000, 1, timestamp(2000)),
        "a positive duration under 1 ms is 1 ms, not 0 (unset)"
    );
    assert_eq!(options(none), (KeyMode::Unspecified, 0, 0, 0, None));
    let modes: Vec<KeyMode> = sent.tasks.iter().map(|t| t.key_mode()).collect();
    assert_eq!(modes, [KeyMode::Unspecified, KeyMode::ReplacePending]);
}

#[test]
fn expired_is_terminal() {
    let terminal: Vec<TaskState> = (0..=7)
        .filter_map(|n| TaskState::try_from(n).ok())
        .filter(|s| crate::is_terminal(*s))
        .collect();
    assert_eq!(
        terminal,
        [
            TaskState::Succeeded,
            TaskState::Failed,
            TaskState::Cancelled,
            TaskState::Expired
        ]
    );
}

#[tokio::test]
async fn get_with_asks_for_children_and_dependency_results_and_answers_them() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let opts = GetTaskOptions {
        include_children: true,
        include_dependency_results: true,
        include_dependents: true,
        ..GetTaskOptions::default()
    };
    let got = client
        .get_with(TaskRef::Key("join".into()), opts)
        .await
        .unwrap();
    assert_eq!(got.task.id, 42);
    let children: Vec<_> = got.children.iter().map(|c| (c.id, c.parent_id)).collect();
    assert_eq!(children, vec![(43, 42), (44, 42)]);
    assert_eq!(got.dependents, vec![u64::MAX]);
    let dep = &got.task.dependency_results[0];
    assert_eq!(
        (dep.key.as_str(), dep.state()),
        ("extract", TaskState::Succeeded)
    );
    assert_eq!(dep.json::<i64>().unwrap(), 7);
    assert!(got.attempts.is_empty());
    client.get(7).await.unwrap();
    assert_eq!(
        fake.calls(),
        vec![
            Call::Get(proto::GetTaskRequest {
                task: key("join"),
                include_dependents: true,
                include_attempts: false,
                include_children: true,
                include_dependency_results: true,
            }),
            Call::Get(proto::GetTaskRequest {
                task: Some(proto::TaskRef {
                    r#ref: Some(proto::task_ref::Ref::Id(7)),
                }),
                ..Default::default()
            }),
        ]
    );
}

#[tokio::test]
async fn cancel_with_descendants_asks_for_them_and_cancel_does_not() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let cancelled = client.cancel_with_descendants("root").await.unwrap();
    assert_eq!(cancelled.task.state(), TaskState::Cancelled);
    assert_eq!(cancelled.descendants_cancelled, 5);
    assert_eq!(client.cancel(9).await.unwrap().id, 9);
    let asked: Vec<_> = fake
        .calls()
        .into_iter()
        .map(|c| match c {
            Call::Cancel(r) => (id_of(&r.task), r.include_descendants),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(asked, vec![(42, true), (9, false)]);
}

#[tokio::test]
async fn bulk_actions_send_the_whole_filter_and_answer_per_shard() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let filter = TaskFilter {
        pool: "llm".into(),
        states: vec![TaskState::Failed, TaskState::Cancelled],
        created_after: Some(at(10)),
        created_before: Some(at(20)),
        finished_after: Some(at(30)),
        finished_before: Some(at(40)),
        key_prefix: "op-".into(),
        error_contains: "boom".into(),
        ids: vec![u64::MAX, 5],
        parent_id: u64::MAX - 2,
    };
    let sent = proto::TaskFilter {
        pool: "llm".into(),
        states: vec![TaskState::Failed as i32, TaskState::Cancelled as i32],
        created_after: timestamp(10),
        created_before: timestamp(20),
        finished_after: timestamp(30),
        finished_before: timestamp(40),
        key_prefix: "op-".into(),
        error_contains: "boom".into(),
        ids: vec![u64::MAX, 5],
        parent_id: u64::MAX - 2,
    };

    let counted = client.cancel_tasks(&filter, true).await.unwrap();
    assert_eq!(
        (counted.matched, counted.changed, counted.incomplete),
        (2, 0, false)
    );
    assert_eq!(counted.unavailable_shards, vec!["gpu".to_string()]);
    assert_eq!(
        counted
            .shards
            .iter()
            .map(|s| (s.shard.as_str(), s.matched, s.changed, s.incomplete))
            .collect::<Vec<_>>(),
        vec![("cpu", 2, 0, false)]
    );
    let opts = RetryTaskOptions {
        run_at: Some(at(50)),
        extra_attempts: 1,
    };
    let retried = client.retry_tasks(&filter, false, opts).await.unwrap();
    assert_eq!(
        (retried.matched, retried.changed, retried.incomplete),
        (2, 2, true)
    );
    let deleted = client.delete_tasks(&filter, false).await.unwrap();
    assert_eq!(
        (deleted.matched, deleted.changed, deleted.incomplete),
        (2, 2, true)
    );

    assert_eq!(
        fake.calls(),
        vec![
            Call::CancelTasks(proto::CancelTasksRequest {
                filter: Some(sent.clone()),
                dry_run: true,
            }),
            Call::RetryTasks(proto::RetryTasksRequest {
                filter: Some(sent.clone()),
                dry_run: false,
                run_at: timestamp(50),
                extra_attempts: 1,
            }),
            Call::DeleteTasks(proto::DeleteTasksRequest {
                filter: Some(sent),
                dry_run: false,
            }),
        ]
    );
}

#[tokio::test]
async fn pause_and_resume_a_pool_answer_its_pause() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let paused = client.pause_pool("llm").await.unwrap();
    assert_eq!((paused.pool.as_str(), paused.paused), ("llm", true));
    assert_eq!(paused.paused_by, "ops");
    assert_eq!(paused.paused_at, timestamp(1000));
    let resumed = client.resume_pool("llm").await.unwrap();
    assert_eq!((resumed.pool.as_str(), resumed.paused), ("llm", false));
    assert_eq!(resumed.paused_at, None);
    assert_eq!(
        fake.calls(),
        vec![
            Call::Pause(proto::PausePoolRequest { pool: "llm".into() }),
            Call::Resume(proto::ResumePoolRequest { pool: "llm".into() }),
        ]
    );
}

#[tokio::test]
async fn put_schedule_sends_the_spec_with_the_token_is_retried_on_unavailable_and_answers_it_stored()
 {
    let (endpoint, fake) = serve(2).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let mut spec = ScheduleSpec::new("llm", "nightly", "0 2 * * *")
        .json(&serde_json::json!({"report": "daily"}))
        .unwrap()
        .timezone("Europe/Paris")
        .priority(7)
        .max_attempts(3)
        .timeout(Duration::from_millis(1500))
        .group_key("tenant-a")
        .paused(true)
        .fire_all_missed(true);
    spec.resources.insert("gpu".into(), 2);
    let put = client.put_schedule(spec).await.unwrap();
    let sent = proto::Schedule {
        pool: "llm".into(),
        name: "nightly".into(),
        cron: "0 2 * * *".into(),
        timezone: "Europe/Paris".into(),
        payload: br#"{"report":"daily"}"#.to_vec(),
        content_type: "application/json".into(),
        priority: 7,
        max_attempts: 3,
        resources: [("gpu".to_string(), 2)].into(),
        paused: true,
        timeout_ms: 1500,
        fire_all_missed: true,
        group_key: "tenant-a".into(),
        ..Default::default()
    };
    assert_eq!(
        put,
        proto::Schedule {
            next_fire_at: timestamp(3000),
            ..sent.clone()
        },
        "the schedule as stored, with its next fire"
    );
    let call = Call::PutSchedule(proto::PutScheduleRequest {
        schedule: Some(sent),
    });
    assert_eq!(fake.calls(), vec![call.clone(), call.clone(), call]);
    let seen = fake.seen.lock().unwrap();
    assert_eq!(
        *seen,
        vec![("nightly".to_string(), "Bearer secret".to_string()); 3]
    );
}

#[tokio::test]
async fn put_schedule_sends_bytes_as_they_are_and_a_spec_s_trace_and_none_outside_a_trace() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let traced = ScheduleSpec::new("llm", "raw", "*/5 * * * * *")
        .bytes(vec![0, 159, 255], "application/octet-stream")
        .trace(traceparent, "vendor=abc");
    client.put_schedule(traced).await.unwrap();
    client
        .put_schedule(ScheduleSpec::new("llm", "plain", "0 * * * *"))
        .await
        .unwrap();
    let sent: Vec<_> = fake
        .calls()
        .into_iter()
        .map(|c| match c {
            Call::PutSchedule(r) => {
                let s = r.schedule.unwrap();
                (s.payload, s.content_type, s.trace, s.timeout_ms, s.paused)
            }
            other => panic!("{other:?}"),
        })
        .collect();
    let trace = proto::TraceContext {
        traceparent: traceparent.into(),
        tracestate: "vendor=abc".into(),
        link: false,
    };
    assert_eq!(
        sent,
        vec![
            (
                vec![0, 159, 255],
                "application/octet-stream".to_string(),
                Some(trace),
                0,
                false
            ),
            (vec![], String::new(), None, 0, false),
        ],
        "no payload, no current span: none sent"
    );
}

#[tokio::test]
async fn a_bad_cron_is_invalid_argument_and_deleting_a_missing_schedule_not_found_not_retried() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let err = client
        .put_schedule(ScheduleSpec::new("llm", "bad", ""))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(
        err.to_string(),
        "INVALID_ARGUMENT: schedule.cron: \"\" is not a cron expression"
    );
    client.delete_schedule("llm", "nightly").await.unwrap();
    let err = client.delete_schedule("llm", "missing").await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(err.message(), "no schedule \"missing\" in pool \"llm\"");
    let deleted = |name: &str| {
        Call::DeleteSchedule(proto::DeleteScheduleRequest {
            pool: "llm".into(),
            name: name.into(),
        })
    };
    let calls = fake.calls();
    assert_eq!(calls.len(), 3, "each once: {calls:?}");
    assert_eq!(calls[1..], [deleted("nightly"), deleted("missing")]);
}

#[tokio::test]
async fn list_schedules_sends_the_pool_or_none_and_answers_the_unavailable_shards() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let listed = client.list_schedules(Some("llm")).await.unwrap();
    let names: Vec<_> = listed
        .schedules
        .iter()
        .map(|s| (s.pool.as_str(), s.name.as_str(), s.next_fire_at))
        .collect();
    assert_eq!(names, vec![("llm", "nightly", timestamp(3000))]);
    assert_eq!(listed.unavailable_shards, vec!["gpu".to_string()]);
    let every = client.list_schedules(None).await.unwrap();
    assert_eq!(every.schedules[0].pool, "default");
    assert_eq!(
        fake.calls(),
        vec![
            Call::ListSchedules(proto::ListSchedulesRequest { pool: "llm".into() }),
            Call::ListSchedules(proto::ListSchedulesRequest::default()),
        ]
    );
}

#[tokio::test]
async fn list_workers_sends_the_pool_or_none_and_answers_the_unavailable_shards() {
    let shard = FakeShard::default();
    let recorded = shard.recorded.clone();
    let endpoint = worker_tests::serve(shard).await;
    let client = Client::new(worker_tests::options(&endpoint)).unwrap();
    let listed = client.list_workers(Some("llm")).await.unwrap();
    let workers: Vec<_> = listed
        .workers
        .iter()
        .map(|w| (w.id.as_str(), w.pools.clone(), w.running))
        .collect();
    assert_eq!(workers, vec![("w-1", vec!["llm".to_string()], 1)]);
    assert_eq!(listed.unavailable_shards, vec!["gpu".to_string()]);
    let every = client.list_workers(None).await.unwrap();
    assert_eq!(every.workers[0].pools, vec!["default".to_string()]);
    assert_eq!(
        recorded.lock().unwrap().listed,
        vec![
            proto::ListWorkersRequest { pool: "llm".into() },
            proto::ListWorkersRequest::default(),
        ]
    );
}

#[tokio::test]
async fn snapshot_and_server_info_answer_the_server_s() {
    let (endpoint, fake) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let snapshot = client.snapshot().await.unwrap();
    let shards: Vec<_> = snapshot
        .shards
        .iter()
        .map(|s| {
            (
                s.shard.as_str(),
                s.leader.as_str(),
                s.term,
                s.pools[0].pending,
            )
        })
        .collect();
    assert_eq!(shards, vec![("cpu", "cpu-1:7070", 3, 5)]);
    assert_eq!(snapshot.unavailable_shards, vec!["gpu".to_string()]);
    let info = client.server_info().await.unwrap();
    assert_eq!(
        (info.shard.as_str(), info.role(), info.role().as_str_name()),
        ("cpu", Role::Leader, "ROLE_LEADER")
    );
    assert_eq!((info.version.as_str(), info.term), ("0.2.0", 3));
    let caller = info.caller.unwrap();
    assert_eq!(
        (caller.name.as_str(), caller.all_pools, caller.permissions),
        ("ops", true, vec!["read".to_string(), "admin".to_string()])
    );
    assert_eq!(fake.calls(), vec![Call::Snapshot, Call::ServerInfo]);
}

/// A raw TCP server that answers a TLS ClientHello with a TLS alert (fatal
/// handshake_failure), as a TLS server does, and closes any other connection at its first
/// bytes (as a TLS server does with a plaintext client when `tls`, or as any server going
/// away does). Counts its connections.
async fn closing_server(tls: bool) -> (String, Arc<Mutex<usize>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(Mutex::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            *counted.lock().unwrap() += 1;
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                if socket.read(&mut first).await.unwrap_or(0) == 1 && tls && first[0] == 0x16 {
                    let _ = socket
                        .write_all(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x28])
                        .await;
                }
            });
        }
    });
    (format!("http://{addr}"), connections)
}

#[tokio::test]
async fn an_http_endpoint_whose_server_speaks_tls_is_a_tls_error_not_retried() {
    let (endpoint, connections) = closing_server(true).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(20))).unwrap();
    let err = client.get(5).await.unwrap_err();
    let secure = endpoint.replace("http://", "https://");
    assert!(matches!(err, crate::Error::Tls(_)), "{err:?}");
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(
        err.message(),
        format!("{endpoint}: the server speaks TLS on this port: use {secure}")
    );
    let n = *connections.lock().unwrap();
    assert!(n <= 3, "{n} connections: retried"); // the call's, and the probe's
}

#[tokio::test]
async fn an_http_endpoint_whose_server_closes_and_is_no_tls_server_is_no_tls_error() {
    let (endpoint, _) = closing_server(false).await;
    let client = Client::new(options(&endpoint, Duration::from_millis(200))).unwrap();
    let err = client.get(5).await.unwrap_err();
    assert!(!matches!(err, crate::Error::Tls(_)), "{err:?}");
}
