//! One error type for the SDK: a refused or failed call with its gRPC code and the
//! server's structured details, or one of the SDK's own errors (redirects, TLS, options).

use std::collections::HashMap;
use std::time::Duration;

use prost::Message;
use tonic::Code;

/// Every error the SDK returns.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The server (or the transport) refused or failed a call.
    #[error("{}: {}", code_name(.0.code), .0.message)]
    Rpc(Box<RpcError>),
    /// A worker was sent to another shard more than 3 times in a row (code
    /// FAILED_PRECONDITION); the message names the chain of shards.
    #[error("{0}")]
    TooManyRedirects(String),
    /// A redirect the connection rules forbid: https:// to http://, the token over plain
    /// http:// to a host that is not loopback, or a target that is not an endpoint (code
    /// FAILED_PRECONDITION). Nothing was dialed.
    #[error("{0}")]
    RedirectRefused(String),
    /// A TLS handshake failed (code UNAVAILABLE, never retried): the message says why and
    /// names the certificate.
    #[error("{0}")]
    Tls(String),
    /// An option or argument is wrong (code INVALID_ARGUMENT); the message names it.
    #[error("INVALID_ARGUMENT: {0}")]
    InvalidArgument(String),
}

/// A refused or failed call: its code, the server's message and what the server said about
/// where to go (from the `cronoq-*` trailers or the structured error).
#[derive(Debug, Clone)]
pub struct RpcError {
    /// The gRPC status code.
    pub code: Code,
    /// The server's message.
    pub message: String,
    /// Why, as an UPPER_SNAKE_CASE constant (NOT_LEADER, WRONG_SHARD, ...), from the
    /// server's google.rpc.ErrorInfo.
    pub reason: String,
    /// The shard that serves the request, when the server sent the caller elsewhere.
    pub shard: String,
    /// That shard's endpoint.
    pub shard_endpoint: String,
    /// The leader a standby names.
    pub leader: String,
    /// What the server suggests waiting before a retry (google.rpc.RetryInfo).
    pub retry_delay: Option<Duration>,
    /// The call's text trailers (cronoq-shard, cronoq-leader, ...).
    pub metadata: HashMap<String, String>,
}

impl RpcError {
    fn new(code: Code, message: String) -> RpcError {
        RpcError {
            code,
            message,
            reason: String::new(),
            shard: String::new(),
            shard_endpoint: String::new(),
            leader: String::new(),
            retry_delay: None,
            metadata: HashMap::new(),
        }
    }
}

impl Error {
    /// The gRPC code of the error.
    pub fn code(&self) -> Code {
        match self {
            Error::Rpc(e) => e.code,
            Error::TooManyRedirects(_) | Error::RedirectRefused(_) => Code::FailedPrecondition,
            Error::Tls(_) => Code::Unavailable,
            Error::InvalidArgument(_) => Code::InvalidArgument,
        }
    }

    /// The server's message, or the SDK's for its own errors.
    pub fn message(&self) -> &str {
        match self {
            Error::Rpc(e) => &e.message,
            Error::TooManyRedirects(m)
            | Error::RedirectRefused(m)
            | Error::Tls(m)
            | Error::InvalidArgument(m) => m,
        }
    }

    /// The details of a refused call, None for the SDK's own errors.
    pub fn rpc(&self) -> Option<&RpcError> {
        match self {
            Error::Rpc(e) => Some(e),
            _ => None,
        }
    }

    /// The structured error's reason ("" when absent).
    pub fn reason(&self) -> &str {
        self.rpc().map_or("", |e| &e.reason)
    }

    /// The shard named by the server ("" when absent).
    pub fn shard(&self) -> &str {
        self.rpc().map_or("", |e| &e.shard)
    }

    /// The shard endpoint named by the server ("" when absent).
    pub fn shard_endpoint(&self) -> &str {
        self.rpc().map_or("", |e| &e.shard_endpoint)
    }

    /// The leader named by a standby ("" when absent).
    pub fn leader(&self) -> &str {
        self.rpc().map_or("", |e| &e.leader)
    }

