// Workers: GET /v1/workers across shards (the pools the viewer may read): pools, labels,
// running tasks and last heartbeat.
import { call } from "./api.js";
import { ago, h, table, when } from "./dom.js";

export async function renderWorkers() {
  const listed = await call("GET", "/v1/workers");
  const workers = listed.workers || [];
  const rows = workers.map((w) => [
    w.id || "", w.name || "", w.shard || "", (w.pools || []).join(", "),
    h("span", { class: "labels" }, Object.entries(w.labels || {}).map(([k, v]) => `${k}=${v}`).join(", ")),
    String(w.concurrency ?? 0), String(w.running ?? 0), when(w.registered_at), ago(w.last_seen_at),
  ]);
  return h("div", { class: "workers-view" },
    h("h1", null, "Workers"),
    (listed.unavailable_shards || []).length
      ? h("p", { class: "warning" }, `Unavailable shards (their workers are missing): ${listed.unavailable_shards.join(", ")}`)
      : null,
    workers.length
      ? table(["id", "name", "shard", "pools", "labels", "concurrency", "running", "registered", "last heartbeat"], rows, { class: "workers" })
      : h("p", { class: "muted" }, "No workers."));
}
