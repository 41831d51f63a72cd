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
}

/** GET or POST a /v1 route; resolves to the JSON body, rejects with ApiError. */
export async function call(method, path, body) {
  const headers = { accept: "application/json" };
  const current = token();
  if (current) headers.authorization = `Bearer ${current}`;
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "omit",
    cache: "no-store",
  });
  let parsed = null;
  try {
    parsed = await response.json();
  } catch {
    parsed = null;
  }
  if (!response.ok) throw new ApiError(response.status, parsed);
  return parsed;
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
