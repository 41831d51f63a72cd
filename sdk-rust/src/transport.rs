//! Endpoints, the connection rules (redirects, the leader, several endpoints), transport
//! retries and TLS, shared by the client and the worker.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::error::Error;

/// The channel's send and receive limit.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// A worker follows at most this many shard redirects in a row.
pub(crate) const MAX_REDIRECTS: usize = 3;
/// Where a client or worker without an endpoint connects.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:7070";

/// The transport retry: UNAVAILABLE (and CANCELLED the caller did not ask for) is retried
/// after `initial_backoff` doubled per failure in a row, capped at `max_backoff`, with equal
/// jitter (see [`RetryConfig::backoff`]). A worker's registration and Work stream back off the
/// same way, for as long as it runs.
#[derive(Debug, Clone, Copy)]
pub struct RetryConfig {
    /// 50 ms by default.
    pub initial_backoff: Duration,
    /// 2 s by default.
    pub max_backoff: Duration,
    /// Bounds a row of retries of one call: 30 s by default; None: no bound.
    pub max_elapsed: Option<Duration>,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            max_elapsed: Some(Duration::from_secs(30)),
        }
    }
}

impl RetryConfig {
    /// How long to wait after `failures` earlier failures in a row (0 for the first): the
    /// step, `initial_backoff` doubled per failure and capped at `max_backoff`, with equal
    /// jitter: half the step fixed, the other half uniformly random. Clients that failed
    /// together spread out, and none retries sooner than half the step.
    pub fn backoff(&self, failures: u32) -> Duration {
        let initial = self.initial_backoff.max(Duration::from_millis(1));
        let max = self.max_backoff.max(initial);
        let step = initial.saturating_mul(1u32 << failures.min(20)).min(max);
        step / 2 + (step / 2).mul_f64(rand::rng().random::<f64>())
    }
}

/// A stream that delivered a message, or stayed open this long, was healthy: its end starts a
/// new row of failures (the backoff from `initial_backoff` again; `max_elapsed` bounds a row).
pub(crate) const HEALTHY_STREAM: Duration = Duration::from_secs(5);

/// A row of failed attempts at one thing of a worker (a registration, a Work stream): the
/// delay before the next attempt ([`RetryConfig::backoff`]), and one log line when the row
/// starts and one when it ends, not one per attempt (naming the worker's id, "" before its
/// first registration).
pub(crate) struct FailureRow {
    retry: RetryConfig,
    what: &'static str,
    failures: u32,
}

impl FailureRow {
    pub(crate) fn new(retry: RetryConfig, what: &'static str) -> Self {
        FailureRow {
            retry,
            what,
            failures: 0,
        }
    }

    /// Counts a failure; returns how long to wait before the next attempt.
    pub(crate) fn failed(&mut self, err: &Error, endpoint: &Endpoint, worker_id: &str) -> Duration {
        let delay = self.retry.backoff(self.failures);
        if self.failures == 0 {
            tracing::warn!(worker_id, error = %err, %endpoint, max_backoff = ?self.retry.max_backoff,
                "cronoq: {} failed; retrying with backoff", self.what);
        } else {
            tracing::debug!(worker_id, error = %err, %endpoint, ?delay, "cronoq: {} failed again", self.what);
        }
        self.failures += 1;
        delay
    }

    /// The attempt worked (a stream: it was healthy): the next failure starts a new row.
    pub(crate) fn succeeded(&mut self, worker_id: &str) {
        if self.failures > 0 {
            tracing::info!(
                worker_id,
                failed_attempts = self.failures,
                "cronoq: {} works again",
                self.what
            );
        }
        self.failures = 0;
    }
}

/// A connection quiet this long is pinged (HTTP/2 keepalive), with or without a call open.
pub const DEFAULT_KEEPALIVE_TIME: Duration = Duration::from_secs(20);
/// A ping not answered within this drops its connection.
pub const DEFAULT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The channels' HTTP/2 keepalive. A server that vanished without closing the connection (a
/// crash, a partition) is noticed in `time` + `timeout`, not the kernel's TCP timeout; its
/// calls fail UNAVAILABLE, retried like any other (the next endpoint, the leader named). A
/// cronoq server sends GOAWAY (too_many_pings) to a client that pings more often than every
/// 10 s: keep `time` at 10 s or more against it.
#[derive(Debug, Clone, Copy)]
pub struct KeepaliveConfig {
    /// [`DEFAULT_KEEPALIVE_TIME`] (20 s) by default.
    pub time: Duration,
    /// [`DEFAULT_KEEPALIVE_TIMEOUT`] (10 s) by default.
    pub timeout: Duration,
}

impl Default for KeepaliveConfig {
    fn default() -> Self {
        KeepaliveConfig {
            time: DEFAULT_KEEPALIVE_TIME,
            timeout: DEFAULT_KEEPALIVE_TIMEOUT,
        }
    }
}

/// PEM files for https:// endpoints, kept for every endpoint, redirects included.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// The CA bundle the server's certificate must chain to; the system roots when None.
    pub ca_file: Option<String>,
    /// A client certificate and its unencrypted key, for servers that require one.
    pub cert_file: Option<String>,
    /// The client certificate's unencrypted key (PEM).
    pub key_file: Option<String>,
}

