/**
 * Transactional enqueue: tasks inserted into the outbox table of the application's own
 * PostgreSQL database, in the application's transaction, on the node-postgres client it gives
 * (`pg` is never imported here: any object with query(text, values) does). A cronoq-server
 * relay submits the committed rows; a rolled-back transaction leaves none.
 *
 * @module cronoq/outbox
 */
import { status as Status } from "@grpc/grpc-js";
import { submitRequest, type TaskSpec } from "./client.js";
import { InvalidArgumentError } from "./errors.js";
import { SubmitTaskRequest } from "./gen/cronoq/v1/task_service.js";
import { checkSubmitRequest, checkTime, DEFAULT_MAX_PAYLOAD_BYTES } from "./limits.js";

/** The schema `cronoq outbox install` creates the outbox in when given none. */
export const DEFAULT_SCHEMA = "cronoq";
const SCHEMA_NAME = /^[A-Za-z_][A-Za-z0-9_]{0,62}$/;

/**
 * What enqueue needs of a database client: node-postgres's Client or PoolClient (in a
 * transaction the application began), or anything that runs a query the same way.
 */
export interface Queryable {
  query(text: string, values: unknown[]): Promise<{ rows: Array<{ id: unknown }> }>;
}

export interface OutboxOptions {
  /** The schema the outbox was installed in ("cronoq" when absent). */
  schema?: string;
  /** The server's limits.max_payload_bytes, when its config raises it (1 MiB when absent). */
  maxPayloadBytes?: number;
}

/** What enqueue takes besides the pool and the payload: the task's fields, as submit takes them, and the outbox's. */
export type EnqueueOptions = Omit<TaskSpec, "pool" | "payload"> & OutboxOptions;

/** The outbox's INSERT: one statement for every row, each row's id answered in the order given. */
function insertSql(schema: string): string {
  if (!SCHEMA_NAME.test(schema)) {
    throw new InvalidArgumentError(Status.INVALID_ARGUMENT,
      `schema: ${JSON.stringify(schema)} is not a plain identifier (letters, digits and _, at most 63)`);
  }
  return `INSERT INTO "${schema}".cronoq_outbox (pool, request)` +
    " SELECT r.pool, r.request FROM unnest($1::text[], $2::bytea[]) WITH ORDINALITY AS r(pool, request, n)" +
    " ORDER BY n RETURNING id";
}

/** A task as the outbox row's request (its request_id empty: the relay sets its own), checked as the server checks it. */
function outboxRequest(spec: TaskSpec, where: string, maxPayloadBytes: number): SubmitTaskRequest {
  checkTime(`${where}run_at`, spec.runAt);
  checkTime(`${where}start_by`, spec.startBy);
  const req = submitRequest(spec);
  checkSubmitRequest(req, where, maxPayloadBytes);
  return req;
}

/**
 * Inserts the tasks into the outbox on client, in its transaction, in one statement: answers
 * their outbox row ids, in order. A task the server would refuse throws InvalidArgumentError
 * (naming "tasks[i]." and the field) before anything is inserted. Each runs once the
 * transaction commits and the relay submits it; a row the server refuses is moved to
 * cronoq_outbox_dead with the reason.
 */
export async function enqueueMany(client: Queryable, specs: TaskSpec[], opts: OutboxOptions = {}): Promise<bigint[]> {
  const sql = insertSql(opts.schema ?? DEFAULT_SCHEMA);
  const maxPayloadBytes = opts.maxPayloadBytes ?? DEFAULT_MAX_PAYLOAD_BYTES;
  const requests = specs.map((spec, i) => outboxRequest(spec, specs.length > 1 ? `tasks[${i}].` : "", maxPayloadBytes));
  if (requests.length === 0) return [];
  const pools = requests.map((req) => req.pool);
  const encoded = requests.map((req) => Buffer.from(SubmitTaskRequest.encode(req).finish()));
  const result = await client.query(sql, [pools, encoded]);
  return result.rows.map((row) => BigInt(String(row.id)));
}

/**
 * Inserts one task into the outbox on client, in its transaction (payload: bytes as they are,
 * anything else as JSON, as submit sends it): answers its outbox row id. A task the server
 * would refuse throws InvalidArgumentError naming the field and value, inserting nothing.
 */
export async function enqueue(client: Queryable, pool: string, payload: unknown, opts: EnqueueOptions = {}): Promise<bigint> {
  const { schema, maxPayloadBytes, ...task } = opts;
  const [id] = await enqueueMany(client, [{ ...task, pool, payload }], { schema, maxPayloadBytes });
  return id!;
}
