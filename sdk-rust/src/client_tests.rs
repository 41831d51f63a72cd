//! The client against an in-process fake TaskService (real gRPC over loopback TCP).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

use crate::proto;
use crate::proto::task_service_server::{TaskService, TaskServiceServer};
use crate::{Client, Code, Options, RetryConfig, TaskSpec};

/// Refuses the first `unavailable` submissions with UNAVAILABLE, then accepts; records the
/// request ids and authorization headers it saw.
struct FakeTasks {
    unavailable: Mutex<usize>,
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

#[tonic::async_trait]
impl TaskService for FakeTasks {
    async fn submit_task(
        &self,
        request: Request<proto::SubmitTaskRequest>,
    ) -> Result<Response<proto::SubmitTaskResponse>, Status> {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let req = request.into_inner();
        self.seen
            .lock()
            .unwrap()
            .push((req.request_id.clone(), auth));
        {
            let mut left = self.unavailable.lock().unwrap();
            if *left > 0 {
                *left -= 1;
                return Err(Status::unavailable("fake: not yet"));
            }
        }
        Ok(Response::new(proto::SubmitTaskResponse {
            task: Some(proto::Task {
                id: u64::MAX - 1,
                pool: req.pool,
                ..Default::default()
            }),
            deduplicated: false,
        }))
    }

    async fn submit_batch(
        &self,
        _: Request<proto::SubmitBatchRequest>,
    ) -> Result<Response<proto::SubmitBatchResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_task(
        &self,
        _: Request<proto::GetTaskRequest>,
    ) -> Result<Response<proto::GetTaskResponse>, Status> {
        Err(Status::not_found("fake: no such task"))
    }

    async fn wait_task(
        &self,
        _: Request<proto::WaitTaskRequest>,
    ) -> Result<Response<proto::WaitTaskResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn cancel_task(
        &self,
        _: Request<proto::CancelTaskRequest>,
    ) -> Result<Response<proto::CancelTaskResponse>, Status> {
        Err(Status::unimplemented("fake"))
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

async fn serve(unavailable: usize) -> (String, Arc<Mutex<Vec<(String, String)>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = FakeTasks {
        unavailable: Mutex::new(unavailable),
        seen: seen.clone(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TaskServiceServer::new(fake))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), seen)
}

fn options(endpoint: &str, max_elapsed: Duration) -> Options {
    Options::new(endpoint).token("secret").retry(RetryConfig {
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
        max_elapsed: Some(max_elapsed),
    })
}

#[tokio::test]
async fn submit_retries_unavailable_with_the_same_request_id_and_the_token() {
    let (endpoint, seen) = serve(2).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let submitted = client.submit(TaskSpec::new("default")).await.unwrap();
    assert_eq!(submitted.task.id, u64::MAX - 1, "all 64 bits survive");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter()
            .all(|(id, auth)| id == &seen[0].0 && auth == "Bearer secret")
    );
    assert_eq!(seen[0].0.len(), 32);
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
    let (endpoint, _) = serve(0).await;
    let client = Client::new(options(&endpoint, Duration::from_secs(5))).unwrap();
    let err = client.get(1).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(err.to_string(), "NOT_FOUND: fake: no such task");
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
