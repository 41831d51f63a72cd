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

/** A timestamp (RFC 3339, as the API sends them) shown as "YYYY-MM-DD HH:MM:SS" UTC, or "" when absent. */
export function when(ts) {
  if (!ts) return "";
  return h("time", { datetime: ts, title: ts }, ts.replace("T", " ").replace(/\.\d+Z$|Z$/, ""));
}

/** How long ago a timestamp was ("4 s ago"), with the full time as its title. */
export function ago(ts) {
  if (!ts) return "";
  const seconds = Math.max(0, Math.round((Date.now() - Date.parse(ts)) / 1000));
  const text = seconds < 120 ? `${seconds} s ago` : seconds < 7200 ? `${Math.round(seconds / 60)} min ago` : `${Math.round(seconds / 3600)} h ago`;
  return h("time", { datetime: ts, title: ts }, text);
}
