// One error tree: CronoqError, a subclass per gRPC code, and the SDK's own kinds
// (TooManyRedirectsError, RedirectRefusedError, TlsError). fromGrpcError builds them from a
// failed call: the cronoq-* trailers first, the structured error (grpc-status-details-bin:
// google.rpc.Status with ErrorInfo and RetryInfo) for what they lack.
import { Metadata, status as Status } from "@grpc/grpc-js";
import { BinaryReader } from "@bufbuild/protobuf/wire";

/** The canonical name of a gRPC code (CANCELLED, FAILED_PRECONDITION, ...). */
export function codeName(code: number): string {
  const name = (Status as unknown as Record<number, string | undefined>)[code];
  return name ?? `CODE(${code})`;
}

export interface ErrorFields {
  reason?: string;
  shard?: string;
  shardEndpoint?: string;
  leader?: string;
  retryDelayMs?: number;
  metadata?: Record<string, string>;
}

/** Every error the SDK raises for a refused or failed call. */
export class CronoqError extends Error {
  /** The gRPC status code (a number of grpc-js's `status`). */
  readonly code: number;
  /** Why, as an UPPER_SNAKE_CASE constant (NOT_LEADER, WRONG_SHARD, ...), from google.rpc.ErrorInfo. */
  readonly reason: string;
  /** The shard that serves the request, when the server sent the caller elsewhere. */
  readonly shard: string;
  /** That shard's endpoint (scheme://host:port). */
  readonly shardEndpoint: string;
  /** The leader a standby names. */
  readonly leader: string;
  /** What the server suggests waiting before a retry (google.rpc.RetryInfo); 0 when it does not. */
  readonly retryDelayMs: number;
  /** The call's text trailers. */
  readonly metadata: Record<string, string>;

  constructor(code: number, message: string, fields: ErrorFields = {}) {
    super(message);
    this.name = new.target.name;
    this.code = code;
    this.reason = fields.reason ?? "";
    this.shard = fields.shard ?? "";
    this.shardEndpoint = fields.shardEndpoint ?? "";
    this.leader = fields.leader ?? "";
    this.retryDelayMs = fields.retryDelayMs ?? 0;
    this.metadata = fields.metadata ?? {};
  }

  /** The code's canonical name. */
  get codeName(): string {
    return codeName(this.code);
  }

  override toString(): string {
    return `${this.name}: ${this.codeName}: ${this.message}`;
  }
}

export class CancelledError extends CronoqError {}
export class UnknownError extends CronoqError {}
export class InvalidArgumentError extends CronoqError {}
export class DeadlineExceededError extends CronoqError {}
export class NotFoundError extends CronoqError {}
export class AlreadyExistsError extends CronoqError {}
export class PermissionDeniedError extends CronoqError {}
export class ResourceExhaustedError extends CronoqError {}
export class FailedPreconditionError extends CronoqError {}
export class AbortedError extends CronoqError {}
export class OutOfRangeError extends CronoqError {}
export class UnimplementedError extends CronoqError {}
export class InternalError extends CronoqError {}
export class UnavailableError extends CronoqError {}
export class DataLossError extends CronoqError {}
export class UnauthenticatedError extends CronoqError {}

/** A worker was sent to another shard more than 3 times in a row; the message names the chain. */
export class TooManyRedirectsError extends FailedPreconditionError {}
/**
 * A redirect (or leader hint) the connection rules forbid: https:// to http://, a token over
 * plain http:// to a non-loopback host, or a target that is not an endpoint (then with the code
 * of the answer that named it).
 */
export class RedirectRefusedError extends FailedPreconditionError {}
/** A TLS handshake failed (code UNAVAILABLE, never retried: no retry can fix it). */
export class TlsError extends CronoqError {}

type ErrorClass = new (code: number, message: string, fields?: ErrorFields) => CronoqError;

const CLASSES: Record<number, ErrorClass> = {
  [Status.CANCELLED]: CancelledError,
  [Status.UNKNOWN]: UnknownError,
  [Status.INVALID_ARGUMENT]: InvalidArgumentError,
  [Status.DEADLINE_EXCEEDED]: DeadlineExceededError,
  [Status.NOT_FOUND]: NotFoundError,
  [Status.ALREADY_EXISTS]: AlreadyExistsError,
  [Status.PERMISSION_DENIED]: PermissionDeniedError,
  [Status.RESOURCE_EXHAUSTED]: ResourceExhaustedError,
  [Status.FAILED_PRECONDITION]: FailedPreconditionError,
  [Status.ABORTED]: AbortedError,
  [Status.OUT_OF_RANGE]: OutOfRangeError,
  [Status.UNIMPLEMENTED]: UnimplementedError,
  [Status.INTERNAL]: InternalError,
  [Status.UNAVAILABLE]: UnavailableError,
  [Status.DATA_LOSS]: DataLossError,
  [Status.UNAUTHENTICATED]: UnauthenticatedError,
};

/** The error of a code, as its class. */
export function errorForCode(code: number, message: string, fields: ErrorFields = {}): CronoqError {
  const cls = CLASSES[code] ?? CronoqError;
  return new cls(code, message, fields);
}

