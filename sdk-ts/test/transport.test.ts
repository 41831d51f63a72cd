// The diagnosis of an http:// endpoint whose server speaks TLS, against raw TCP servers.
import { test } from "node:test";
import assert from "node:assert/strict";
import * as net from "node:net";
import { status as Status } from "@grpc/grpc-js";
import { Client, Endpoint, TlsError, UnavailableError } from "../src/index.js";
import { probeSpeaksTls } from "../src/transport.js";

// A TLS alert record: fatal handshake_failure.
const ALERT = Buffer.from([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x28]);

/** A server that answers a TLS ClientHello with a TLS alert and closes any other connection, as a TLS server does with a plaintext client. */
async function listen(onData: (socket: net.Socket, first: Buffer) => void): Promise<{ port: number; close: () => Promise<void> }> {
  const sockets = new Set<net.Socket>();
  const server = net.createServer((socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
    socket.on("error", () => {});
    socket.once("data", (first) => onData(socket, first));
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as net.AddressInfo).port;
  return {
    port,
    close: () => {
      for (const s of sockets) s.destroy();
      return new Promise((resolve) => server.close(() => resolve()));
    },
  };
}

const tlsLike = (socket: net.Socket, first: Buffer) => {
  if (first[0] === 0x16) socket.end(ALERT);
  else socket.destroy();
};

test("probeSpeaksTls: a TLS alert is TLS; a server that closes, or nothing listening, is not", async () => {
  const tlsServer = await listen(tlsLike);
  const plain = await listen((socket) => socket.destroy());
  try {
    assert.equal(await probeSpeaksTls(new Endpoint("http", "127.0.0.1", tlsServer.port)), true);
    assert.equal(await probeSpeaksTls(new Endpoint("http", "127.0.0.1", plain.port)), false);
  } finally {
    await tlsServer.close();
    await plain.close();
  }
  assert.equal(await probeSpeaksTls(new Endpoint("http", "127.0.0.1", plain.port)), false);
});

test("probeSpeaksTls: a server that never answers is not TLS, within the timeout", async () => {
  const silent = await listen(() => {});
  try {
    const started = Date.now();
    assert.equal(await probeSpeaksTls(new Endpoint("http", "127.0.0.1", silent.port), 200), false);
    assert.ok(Date.now() - started < 2000);
  } finally {
    await silent.close();
  }
});

test("an http:// endpoint whose server speaks TLS: a TlsError saying to use https://, not retried", async () => {
  let connections = 0;
  const server = await listen((socket, first) => {
    connections++;
    tlsLike(socket, first);
  });
  const client = new Client({ endpoint: `http://127.0.0.1:${server.port}`, retry: { initialBackoffMs: 10, maxElapsedMs: 20_000 } });
  try {
    const err = await client.get(5n).then(() => undefined, (e: unknown) => e);
    assert.ok(err instanceof TlsError, String(err));
    assert.equal(err.code, Status.UNAVAILABLE);
    assert.equal(err.message, `http://127.0.0.1:${server.port}: the server speaks TLS on this port: use https://127.0.0.1:${server.port}`);
    assert.ok(connections <= 3, `${connections} connections: retried`); // the call's, and the probe's
  } finally {
    client.close();
    await server.close();
  }
});

test("watch on an http:// endpoint whose server speaks TLS: a TlsError", async () => {
  const server = await listen(tlsLike);
  const client = new Client({ endpoint: `http://127.0.0.1:${server.port}`, retry: { initialBackoffMs: 10, maxElapsedMs: 20_000 } });
  try {
    const err = await (async () => {
      for await (const _ of client.watch()) return undefined;
    })().then(() => undefined, (e: unknown) => e);
    assert.ok(err instanceof TlsError, String(err));
    assert.match(err.message, /: the server speaks TLS on this port: use https:\/\//);
  } finally {
    client.close();
    await server.close();
  }
});

test("an http:// endpoint whose server closes connections and is no TLS server: UNAVAILABLE, retried", async () => {
  let connections = 0;
  const server = await listen((socket) => {
    connections++;
    socket.destroy();
  });
  const client = new Client({ endpoint: `http://127.0.0.1:${server.port}`, retry: { initialBackoffMs: 10, maxBackoffMs: 20, maxElapsedMs: 300 } });
  try {
    const err = await client.get(5n).then(() => undefined, (e: unknown) => e);
    assert.ok(err instanceof UnavailableError && !(err instanceof TlsError), String(err));
    assert.ok(connections > 2, `${connections} connections: not retried`);
  } finally {
    client.close();
    await server.close();
  }
});
