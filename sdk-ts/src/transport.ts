// The connection: channels to the configured endpoints, moved on UNAVAILABLE (to the leader
// a standby names, within the redirect rules, else to the next configured endpoint), the
// token on every call, transport retries with exponential backoff and jitter, and the
// diagnosis of failed TLS handshakes.
import { readFileSync } from "node:fs";
import { isIP } from "node:net";
import * as tls from "node:tls";
import {
  ChannelCredentials,
  credentials,
  Metadata,
  status as Status,
  type CallOptions,
  type ChannelOptions,
  type ClientUnaryCall,
  type ServiceError,
} from "@grpc/grpc-js";
import { AdminServiceClient } from "./gen/cronoq/v1/admin_service.js";
import { ScheduleServiceClient } from "./gen/cronoq/v1/schedule_service.js";
import { TaskServiceClient } from "./gen/cronoq/v1/task_service.js";
import { WorkerServiceClient } from "./gen/cronoq/v1/worker_service.js";
import { checkRedirect, Endpoint, parseTarget } from "./endpoint.js";
import { VERSION } from "./version.js";
import { CronoqError, fromGrpcError, InvalidArgumentError, isRetryable, TlsError, UnavailableError } from "./errors.js";

/** The channel's send and receive limit. */
export const MAX_MESSAGE_BYTES = 64 << 20;

/**
 * Transport retries: UNAVAILABLE (and CANCELLED the caller did not ask for) is retried after
 * initialBackoffMs doubled per failure in a row, capped at maxBackoffMs, with equal jitter
 * (see backoffMs). A worker's registration and Work stream back off the same way, for as long
 * as it runs.
 */
export interface RetryConfig {
  /** 50 ms when absent. */
  initialBackoffMs?: number;
  /** 2000 ms when absent. */
  maxBackoffMs?: number;
  /** Bounds a row of retries of one call: 30 s when absent; negative: no bound. A worker's own calls are retried until it stops. */
  maxElapsedMs?: number;
}

/**
 * The channels' HTTP/2 keepalive: a connection quiet for timeMs is pinged, with or without a
 * call open, and dropped when the ping is not answered within timeoutMs. A server that vanished
 * without closing the connection (a crash, a partition) is then noticed in timeMs + timeoutMs,
 * not the kernel's TCP timeout, and its calls fail UNAVAILABLE, retried like any other (the next
 * endpoint, the leader named). A cronoq server sends GOAWAY (too_many_pings) to a client that
 * pings more often than every 10 s: keep timeMs at 10 s or more against it.
 */
export interface KeepaliveConfig {
  /** DEFAULT_KEEPALIVE.timeMs (20 s) when absent. */
  timeMs?: number;
  /** DEFAULT_KEEPALIVE.timeoutMs (10 s) when absent. */
  timeoutMs?: number;
}

export const DEFAULT_KEEPALIVE = { timeMs: 20_000, timeoutMs: 10_000 } as const;

/** PEM files for https:// endpoints, kept for every endpoint, redirects included. */
export interface TlsOptions {
  /** The CA bundle the server's certificate must chain to; Node's roots when absent. */
  caFile?: string;
  /** A client certificate and its unencrypted key, for servers that require one. Give both or neither. */
  certFile?: string;
  keyFile?: string;
}

/** Where log lines go; the default writes warnings and errors to the console. */
export interface Logger {
  debug(message: string, fields?: Record<string, unknown>): void;
  info(message: string, fields?: Record<string, unknown>): void;
  warn(message: string, fields?: Record<string, unknown>): void;
  error(message: string, fields?: Record<string, unknown>): void;
}

export const consoleLogger: Logger = {
  debug() {},
  info() {},
  warn: (message, fields) => console.warn(message, fields ?? ""),
  error: (message, fields) => console.error(message, fields ?? ""),
};

/** What a client and a worker are configured with. */
export interface ConnectionOptions {
  /** "http://host:port" or "https://host:port" (read by readEndpoint: the scheme defaults to http://, the port to 80 or 443); several (comma-separated, or a list) are tried in turn. */
  endpoint: string | string[];
  /** A bearer token sent with every call. */
  token?: string;
  tls?: TlsOptions;
  /** Follow redirects to plain http:// on non-loopback hosts with the token (trusted networks only). */
  insecureRedirectHttp?: boolean;
  retry?: RetryConfig;
  keepalive?: KeepaliveConfig;
  /** Per call; 30 s when absent, none when 0. */
  timeoutMs?: number;
  logger?: Logger;
}

