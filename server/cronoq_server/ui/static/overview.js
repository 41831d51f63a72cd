// Overview: every shard of GET /v1/snapshot (name, number, leader, term), its per-pool counts by
// state, resources and workers; shards the server could not reach are named as unavailable.
import { call } from "./api.js";
import { h, table } from "./dom.js";

export const STATES = ["pending", "blocked", "running", "succeeded", "failed", "cancelled"];

function poolRows(shard) {
  return (shard.pools || []).map((pool) => [
    h("a", { href: `#/tasks?pool=${encodeURIComponent(pool.pool)}` }, pool.pool),
    ...STATES.map((state) => h("span", { class: `num state-${state}`, "data-count": state }, String(pool[state] ?? 0))),
  ]);
}

function resourceRows(shard) {
  return (shard.resources || []).map((r) => [
    r.name,
    Number(r.capacity) > 0 ? `${r.in_use} / ${r.capacity}` : "",
    r.rate ? `${r.rate}/s, burst ${r.burst}` : "",
  ]);
}

function workerRows(shard) {
  return (shard.workers || []).map((w) => [
    w.id || "",
    w.name || "",
    (w.pools || []).join(", "),
    String(w.running ?? 0),
    w.last_seen_at || "",
  ]);
}

function shardCard(shard) {
  return h("section", { class: "shard", "data-shard": shard.shard },
    h("h2", null, `Shard ${shard.shard} `, h("small", null, `#${shard.number} · term ${shard.term} · leader ${shard.leader || "?"}`)),
    (shard.pools || []).length
      ? table(["pool", ...STATES], poolRows(shard), { class: "counts" })
      : h("p", { class: "muted" }, "No pools."),
    (shard.resources || []).length
      ? [h("h3", null, "Resources"), table(["resource", "in use / capacity", "rate"], resourceRows(shard))]
      : null,
    h("h3", null, "Workers"),
    (shard.workers || []).length
      ? table(["id", "name", "pools", "running", "last heartbeat"], workerRows(shard), { class: "workers" })
      : h("p", { class: "muted" }, "No workers."));
}

export async function renderOverview() {
  const snapshot = await call("GET", "/v1/snapshot");
  const shards = snapshot.shards || [];
  const unavailable = snapshot.unavailable_shards || [];
  return h("div", { class: "overview" },
    h("h1", null, "Overview"),
    shards.map(shardCard),
    unavailable.map((name) => h("section", { class: "shard unavailable", "data-shard": name },
      h("h2", null, `Shard ${name} `, h("small", null, "unavailable")),
      h("p", null, "This shard did not answer; its pools are not counted above."))));
}
