// Schedules: GET /v1/schedules across shards, with the next fire in the schedule's zone and in
// UTC, and the last fire; Pause, Resume and
// Delete (PUT / DELETE /v1/pools/{pool}/schedules/{name}) for a viewer with `schedule` on the pool.
import { EXACT_NUMBERS, call, caller, may, parseExact } from "./api.js";
import { h, table, when, whenBoth } from "./dom.js";

// The fields a PUT sends back: the schedule as listed, without its times (the server keeps them).
// The listing is parsed with parseExact, so each number goes back as the server wrote it.
const KEPT = ["cron", "timezone", "payload", "payload_json", "content_type", "priority", "max_attempts", "resources", "timeout_ms", "fire_all_missed", "group_key"];

function path(s) {
  return `/v1/pools/${encodeURIComponent(s.pool)}/schedules/${encodeURIComponent(s.name)}`;
}

function actions(s, status) {
  const act = (label, run) => h("button", {
    type: "button",
    onclick: async () => {
      try {
        await run();
        window.dispatchEvent(new HashChangeEvent("hashchange")); // drawn again
      } catch (err) {
        status.textContent = `${label} refused: ${err.message}`;
      }
    },
  }, label);
  const body = Object.fromEntries(KEPT.filter((k) => s[k] !== undefined).map((k) => [k, s[k]]));
  const toggle = !EXACT_NUMBERS && hasNumber(s.payload_json)
    ? h("span", { class: "muted", title: "this browser cannot send its payload's numbers back exactly" }, "pause with the CLI")
    : s.paused
      ? act("Resume", () => call("PUT", path(s), { ...body, paused: false }))
      : act("Pause", () => call("PUT", path(s), { ...body, paused: true }));
  // Delete asks once more on the page itself (no confirm() dialog).
  const remove = h("button", {
    type: "button",
    class: "danger",
    onclick: (event) => {
      event.target.replaceWith(act("Really delete", () => call("DELETE", path(s))));
    },
  }, "Delete");
  return h("span", { class: "actions" }, toggle, remove);
}

// Without JSON.rawJSON (an older browser) a payload's number could go back changed.
function hasNumber(value) {
  return typeof value === "number" || (value !== null && typeof value === "object" && Object.values(value).some(hasNumber));
}

export async function renderSchedules() {
  const [listed, who] = await Promise.all([call("GET", "/v1/schedules", undefined, parseExact), caller()]);
  const schedules = listed.schedules || [];
  const status = h("p", { class: "status" });
  const rows = schedules.map((s) => [
    s.pool, s.name || "", h("code", null, s.cron || ""), s.timezone || "UTC", s.paused ? "paused" : "active",
    whenBoth(s.next_fire_at, s.timezone || "UTC"), when(s.last_fire_at),
    may(who, "schedule", s.pool) ? actions(s, status) : "",
  ]);
  return h("div", { class: "schedules-view" },
    h("h1", null, "Schedules"),
    (listed.unavailable_shards || []).length
      ? h("p", { class: "warning" }, `Unavailable shards (their schedules are missing): ${listed.unavailable_shards.join(", ")}`)
      : null,
    status,
    schedules.length
      ? table(["pool", "name", "cron", "timezone", "state", "next fire", "last fire", ""], rows, { class: "schedules" })
      : h("p", { class: "muted" }, "No schedules."));
}