export interface Retry {
  initialBackoffMs: number;
  maxBackoffMs: number;
  maxElapsedMs: number;
}

export function retryWithDefaults(r: RetryConfig = {}): Retry {
  const initialBackoffMs = r.initialBackoffMs && r.initialBackoffMs > 0 ? r.initialBackoffMs : 50;
  let maxBackoffMs = r.maxBackoffMs && r.maxBackoffMs > 0 ? r.maxBackoffMs : 2000;
  maxBackoffMs = Math.max(maxBackoffMs, initialBackoffMs);
  const maxElapsedMs = r.maxElapsedMs === undefined || r.maxElapsedMs === 0 ? 30_000 : r.maxElapsedMs;
  return { initialBackoffMs, maxBackoffMs, maxElapsedMs };
}

/**
 * How long to wait after `failures` earlier failures in a row (0 for the first): the step,
 * initialBackoffMs doubled per failure and capped at maxBackoffMs, with equal jitter: half the
 * step fixed, the other half uniformly random. Clients that failed together spread out, and
 * none retries sooner than half the step.
 */
export function backoffMs(r: Retry, failures: number): number {
  const step = Math.min(r.initialBackoffMs * 2 ** Math.min(failures, 30), r.maxBackoffMs);
  return step / 2 + Math.random() * (step / 2);
}

/**
 * A stream that delivered a message, or stayed open this long, was healthy: its end starts a
 * new row of failures (the backoff from initialBackoffMs again; maxElapsedMs bounds a row).
 */
export const HEALTHY_STREAM_MS = 5000;

/**
 * A row of failed attempts at one thing (a registration, a Work stream): the delay before the
 * next attempt (backoffMs), and one log line when the row starts and one when it ends, not one
 * per attempt.
 */
export class FailureRow {
  failures = 0;

  constructor(private readonly retry: Retry, private readonly log: Logger, private readonly what: string) {}

  /** Counts a failure; returns how long to wait before the next attempt (ms). */
  failed(err: unknown, endpoint: Endpoint): number {
    const delay = backoffMs(this.retry, this.failures);
    const fields = { error: String(err), endpoint: endpoint.toString() };
    if (this.failures === 0) this.log.warn(`cronoq: ${this.what} failed; retrying with backoff`, { ...fields, max_backoff_ms: this.retry.maxBackoffMs });
    else this.log.debug(`cronoq: ${this.what} failed again`, { ...fields, after_ms: delay });
    this.failures++;
    return delay;
  }

  /** The attempt worked (a stream: it was healthy): the next failure starts a new row. */
  succeeded(): void {
    if (this.failures > 0) this.log.info(`cronoq: ${this.what} works again`, { failed_attempts: this.failures });
    this.failures = 0;
  }
}

