// Payloads and results: bytes as they are, anything else as JSON.
import { status as Status } from "@grpc/grpc-js";
import { InvalidArgumentError } from "./errors.js";
import type { DependencyResult, Task } from "./gen/cronoq/v1/task.js";

/** Marks payloads and results stored as JSON. */
export const JSON_CONTENT_TYPE = "application/json";

/** Bytes (Uint8Array, Buffer) as they are with no content type; anything else as JSON. */
export function encodePayload(value: unknown): { data: Buffer; contentType: string } {
  if (value instanceof Uint8Array) return { data: Buffer.from(value), contentType: "" };
  if (value === undefined) return { data: Buffer.alloc(0), contentType: "" };
  let text: string;
  try {
    text = JSON.stringify(value, (_k, v: unknown) => (typeof v === "bigint" ? v.toString() : v));
  } catch (err) {
    throw new InvalidArgumentError(Status.INVALID_ARGUMENT, `payload: not JSON-serializable: ${(err as Error).message}`);
  }
  return { data: Buffer.from(text, "utf8"), contentType: JSON_CONTENT_TYPE };
}

function decodeJson(data: Uint8Array, contentType: string, what: string, id: bigint): unknown {
  if (contentType !== JSON_CONTENT_TYPE) {
    throw new InvalidArgumentError(Status.INVALID_ARGUMENT,
      `task ${id}: ${what} has content type "${contentType}", not ${JSON_CONTENT_TYPE}`);
  }
  if (data.length === 0) return null;
  try {
    return JSON.parse(Buffer.from(data).toString("utf8"));
  } catch (err) {
    throw new InvalidArgumentError(Status.INVALID_ARGUMENT, `task ${id}: ${what} is not valid JSON: ${(err as Error).message}`);
  }
}

/** A task's JSON payload, parsed (throws InvalidArgumentError for other content types). */
export function decodePayload(task: Task): unknown {
  return decodeJson(task.payload, task.contentType, "payload", task.id);
}

/** A task's JSON result, parsed. */
export function decodeResult(task: Task): unknown {
  return decodeJson(task.result, task.resultContentType, "result", task.id);
}

/** A dependency's result as its dependent's handler gets it: JSON parsed, other bytes as they are, null when it has none. */
export function decodeDependencyResult(dependency: DependencyResult): unknown {
  if (dependency.result.length === 0) return null;
  if (dependency.contentType !== JSON_CONTENT_TYPE) return dependency.result;
  return decodeJson(dependency.result, dependency.contentType, "result", dependency.id);
}
