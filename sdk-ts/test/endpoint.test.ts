import { test } from "node:test";
import assert from "node:assert/strict";
import { checkRedirect, Endpoint } from "../src/endpoint.js";
import { InvalidArgumentError, RedirectRefusedError } from "../src/errors.js";
import { backoffMs, retryWithDefaults } from "../src/transport.js";

test("Endpoint.parse: schemes, default ports, bare host:port is http", () => {
  assert.equal(Endpoint.parse("https://q.example").toString(), "https://q.example:443");
  assert.equal(Endpoint.parse("127.0.0.1:7070").toString(), "http://127.0.0.1:7070");
  assert.equal(Endpoint.parse("http://[::1]:80").toString(), "http://[::1]:80");
  assert.throws(() => Endpoint.parse("ftp://x:1"), InvalidArgumentError);
  assert.throws(() => Endpoint.parse("http://x:1/path"), InvalidArgumentError);
  assert.deepEqual(Endpoint.parseList("http://a:1, http://b:2").map(String), ["http://a:1", "http://b:2"]);
  assert.throws(() => Endpoint.parseList(" , "), InvalidArgumentError);
});

test("loopback hosts", () => {
  assert.ok(Endpoint.parse("http://localhost:1").loopback);
  assert.ok(Endpoint.parse("http://127.0.0.9:1").loopback);
  assert.ok(Endpoint.parse("http://[::1]:1").loopback);
  assert.ok(!Endpoint.parse("http://10.0.0.1:1").loopback);
});

test("checkRedirect: never https to http; a token over plain http only to loopback unless allowed", () => {
  const https = Endpoint.parse("https://a:1");
  const remote = Endpoint.parse("http://10.0.0.2:1");
  assert.throws(() => checkRedirect(https, Endpoint.parse("http://127.0.0.1:2"), false, true), (e: unknown) =>
    e instanceof RedirectRefusedError && /https:\/\/ to http:\/\//.test(e.message));
  assert.throws(() => checkRedirect(Endpoint.parse("http://127.0.0.1:1"), remote, true, false), (e: unknown) =>
    e instanceof RedirectRefusedError && /insecure_redirect_http/.test(e.message));
  checkRedirect(Endpoint.parse("http://127.0.0.1:1"), remote, true, true);
  checkRedirect(Endpoint.parse("http://127.0.0.1:1"), remote, false, false);
  checkRedirect(https, Endpoint.parse("https://b:2"), true, false);
});

test("backoff doubles to the cap with equal jitter: half the step fixed, half random", () => {
  const r = retryWithDefaults({ initialBackoffMs: 100, maxBackoffMs: 2000 });
  for (const [failures, step] of [[0, 100], [1, 200], [3, 800], [4, 1600], [5, 2000], [40, 2000]]) {
    const delays = Array.from({ length: 200 }, () => backoffMs(r, failures));
    const [lo, hi] = [Math.min(...delays), Math.max(...delays)];
    assert.ok(lo >= step / 2 && hi <= step, `backoffMs(${failures}) in [${lo}, ${hi}], want [${step / 2}, ${step}]`);
    assert.ok(hi - lo > step / 4, `backoffMs(${failures}) in [${lo}, ${hi}]: not jittered`);
  }
  assert.equal(retryWithDefaults({}).maxElapsedMs, 30_000);
  assert.equal(retryWithDefaults({ maxElapsedMs: -1 }).maxElapsedMs, -1);
});
