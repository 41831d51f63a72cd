import { test } from "node:test";
import assert from "node:assert/strict";
import { status as Status } from "@grpc/grpc-js";
import { checkRedirect, Endpoint, parseTarget } from "../src/endpoint.js";
import { InvalidArgumentError, RedirectRefusedError, UnavailableError } from "../src/errors.js";
import { backoffMs, Connection, retryWithDefaults } from "../src/transport.js";
import { silent } from "./helpers.js";

test("Endpoint.parse: schemes, default ports, bare host:port is http", () => {
  assert.equal(Endpoint.parse("https://q.example").toString(), "https://q.example:443");
  assert.equal(Endpoint.parse("127.0.0.1:7070").toString(), "http://127.0.0.1:7070");
  assert.equal(Endpoint.parse("http://[::1]:80").toString(), "http://[::1]:80");
  assert.throws(() => Endpoint.parse("ftp://x:1"), InvalidArgumentError);
  assert.throws(() => Endpoint.parse("http://x:1/path"), InvalidArgumentError);
  assert.deepEqual(Endpoint.parseList("http://a:1, http://b:2").map(String), ["http://a:1", "http://b:2"]);
  assert.throws(() => Endpoint.parseList(" , "), InvalidArgumentError);
});

// The grammar of conformance/README.md, "Endpoints": each form, and what it is reported as.
const ACCEPTED: [string, string][] = [
  ["http://127.0.0.1:7070", "http://127.0.0.1:7070"],
  ["127.0.0.1:7070", "http://127.0.0.1:7070"], // no scheme: http
  ["q.example", "http://q.example:80"], // no port: 80 for http
  ["https://q.example", "https://q.example:443"], // 443 for https
  ["HTTP://Q.Example:8080", "http://q.example:8080"], // scheme and name in any case, reported in lower case
  ["HtTpS://LOCALHOST", "https://localhost:443"],
  ["http://q.example:1/", "http://q.example:1"], // one trailing /
  ["q.example/", "http://q.example:80"],
  [" \thttp://q.example:1\t ", "http://q.example:1"], // spaces and tabs around
  ["http://my_host-1.internal:65535", "http://my_host-1.internal:65535"], // - and _ in labels
  ["http://1a.b2:1", "http://1a.b2:1"], // digits anywhere, the last label not all digits
  ["http://127.0.0.1.nip.io:1", "http://127.0.0.1.nip.io:1"], // a name, not an address
  [`http://${"a".repeat(63)}.example:1`, `http://${"a".repeat(63)}.example:1`], // 63 characters a label
  ["http://0.0.0.0:1", "http://0.0.0.0:1"], // "0" is no leading zero
  ["http://255.255.255.255:1", "http://255.255.255.255:1"],
  ["http://[::1]:80", "http://[::1]:80"], // IPv6 in brackets
  ["https://[2001:DB8::A]", "https://[2001:db8::a]:443"],
  ["http://[1:2:3:4:5:6:7:8]:1", "http://[1:2:3:4:5:6:7:8]:1"],
  ["http://[1:2:3:4:5:6:7::]:1", "http://[1:2:3:4:5:6:7::]:1"],
  ["http://[::]:1", "http://[::]:1"],
  ["http://[::ffff:127.0.0.1]:1", "http://[::ffff:127.0.0.1]:1"], // dotted IPv4 ending an IPv6 address
  ["http://[1:2:3:4:5:6:1.2.3.4]:1", "http://[1:2:3:4:5:6:1.2.3.4]:1"],
];

const REFUSED: string[] = [
  "", " \t ", // empty
  "ftp://q.example:1", "://q.example:1", "HTTPS:q.example:1", // the scheme
  "http://", "http://:1", "http://q.example:", "http://q.example:/", // an empty host or port
  "http://q.example:1/api", "http://q.example:1//", "http:/q.example:1", // a path
  "http://q.example:1?x=y", "http://q.example:1#top", // a query, a fragment
  "http://user@q.example:1", "http://127.0.0.1@127.0.0.1:1", "http://u:p@q.example:1", // user info
  "http://127.0.0.%31:1", "http://q%2eexample:1", "http://[fe80::1%25eth0]:1", "http://[fe80::1%eth0]:1", // percent, a zone
  "http:\\\\q.example:1", "http://q.example\\:1", // a backslash
  "http://q .example:1", "http://q.example: 1", "http://q.example:1\t/", // a space or tab inside
  "http://localhost.:1", "http://q..example:1", "http://.q.example:1", // an empty label, a trailing dot
  `http://${"a".repeat(64)}.example:1`, "http://q!.example:1", "http://ĥost:1", // not a label
  "http://2130706433:1", "http://0177.0.0.1:1", "http://0x7f.0.0.1:1", "http://127.1:1", "http://0x7f000001:1", "http://a.0X1F:1", // an address parser's other forms
  "http://127.0.0.256:1", "http://1.2.3.4.5:1", "http://00.0.0.1:1", "http://q.example.1:1", // ends in a number, not IPv4
  "http://q.example:0", "http://q.example:01", "http://q.example:65536", "http://q.example:+1", "http://q.example:1e3", // the port
  "http://q.example:1:2",
  "http://::1:80", "http://[::1", "http://[::1]x", "http://[::1]:", "http://[]:1", // IPv6
  "http://[1::2::3]:1", "http://[1:2:3:4:5:6:7:8:9]:1", "http://[1:2:3:4:5:6:7]:1", "http://[12345::1]:1",
  "http://[g::1]:1", "http://[::1.2.3]:1", "http://[1.2.3.4::]:1", "http://[::01.2.3.4]:1", "http://[:1::]:1",
  "http://[q.example]:1", "http://[127.0.0.1]:1",
];

