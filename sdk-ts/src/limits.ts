// What the server refuses in a submission, checked before a request leaves the application: a
// task enqueued in the application's own transaction (the outbox) is refused there, in that
// transaction, not later by the relay. The bounds and messages are the server's.
import { status as Status } from "@grpc/grpc-js";
import { InvalidArgumentError } from "./errors.js";
import { KeyMode, keyModeToJSON, RunWhen } from "./gen/cronoq/v1/task.js";
import type { SubmitTaskRequest } from "./gen/cronoq/v1/task_service.js";
import type { Timestamp } from "./gen/google/protobuf/timestamp.js";

/**
 * A control character (C0, DEL, C1), a line separator or a bidi control: the server refuses them
 * in a caller's text (they forge log lines, or show a text in another order than it is stored).
 */
export const CONTROL_CHARACTER = /[\u0000-\u001f\u007f-\u009f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]/;

/** A refused character as an escape ("\n", "\u202e"): shown raw, most of them are invisible. */
export function shown(c: string): string {
  return c < " " ? JSON.stringify(c) : `"\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}"`;
}

/** The server's limits.max_payload_bytes when its config does not set one: 1 MiB. */
export const DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20;
const MAX_POOL_LENGTH = 256;
const MAX_KEY_LENGTH = 256;
const MAX_CONTENT_TYPE = 256;
const MAX_GROUP_KEY_BYTES = 256;
const MAX_TRACESTATE_BYTES = 512;
/** Keys of schedules' tasks start with this; a submission may not use it. */
const SCHEDULE_KEY_PREFIX = "schedule:";
/** 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z in seconds since the epoch: the Timestamp's range. */
const MIN_TIMESTAMP_SECONDS = -62135596800n;
const MAX_TIMESTAMP_SECONDS = 253402300799n;
const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$/;
const RUN_WHEN_VALUES = new Set<number>([RunWhen.RUN_WHEN_UNSPECIFIED, RunWhen.RUN_WHEN_DEPENDENCIES_SUCCEEDED, RunWhen.RUN_WHEN_DEPENDENCIES_ENDED]);
const KEY_MODE_VALUES = new Set<number>([KeyMode.KEY_MODE_UNSPECIFIED, KeyMode.KEY_MODE_RETURN_EXISTING, KeyMode.KEY_MODE_REPLACE_PENDING, KeyMode.KEY_MODE_DEBOUNCE]);
const MAX_DEBOUNCE_MS = 7 * 86_400_000;
const TASK_RANGES = {
  priority: { low: -(2 ** 31), high: 2 ** 31 - 1, meaning: "any int32; higher runs first" },
  maxAttempts: { low: 0, high: 1000, meaning: "0 takes the pool's default" },
  timeoutMs: { low: 0, high: 7 * 86_400_000, meaning: "at most 7 days; 0 takes the pool's timeout" },
  debounceMs: { low: 0, high: MAX_DEBOUNCE_MS, meaning: "at most 7 days" },
  maxDebounceMs: { low: 0, high: MAX_DEBOUNCE_MS, meaning: "at most 7 days; 0: no bound" },
  keyTtlMs: { low: 0, high: 366 * 86_400_000, meaning: "at most 366 days; 0: the key is held until the task is deleted" },
} as const;
const FIELD_NAMES = {
  priority: "priority", maxAttempts: "max_attempts", timeoutMs: "timeout_ms",
  debounceMs: "debounce_ms", maxDebounceMs: "max_debounce_ms", keyTtlMs: "key_ttl_ms",
} as const;

function invalid(message: string): InvalidArgumentError {
  return new InvalidArgumentError(Status.INVALID_ARGUMENT, message);
}

/** A value in a message: at most 64 characters of it, quoted. */
function quoted(value: string): string {
  const chars = [...value];
  return JSON.stringify(chars.slice(0, 64).join("")) + (chars.length > 64 ? "…" : "");
}

/** A caller-chosen name or label: at most limit characters (or UTF-8 bytes), no control characters. */
export function checkText(field: string, value: string, limit: number, inBytes = false): void {
  const size = inBytes ? Buffer.byteLength(value, "utf8") : [...value].length;
  if (size > limit) throw invalid(`${field}: ${size} ${inBytes ? "bytes" : "characters"}, more than ${limit}: ${quoted(value)}`);
  const control = CONTROL_CHARACTER.exec(value);
  if (control) throw invalid(`${field}: control character ${shown(control[0])} in ${quoted(value)}`);
}

/**
 * Refuses a submission the server would refuse whatever its configuration (InvalidArgumentError
 * naming the field, prefixed by where: "tasks[2]." in a list): what it checks besides the pool's
 * existence and the resources its config names.
 */
