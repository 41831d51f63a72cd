// Tasks: GET /v1/tasks paged across shards in id order, filtered by pool and state; a task's
// page (GET /v1/tasks/{id}) with its payload, result and error as text, its dependencies and
// dependents, and Cancel for a viewer that may cancel in its pool. A key is looked up with
// GET /v1/tasks?key= on every shard: one that names tasks in two shards lists both.
import { call, caller, may, query } from "./api.js";
import { h, table, when } from "./dom.js";

const STATES = ["", "PENDING", "BLOCKED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"];
const PAGE_SIZE = 50;
const TERMINAL = new Set(["TASK_STATE_SUCCEEDED", "TASK_STATE_FAILED", "TASK_STATE_CANCELLED"]);

function stateName(state) {
  return String(state || "").replace(/^TASK_STATE_/, "");
}

/** A task's state as a word coloured by its class ("SUCCEEDED" in state-succeeded). */
export function stateBadge(state) {
  const name = stateName(state);
  return h("span", { class: `state state-${name.toLowerCase()}` }, name);
}

function taskLink(id) {
  return h("a", { href: `#/task/${encodeURIComponent(id)}` }, String(id));
}

function filterForm(params) {
  const pool = h("input", { name: "pool", value: params.get("pool") || "", placeholder: "all pools", "aria-label": "pool" });
  const state = h("select", { name: "state", "aria-label": "state" },
    STATES.map((s) => h("option", { value: s, selected: (params.get("state") || "") === s }, s || "any state")));
  return h("form", {
    class: "filters",
    onsubmit: (event) => {
      event.preventDefault();
      location.hash = `#/tasks${query({ pool: pool.value.trim(), state: state.value })}`;
    },
  }, pool, state, h("button", { type: "submit" }, "Filter"));
}

export async function renderTasks(params) {
  const pool = params.get("pool") || "";
  const state = params.get("state") || "";
  const pageToken = params.get("page_token") || "";
  const previous = (params.get("prev") || "").split(",").filter((t) => t !== "");
  const listed = await call("GET", `/v1/tasks${query({
    pool, state: state ? `TASK_STATE_${state}` : "", page_size: PAGE_SIZE, page_token: pageToken,
  })}`);
  const tasks = listed.tasks || [];
  const rows = taskRows(tasks);
  // Previous pages: the tokens that led here, kept in the address ("-" for the first page).
  const back = previous.length
    ? h("a", { href: `#/tasks${query({ pool, state, page_token: previous.at(-1) === "-" ? "" : previous.at(-1), prev: previous.slice(0, -1).join(",") })}` }, "← previous")
    : null;
  const next = listed.next_page_token
    ? h("a", { href: `#/tasks${query({ pool, state, page_token: listed.next_page_token, prev: [...previous, pageToken || "-"].join(",") })}` }, "next →")
    : null;
  return h("div", { class: "tasks" },
    h("h1", null, "Tasks"),
    filterForm(params),
    (listed.unavailable_shards || []).length
      ? h("p", { class: "warning" }, `Unavailable shards (their tasks are missing): ${listed.unavailable_shards.join(", ")}`)
      : null,
    tasks.length
      ? table(TASK_HEADERS, rows, { class: "task-list" })
      : h("p", { class: "muted" }, "No tasks."),
    h("p", { class: "pager" }, back, " ", next));
}

/** A payload or result as readable text: JSON pretty-printed, UTF-8 as text, else base64. */
function bytesText(json, base64) {
  if (json !== undefined) return JSON.stringify(json, null, 2);
  if (!base64) return "";
  try {
    const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
    return new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch {
    return `base64: ${base64}`;
  }
}

function field(name, value) {
  return [h("dt", null, name), h("dd", null, value)];
}

function links(ids) {
  return (ids || []).flatMap((id, i) => (i ? [", ", taskLink(id)] : [taskLink(id)]));
}

function taskRows(tasks) {
  return tasks.map((t) => [
    taskLink(t.id), t.pool || "", t.key || "",
    stateBadge(t.state),
    String(t.attempt ?? 0), when(t.created_at), t.worker_id || "",
  ]);
}

const TASK_HEADERS = ["id", "pool", "key", "state", "attempt", "created", "worker"];

/** The task a search names: by id, or by key on every shard (a list when several hold it). */
export async function renderTask(ref) {
  if (/^[0-9]+$/.test(ref)) return renderTaskById(ref);
  const listed = await call("GET", `/v1/tasks${query({ key: ref })}`);
  const found = listed.tasks || [];
  const unavailable = (listed.unavailable_shards || []).length
    ? h("p", { class: "warning" }, `Unavailable shards (a task with this key may be there): ${listed.unavailable_shards.join(", ")}`)
    : null;
  if (found.length === 1 && !unavailable) return renderTaskById(found[0].id);
  return h("div", { class: "tasks" },
    h("h1", null, "Tasks with key ", h("code", null, ref)),
    found.length > 1 ? h("p", { class: "warning" }, `This key names tasks in ${found.length} shards (keys are unique only within a shard): use the id.`) : null,
    unavailable,
    found.length ? table(TASK_HEADERS, taskRows(found), { class: "task-list" }) : h("p", { class: "muted" }, "No task has this key."));
}

async function renderTaskById(id) {
  const [got, who] = await Promise.all([call("GET", `/v1/tasks/${id}${query({ include_dependents: true })}`), caller()]);
  const task = got.task;
  const status = h("p", { class: "status" });
  const cancellable = !TERMINAL.has(task.state) && !task.cancel_requested && may(who, "cancel", task.pool);
  const cancel = !cancellable ? null : h("button", {
    type: "button",
    class: "danger",
    onclick: async () => {
      try {
        await call("POST", `/v1/tasks/${task.id}/cancel`, {});
        window.dispatchEvent(new HashChangeEvent("hashchange")); // drawn again, in its new state
      } catch (err) {
        status.textContent = `Cancel refused: ${err.message}`;
      }
    },
  }, "Cancel");
  return h("div", { class: "task" },
    h("h1", null, `Task ${task.id}`),
    h("dl", null,
      field("pool", task.pool || ""), field("key", task.key || ""), field("state", stateName(task.state)),
      field("attempt", `${task.attempt ?? 0} of ${task.max_attempts ?? "?"}`), field("priority", String(task.priority ?? 0)),
      field("worker", task.worker_id || ""), field("created", when(task.created_at)),
      field("run at", when(task.run_at)), field("started", when(task.started_at)),
      field("finished", when(task.finished_at)), field("lease expires", when(task.lease_expires_at)),
      field("timeout", Number(task.timeout_ms) ? `${task.timeout_ms} ms` : "none"),
      field("cancel requested", task.cancel_requested ? "yes" : "no"),
      field("depends on", links(task.depends_on)),
      field("dependents", links(got.dependents))),
    cancel, status,
    task.error ? [h("h2", null, "Error"), h("pre", { class: "error" }, task.error)] : null,
    h("h2", null, "Payload"), h("pre", { class: "payload" }, bytesText(task.payload_json, task.payload)),
    task.result || task.result_json !== undefined
      ? [h("h2", null, "Result"), h("pre", { class: "result" }, bytesText(task.result_json, task.result))]
      : null);
}
