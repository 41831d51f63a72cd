// cronoq's TypeScript SDK: a Client (submit, get, wait, cancel, list, watch) and a Worker.
export { Client, newRequestId } from "./client.js";
export type { CallOptions, ListOptions, Submitted, TaskRef, TaskSpec, Waited, WatchOptions } from "./client.js";
export {
  LeaseLostError,
  nonRetryable,
  retryAfter,
  TaskCancelledError,
  TaskFailure,
  TaskTimeoutError,
  Worker,
  WorkerStoppingError,
} from "./worker.js";
export type { Handler, WorkerOptions } from "./worker.js";
export { checkRedirect, Endpoint } from "./endpoint.js";
export { backoffMs, consoleLogger, DEFAULT_KEEPALIVE, MAX_MESSAGE_BYTES, retryWithDefaults } from "./transport.js";
export type { ConnectionOptions, KeepaliveConfig, Logger, Retry, RetryConfig, TlsOptions } from "./transport.js";
export * from "./errors.js";
export { decodePayload, decodeResult, encodePayload, JSON_CONTENT_TYPE } from "./payload.js";
export { TaskState, taskStateToJSON } from "./gen/cronoq/v1/task.js";
export type { Task, TaskEvent } from "./gen/cronoq/v1/task.js";