test("Endpoint.parse: every form of the grammar, and how it is reported", () => {
  for (const [text, reported] of ACCEPTED) {
    assert.equal(Endpoint.parse(text).toString(), reported, JSON.stringify(text));
  }
});

test("Endpoint.parse: anything else is INVALID_ARGUMENT naming the text, never repaired", () => {
  for (const text of REFUSED) {
    assert.throws(() => Endpoint.parse(text), (e: unknown) =>
      e instanceof InvalidArgumentError && e.code === Status.INVALID_ARGUMENT &&
      e.message.includes(`"${text}"`) && e.message.includes("not an endpoint"), JSON.stringify(text));
  }
});

test("Endpoint.parseList: spaces and tabs around each item; one item that is not an endpoint refuses the list", () => {
  assert.deepEqual(Endpoint.parseList(" http://a:1 ,\thttp://b:2\t").map(String), ["http://a:1", "http://b:2"]);
  assert.throws(() => Endpoint.parseList("http://a:1, http://0x7f.0.0.1:2"), (e: unknown) =>
    e instanceof InvalidArgumentError && e.message.includes("0x7f.0.0.1"));
});

test("loopback is exactly localhost (any case), 127.0.0.0/8 and ::1", () => {
  const yes = ["localhost", "LOCALHOST", "LocalHost", "127.0.0.1", "127.0.0.9", "127.255.255.255", "[::1]", "[0:0:0:0:0:0:0:1]", "[::0:1]"];
  const no = ["10.0.0.1", "126.255.255.255", "128.0.0.1", "0.0.0.0", "127.0.0.1.nip.io", "localhost.example", "my-localhost",
    "[::ffff:127.0.0.1]", "[::127.0.0.1]", "[::2]", "[::]", "[1::1]"];
  for (const host of yes) assert.ok(Endpoint.parse(`http://${host}:1`).loopback, host);
  for (const host of no) assert.ok(!Endpoint.parse(`http://${host}:1`).loopback, host);
  assert.throws(() => Endpoint.parse("http://localhost.:1"), InvalidArgumentError); // not loopback: not an endpoint
});

test("parseTarget: a redirect or leader target that is not an endpoint is a refused redirect with the answer's code", () => {
  assert.equal(parseTarget("HTTP://LocalHost:7/", Status.FAILED_PRECONDITION).toString(), "http://localhost:7");
  for (const [target, code] of [["http://2130706433:7", Status.FAILED_PRECONDITION], ["http://127.1:7", Status.UNAVAILABLE]] as const) {
    assert.throws(() => parseTarget(target, code), (e: unknown) =>
      e instanceof RedirectRefusedError && e.code === code && e.message.includes(target) && e.message.includes("not an endpoint"));
  }
});

test("Connection: a redirect or leader hint that is not an endpoint is not followed", () => {
  const warnings: string[] = [];
  const conn = new Connection({ endpoint: "http://127.0.0.1:7070", token: "t", logger: { ...silent, warn: (m, f) => warnings.push(`${m} ${JSON.stringify(f)}`) } });
  try {
    assert.throws(() => conn.follow("http://0177.0.0.1:7071", Status.FAILED_PRECONDITION), (e: unknown) =>
      e instanceof RedirectRefusedError && e.code === Status.FAILED_PRECONDITION && e.message.includes("0177.0.0.1"));
    assert.equal(conn.endpoint.toString(), "http://127.0.0.1:7070");
    conn.onUnavailable(new UnavailableError(Status.UNAVAILABLE, "a standby", { leader: "http://127.0.0.1:7071?x=y" }));
    assert.equal(conn.endpoint.toString(), "http://127.0.0.1:7070");
    assert.ok(warnings.some((w) => w.includes("not following the leader") && w.includes("not an endpoint")), warnings.join("\n"));
  } finally {
    conn.close();
  }
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