export function checkSubmitRequest(req: SubmitTaskRequest, where = "", maxPayloadBytes = DEFAULT_MAX_PAYLOAD_BYTES): void {
  if (!req.pool) throw invalid(`${where}pool: required`);
  checkText(`${where}pool`, req.pool, MAX_POOL_LENGTH);
  checkText(`${where}key`, req.key, MAX_KEY_LENGTH);
  if (req.key.startsWith(SCHEDULE_KEY_PREFIX)) {
    throw invalid(`${where}key: ${quoted(req.key)}: keys starting with "${SCHEDULE_KEY_PREFIX}" are reserved for schedules`);
  }
  checkText(`${where}content_type`, req.contentType, MAX_CONTENT_TYPE);
  checkText(`${where}group_key`, req.groupKey, MAX_GROUP_KEY_BYTES, true);
  if (req.payload.length > maxPayloadBytes) {
    throw invalid(`${where}payload: ${req.payload.length} bytes exceeds limits.max_payload_bytes ${maxPayloadBytes}`);
  }
  for (const [name, range] of Object.entries(TASK_RANGES) as Array<[keyof typeof TASK_RANGES, (typeof TASK_RANGES)[keyof typeof TASK_RANGES]]>) {
    const value = req[name];
    const inRange = typeof value === "bigint" ? BigInt(range.low) <= value && value <= BigInt(range.high) : Number.isInteger(value) && range.low <= value && value <= range.high;
    if (!inRange) throw invalid(`${where}${FIELD_NAMES[name]}: ${value} is not between ${range.low} and ${range.high} (${range.meaning})`);
  }
  for (const [field, time] of [["run_at", req.runAt], ["start_by", req.startBy]] as const) {
    if (time && !(MIN_TIMESTAMP_SECONDS <= time.seconds && time.seconds <= MAX_TIMESTAMP_SECONDS)) {
      throw invalid(`${where}${field}: ${time.seconds} s since the epoch is not between 0001-01-01 and 9999-12-31`);
    }
  }
  if (req.runAt && req.startBy && !isAfter(req.startBy, req.runAt)) {
    throw invalid(`${where}start_by: ${jsonTimestamp(req.startBy)} is not after run_at ${jsonTimestamp(req.runAt)}`);
  }
  if (!RUN_WHEN_VALUES.has(req.runWhen)) throw invalid(`${where}run_when: unknown value ${req.runWhen}`);
  checkKeyMode(req, where);
  req.dependsOn.forEach((ref, i) => {
    if (ref.id !== undefined) {
      if (ref.id === 0n) throw invalid(`${where}depends_on[${i}].id: 0 is not a task id`);
    } else if (ref.key !== undefined) {
      checkText(`${where}depends_on[${i}].key`, ref.key, MAX_KEY_LENGTH);
    } else {
      throw invalid(`${where}depends_on[${i}]: give an id or a key`);
    }
  });
  const trace = req.trace;
  if (trace?.traceparent) {
    const parts = TRACEPARENT.exec(trace.traceparent);
    if (!parts || parts[1] === "ff" || /^0+$/.test(parts[2]!) || /^0+$/.test(parts[3]!)) {
      throw invalid(`${where}trace.traceparent: ${quoted(trace.traceparent)} is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)`);
    }
    checkText(`${where}trace.tracestate`, trace.tracestate, MAX_TRACESTATE_BYTES, true);
  }
}

function isAfter(a: Timestamp, b: Timestamp): boolean {
  return a.seconds > b.seconds || (a.seconds === b.seconds && a.nanos > b.nanos);
}

/** A Timestamp in RFC 3339 as protobuf's JSON writes it (as the server names it): a fraction only when there is one, of 3, 6 or 9 digits. */
function jsonTimestamp(time: Timestamp): string {
  const whole = new Date(Number(time.seconds) * 1000).toISOString().slice(0, 19);
  if (time.nanos === 0) return `${whole}Z`;
  const digits = time.nanos % 1_000_000 === 0 ? 3 : time.nanos % 1000 === 0 ? 6 : 9;
  return `${whole}.${String(time.nanos).padStart(9, "0").slice(0, digits)}Z`;
}

/**
 * The key mode, its debounce and the key TTL, as the server refuses them. A mode not given is
 * the pool's default_key_mode, and a debounce not given the pool's debounce: what depends on the
 * pool's configuration is left to the server.
 */
function checkKeyMode(req: SubmitTaskRequest, where: string): void {
  const mode = req.keyMode;
  if (!KEY_MODE_VALUES.has(mode)) throw invalid(`${where}key_mode: unknown value ${mode}`);
  if (!req.key) {
    const needKey: Array<[string, boolean, string | bigint]> = [
      ["key_mode", mode > KeyMode.KEY_MODE_RETURN_EXISTING, keyModeToJSON(mode)],
      ["key_ttl_ms", req.keyTtlMs !== 0n, req.keyTtlMs],
      ["debounce_ms", req.debounceMs !== 0n, req.debounceMs],
      ["max_debounce_ms", req.maxDebounceMs !== 0n, req.maxDebounceMs],
    ];
    const given = needKey.find(([, asked]) => asked);
    if (given) throw invalid(`${where}key: required with ${given[0]} ${given[2]}`);
    return;
  }
  if (mode === KeyMode.KEY_MODE_DEBOUNCE) {
    if (req.debounceMs !== 0n && req.maxDebounceMs !== 0n && req.maxDebounceMs < req.debounceMs) {
      throw invalid(`${where}max_debounce_ms: ${req.maxDebounceMs} is less than debounce_ms ${req.debounceMs}`);
    }
    if (req.runAt) throw invalid(`${where}run_at: not with KEY_MODE_DEBOUNCE (debounce_ms says when it runs)`);
  } else if (mode !== KeyMode.KEY_MODE_UNSPECIFIED) {
    for (const [field, value] of [["debounce_ms", req.debounceMs], ["max_debounce_ms", req.maxDebounceMs]] as const) {
      if (value !== 0n) throw invalid(`${where}${field}: ${value} applies only with KEY_MODE_DEBOUNCE, not ${keyModeToJSON(mode)}`);
    }
  }
}

/** A time given as a Date or ms since the epoch that a Timestamp can hold, or InvalidArgumentError naming the field. */
export function checkTime(field: string, time: Date | number | undefined): void {
  if (time !== undefined && !Number.isFinite(Number(time))) throw invalid(`${field}: ${String(time)} is not a time`);
}