/// How a client or a worker connects. Build it with [`Options::new`] and its setters.
#[derive(Clone)]
pub struct Options {
    pub(crate) endpoint: String,
    pub(crate) token: Option<String>,
    pub(crate) tls: Option<TlsFiles>,
    pub(crate) insecure_redirect_http: bool,
    pub(crate) retry: RetryConfig,
    pub(crate) keepalive: KeepaliveConfig,
    pub(crate) timeout: Duration,
}

impl fmt::Debug for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Options")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .field("insecure_redirect_http", &self.insecure_redirect_http)
            .field("retry", &self.retry)
            .field("keepalive", &self.keepalive)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Default for Options {
    fn default() -> Self {
        Options::new(DEFAULT_ENDPOINT)
    }
}

impl Options {
    /// `endpoint`: "http://host:port" or "https://host:port", or several separated by
    /// commas (servers of one deployment, tried in turn); the grammar is
    /// [`Endpoint::parse`]'s, checked when the client or worker is built.
    pub fn new(endpoint: impl Into<String>) -> Options {
        Options {
            endpoint: endpoint.into(),
            token: None,
            tls: None,
            insecure_redirect_http: false,
            retry: RetryConfig::default(),
            keepalive: KeepaliveConfig::default(),
            timeout: Duration::from_secs(30),
        }
    }

    /// Sent as `authorization: Bearer <token>` with every call.
    pub fn token(mut self, token: impl Into<String>) -> Options {
        self.token = Some(token.into()).filter(|t: &String| !t.is_empty());
        self
    }

    /// The CA bundle that https:// servers' certificates must chain to.
    pub fn ca_file(mut self, path: impl Into<String>) -> Options {
        self.tls.get_or_insert_with(TlsFiles::default).ca_file = Some(path.into());
        self
    }

    /// A client certificate and its unencrypted key (PEM), for servers that require one.
    pub fn client_cert(
        mut self,
        cert_file: impl Into<String>,
        key_file: impl Into<String>,
    ) -> Options {
        let tls = self.tls.get_or_insert_with(TlsFiles::default);
        tls.cert_file = Some(cert_file.into());
        tls.key_file = Some(key_file.into());
        self
    }

    /// Follow a redirect to plain http:// on a host that is not loopback with the token
    /// (trusted networks only).
    pub fn insecure_redirect_http(mut self, allow: bool) -> Options {
        self.insecure_redirect_http = allow;
        self
    }

    /// The transport retries of UNAVAILABLE.
    pub fn retry(mut self, retry: RetryConfig) -> Options {
        self.retry = retry;
        self
    }

    /// The HTTP/2 keepalive that notices a server gone silent: 20 s, 10 s by default.
    pub fn keepalive(mut self, keepalive: KeepaliveConfig) -> Options {
        self.keepalive = keepalive;
        self
    }

    /// The timeout of each call (each attempt of it): 30 s by default.
    pub fn timeout(mut self, timeout: Duration) -> Options {
        if !timeout.is_zero() {
            self.timeout = timeout;
        }
        self
    }
}

/// One server: http://host:port or https://host:port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// `http` or `https`.
    pub scheme: String,
    /// A host name in lower case, a dotted-decimal IPv4 address, or an IPv6 address in lower
    /// case (without brackets).
    pub host: String,
    /// The TCP port.
    pub port: u16,
}

