// Builds elements from data with createElement and textContent only: user data (keys, payloads,
// results, errors, worker names) is never parsed as HTML.

/** h("td", {class: "num"}, "text", child, ...): strings become text nodes; null/undefined are skipped. */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else {
      el.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.appendChild(child);
    else el.appendChild(document.createTextNode(String(child)));
  }
}

const SVG_NS = "http://www.w3.org/2000/svg";

/** svg("path", {d: "M0 0"}, child, ...): an SVG element (createElementNS); strings become text nodes. */
export function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

/** A table from a header row and rows of cells (strings or nodes). */
export function table(headers, rows, attrs) {
  return h("table", attrs,
    h("thead", null, h("tr", null, headers.map((name) => h("th", null, name)))),
    h("tbody", null, rows.map((cells) => h("tr", null, cells.map((cell) => h("td", null, cell))))));
}

/** Replaces the children of el. */
export function show(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

/** The browser's own time zone (an IANA name such as "Europe/Paris"). */
export const LOCAL_ZONE = Intl.DateTimeFormat().resolvedOptions().timeZone || "local";

const formats = new Map(); // one Intl.DateTimeFormat per zone

/** A timestamp as "YYYY-MM-DD HH:MM:SS" in an IANA time zone. */
export function inZone(ts, zone) {
  if (!formats.has(zone)) {
    formats.set(zone, new Intl.DateTimeFormat("en-CA", {
      timeZone: zone, hourCycle: "h23", year: "numeric", month: "2-digit", day: "2-digit",
      hour: "2-digit", minute: "2-digit", second: "2-digit",
    }));
  }
  const parts = Object.fromEntries(formats.get(zone).formatToParts(new Date(ts)).map((p) => [p.type, p.value]));
  return `${parts.year}-${parts.month}-${parts.day} ${parts.hour}:${parts.minute}:${parts.second}`;
}

/** A timestamp (RFC 3339, as the API sends them) shown in UTC and labelled so, with the time in
 * the browser's zone (named) as its title; "" when absent. */
export function when(ts) {
  if (!ts) return "";
  return h("time", { datetime: ts, title: `${inZone(ts, LOCAL_ZONE)} ${LOCAL_ZONE} (your zone)` }, `${utc(ts)} UTC`);
}

/** A timestamp in UTC and, on a second line, in `zone` (a schedule's, or the browser's), both named. */
export function whenBoth(ts, zone = LOCAL_ZONE) {
  if (!ts) return "";
  const local = zone === LOCAL_ZONE ? `${LOCAL_ZONE} (your zone)` : zone;
  return h("time", { datetime: ts, class: "both" },
    zone === "UTC" || zone === "Etc/UTC" ? `${utc(ts)} UTC` : [`${inZone(ts, zone)} ${local}`, h("br"), h("small", null, `${utc(ts)} UTC`)]);
}

function utc(ts) {
  return ts.replace("T", " ").replace(/\.\d+Z$|Z$/, "");
}

/** A duration in milliseconds as "850 ms", "12.3 s", "4 min 5 s" or "2 h 3 min". */
export function duration(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "";
  const n = Math.max(0, Math.round(Number(ms)));
  if (n < 1000) return `${n} ms`;
  if (n < 60_000) return `${(n / 1000).toFixed(1)} s`;
  const s = Math.round(n / 1000);
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}

/** How long ago a timestamp was ("4 s ago"), with the full time as its title. */
export function ago(ts) {
  if (!ts) return "";
  const seconds = Math.max(0, Math.round((Date.now() - Date.parse(ts)) / 1000));
  const text = seconds < 120 ? `${seconds} s ago` : seconds < 7200 ? `${Math.round(seconds / 60)} min ago` : `${Math.round(seconds / 3600)} h ago`;
  return h("time", { datetime: ts, title: ts }, text);
}
