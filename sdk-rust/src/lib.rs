//! The Rust SDK of cronoq, a durable sharded task queue: a [`Client`] that submits, reads,
//! waits for, cancels, retries and deletes tasks (one by one or by filter), pauses pools,
//! puts cron schedules and reads the cluster's workers, snapshot and server info, and a
//! [`Worker`] that runs tasks over the bidirectional `WorkerService.Work` stream; with feature
//! `outbox` (tokio-postgres) or `outbox-sqlx`, `outbox` enqueues a task in the application's
//! own PostgreSQL transaction.

#![warn(missing_docs)]

mod checks;
#[cfg(test)]
mod checks_tests;
mod client;
#[cfg(test)]
mod client_tests;
mod error;
mod otel;
#[cfg(all(test, feature = "otel"))]
mod otel_tests;
#[cfg(any(feature = "outbox", feature = "outbox-sqlx"))]
pub mod outbox;
#[cfg(all(test, any(feature = "outbox", feature = "outbox-sqlx")))]
mod outbox_tests;
mod transport;
mod worker;
#[cfg(test)]
mod worker_tests;

pub use client::{
    Attempt, AttemptOutcome, BulkResult, BulkShardResult, Cancelled, Client, DependencyResult,
    GetTaskOptions, JSON_CONTENT_TYPE, KeyMode, ListOptions, PoolPause, Retried, RetryTaskOptions,
    Role, RunWhen, Schedule, ScheduleSpec, Submitted, Task, TaskAttempts, TaskDetails, TaskFilter,
    TaskRef, TaskSpec, TaskState, Waited, WatchOptions, decode_payload, decode_result, is_terminal,
    new_request_id,
};
pub use error::{Error, RpcError, code_name};
pub use otel::TRACER_NAME;
pub use tokio_util::sync::CancellationToken;
pub use tonic::Code;
pub use transport::{
    DEFAULT_ENDPOINT, DEFAULT_KEEPALIVE_TIME, DEFAULT_KEEPALIVE_TIMEOUT, Endpoint, KeepaliveConfig,
    MAX_MESSAGE_BYTES, Options, RetryConfig, TlsFiles, check_redirect,
};

/// The generated cronoq.v1 messages and clients.
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    // The protos' comments are not rustdoc: "[[outboxes]]" names a TOML table, not an item.
    #![allow(rustdoc::broken_intra_doc_links)]
    tonic::include_proto!("cronoq.v1");
}
pub use worker::{TaskContext, TaskError, TaskResult, Worker, WorkerOptions};
