//! The Rust SDK of cronoq, a durable sharded task queue: a [`Client`] that submits, reads,
//! waits for and cancels tasks, and a [`Worker`] that runs them over the bidirectional
//! `WorkerService.Work` stream.

mod error;
mod transport;

pub use error::{Error, RpcError, code_name};
pub use tonic::Code;
pub use transport::{DEFAULT_ENDPOINT, Endpoint, MAX_MESSAGE_BYTES, Options, RetryConfig, TlsFiles, check_redirect};

/// The generated cronoq.v1 messages and clients.
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("cronoq.v1");
}