impl Endpoint {
    /// Reads one endpoint: `[scheme "://"] host [":" port] ["/"]`, the grammar every cronoq
    /// SDK shares. The scheme is http or https (any case; http when absent), the host a name,
    /// dotted-decimal IPv4 with four parts or `[IPv6]`, the port 1-65535 (80 or 443 when
    /// absent). Spaces and tabs around the text are ignored. Anything else (user info, a path,
    /// a query, percent-encoding, another IPv4 form...) is an [`Error::InvalidArgument`]
    /// naming the text: it is refused, never repaired into something else.
    pub fn parse(text: &str) -> Result<Endpoint, Error> {
        Endpoint::read(text).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "endpoint: {text:?} is not an endpoint (http://host:port or https://host:port)"
            ))
        })
    }

    /// Reads a redirect's or a standby's leader target with the same grammar as
    /// [`Endpoint::parse`]; one that does not match is a refused redirect, so a server can
    /// never send the SDK (and its token) to something a URL parser would guess at.
    pub(crate) fn parse_target(target: &str) -> Result<Endpoint, Error> {
        Endpoint::read(target).ok_or_else(|| {
            Error::RedirectRefused(format!(
                "redirect to {target:?} refused: not an endpoint (http://host:port or https://host:port)"
            ))
        })
    }

    /// One endpoint, or several separated by commas (spaces and tabs around each ignored).
    pub fn parse_list(text: &str) -> Result<Vec<Endpoint>, Error> {
        let out = text
            .split(',')
            .filter(|p| !p.trim_matches(BLANKS).is_empty())
            .map(Endpoint::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if out.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "endpoint: {text:?} names no endpoint"
            )));
        }
        Ok(out)
    }

    /// The grammar itself, shared by every caller; None when `text` is not an endpoint.
    fn read(text: &str) -> Option<Endpoint> {
        let text = text.trim_matches(BLANKS);
        let (scheme, rest) = match text.split_once("://") {
            Some((scheme, rest)) => (scheme.to_ascii_lowercase(), rest),
            None => ("http".to_string(), text),
        };
        let default_port = match scheme.as_str() {
            "http" => 80,
            "https" => 443,
            _ => return None,
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (host, after_host) = match rest.strip_prefix('[') {
            Some(bracketed) => {
                let (address, after) = bracketed.split_once(']')?;
                (read_ipv6(address)?, after)
            }
            None => {
                let end = rest.find(':').unwrap_or(rest.len());
                (read_name_or_ipv4(&rest[..end])?, &rest[end..])
            }
        };
        let port = match after_host {
            "" => default_port,
            _ => read_port(after_host.strip_prefix(':')?)?,
        };
        Some(Endpoint { scheme, host, port })
    }

    /// Whether the endpoint is https://.
    pub fn secure(&self) -> bool {
        self.scheme == "https"
    }

    /// Whether the host is loopback: exactly `localhost`, 127.0.0.0/8 or ::1. Not an
    /// IPv4-mapped address nor a name that merely resolves there: a token goes over plain
    /// http:// to these only.
    pub fn loopback(&self) -> bool {
        match self.host.parse::<IpAddr>() {
            Ok(IpAddr::V4(ip)) => ip.is_loopback(),
            Ok(IpAddr::V6(ip)) => ip == Ipv6Addr::LOCALHOST,
            Err(_) => self.host.eq_ignore_ascii_case("localhost"),
        }
    }

    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// What is ignored around an endpoint: spaces and tabs (anywhere else they are refused).
const BLANKS: [char; 2] = [' ', '\t'];

/// An IPv6 address in its RFC 4291 text form (no zone), in lower case.
fn read_ipv6(text: &str) -> Option<String> {
    text.parse::<Ipv6Addr>().ok()?;
    Some(text.to_ascii_lowercase())
}

/// A name (labels of letters, digits, `-` and `_`), in lower case, or an IPv4 address. A host
/// whose last label is a number must be four dotted decimals: the looser forms other parsers
/// read (`127.1`, `0177.0.0.1`, `2130706433`) could name a different host than it seems.
fn read_name_or_ipv4(text: &str) -> Option<String> {
    let labels: Vec<&str> = text.split('.').collect();
    let ends_in_number = labels.last().is_some_and(|last| is_number(last));
    if ends_in_number {
        let canonical = labels.len() == 4 && labels.iter().all(|part| is_ipv4_part(part));
        return canonical.then(|| text.to_string());
    }
    let is_label = |label: &&str| {
        (1..=63).contains(&label.len())
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    labels
        .iter()
        .all(is_label)
        .then(|| text.to_ascii_lowercase())
}

/// Whether an address parser reads label as a number: decimal digits, or `0x` and hex digits
/// (inet_aton reads `0x7f000001` as 127.0.0.1).
fn is_number(label: &str) -> bool {
    match label
        .strip_prefix("0x")
        .or_else(|| label.strip_prefix("0X"))
    {
        Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
        None => !label.is_empty() && label.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// 0-255 in decimal without a leading zero.
fn is_ipv4_part(text: &str) -> bool {
    is_decimal(text) && text.parse::<u8>().is_ok()
}

/// A port: 1-65535 in decimal without a leading zero.
fn read_port(text: &str) -> Option<u16> {
    if !is_decimal(text) {
        return None;
    }
    text.parse::<u16>().ok().filter(|port| *port > 0)
}

/// Digits only, and no leading zero ("0" itself is one).
fn is_decimal(text: &str) -> bool {
    !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'))
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.scheme, self.authority())
    }
}

/// The connection rules for following a redirect (or a standby's leader hint): never
/// https:// to http://, and a token goes over plain http:// only to a loopback host unless
/// `insecure_redirect_http`.
pub fn check_redirect(
    current: &Endpoint,
    target: &Endpoint,
    has_token: bool,
    insecure_redirect_http: bool,
) -> Result<(), Error> {
    if current.secure() && !target.secure() {
        return Err(Error::RedirectRefused(format!(
            "redirect from {current} to {target} refused: never follow https:// to http://"
        )));
    }
    if has_token && !target.secure() && !target.loopback() && !insecure_redirect_http {
        return Err(Error::RedirectRefused(format!(
            "redirect to {target} refused: the token would go over plain http:// to a non-loopback host \
             (set insecure_redirect_http on trusted networks only)"
        )));
    }
    Ok(())
}

/// The TLS material, read once from the files.
struct TlsMaterial {
    tonic: ClientTlsConfig,
    rustls: Arc<rustls::ClientConfig>,
    files: TlsFiles,
}

fn read_file(what: &str, path: &str) -> Result<Vec<u8>, Error> {
    std::fs::read(path)
        .map_err(|e| Error::InvalidArgument(format!("tls.{what}: cannot read {path:?}: {e}")))
}

impl TlsMaterial {
    fn load(files: Option<&TlsFiles>) -> Result<TlsMaterial, Error> {
        let files = files.cloned().unwrap_or_default();
        // The application's process-wide provider if it installed one, as tonic's channel does.
        let provider = rustls::crypto::CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()));
        let mut roots = rustls::RootCertStore::empty();
        let mut tonic = ClientTlsConfig::new();
        if let Some(ca) = &files.ca_file {
            let pem = read_file("ca_file", ca)?;
            let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
                .filter_map(Result::ok)
                .collect();
            if certs.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "tls.ca_file: {ca:?} holds no PEM certificate"
                )));
            }
            for cert in certs {
                let _ = roots.add(cert);
            }
            tonic = tonic.ca_certificate(Certificate::from_pem(pem));
        } else {
            tonic = tonic.with_native_roots();
            for cert in rustls_native_roots() {
                let _ = roots.add(cert);
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::InvalidArgument(format!("tls: {e}")))?
            .with_root_certificates(roots);
        let mut config = match (&files.cert_file, &files.key_file) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let cert_pem = read_file("cert_file", cert)?;
                let key_pem = read_file("key_file", key)?;
                let chain: Vec<_> = rustls_pemfile::certs(&mut cert_pem.as_slice())
                    .filter_map(Result::ok)
                    .collect();
                let private = rustls_pemfile::private_key(&mut key_pem.as_slice())
                    .ok()
                    .flatten()
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "tls.key_file: {key:?} holds no unencrypted PEM private key"
                        ))
                    })?;
                tonic = tonic.identity(Identity::from_pem(cert_pem, key_pem));
                builder.with_client_auth_cert(chain, private).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "tls.cert_file: {cert:?} with tls.key_file {key:?} is not a certificate and its key ({e})"
                    ))
                })?
            }
            _ => {
                return Err(Error::InvalidArgument(
                    "tls: give both cert_file and key_file (a client certificate and its key), or neither".into(),
                ));
            }
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(TlsMaterial {
            tonic,
            rustls: Arc::new(config),
            files,
        })
    }
}

