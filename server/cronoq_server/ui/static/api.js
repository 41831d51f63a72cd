// Calls to the server's HTTP JSON API (same origin), with the token kept in sessionStorage.

const TOKEN_KEY = "cronoq.token";

export class ApiError extends Error {
  constructor(status, body) {
    super((body && body.message) || `HTTP ${status}`);
    this.status = status;
    this.code = (body && body.code) || String(status);
  }
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
  callerPromise = null;
  poolsPromise = null;
}

let callerPromise = null;

/** Who the token is and what it may do (GET /v1/info's caller), asked once per token. */
export function caller() {
  if (!callerPromise) {
    callerPromise = serverInfo().then((info) => info.caller || {});
    callerPromise.catch(() => { callerPromise = null; });
  }
  return callerPromise;
}

let poolsPromise = null;

/** The names of the pools the viewer may read, sorted: the token's own pools, with those the
 * snapshot holds (which are all of them for a token on every pool); asked once per token. */
export function readablePools() {
  if (!poolsPromise) {
    // A token on named pools needs no snapshot: its pools are those (the snapshot holds no other).
    poolsPromise = caller().then(async (who) => (who.all_pools ? notePools(who, await call("GET", "/v1/snapshot")) : notePools(who, {})));
    poolsPromise.catch(() => { poolsPromise = null; });
  }
  return poolsPromise;
}

/** Records the pools of a snapshot just read (the overview's): readablePools() answers them. */
export function notePools(who, snapshot) {
  const reads = (who.permissions || []).some((p) => p === "read" || p === "admin");
  const names = new Set(who.all_pools || !reads ? [] : who.pools || []);
  for (const shard of snapshot.shards || []) for (const pool of shard.pools || []) names.add(pool.pool);
  const sorted = [...names].sort();
  poolsPromise = Promise.resolve(sorted);
  return sorted;
}

/** Worker ids to their names (GET /v1/workers, every shard); empty when they cannot be read. */
export async function workerNames() {
  try {
    const listed = await call("GET", "/v1/workers");
    return new Map((listed.workers || []).filter((w) => w.name).map((w) => [w.id, w.name]));
  } catch {
    return new Map();
  }
}

/** GET /v1/info: this server (shard, role, leader) and the caller. */
export function serverInfo() {
  return call("GET", "/v1/info");
}

/** Whether the caller holds `permission` on `pool`. */
export function may(who, permission, pool) {
  return (who.permissions || []).includes(permission) && (who.all_pools || (who.pools || []).includes(pool));
}

function headers(accept) {
  const out = { accept };
  const current = token();
  if (current) out.authorization = `Bearer ${current}`;
  return out;
}

/** Whether this browser can parse and write JSON numbers as their own text (JSON.rawJSON). */
export const EXACT_NUMBERS = typeof JSON.rawJSON === "function";

/** JSON.parse keeping each number as its own text (a JSON.rawJSON), which JSON.stringify writes
 * back as it was: for values the page only sends back (a big integer stays whole, 1.0 stays 1.0). */
export function parseExact(text) {
  return JSON.parse(text, (key, value, context) =>
    (EXACT_NUMBERS && typeof value === "number" && context ? JSON.rawJSON(context.source) : value));
}

/** GET, POST, PUT or DELETE a /v1 route; resolves to the JSON body (parsed by `parse`),
 * rejects with ApiError. */
export async function call(method, path, body, parse = JSON.parse) {
  const sent = headers("application/json");
  if (body !== undefined) sent["content-type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers: sent,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "omit",
    cache: "no-store",
  });
  const parsed = await jsonOf(response, parse);
  if (!response.ok) throw new ApiError(response.status, parsed);
  return parsed;
}

/** A response's JSON body, or null when it has none. */
async function jsonOf(response, parse = JSON.parse) {
  try {
    return parse(await response.text());
  } catch {
    return null;
  }
}

/** A query string from the entries whose value is not empty. */
export function query(params) {
  const q = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") q.set(name, String(value));
  }
  const text = q.toString();
  return text ? `?${text}` : "";
}

/**
 * Reads a Server-Sent Events route with fetch (EventSource cannot send `authorization`):
 * calls onOpen(response) once the headers arrive, then onEvent({id, event, data}) for each
 * event; resolves when the server ends the stream, rejects on an error or when `signal` aborts.
 */
export async function readEvents(path, { signal, onOpen, onEvent }) {
  const response = await fetch(path, { headers: headers("text/event-stream"), credentials: "omit", cache: "no-store", signal });
  if (!response.ok) throw new ApiError(response.status, await jsonOf(response));
  onOpen(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { id: "", event: "message", data: "" };
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue; // a comment (keep-alive)
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (name === "id") event.id = text;
        else if (name === "event") event.event = text;
        else if (name === "data") event.data += (event.data ? "\n" : "") + text;
      }
      if (event.data) onEvent(event);
    }
  }
}
