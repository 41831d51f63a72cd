/**
 * cronoq's TypeScript SDK: a Client (submit, get, wait, cancel, list, watch; retry, delete,
 * attempts, bulk actions, pause/resume; schedules; workers, snapshot, server info) and a Worker (whose handlers read their dependencies'
 * results and spawn tasks: workflows).
 *
 * @module cronoq
 */
export { Client, isTerminal, newRequestId } from "./client.js";
export type {
  BulkOptions,
  BulkResult,
  CallOptions,
  CancelledWithDescendants,
  CancelOptions,
  GetOptions,
  ListOptions,
  PoolOptions,
  RetryOptions,
  ScheduleSpec,
  SpawnOptions,
  Submitted,
  TaskFilter,
  TaskRef,
  TaskSpec,
  TaskTrace,
  TaskWithAttempts,
  TaskWithChildren,
  Waited,
  WatchOptions,
} from "./client.js";
export {
  defaultPrefetch,
  LeaseLostError,
  nonRetryable,
  retryAfter,
  Snooze,
  TaskCancelledError,
  TaskFailure,
  TaskTimeoutError,
  Worker,
  WorkerStoppingError,
} from "./worker.js";
export type { DependencyResult, Handler, TaskContext, WorkerOptions } from "./worker.js";
export { checkRedirect, Endpoint } from "./endpoint.js";
export { backoffMs, consoleLogger, DEFAULT_KEEPALIVE, MAX_MESSAGE_BYTES, retryWithDefaults } from "./transport.js";
export type { ConnectionOptions, KeepaliveConfig, Logger, Retry, RetryConfig, TlsOptions } from "./transport.js";
export * from "./errors.js";
export { decodeDependencyResult, decodePayload, decodeResult, encodePayload, JSON_CONTENT_TYPE } from "./payload.js";
export {
  AttemptOutcome,
  attemptOutcomeToJSON,
  KeyMode,
  keyModeFromJSON,
  keyModeToJSON,
  RunWhen,
  runWhenFromJSON,
  runWhenToJSON,
  TaskState,
  taskStateFromJSON,
  taskStateToJSON,
} from "./gen/cronoq/v1/task.js";
export type { Attempt, Task, TaskEvent, TaskProgress } from "./gen/cronoq/v1/task.js";
export type { BulkShardResult } from "./gen/cronoq/v1/task_service.js";
export { Role, roleFromJSON, roleToJSON } from "./gen/cronoq/v1/admin_service.js";
export type {
  Caller,
  GetServerInfoResponse,
  GetSnapshotResponse,
  GroupCounts,
  OutboxStatus,
  PoolActivity,
  PoolCounts,
  PoolPause,
  ResourceUsage,
  ShardSnapshot,
} from "./gen/cronoq/v1/admin_service.js";
export type { ListSchedulesResponse, Schedule } from "./gen/cronoq/v1/schedule_service.js";
// Named apart from the SDK's Worker (the class that runs handlers): a worker the server lists.
export type { ListWorkersResponse, Worker as RegisteredWorker } from "./gen/cronoq/v1/worker_service.js";