/** What google.rpc.Status says: its message, and its details (ErrorInfo, RetryInfo). */
export interface StatusDetails {
  /** The server's message, byte for byte (grpc-message may not survive: see fromGrpcError). */
  message: string;
  reason: string;
  metadata: Record<string, string>;
  retryDelayMs: number;
}

const ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo";
const RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo";

/** Decodes a serialized google.rpc.Status (grpc-status-details-bin): its message, ErrorInfo and RetryInfo. */
export function decodeStatusDetails(bytes: Uint8Array): StatusDetails {
  const out: StatusDetails = { message: "", reason: "", metadata: {}, retryDelayMs: 0 };
  const status = new BinaryReader(bytes);
  while (status.pos < status.len) {
    const [field, wire] = status.tag();
    if (field === 2) {
      out.message = status.string();
      continue;
    }
    if (field !== 3) {
      status.skip(wire);
      continue;
    }
    // google.protobuf.Any: type_url = 1, value = 2
    const any = new BinaryReader(status.bytes());
    let typeUrl = "";
    let value: Uint8Array = new Uint8Array();
    while (any.pos < any.len) {
      const [f, w] = any.tag();
      if (f === 1) typeUrl = any.string();
      else if (f === 2) value = any.bytes();
      else any.skip(w);
    }
    if (typeUrl === ERROR_INFO) decodeErrorInfo(value, out);
    else if (typeUrl === RETRY_INFO) out.retryDelayMs = decodeRetryDelayMs(value);
  }
  return out;
}

function decodeErrorInfo(bytes: Uint8Array, out: StatusDetails): void {
  const r = new BinaryReader(bytes);
  while (r.pos < r.len) {
    const [f, w] = r.tag();
    if (f === 1) out.reason = r.string();
    else if (f === 3) {
      const entry = new BinaryReader(r.bytes());
      let key = "";
      let value = "";
      while (entry.pos < entry.len) {
        const [ef, ew] = entry.tag();
        if (ef === 1) key = entry.string();
        else if (ef === 2) value = entry.string();
        else entry.skip(ew);
      }
      out.metadata[key] = value;
    } else r.skip(w);
  }
}

function decodeRetryDelayMs(bytes: Uint8Array): number {
  const r = new BinaryReader(bytes);
  let ms = 0;
  while (r.pos < r.len) {
    const [f, w] = r.tag();
    if (f !== 1) {
      r.skip(w);
      continue;
    }
    const duration = new BinaryReader(r.bytes()); // seconds = 1, nanos = 2
    while (duration.pos < duration.len) {
      const [df, dw] = duration.tag();
      if (df === 1) ms += Number(duration.int64()) * 1000;
      else if (df === 2) ms += Math.round(duration.int32() / 1e6);
      else duration.skip(dw);
    }
  }
  return ms;
}

/** The shape of grpc-js's errors of failed calls. */
export interface GrpcServiceError {
  code: number;
  details?: string;
  metadata?: Metadata;
}

function isGrpcError(err: unknown): err is GrpcServiceError {
  return typeof err === "object" && err !== null && typeof (err as { code?: unknown }).code === "number";
}

/** The SDK error for a failed gRPC call; CronoqErrors pass through unchanged. */
export function fromGrpcError(err: unknown): Error {
  if (err instanceof CronoqError) return err;
  if (!isGrpcError(err)) return err instanceof Error ? err : new Error(String(err));
  const metadata: Record<string, string> = {};
  let details: StatusDetails = { message: "", reason: "", metadata: {}, retryDelayMs: 0 };
  if (err.metadata) {
    for (const [key, values] of Object.entries(err.metadata.getMap())) {
      if (key === "grpc-status-details-bin") {
        try {
          details = decodeStatusDetails(values as Buffer);
        } catch {
          // a malformed structured error: the trailers alone
        }
      } else if (!key.endsWith("-bin") && typeof values === "string") {
        metadata[key] = values;
      }
    }
  }
  const pick = (trailer: string, info: string): string => metadata[trailer] || details.metadata[info] || "";
  // grpc-message verbatim (grpc-js's details), else the structured error's message: Node's
  // HTTP/2 drops a grpc-message that begins or ends in a space (RFC 9113 forbids it), which
  // leaves grpc-js's details empty and its own message only "9 FAILED_PRECONDITION: ".
  const message = err.details || details.message || codeName(err.code);
  return errorForCode(err.code, message, {
    reason: details.reason,
    shard: pick("cronoq-shard", "shard"),
    shardEndpoint: pick("cronoq-shard-endpoint", "shard_endpoint"),
    leader: pick("cronoq-leader", "leader"),
    retryDelayMs: details.retryDelayMs,
    metadata,
  });
}

/** Failures a transport retry may get past: UNAVAILABLE (not a TLS failure) and CANCELLED the caller did not ask for. */
export function isRetryable(err: unknown): boolean {
  return err instanceof UnavailableError || err instanceof CancelledError;
}
