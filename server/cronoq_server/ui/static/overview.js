// Overview: every shard of GET /v1/snapshot (name, number, leader, standbys, term; "Single
// server" when unsharded), its per-pool counts by state with a Paused badge and Pause / Resume
// (POST /v1/pools/{pool}/pause|resume) for a viewer with admin on the pool, a capped pool's
// groups with the most tasks, resources (a keyed one's keys at their limit) and
// workers, and charts of the pools' recent activity; shards the server could not reach are
// named as unavailable. The snapshot holds only the pools the viewer may read.
import { call, caller, may, notePools } from "./api.js";
import { lineChart } from "./chart.js";
import { ago, h, table } from "./dom.js";

export const STATES = ["pending", "blocked", "running", "succeeded", "failed", "cancelled", "expired"];

let refused = ""; // the last refused Pause / Resume, kept across the page's refreshes until the next success

/** Pause or Resume for a pool, for a viewer with admin on it; a refusal is shown in `status`. */
function pauseButton(pool, status) {
  const verb = pool.paused ? "Resume" : "Pause";
  return h("button", {
    type: "button",
    class: pool.paused ? "resume-pool" : "pause-pool",
    onclick: async () => {
      try {
        await call("POST", `/v1/pools/${encodeURIComponent(pool.pool)}/${verb.toLowerCase()}`, {});
        refused = "";
        window.dispatchEvent(new HashChangeEvent("hashchange")); // drawn again, with its badge
      } catch (err) {
        refused = `${verb} ${pool.pool} refused: ${err.message}`;
        status.textContent = refused;
      }
    },
  }, verb);
}

function poolRows(shard, who, status) {
  return (shard.pools || []).map((pool) => [
    [h("a", { href: `#/tasks?pool=${encodeURIComponent(pool.pool)}` }, pool.pool),
      pool.paused ? [" ", h("span", { class: "badge paused", title: "nothing is leased from this pool" }, "Paused")] : null],
    ...STATES.map((state) => h("span", { class: `num state-${state}`, "data-count": state }, String(pool[state] ?? 0))),
    may(who, "admin", pool.pool) ? pauseButton(pool, status) : "",
  ]);
}

/** A pool with max_running_per_group: its cap and the groups the snapshot lists (those with the
 * most tasks pending and running), each marked when it runs as many as the cap allows. */
function groupsOf(pool) {
  const cap = Number(pool.max_running_per_group || 0);
  if (cap <= 0) return null;
  const rows = (pool.groups || []).map((g) => {
    const running = Number(g.running ?? 0);
    return [
      g.group_key ? g.group_key : h("span", { class: "muted", title: "tasks without a group key" }, "(no group)"),
      h("span", { class: "num" }, String(g.pending ?? 0)),
      h("span", { class: "num" }, String(running)),
      running >= cap ? h("span", { class: "badge at-cap", title: "no more of this group starts until one ends" }, "at cap") : "",
    ];
  });
  return h("section", { class: "groups", "data-pool": pool.pool },
    h("h3", null, `Groups in ${pool.pool} `, h("small", null, `at most ${cap} running per group`)),
    rows.length
      ? table(["group", "pending", "running", ""], rows)
      : h("p", { class: "muted" }, "No group has tasks pending or running."));
}

const KEYS_SHOWN = 10; // the snapshot lists at most this many keys at their limit

/** A keyed resource (per_key): "per key", the keys in use and those at their limit. */
function keyedCell(r) {
  if (!r.per_key) return "";
  const atLimit = (r.keys_at_limit || []).slice(0, KEYS_SHOWN);
  return h("span", { class: "keyed" }, `per key · ${r.keys ?? 0} keys in use`,
    atLimit.length ? [" · at limit: ", atLimit.map((key, i) => [i ? ", " : "", h("code", null, key)])] : null);
}

/** The shard's resources; the keys column only when one of them is keyed. */
function resourceTable(shard) {
  const resources = shard.resources || [];
  const keyed = resources.some((r) => r.per_key);
  return table(["resource", "in use / capacity", "rate", ...(keyed ? ["keys"] : [])], resources.map((r) => [
    r.name,
    // A keyed resource's in_use is summed over its keys; its sizes are each key's.
    Number(r.capacity) > 0 ? (r.per_key ? `${r.in_use ?? 0} (${r.capacity} per key)` : `${r.in_use} / ${r.capacity}`) : "",
    r.rate ? `${r.rate}/s, burst ${r.burst}${r.per_key ? " per key" : ""}` : "",
    ...(keyed ? [keyedCell(r)] : []),
  ]), { class: "resources" });
}

function workerRows(shard) {
  return (shard.workers || []).map((w) => [
    w.id || "",
    w.name || "",
    (w.pools || []).join(", "),
    String(w.running ?? 0),
    ago(w.last_seen_at),
  ]);
}

/** The shard's title: "Single server" when the deployment is not sharded, else its name and number. */
export function shardTitle(name, number) {
  return name === "unsharded" ? "Single server" : `Shard ${name} #${number ?? 0}`;
}

function outboxRows(shard) {
  return (shard.outboxes || []).map((o) => [
    o.name,
    o.pending,
    `${Number(o.lag_seconds).toFixed(3)} s`,
    o.relayed,
    o.dead,
    o.last_error || "",
  ]);
}

