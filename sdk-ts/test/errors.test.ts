import { test } from "node:test";
import assert from "node:assert/strict";
import http2 from "node:http2";
import type { AddressInfo } from "node:net";
import { Metadata, status as Status } from "@grpc/grpc-js";
import { Client } from "../src/client.js";
import {
  codeName,
  CronoqError,
  decodeStatusDetails,
  FailedPreconditionError,
  fromGrpcError,
  isRetryable,
  NotFoundError,
  TlsError,
  UnavailableError,
} from "../src/errors.js";
import { silent, statusDetailsBin } from "./helpers.js";

test("decodeStatusDetails reads ErrorInfo's reason and metadata and RetryInfo's delay", () => {
  const details = decodeStatusDetails(statusDetailsBin("WRONG_SHARD", { shard: "gpu", shard_endpoint: "https://gpu:7070" }, 1500));
  assert.equal(details.reason, "WRONG_SHARD");
  assert.deepEqual(details.metadata, { shard: "gpu", shard_endpoint: "https://gpu:7070" });
  assert.equal(details.retryDelayMs, 1500);
});

test("fromGrpcError: a class per code, fields from the structured error alone", () => {
  const md = new Metadata();
  md.set("grpc-status-details-bin", statusDetailsBin("WRONG_SHARD", { shard: "gpu", shard_endpoint: "https://gpu:7070" }));
  const err = fromGrpcError({ code: Status.FAILED_PRECONDITION, details: "pool llm is on shard gpu", metadata: md });
  assert.ok(err instanceof FailedPreconditionError);
  assert.ok(err instanceof CronoqError);
  const e = err as FailedPreconditionError;
  assert.equal(e.message, "pool llm is on shard gpu");
  assert.equal(e.codeName, "FAILED_PRECONDITION");
  assert.equal(e.reason, "WRONG_SHARD");
  assert.equal(e.shard, "gpu");
  assert.equal(e.shardEndpoint, "https://gpu:7070");
});

test("fromGrpcError: the cronoq-* trailers win over the structured error", () => {
  const md = new Metadata();
  md.set("cronoq-leader", "http://127.0.0.1:2");
  md.set("grpc-status-details-bin", statusDetailsBin("NOT_LEADER", { leader: "http://127.0.0.1:1" }));
  const e = fromGrpcError({ code: Status.UNAVAILABLE, details: "standby", metadata: md }) as UnavailableError;
  assert.ok(e instanceof UnavailableError);
  assert.equal(e.leader, "http://127.0.0.1:2");
  assert.equal(e.reason, "NOT_LEADER");
  assert.equal(e.metadata["cronoq-leader"], "http://127.0.0.1:2");
});

const ENDS_IN_SPACE = "scripted refusal of task 5 that ends in a space ";

test("fromGrpcError: without grpc-message, the structured error's message verbatim, not the code's name", () => {
  const md = new Metadata();
  md.set("grpc-status-details-bin", statusDetailsBin("SCRIPTED", {}, 0, ENDS_IN_SPACE));
  const e = fromGrpcError({ code: Status.FAILED_PRECONDITION, details: "", metadata: md });
  assert.equal(e.message, ENDS_IN_SPACE);
  assert.equal(fromGrpcError({ code: Status.FAILED_PRECONDITION, details: "" }).message, "FAILED_PRECONDITION");
});

test("a server message that ends in a space reaches the caller (Node's HTTP/2 drops such a grpc-message)", async () => {
  // A trailers-only gRPC answer whose grpc-message is not percent-encoded, as grpc-core sends it.
  const server = http2.createServer();
  server.on("stream", (stream) => stream.respond({
    ":status": 200,
    "content-type": "application/grpc",
    "grpc-status": String(Status.FAILED_PRECONDITION),
    "grpc-message": ENDS_IN_SPACE,
    "grpc-status-details-bin": statusDetailsBin("SCRIPTED", {}, 0, ENDS_IN_SPACE).toString("base64"),
  }, { endStream: true }));
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const client = new Client({ endpoint: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, logger: silent });
  try {
    await assert.rejects(client.get(5n), (err: unknown) =>
      err instanceof FailedPreconditionError && err.message === ENDS_IN_SPACE && err.reason === "SCRIPTED");
  } finally {
    client.close();
    server.close();
  }
});

test("retryable: UNAVAILABLE and CANCELLED, never a TLS failure", () => {
  assert.ok(isRetryable(fromGrpcError({ code: Status.UNAVAILABLE, details: "down" })));
  assert.ok(isRetryable(fromGrpcError({ code: Status.CANCELLED, details: "closed" })));
  assert.ok(!isRetryable(fromGrpcError({ code: Status.NOT_FOUND, details: "no task 5" })));
  assert.ok(!isRetryable(new TlsError(Status.UNAVAILABLE, "https://x:1: TLS handshake failed")));
  assert.ok(fromGrpcError({ code: Status.NOT_FOUND, details: "x" }) instanceof NotFoundError);
  assert.equal(codeName(Status.DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
  assert.equal(codeName(99), "CODE(99)");
});