/// The system's roots, for the probe (tonic reads them itself for calls).
fn rustls_native_roots() -> Vec<rustls::pki_types::CertificateDer<'static>> {
    let found = rustls_native_certs::load_native_certs();
    if !found.errors.is_empty() {
        tracing::debug!(errors = ?found.errors, "cronoq: some system CA certificates could not be read");
    }
    found.certs
}

struct State {
    current: Endpoint,
    next: usize,
    channels: HashMap<Endpoint, Channel>,
}

/// A channel to one server of the configured endpoints, moved on UNAVAILABLE to the leader
/// a standby names (within the redirect rules), else to the next configured endpoint.
pub(crate) struct Connection {
    configured: Vec<Endpoint>,
    token: Option<String>,
    tls: TlsMaterial,
    insecure: bool,
    pub(crate) retry: RetryConfig,
    keepalive: KeepaliveConfig,
    pub(crate) timeout: Duration,
    state: Mutex<State>,
}

impl Connection {
    pub(crate) fn new(opts: &Options) -> Result<Connection, Error> {
        let configured = Endpoint::parse_list(&opts.endpoint)?;
        let tls = TlsMaterial::load(opts.tls.as_ref())?;
        Ok(Connection {
            state: Mutex::new(State {
                current: configured[0].clone(),
                next: 0,
                channels: HashMap::new(),
            }),
            configured,
            token: opts.token.clone(),
            tls,
            insecure: opts.insecure_redirect_http,
            retry: opts.retry,
            keepalive: opts.keepalive,
            timeout: opts.timeout,
        })
    }

    /// The server calls go to now.
    pub(crate) fn endpoint(&self) -> Endpoint {
        self.state.lock().unwrap().current.clone()
    }

    pub(crate) fn is_configured(&self, ep: &Endpoint) -> bool {
        self.configured.contains(ep)
    }

    /// The channel to the current endpoint (opened lazily) and that endpoint.
    pub(crate) fn channel(&self) -> Result<(Channel, Endpoint), Error> {
        let mut st = self.state.lock().unwrap();
        let ep = st.current.clone();
        if let Some(ch) = st.channels.get(&ep) {
            return Ok((ch.clone(), ep));
        }
        let bad =
            |e: tonic::transport::Error| Error::InvalidArgument(format!("endpoint {ep}: {e}"));
        let mut builder = tonic::transport::Endpoint::from_shared(ep.to_string())
            .map_err(bad)?
            .connect_timeout(Duration::from_secs(5))
            .user_agent(concat!("cronoq-rust/", env!("CARGO_PKG_VERSION")))
            .map_err(bad)?
            .tcp_nodelay(true)
            .http2_keep_alive_interval(self.keepalive.time)
            .keep_alive_timeout(self.keepalive.timeout)
            // A client between calls notices too, not only a worker's stream.
            .keep_alive_while_idle(true);
        if ep.secure() {
            builder = builder
                .tls_config(self.tls.tonic.clone().domain_name(ep.host.clone()))
                .map_err(bad)?;
        }
        let ch = builder.connect_lazy();
        st.channels.insert(ep.clone(), ch.clone());
        Ok((ch, ep))
    }

    /// Moves to `target` (a redirect or the leader) if it is an endpoint and the connection
    /// rules allow it; otherwise it stays where it is, nothing dialed.
    pub(crate) fn follow(&self, target: &str) -> Result<(), Error> {
        self.move_to(Endpoint::parse_target(target)?)
    }

    fn move_to(&self, dest: Endpoint) -> Result<(), Error> {
        let mut st = self.state.lock().unwrap();
        check_redirect(&st.current, &dest, self.token.is_some(), self.insecure)?;
        st.current = dest;
        Ok(())
    }