function shardCard(shard, who, status) {
  const standbys = (shard.standbys || []).length ? shard.standbys.join(", ") : "none seen";
  const term = Number(shard.term) ? ` · term ${shard.term}` : ""; // 0 on SQLite: nothing to tell
  return h("section", { class: "shard", "data-shard": shard.shard },
    h("h2", null, `${shardTitle(shard.shard, shard.number)} `,
      h("small", null, `leader ${shard.leader || "?"}${term} · standbys ${standbys}`)),
    (shard.pools || []).length
      ? table(["pool", ...STATES, ""], poolRows(shard, who, status), { class: "counts" })
      : h("p", { class: "muted" }, "No pools."),
    (shard.pools || []).map(groupsOf),
    (shard.resources || []).length
      ? [h("h3", null, "Resources"), resourceTable(shard)]
      : null,
    (shard.outboxes || []).length
      ? [h("h3", null, "Outboxes"),
        table(["outbox", "waiting", "lag", "relayed", "dead", "last error"], outboxRows(shard), { class: "outboxes" })]
      : null,
    h("h3", null, "Workers"),
    (shard.workers || []).length
      ? table(["id", "name", "pools", "running", "last heartbeat"], workerRows(shard), { class: "workers" })
      : h("p", { class: "muted" }, "No workers."));
}

/**
 * Every pool's activity summed per bucket, aligned on time (buckets start at multiples of their
 * length on every shard); the last bucket, still filling, is left out.
 */
export function sumActivity(shards) {
  const all = shards.flatMap((shard) => shard.activity || []);
  if (!all.length) return null;
  const bucketMs = all[0].bucket_ms;
  const length = all[0].submitted.length;
  const end = Math.max(...all.map((a) => Number(a.start_unix_ms))) + length * bucketMs;
  const start = end - length * bucketMs;
  const fields = ["submitted", "started", "succeeded", "failed", "start_latency_sum_ms"];
  const sums = Object.fromEntries(fields.map((f) => [f, new Array(length).fill(0)]));
  sums.start_latency_max_ms = new Array(length).fill(0);
  for (const a of all) {
    const offset = (Number(a.start_unix_ms) - start) / bucketMs;
    for (let i = 0; i < length; i++) {
      const at = i + offset;
      if (at < 0 || at >= length) continue;
      for (const f of fields) sums[f][at] += Number(a[f][i] || 0);
      sums.start_latency_max_ms[at] = Math.max(sums.start_latency_max_ms[at], Number(a.start_latency_max_ms[i] || 0));
    }
  }
  for (const f of Object.keys(sums)) sums[f] = sums[f].slice(0, -1);
  return { bucketMs, sums };
}

const RECENT = 12; // the legend's figures: the last minute (12 buckets of 5 s)

function charts(shards) {
  const activity = sumActivity(shards);
  if (!activity) return null;
  const { bucketMs, sums } = activity;
  const perSecond = (values) => values.map((v) => v / (bucketMs / 1000));
  const recent = (values) => values.slice(-RECENT);
  const add = (values) => values.reduce((a, b) => a + b, 0);
  const rate = (values) => add(recent(values)) / ((RECENT * bucketMs) / 1000);
  const started = add(recent(sums.started));
  const mean = sums.started.map((n, i) => (n ? sums.start_latency_sum_ms[i] / n : null));
  const max = sums.started.map((n, i) => (n ? sums.start_latency_max_ms[i] : null));
  const note = "(last minute)";
  return h("div", { class: "charts" },
    lineChart({
      name: "throughput",
      title: "Throughput (tasks per second)",
      unit: `${bucketMs / 1000} s buckets`,
      bucketMs,
      note,
      lines: [
        { label: "submitted", cls: "c-submitted", values: perSecond(sums.submitted), summary: rate(sums.submitted) },
        { label: "succeeded", cls: "c-succeeded", values: perSecond(sums.succeeded), summary: rate(sums.succeeded) },
        { label: "failed", cls: "c-failed", values: perSecond(sums.failed), summary: rate(sums.failed) },
      ],
    }),
    lineChart({
      name: "latency",
      title: "Submit → start latency (ms, log scale)",
      unit: "from when a task was due to its start",
      bucketMs,
      log: true, // one slow start must not flatten every other bucket
      note,
      lines: [
        { label: "mean", cls: "c-mean", values: mean, summary: started ? add(recent(sums.start_latency_sum_ms)) / started : null },
        { label: "max", cls: "c-max", values: max, summary: started ? Math.max(...recent(sums.start_latency_max_ms)) : null },
      ],
    }));
}

export async function renderOverview() {
  const [snapshot, who] = await Promise.all([call("GET", "/v1/snapshot"), caller()]);
  notePools(who, snapshot);
  const shards = snapshot.shards || [];
  const unavailable = snapshot.unavailable_shards || [];
  const status = h("p", { class: "status error", role: "alert" }, refused);
  return h("div", { class: "overview" },
    h("h1", null, "Overview"),
    status,
    charts(shards),
    shards.map((shard) => shardCard(shard, who, status)),
    unavailable.map((name) => h("section", { class: "shard unavailable", "data-shard": name },
      h("h2", null, `Shard ${name} `, h("small", null, "unavailable")),
      h("p", null, "This shard did not answer; its pools are not counted above."))));
}