/** Waits ms; resolves false at once when signal aborts first. */
export function sleep(ms: number, signal?: AbortSignal): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve(false);
    const onAbort = () => {
      clearTimeout(timer);
      resolve(false);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve(true);
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

type Callback<Res> = (err: ServiceError | null, res?: Res) => void;
/** One unary call on a generated client, with its metadata, options and callback. */
export type UnaryCall<C, Res> = (client: C, md: Metadata, opts: Partial<CallOptions>, cb: Callback<Res>) => ClientUnaryCall;

interface Clients {
  task: TaskServiceClient;
  worker: WorkerServiceClient;
  admin: AdminServiceClient;
  schedule: ScheduleServiceClient;
}

interface TlsMaterial {
  ca?: Buffer;
  cert?: Buffer;
  key?: Buffer;
}

function loadTls(opts: TlsOptions | undefined): TlsMaterial {
  if (!opts) return {};
  if (!opts.certFile !== !opts.keyFile) {
    throw new InvalidArgumentError(Status.INVALID_ARGUMENT,
      "tls: give both certFile and keyFile (a client certificate and its key), or neither");
  }
  const read = (what: string, file: string): Buffer => {
    try {
      return readFileSync(file);
    } catch (err) {
      throw new InvalidArgumentError(Status.INVALID_ARGUMENT, `tls.${what}: cannot read "${file}": ${(err as Error).message}`);
    }
  };
  return {
    ca: opts.caFile ? read("caFile", opts.caFile) : undefined,
    cert: opts.certFile ? read("certFile", opts.certFile) : undefined,
    key: opts.keyFile ? read("keyFile", opts.keyFile) : undefined,
  };
}

export class Connection {
  readonly configured: Endpoint[];
  readonly retry: Retry;
  readonly keepalive: Required<KeepaliveConfig>;
  readonly timeoutMs: number;
  readonly log: Logger;
  readonly token: string;
  private readonly insecureRedirectHttp: boolean;
  private readonly tlsFiles: TlsOptions | undefined;
  private readonly tlsMaterial: TlsMaterial;
  private current: Endpoint;
  private next = 0;
  private readonly channels = new Map<string, Clients>();

  constructor(opts: ConnectionOptions) {
    this.configured = Endpoint.parseList(opts.endpoint);
    this.tlsFiles = opts.tls;
    this.tlsMaterial = loadTls(opts.tls);
    this.token = opts.token ?? "";
    this.insecureRedirectHttp = opts.insecureRedirectHttp ?? false;
    this.retry = retryWithDefaults(opts.retry);
    this.keepalive = {
      timeMs: opts.keepalive?.timeMs ?? DEFAULT_KEEPALIVE.timeMs,
      timeoutMs: opts.keepalive?.timeoutMs ?? DEFAULT_KEEPALIVE.timeoutMs,
    };
    this.timeoutMs = opts.timeoutMs ?? 30_000;
    this.log = opts.logger ?? consoleLogger;
    this.current = this.configured[0]!;
  }

  /** The server calls go to now. */
  get endpoint(): Endpoint {
    return this.current;
  }

  isConfigured(ep: Endpoint): boolean {
    return this.configured.some((c) => c.equals(ep));
  }

  /** The generated clients of the current endpoint (opened on first use). */
  clients(): { clients: Clients; endpoint: Endpoint } {
    const ep = this.current;
    const key = ep.toString();
    let clients = this.channels.get(key);
    if (!clients) {
      const creds: ChannelCredentials = ep.secure
        ? credentials.createSsl(this.tlsMaterial.ca ?? null, this.tlsMaterial.key ?? null, this.tlsMaterial.cert ?? null)
        : credentials.createInsecure();
      const options: ChannelOptions = {
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        "grpc.primary_user_agent": `cronoq-ts/${VERSION}`, // first; grpc-js's own name follows
        "grpc.enable_retries": 0,
        // Reconnect as fast as the SDK's own retries, not gRPC's default (1 s, growing to 2 min).
        "grpc.initial_reconnect_backoff_ms": this.retry.initialBackoffMs,
        "grpc.max_reconnect_backoff_ms": this.retry.maxBackoffMs,
        "grpc.keepalive_time_ms": this.keepalive.timeMs,
        "grpc.keepalive_timeout_ms": this.keepalive.timeoutMs,
        // A client between calls notices too, not only a worker's stream.
        "grpc.keepalive_permit_without_calls": 1,
      };
      const task = new TaskServiceClient(ep.target, creds, options);
      // The other services share the task service's channel.
      const shared = { ...options, channelOverride: task.getChannel() };
      const worker = new WorkerServiceClient(ep.target, creds, shared);
      const admin = new AdminServiceClient(ep.target, creds, shared);
      const schedule = new ScheduleServiceClient(ep.target, creds, shared);
      clients = { task, worker, admin, schedule };
      this.channels.set(key, clients);
    }
    return { clients, endpoint: ep };
  }

  /**
   * Moves to target (a redirect's or the leader's) if it is an endpoint and the connection rules
   * allow it; code is the gRPC code of the answer that named it. Throws RedirectRefusedError.
   */
  follow(target: string, code: number): void {
    const dest = parseTarget(target, code);
    checkRedirect(this.current, dest, this.token !== "", this.insecureRedirectHttp);
    this.current = dest;
  }

  /** After an UNAVAILABLE: to the leader it names, else (with several endpoints, or away from a redirect target) the next configured endpoint. */
  onUnavailable(err: unknown): void {
    if (err instanceof CronoqError && err.leader) {
      try {
        if (!parseTarget(err.leader, err.code).equals(this.current)) {
          this.follow(err.leader, err.code);
          return;
        }
      } catch (ferr) {
        this.log.warn("cronoq: not following the leader", { leader: err.leader, error: String(ferr) });
      }
    }
    if (this.configured.length > 1 || !this.current.equals(this.configured[0]!)) {
      this.next = (this.next + 1) % this.configured.length;
      this.current = this.configured[this.next]!;
    }
  }

  /** The call metadata: the token. */
  metadata(): Metadata {
    const md = new Metadata();
    if (this.token) md.set("authorization", `Bearer ${this.token}`);
    return md;
  }

  /** One call on the current endpoint, with the token and a timeout (0: none); errors become the SDK's. */
  async once<Res>(call: UnaryCall<Clients, Res>, timeoutMs: number, signal?: AbortSignal): Promise<Res> {
    const { clients, endpoint } = this.clients();
    const opts: Partial<CallOptions> = timeoutMs > 0 ? { deadline: Date.now() + timeoutMs } : {};
    try {
      return await new Promise<Res>((resolve, reject) => {
        const pending = call(clients, this.metadata(), opts, (err, res) => {
          signal?.removeEventListener("abort", onAbort);
          if (err) reject(err);
          else resolve(res as Res);
        });
        const onAbort = () => pending.cancel();
        signal?.addEventListener("abort", onAbort, { once: true });
      });
    } catch (err) {
      throw await this.diagnose(endpoint, fromGrpcError(err));
    }
  }

  /** A call with the transport retries: UNAVAILABLE and CANCELLED are retried with backoff, moving to the leader or the next endpoint, until retry.maxElapsedMs. */
  async invoke<Res>(what: string, call: UnaryCall<Clients, Res>, timeoutMs: number, signal?: AbortSignal): Promise<Res> {
    const started = Date.now();
    for (let failures = 0; ; failures++) {
      try {
        return await this.once(call, timeoutMs, signal);
      } catch (err) {
        if (!isRetryable(err) || signal?.aborted) throw err;
        if (this.retry.maxElapsedMs > 0 && Date.now() - started >= this.retry.maxElapsedMs) throw err;
        this.onUnavailable(err);
        const delay = backoffMs(this.retry, failures);
        this.log.debug("cronoq: retrying", { call: what, error: String(err), endpoint: this.current.toString(), after_ms: delay });
        if (!(await sleep(delay, signal))) throw err;
      }
    }
  }

  /**
   * Turns an UNAVAILABLE that is a failed TLS handshake with ep into a TlsError. From an
   * https:// endpoint, a probe handshake with the same settings says why. From an http://
   * endpoint whose server closed the connection, a probe tells a TLS server (the user forgot
   * https://) apart from a server going away.
   */
  async diagnose(ep: Endpoint, err: Error): Promise<Error> {
    if (!(err instanceof UnavailableError) || err.shardEndpoint || err.leader || err.reason) return err;
    if (!ep.secure) {
      if (!CLOSED.test(err.message) || !(await probeSpeaksTls(ep))) return err;
      const secure = new Endpoint("https", ep.host, ep.port);
      return new TlsError(Status.UNAVAILABLE, `${ep}: the server speaks TLS on this port: use ${secure}`, { metadata: err.metadata });
    }
    const reason = await probeTls(ep, this.tlsMaterial, this.tlsFiles);
    if (!reason) return err;
    return new TlsError(Status.UNAVAILABLE, `${ep}: TLS handshake failed: ${reason}`, { metadata: err.metadata });
  }

  close(): void {
    for (const clients of this.channels.values()) {
      clients.worker.close();
      clients.admin.close();
      clients.schedule.close();
      clients.task.close();
    }
    this.channels.clear();
  }
}

const PROBE_TIMEOUT_MS = 3000;
// The HTTP/2 client connection preface and an empty SETTINGS frame.
const H2_PREFACE = Buffer.concat([
  Buffer.from("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
  Buffer.from([0, 0, 0, 4, 0, 0, 0, 0, 0]),
]);
// What grpc-js says of a connection the server closed, which is also how a TLS server answers
// a plaintext client.
const CLOSED = /Failed to connect|Socket closed|ECONNRESET/;
// Errors of the network, not of TLS: the server is down or unreachable.
const NETWORK_ERRORS = new Set(["ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "EHOSTUNREACH", "ENETUNREACH", "ENOTFOUND", "EAI_AGAIN", "EPIPE"]);

function clientCertReason(files: TlsOptions | undefined): string {
  if (!files?.certFile) return "the server requires a client certificate (none given: set tls.certFile and tls.keyFile)";
  return `the server refused the client certificate "${files.certFile}" (not signed by a CA in its server.tls.client_ca, or expired)`;
}

/** Why a handshake error happened, in words. */
function tlsReason(err: NodeJS.ErrnoException, ep: Endpoint, files: TlsOptions | undefined): string {
  const code = err.code ?? "";
  const detail = `${code ? code + ": " : ""}${err.message}`;
  switch (code) {
    case "SELF_SIGNED_CERT_IN_CHAIN":
    case "DEPTH_ZERO_SELF_SIGNED_CERT":
    case "UNABLE_TO_VERIFY_LEAF_SIGNATURE":
    case "UNABLE_TO_GET_ISSUER_CERT_LOCALLY":
    case "UNABLE_TO_GET_ISSUER_CERT":
      return `certificate verify failed: unknown CA (the server's certificate is not signed by a trusted CA) (${detail})`;
    case "CERT_HAS_EXPIRED":
    case "CERT_NOT_YET_VALID":
      return `certificate verify failed: the server's certificate has expired or is not yet valid (${detail})`;
    case "ERR_TLS_CERT_ALTNAME_INVALID":
      return `hostname mismatch: the server's certificate is not valid for "${ep.host}" (${detail})`;
  }
  if (/certificate required|unknown ca|bad certificate|alert number 4[0-9]|sslv3 alert/i.test(err.message)) {
    return `${clientCertReason(files)} (${detail})`;
  }
  if (/wrong version number|packet length too long/i.test(err.message)) {
    return `the server does not speak TLS on this port: is it an http:// endpoint? (${detail})`;
  }
  return detail;
}

/**
 * A TLS connection to ep for a probe, settled once: by `wire`'s handlers calling done, or with
 * `onTimeout` after timeoutMs; the socket is destroyed either way.
 */
function tlsProbe<T>(
  ep: Endpoint,
  options: tls.ConnectionOptions,
  timeoutMs: number,
  onTimeout: T,
  wire: (socket: tls.TLSSocket, done: (value: T) => void) => void,
): Promise<T> {
  return new Promise((resolve) => {
    let settled = false;
    const done = (value: T) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      socket.destroy();
      resolve(value);
    };
    const timer = setTimeout(() => done(onTimeout), timeoutMs);
    const socket = tls.connect({
      host: ep.host,
      port: ep.port,
      servername: isIP(ep.host) ? undefined : ep.host,
      ALPNProtocols: ["h2"],
      ...options,
    });
    wire(socket, done);
  });
}

/** Why a TLS connection to ep fails, or "" when it does not, or when the server cannot be reached at all. */
export function probeTls(ep: Endpoint, material: TlsMaterial, files: TlsOptions | undefined): Promise<string> {
  const options = { ca: material.ca, cert: material.cert, key: material.key };
  return tlsProbe(ep, options, PROBE_TIMEOUT_MS, "", (socket, done) => {
    let secured = false;
    socket.once("secureConnect", () => {
      secured = true;
      // TLS 1.3: a server that refuses the client's certificate closes the connection after
      // the handshake; one that accepts it answers the HTTP/2 preface.
      socket.write(H2_PREFACE);
    });
    socket.once("data", () => done(""));
    socket.once("error", (err: NodeJS.ErrnoException) => {
      if (!secured && NETWORK_ERRORS.has(err.code ?? "")) return done("");
      done(secured ? clientCertReason(files) + ` (${err.message})` : tlsReason(err, ep, files));
    });
    socket.once("close", () => done(secured ? clientCertReason(files) : ""));
  });
}

/**
 * Whether a TLS handshake (unverified) with ep completes, or is refused with a TLS alert: a
 * TLS server on a port the client was told is plaintext (http://).
 */
export function probeSpeaksTls(ep: Endpoint, timeoutMs = PROBE_TIMEOUT_MS): Promise<boolean> {
  // A probe: nothing is sent, so the server's certificate need not be trusted.
  return tlsProbe(ep, { rejectUnauthorized: false }, timeoutMs, false, (socket, done) => {
    socket.once("secureConnect", () => done(true));
    socket.once("error", (err: NodeJS.ErrnoException) => done(/alert/i.test(`${err.code ?? ""} ${err.message}`)));
    socket.once("close", () => done(false));
  });
}