    /// After an UNAVAILABLE: to the leader it names, else (with several endpoints, or away
    /// from a redirect target) to the next configured endpoint.
    pub(crate) fn on_unavailable(&self, err: &Error) {
        let leader = err.leader();
        if !leader.is_empty() {
            let followed = match Endpoint::parse_target(leader) {
                // A standby naming the server already called: pass it over like any other.
                Ok(dest) if dest == self.endpoint() => Ok(false),
                Ok(dest) => self.move_to(dest).map(|()| true),
                Err(e) => Err(e),
            };
            match followed {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => tracing::warn!(leader, error = %e, "cronoq: not following the leader"),
            }
        }
        let mut st = self.state.lock().unwrap();
        if self.configured.len() > 1 || st.current != self.configured[0] {
            st.next = (st.next + 1) % self.configured.len();
            st.current = self.configured[st.next].clone();
        }
    }

    /// A request with the token and, when given, a timeout the server sees.
    pub(crate) fn request<M>(&self, message: M, timeout: Option<Duration>) -> tonic::Request<M> {
        let mut req = tonic::Request::new(message);
        if let Some(token) = &self.token
            && let Ok(value) = format!("Bearer {token}").parse()
        {
            req.metadata_mut().insert("authorization", value);
        }
        if let Some(t) = timeout {
            req.set_timeout(t);
        }
        req
    }

    /// Runs `call` once on the current endpoint, bounded by `timeout`, and translates its
    /// error to the SDK's (a failed TLS handshake is [`Error::Tls`]).
    pub(crate) async fn once<T, F, Fut>(
        &self,
        timeout: Option<Duration>,
        call: F,
    ) -> Result<T, Error>
    where
        F: FnOnce(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let (ch, ep) = self.channel()?;
        let fut = call(ch);
        let result = match timeout {
            Some(d) => tokio::time::timeout(d + Duration::from_millis(500), fut)
                .await
                .unwrap_or_else(|_| {
                    Err(tonic::Status::deadline_exceeded(format!(
                        "no answer from {ep} in {d:?}"
                    )))
                }),
            None => fut.await,
        };
        match result {
            Ok(resp) => Ok(resp.into_inner()),
            Err(status) => Err(self.diagnose(&ep, status).await),
        }
    }

    /// Runs `call` with the transport retries: UNAVAILABLE and CANCELLED are retried with
    /// backoff, moving to the leader or the next endpoint, until the retry's max_elapsed.
    pub(crate) async fn invoke<T, F, Fut>(
        &self,
        what: &str,
        timeout: Duration,
        call: F,
    ) -> Result<T, Error>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let started = Instant::now();
        let mut failures = 0;
        loop {
            let err = match self.once(Some(timeout), &call).await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            if !err.is_retryable() {
                return Err(err);
            }
            if self
                .retry
                .max_elapsed
                .is_some_and(|m| started.elapsed() >= m)
            {
                return Err(err);
            }
            self.on_unavailable(&err);
            let delay = self.retry.backoff(failures);
            tracing::debug!(call = what, error = %err, endpoint = %self.endpoint(), ?delay, "cronoq: retrying");
            tokio::time::sleep(delay).await;
            failures += 1;
        }
    }

    /// The SDK's error for a failed call to `ep`: a failed TLS handshake is an
    /// [`Error::Tls`]. From an https:// endpoint, an UNAVAILABLE is probed with a handshake
    /// with the same settings, which says why. From an http:// endpoint whose server closed
    /// the connection, a probe tells a TLS server (the user forgot https://) apart from a
    /// server going away.
    pub(crate) async fn diagnose(&self, ep: &Endpoint, status: tonic::Status) -> Error {
        if !ep.secure() {
            if closed_by_server(&status) && probe_speaks_tls(ep, &self.tls.rustls).await {
                let secure = Endpoint {
                    scheme: "https".into(),
                    ..ep.clone()
                };
                return Error::Tls(format!(
                    "{ep}: the server speaks TLS on this port: use {secure}"
                ));
            }
            return Error::from(status);
        }
        let err = Error::from(status);
        if err.code() != Code::Unavailable || !matches!(err, Error::Rpc(_)) {
            return err;
        }
        if err
            .rpc()
            .is_some_and(|e| !e.metadata.is_empty() || !e.reason.is_empty())
        {
            return err; // the server answered: the handshake worked
        }
        match self.probe_tls(ep).await {
            Some(reason) => Error::Tls(format!("{ep}: TLS handshake failed: {reason}")),
            None => err,
        }
    }

    /// Why a TLS connection to `ep` fails, or None if it does not (or the server cannot be
    /// reached at all: that is no TLS problem).
    async fn probe_tls(&self, ep: &Endpoint) -> Option<String> {
        const STEP: Duration = Duration::from_secs(3);
        let tcp = tokio::time::timeout(
            STEP,
            tokio::net::TcpStream::connect((ep.host.as_str(), ep.port)),
        )
        .await
        .ok()?
        .ok()?;
        let name = rustls::pki_types::ServerName::try_from(ep.host.clone()).ok()?;
        let connector = tokio_rustls::TlsConnector::from(self.tls.rustls.clone());
        let mut tls = match tokio::time::timeout(STEP, connector.connect(name, tcp)).await {
            Err(_) => return None,
            Ok(Err(e)) => return Some(self.tls_reason(&e.to_string(), ep)),
            Ok(Ok(tls)) => tls,
        };
        // TLS 1.3: a server checks the client's certificate after the client's side of the
        // handshake; one that refuses it closes the connection instead of answering HTTP/2.
        const PREFACE: &[u8] =
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
        if tls.write_all(PREFACE).await.is_err() {
            return Some(self.client_cert_reason());
        }
        let mut byte = [0u8; 1];
        match tokio::time::timeout(STEP, tls.read(&mut byte)).await {
            Ok(Ok(n)) if n > 0 => None,
            Ok(Err(e)) if e.to_string().contains("AlertReceived") => {
                Some(self.tls_reason(&e.to_string(), ep))
            }
            Ok(_) => Some(self.client_cert_reason()),
            Err(_) => None,
        }
    }

    fn tls_reason(&self, msg: &str, ep: &Endpoint) -> String {
        let why = if msg.contains("UnknownIssuer") {
            "certificate verify failed: unknown CA (the server's certificate is not signed by a trusted CA)".to_string()
        } else if msg.contains("Expired") || msg.contains("NotValidYet") {
            "certificate verify failed: the server's certificate has expired or is not yet valid"
                .to_string()
        } else if msg.contains("NotValidForName") {
            format!(
                "hostname mismatch: the server's certificate is not valid for {:?}",
                ep.host
            )
        } else if msg.contains("CertificateRequired")
            || msg.contains("BadCertificate")
            || msg.contains("UnknownCA")
        {
            self.client_cert_reason()
        } else if msg.contains("CorruptMessage") || msg.contains("InvalidContentType") {
            "the server does not speak TLS on this port: is it an http:// endpoint?".to_string()
        } else {
            "the handshake was refused".to_string()
        };
        format!("{why} ({msg})")
    }

    fn client_cert_reason(&self) -> String {
        match &self.tls.files.cert_file {
            None => {
                "the server requires a client certificate (none given: set client_cert)".to_string()
            }
            Some(cert) => format!(
                "the server refused the client certificate {cert:?} (not signed by a CA in its server.tls.client_ca, or expired)"
            ),
        }
    }
}

