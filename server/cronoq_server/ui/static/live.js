// Live: the event stream of every pool the viewer may read (GET /v1/watch as Server-Sent Events,
// read with fetch so the token goes in `authorization`). After a break it reconnects from the
// last event's cursor (or, before any event, the cursor the stream started at: the
// cronoq-watch-cursor header), so no event in between is lost or shown twice. Above
// MAX_EVENTS_PER_S it pauses itself; Resume then goes on live, skipping what came meanwhile.
import { ApiError, readEvents, workerNames } from "./api.js";
import { h, table, when } from "./dom.js";
import { stateBadge, workerLabel } from "./tasks.js";

const KEEP = 200; // rows shown, newest first
const RETRY_MS = [500, 1000, 2000, 5000];
// More events than this in a second is more than a person reads: the view pauses itself, so a
// page left open does not cost the server the conversion of every event of a busy queue.
export const MAX_EVENTS_PER_S = 200;

const NAMES_EVERY_MS = 10_000; // a worker not known yet: the names are asked again, at most this often

function row(event, names) {
  const task = event.task || {};
  return h("tr", { "data-task": task.id || "" },
    h("td", null, when(event.time)),
    h("td", null, event.shard || ""),
    h("td", null, h("a", { href: `#/task/${encodeURIComponent(task.id || "")}` }, String(task.id || ""))),
    h("td", null, task.pool || ""),
    h("td", null, task.key || ""),
    h("td", null, stateBadge(task.state)),
    h("td", null, String(task.attempt ?? 0)),
    h("td", null, workerLabel(task.worker_id, names)),
    h("td", null, task.error || ""));
}

/** The live view and a stop function that ends its stream (called when the view is left). */
export function renderLive(params) {
  const pool = params.get("pool") || "";
  const status = h("span", { class: "live-status", role: "status" }, "connecting…");
  const list = table(["time", "shard", "task", "pool", "key", "state", "attempt", "worker", "error"], [], { class: "live" });
  const body = list.querySelector("tbody");
  const waiting = h("p", { class: "muted waiting" }, "Waiting for events… (a task submitted, started or ended in these pools shows here)");
  let names = new Map();
  let namesAsked = 0;
  const askNames = () => {
    namesAsked = performance.now();
    workerNames().then((known) => { names = known; });
  };
  askNames();
  let controller = new AbortController();
  let cursor = "";
  const seen = new Set(); // cursors shown: a replay after a reconnect repeats none
  let failures = 0;
  let windowStart = 0; // the events of the current second, for MAX_EVENTS_PER_S
  let inWindow = 0;
  let skipAhead = false; // after a pause for the rate: resume live, not from the cursor

  const setStatus = (text, cls) => {
    status.textContent = text;
    status.className = `live-status ${cls}`;
  };

  async function run() {
    while (!controller.signal.aborted) {
      const q = new URLSearchParams();
      if (pool) q.set("pool", pool);
      if (cursor) q.set("cursor", cursor);
      try {
        const qs = q.toString();
        await readEvents(`/v1/watch${qs ? `?${qs}` : ""}`, {
          signal: controller.signal,
          onOpen: (response) => {
            failures = 0;
            if (!cursor) cursor = response.headers.get("cronoq-watch-cursor") || "";
            const missing = response.headers.get("cronoq-unavailable-shards");
            setStatus(missing ? `live (unavailable shards: ${missing})` : "live", "connected");
          },
          onEvent: (event) => {
            if (event.event === "error") throw new ApiError(500, JSON.parse(event.data));
            const now = performance.now();
            if (now - windowStart > 1000) {
              windowStart = now;
              inWindow = 0;
            }
            if (++inWindow > MAX_EVENTS_PER_S) {
              controller.abort();
              skipAhead = true;
              pause.textContent = "Resume";
              setStatus(
                `paused: more than ${MAX_EVENTS_PER_S} events a second, more than a page can show; Resume goes on live from then (the events in between are skipped), or watch one pool (#/live?pool=NAME)`,
                "paused",
              );
              return;
            }
            if (event.id) {
              if (seen.has(event.id)) return;
              seen.add(event.id);
              cursor = event.id;
            }
            const parsed = JSON.parse(event.data);
            const worker = (parsed.task || {}).worker_id;
            if (worker && !names.has(worker) && now - namesAsked > NAMES_EVERY_MS) askNames();
            waiting.hidden = true;
            body.prepend(row(parsed, names));
            while (body.children.length > KEEP) body.lastElementChild.remove();
            if (seen.size > KEEP * 10) seen.clear();
          },
        });
      } catch (err) {
        if (controller.signal.aborted) return;
        if (err instanceof ApiError && [400, 401, 403].includes(err.status)) {
          if (err.status === 400 && cursor) {
            cursor = ""; // too old to resume: go on live, and say so
            setStatus(`resumed live: ${err.message}`, "reconnecting");
            continue;
          }
          setStatus(`stopped: ${err.message}`, "error");
          return;
        }
        setStatus(`reconnecting… (${err.message || err})`, "reconnecting");
      }
      if (controller.signal.aborted) return;
      const wait = RETRY_MS[Math.min(failures++, RETRY_MS.length - 1)];
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  }

  // Pause ends the stream (a stream costs the server the conversion of every event it sends);
  // Resume goes on from the last event shown, so none in between is missed.
  const pause = h("button", {
    type: "button",
    class: "pause",
    onclick: () => {
      if (controller.signal.aborted) {
        if (skipAhead) cursor = "";
        skipAhead = false;
        inWindow = 0;
        controller = new AbortController();
        pause.textContent = "Pause";
        setStatus("connecting…", "");
        run();
      } else {
        controller.abort();
        pause.textContent = "Resume";
        setStatus("paused", "paused");
      }
    },
  }, "Pause");
  run();
  const view = h("div", { class: "live-view" },
    h("h1", null, "Live"),
    h("p", { class: "muted" }, pool ? `Events of pool ${pool}.` : "Events of every pool you may read, newest first."),
    h("p", null, status, " ", pause),
    waiting,
    list);
  return { view, stop: () => controller.abort() };
}