    /// Whether a transport retry may get past it: UNAVAILABLE, or CANCELLED the caller did not
    /// ask for (a server that closed while the call waited). A TLS error is never retried.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Rpc(e) if matches!(e.code, Code::Unavailable | Code::Cancelled))
    }

    pub(crate) fn rpc_code(code: Code, message: impl Into<String>) -> Error {
        Error::Rpc(Box::new(RpcError::new(code, message.into())))
    }

    /// The SDK's error for a gRPC status: trailers and the structured error
    /// (grpc-status-details-bin) give reason, shard, shard endpoint and leader.
    pub fn from_status(status: &tonic::Status) -> Error {
        let mut e = RpcError::new(status.code(), status.message().to_string());
        if e.message.is_empty() {
            e.message = code_name(e.code).to_string();
        }
        for kv in status.metadata().iter() {
            if let tonic::metadata::KeyAndValueRef::Ascii(key, value) = kv
                && let Ok(v) = value.to_str()
            {
                e.metadata.insert(key.as_str().to_string(), v.to_string());
            }
        }
        let mut info = HashMap::new();
        if let Ok(details) = RpcStatus::decode(status.details()) {
            for any in details.details {
                match any.type_url.rsplit('/').next() {
                    Some("google.rpc.ErrorInfo") => {
                        if let Ok(d) = ErrorInfo::decode(any.value.as_slice()) {
                            e.reason = d.reason;
                            info = d.metadata;
                        }
                    }
                    Some("google.rpc.RetryInfo") => {
                        if let Ok(d) = RetryInfo::decode(any.value.as_slice())
                            && let Some(delay) = d.retry_delay
                        {
                            e.retry_delay = Some(Duration::new(
                                delay.seconds.max(0) as u64,
                                delay.nanos.max(0) as u32,
                            ));
                        }
                    }
                    _ => {}
                }
            }
        }
        // The cronoq-* trailers win; the structured error's metadata fills what they lack.
        let pick = |trailer: &str, key: &str| {
            e.metadata
                .get(trailer)
                .filter(|v| !v.is_empty())
                .or_else(|| info.get(key))
                .cloned()
                .unwrap_or_default()
        };
        let shard = pick("cronoq-shard", "shard");
        let shard_endpoint = pick("cronoq-shard-endpoint", "shard_endpoint");
        let leader = pick("cronoq-leader", "leader");
        e.shard = shard;
        e.shard_endpoint = shard_endpoint;
        e.leader = leader;
        Error::Rpc(Box::new(e))
    }
}

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Error {
        Error::from_status(&status)
    }
}

/// A code's canonical gRPC name, as the server and the other SDKs spell it.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// google.rpc.Status, as grpc-status-details-bin carries it.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

/// google.rpc.ErrorInfo.
#[derive(Clone, PartialEq, prost::Message)]
struct ErrorInfo {
    #[prost(string, tag = "1")]
    reason: String,
    #[prost(string, tag = "2")]
    domain: String,
    #[prost(map = "string, string", tag = "3")]
    metadata: HashMap<String, String>,
}

/// google.rpc.RetryInfo.
#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<prost_types::Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structured_error_gives_reason_and_shard() {
        let info = ErrorInfo {
            reason: "WRONG_SHARD".into(),
            domain: "cronoq".into(),
            metadata: HashMap::from([
                ("shard".to_string(), "gpu".to_string()),
                (
                    "shard_endpoint".to_string(),
                    "http://10.0.0.2:7070".to_string(),
                ),
            ]),
        };
        let details = RpcStatus {
            code: Code::FailedPrecondition as i32,
            message: "wrong shard".into(),
            details: vec![prost_types::Any {
                type_url: "type.googleapis.com/google.rpc.ErrorInfo".into(),
                value: info.encode_to_vec(),
            }],
        };
        let status = tonic::Status::with_details(
            Code::FailedPrecondition,
            "wrong shard",
            details.encode_to_vec().into(),
        );
        let err = Error::from(status);
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert_eq!(err.reason(), "WRONG_SHARD");
        assert_eq!(err.shard(), "gpu");
        assert_eq!(err.shard_endpoint(), "http://10.0.0.2:7070");
        assert_eq!(err.to_string(), "FAILED_PRECONDITION: wrong shard");
    }

    #[test]
    fn only_unavailable_and_cancelled_are_retryable() {
        assert!(Error::rpc_code(Code::Unavailable, "x").is_retryable());
        assert!(Error::rpc_code(Code::Cancelled, "x").is_retryable());
        assert!(!Error::rpc_code(Code::NotFound, "x").is_retryable());
        assert!(!Error::Tls("x".into()).is_retryable());
    }
}