/// Whether a call failed because the server closed its connection (the transport's errors
/// name a closed, reset or broken connection), which is also how a TLS server answers a
/// plaintext client.
fn closed_by_server(status: &tonic::Status) -> bool {
    if !matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled
    ) {
        return false;
    }
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::UnexpectedEof
            )
        {
            return true;
        }
        let text = e.to_string();
        if text.contains("connection closed") || text.contains("closed before") {
            return true;
        }
        source = e.source();
    }
    false
}

/// Whether a TLS handshake with `ep` completes, or fails in a way only a TLS server causes (it
/// sent a certificate this client rejects, or a TLS alert): a TLS server on a port the client
/// was told is plaintext (http://). Nothing is sent over the connection.
async fn probe_speaks_tls(ep: &Endpoint, config: &Arc<rustls::ClientConfig>) -> bool {
    const STEP: Duration = Duration::from_secs(3);
    let Ok(Ok(tcp)) = tokio::time::timeout(
        STEP,
        tokio::net::TcpStream::connect((ep.host.as_str(), ep.port)),
    )
    .await
    else {
        return false;
    };
    let Ok(name) = rustls::pki_types::ServerName::try_from(ep.host.clone()) else {
        return false;
    };
    let connector = tokio_rustls::TlsConnector::from(config.clone());
    match tokio::time::timeout(STEP, connector.connect(name, tcp)).await {
        Err(_) => false,
        Ok(Ok(_)) => true,
        Ok(Err(e)) => e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .is_some_and(|e| {
                matches!(
                    e,
                    rustls::Error::InvalidCertificate(_)
                        | rustls::Error::AlertReceived(_)
                        | rustls::Error::PeerIncompatible(_)
                )
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(s: &str) -> Endpoint {
        Endpoint::parse(s).unwrap()
    }

    /// Every form the grammar accepts, and how it is reported.
    #[test]
    fn accepts_every_form_of_the_grammar() {
        let longest_label = format!("http://{}.example:1", "a".repeat(63));
        let cases = [
            // scheme: http or https in any case, http when absent; port: 80 or 443 by default
            ("127.0.0.1:7070", "http://127.0.0.1:7070"),
            ("http://example.com", "http://example.com:80"),
            ("https://example.com", "https://example.com:443"),
            ("HTTP://example.com:1", "http://example.com:1"),
            ("HttpS://example.com:1", "https://example.com:1"),
            // one trailing slash; spaces and tabs around the text
            ("http://example.com:1/", "http://example.com:1"),
            ("example.com/", "http://example.com:80"),
            (" \thttp://example.com:1\t ", "http://example.com:1"),
            // names: any case, read in lower case; letters, digits, "-" and "_"
            ("http://Example.COM:1", "http://example.com:1"),
            ("http://my_host-1.internal:1", "http://my_host-1.internal:1"),
            ("http://a1.b2.3c:1", "http://a1.b2.3c:1"),
            (longest_label.as_str(), longest_label.as_str()),
            ("http://localhost:1", "http://localhost:1"),
            ("http://LOCALHOST:1", "http://localhost:1"),
            ("http://LocalHost:1", "http://localhost:1"),
            ("http://localhost.example:1", "http://localhost.example:1"),
            ("http://127.0.0.1.nip.io:1", "http://127.0.0.1.nip.io:1"),
            // IPv4: four dotted decimals 0-255
            ("http://0.0.0.0:1", "http://0.0.0.0:1"),
            ("http://10.0.0.1:1", "http://10.0.0.1:1"),
            ("http://127.0.0.2:1", "http://127.0.0.2:1"),
            ("http://127.255.255.255:1", "http://127.255.255.255:1"),
            ("http://128.0.0.1:1", "http://128.0.0.1:1"),
            ("http://255.255.255.255:1", "http://255.255.255.255:1"),
            // IPv6 in brackets, reported in lower case
            ("http://[::1]:80", "http://[::1]:80"),
            ("[::1]", "http://[::1]:80"),
            ("https://[2001:DB8::1]/", "https://[2001:db8::1]:443"),
            ("http://[::ffff:127.0.0.1]:1", "http://[::ffff:127.0.0.1]:1"),
            ("http://[::]:1", "http://[::]:1"),
            // ports: 1-65535
            ("http://example.com:1", "http://example.com:1"),
            ("http://example.com:65535", "http://example.com:65535"),
        ];
        for (text, reported) in cases {
            let parsed = Endpoint::parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!(parsed.to_string(), reported, "{text:?}");
        }
    }

    /// Every form the grammar refuses: each is INVALID_ARGUMENT naming the text when
    /// configured, and a refused redirect saying "not an endpoint" as a redirect target.
    #[test]
    fn refuses_what_is_not_an_endpoint() {
        let long_label = "a".repeat(64);
        let cases = [
            // nothing, or no host
            "",
            " \t ",
            "http://",
            "http:///",
            "http://:1",
            "//example.com:1",
            // schemes
            "ftp://example.com:1",
            "://example.com:1",
            "http:/example.com:1",
            "http//example.com:1",
            // user info, paths, queries, fragments, percent-encoding, backslashes
            "http://user@example.com:1",
            "http://127.0.0.1@127.0.0.1:1",
            "http://example.com:1/api",
            "http://example.com:1//",
            "http://example.com/api",
            "http://example.com:1?x=y",
            "http://example.com:1/?x=y",
            "http://example.com:1#top",
            "http://127.0.0.%31:1",
            "http://exa%6dple.com:1",
            "http://example.com\\x:1",
            // spaces and other blanks inside, or other than spaces and tabs around
            "http://exa mple.com:1",
            "http://example.com :1",
            "http://example.com: 1",
            "http:// example.com:1",
            "http://example.com:1\n",
            // names: empty labels, a trailing dot, too long, other characters
            "http://localhost.:1",
            "http://.example.com:1",
            "http://example..com:1",
            &format!("http://{long_label}.example:1"),
            "http://exämple.com:1",
            "http://example*.com:1",
            // a host that ends in a number is four dotted decimals, nothing looser
            "http://2130706433:1",
            "http://0177.0.0.1:1",
            "http://0x7f.0.0.1:1",
            "http://0x7f000001:1",
            "http://a.0X1F:1",
            "http://127.1:1",
            "http://127.0.1:1",
            "http://1.2.3.4.5:1",
            "http://256.0.0.1:1",
            "http://127.0.0.01:1",
            "http://00.0.0.0:1",
            "http://-1.0.0.0:1",
            "http://+1.0.0.0:1",
            "http://example.123:1",
            "http://1.2.3.4.:1",
            // IPv6: brackets, the RFC 4291 form, no zone
            "http://::1:1",
            "http://[::1:1",
            "http://::1]:1",
            "http://[]:1",
            "http://[127.0.0.1]:1",
            "http://[example.com]:1",
            "http://[::1%eth0]:1",
            "http://[fe80::1%25eth0]:1",
            "http://[::1]x:1",
            "http://[::1]:",
            "http://[1:2:3:4:5:6:7:8:9]:1",
            // ports: 1-65535 in decimal without a leading zero, not empty
            "http://example.com:",
            "http://example.com:0",
            "http://example.com:07070",
            "http://example.com:65536",
            "http://example.com:100000",
            "http://example.com:+1",
            "http://example.com:-1",
            "http://example.com:0x50",
            "http://example.com:1:2",
        ];
        for text in cases {
            match Endpoint::parse(text) {
                Err(Error::InvalidArgument(m)) => {
                    assert!(m.contains(&format!("{text:?}")), "{text:?}: {m}");
                }
                other => panic!("{text:?} configured: {other:?}"),
            }
            match Endpoint::parse_target(text) {
                Err(e @ Error::RedirectRefused(_)) => {
                    assert_eq!(e.code(), Code::FailedPrecondition);
                    assert!(e.message().contains("not an endpoint"), "{text:?}: {e}");
                    assert!(e.message().contains(&format!("{text:?}")), "{text:?}: {e}");
                }
                other => panic!("{text:?} as a target: {other:?}"),
            }
        }
    }

    #[test]
    fn parsed_loopback_hosts() {
        for text in [
            "http://localhost:1",
            "HTTP://LocalHost:1/",
            " localhost\t",
            "http://127.0.0.1:1",
            "http://127.0.0.2:1",
            "http://127.255.255.255:1",
            "http://[::1]:1",
            "https://[0:0:0:0:0:0:0:1]:1",
        ] {
            assert!(ep(text).loopback(), "{text:?}");
        }
        for text in [
            "http://localhost.example:1",
            "http://localhost-1:1",
            "http://127.0.0.1.nip.io:1",
            "http://[::ffff:127.0.0.1]:1",
            "http://[::127.0.0.1]:1",
            "http://[::]:1",
            "http://0.0.0.0:1",
            "http://126.255.255.255:1",
            "http://128.0.0.1:1",
            "http://10.0.0.1:1",
        ] {
            assert!(!ep(text).loopback(), "{text:?}");
        }
    }

    #[test]
    fn loopback_is_localhost_127_8_and_ipv6_1_only() {
        let endpoint = |host: &str| Endpoint {
            scheme: "http".into(),
            host: host.into(),
            port: 1,
        };
        for host in ["localhost", "LOCALHOST", "127.0.0.1", "127.1.2.3", "::1"] {
            assert!(endpoint(host).loopback(), "{host}");
        }
        for host in [
            "localhost.",
            "localhost.localdomain",
            "127.0.0.1.nip.io",
            "::ffff:127.0.0.1",
            "::127.0.0.1",
            "0.0.0.0",
            "::",
            "128.0.0.1",
            "example.com",
        ] {
            assert!(!endpoint(host).loopback(), "{host}");
        }
    }

    #[test]
    fn parses_lists_of_endpoints() {
        let list = Endpoint::parse_list(" a:1 ,\tHTTPS://B:2/\t,, c").unwrap();
        let reported: Vec<String> = list.iter().map(ToString::to_string).collect();
        assert_eq!(reported, ["http://a:1", "https://b:2", "http://c:80"]);
        assert!(matches!(
            Endpoint::parse_list("a:1, 127.1:2"),
            Err(Error::InvalidArgument(m)) if m.contains("127.1:2")
        ));
        assert!(Endpoint::parse_list(" , \t").is_err());
    }

    fn connection(endpoint: &str) -> Connection {
        Connection::new(&Options::new(endpoint).token("secret")).unwrap()
    }

    #[test]
    fn a_malformed_redirect_target_is_refused_and_not_followed() {
        let conn = connection("http://127.0.0.1:1");
        let err = conn.follow("http://0177.0.0.1:2").unwrap_err();
        assert!(matches!(err, Error::RedirectRefused(_)), "{err:?}");
        assert!(err.message().contains("0177.0.0.1") && err.message().contains("not an endpoint"));
        assert_eq!(conn.endpoint().to_string(), "http://127.0.0.1:1");
        conn.follow("http://LocalHost:2").unwrap();
        assert_eq!(conn.endpoint().to_string(), "http://localhost:2");
    }

    #[test]
    fn a_malformed_leader_is_not_followed() {
        let unavailable = |leader: &str| {
            let mut trailers = tonic::metadata::MetadataMap::new();
            trailers.insert("cronoq-leader", leader.parse().unwrap());
            Error::from(tonic::Status::with_metadata(
                Code::Unavailable,
                "standby",
                trailers,
            ))
        };
        let conn = connection("http://127.0.0.1:1,http://127.0.0.1:2");
        conn.on_unavailable(&unavailable("http://127.0.0.1:3/api"));
        assert_eq!(conn.endpoint().to_string(), "http://127.0.0.1:2");
        conn.on_unavailable(&unavailable("http://LOCALHOST:3"));
        assert_eq!(conn.endpoint().to_string(), "http://localhost:3");
    }

    #[test]
    fn redirect_rules() {
        let tls = ep("https://a:1");
        let plain_remote = ep("http://10.1.1.1:1");
        assert!(matches!(
            check_redirect(&tls, &plain_remote, false, true),
            Err(Error::RedirectRefused(_))
        ));
        assert!(
            check_redirect(
                &ep("http://127.0.0.1:1"),
                &ep("http://127.0.0.1:2"),
                true,
                false
            )
            .is_ok()
        );
        assert!(check_redirect(&ep("http://127.0.0.1:1"), &plain_remote, true, false).is_err());
        assert!(check_redirect(&ep("http://127.0.0.1:1"), &plain_remote, true, true).is_ok());
        assert!(check_redirect(&ep("http://127.0.0.1:1"), &plain_remote, false, false).is_ok());
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_equal_jitter() {
        let r = RetryConfig {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            max_elapsed: None,
        };
        for (failures, step_ms) in [
            (0, 100),
            (1, 200),
            (3, 800),
            (4, 1600),
            (5, 2000),
            (40, 2000),
        ] {
            let step = Duration::from_millis(step_ms);
            let delays: Vec<Duration> = (0..200).map(|_| r.backoff(failures)).collect();
            let (lo, hi) = (*delays.iter().min().unwrap(), *delays.iter().max().unwrap());
            assert!(
                lo >= step / 2 && hi <= step,
                "backoff({failures}) in [{lo:?}, {hi:?}]"
            );
            assert!(
                hi - lo > step / 4,
                "backoff({failures}) in [{lo:?}, {hi:?}]: not jittered"
            );
        }
    }
}
