// Tasks: GET /v1/tasks?newest_first=true paged across shards, filtered by pool (a choice of the
// pools the viewer may read) and state, with tasks picked by checkbox or "all that match" for a
// bulk Cancel, Retry or Delete (counted by a dry run and confirmed on the page); a task's page
// (GET /v1/tasks/{id}) with its payload, result and error as text, its attempts, its dependencies
// and dependents, its parent and the tasks it spawned (and its workflow drawn as a graph, see
// workflow.js), and Retry, Cancel and Delete where its state and the viewer's grants allow.
// A key is looked up with GET /v1/tasks?key= on every shard: one that names tasks in two shards
// lists both.
import { call, caller, may, query, readablePools, workerNames } from "./api.js";
import { duration, h, show, table, when } from "./dom.js";
import { workflowSection } from "./workflow.js";

const STATES = ["", "PENDING", "BLOCKED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"];
const PAGE_SIZE = 50;
const TERMINAL = new Set(["TASK_STATE_SUCCEEDED", "TASK_STATE_FAILED", "TASK_STATE_CANCELLED", "TASK_STATE_EXPIRED"]);
const RETRYABLE = new Set(["TASK_STATE_FAILED", "TASK_STATE_CANCELLED", "TASK_STATE_EXPIRED"]);
const MAX_CHILDREN = 1000; // GetTask's children at most
const ERROR_SHOWN = 80; // characters of an error in the list; the whole text is its title

// The bulk actions: their route, the permission each needs, and the words the page uses.
const BULK = {
  cancel: { path: "/v1/tasks/bulk-cancel", permission: "cancel", verb: "Cancel", done: "cancelled" },
  retry: { path: "/v1/tasks/bulk-retry", permission: "submit", verb: "Retry", done: "retried" },
  delete: { path: "/v1/tasks/bulk-delete", permission: "admin", verb: "Delete", done: "deleted" },
};

let notice = null; // what the last action did, shown once by the next drawing of a view

function takeNotice() {
  const shown = notice;
  notice = null;
  return shown;
}

/** A task state's name without its prefix ("SUCCEEDED"). */
export function stateName(state) {
  return String(state || "").replace(/^TASK_STATE_/, "");
}

/** A task's state as a word coloured by its class ("SUCCEEDED" in state-succeeded). */
export function stateBadge(state) {
  const name = stateName(state);
  return h("span", { class: `state state-${name.toLowerCase()}` }, name);
}

/** A worker by its name (its id as the title), or its id when its name is not known. */
export function workerLabel(id, names, name) {
  if (!id) return "";
  const known = name || names.get(id);
  return known ? h("span", { class: "worker", title: id }, known) : id;
}

function taskLink(id) {
  return h("a", { href: `#/task/${encodeURIComponent(id)}` }, String(id));
}

// The pool choice is filled when the pools are known: the list does not wait for the snapshot
// they may come from.
function filterForm(params) {
  const chosen = params.get("pool") || "";
  const option = (name) => h("option", { value: name, selected: chosen === name }, name);
  const pool = h("select", { name: "pool", "aria-label": "pool" }, h("option", { value: "" }, "all pools"), chosen ? option(chosen) : null);
  readablePools().then((pools) => {
    const current = pool.value; // as the viewer may have chosen meanwhile
    const names = [...new Set(chosen ? [...pools, chosen] : pools)].sort();
    pool.replaceChildren(h("option", { value: "" }, "all pools"), ...names.map(option));
    pool.value = current;
    pool.dataset.loaded = "true";
  }, () => { pool.dataset.loaded = "true"; });
  const state = h("select", { name: "state", "aria-label": "state" },
    STATES.map((s) => h("option", { value: s, selected: (params.get("state") || "") === s }, s || "any state")));
  return h("form", {
    class: "filters",
    onsubmit: (event) => {
      event.preventDefault();
      location.hash = `#/tasks${query({ pool: pool.value, state: state.value })}`;
    },
  }, pool, state, h("button", { type: "submit" }, "Filter"));
}

/** How long a task ran (started → finished), or has been running. */
function ranFor(task) {
  if (!task.started_at) return "";
  if (task.finished_at) return duration(Date.parse(task.finished_at) - Date.parse(task.started_at));
  return task.state === "TASK_STATE_RUNNING" ? `${duration(Date.now() - Date.parse(task.started_at))} so far` : "";
}

function errorCell(error) {
  if (!error) return "";
  const short = error.length > ERROR_SHOWN ? `${error.slice(0, ERROR_SHOWN)}…` : error;
  return h("span", { class: "error", title: error }, short);
}

function taskRows(tasks, names) {
  return tasks.map((t) => [
    taskLink(t.id), t.pool || "", t.key || "",
    stateBadge(t.state),
    String(t.attempt ?? 0), when(t.created_at), when(t.finished_at), ranFor(t),
    workerLabel(t.worker_id, names), errorCell(t.error),
  ]);
}

const TASK_HEADERS = ["id", "pool", "key", "state", "attempt", "created", "finished", "duration", "worker", "error"];

/** The words for a filter: "pool default, state FAILED" (or "every pool you may act on"). */
function describe(pool, state) {
  return [pool ? `pool ${pool}` : "every pool you may act on", state ? `state ${state}` : null].filter(Boolean).join(", ");
}

/**
 * The bulk actions of the task list: a checkbox per row and one for the page, "All that match",
 * and the actions the viewer may take; each asks for the count first (dry_run), shows it in a
 * dialog on the page, and acts only when confirmed.
 */
function bulkActions({ who, pool, state, list }) {
  const allowed = Object.entries(BULK).filter(([, a]) => (pool ? may(who, a.permission, pool) : (who.permissions || []).includes(a.permission)));
  if (!allowed.length) return null; // a viewer who may change nothing gets no checkboxes
  const picked = new Set();
  let allMatching = false;
  const boxes = [...list.querySelectorAll("tbody tr")].map((row) => {
    const id = row.querySelector("td a").textContent;
    const box = h("input", { type: "checkbox", class: "pick", "aria-label": `select task ${id}`, "data-id": id });
    box.addEventListener("change", () => {
      if (box.checked) picked.add(id);
      else picked.delete(id);
      allMatching = false;
      update();
    });
    row.prepend(h("td", null, box));
    return box;
  });
  const pageBox = h("input", { type: "checkbox", class: "pick-page", "aria-label": "select the tasks of this page" });
  pageBox.addEventListener("change", () => {
    for (const box of boxes) {
      box.checked = pageBox.checked;
      if (box.checked) picked.add(box.dataset.id);
      else picked.delete(box.dataset.id);
    }
    allMatching = false;
    update();
  });
  list.querySelector("thead tr").prepend(h("th", null, pageBox));
  const everything = h("button", {
    type: "button",
    class: "pick-all",
    onclick: () => {
      allMatching = !allMatching;
      for (const box of boxes) box.checked = allMatching;
      pageBox.checked = allMatching;
      picked.clear();
      if (allMatching) for (const box of boxes) picked.add(box.dataset.id);
      update();
    },
  }, "Select all that match");
  const chosen = h("span", { class: "picked", role: "status" });
  const dialog = h("div", { class: "confirm", role: "dialog", "aria-modal": "true", hidden: true });
  const status = h("p", { class: "status error", role: "alert" });
  const buttons = allowed.map(([name, action]) => h("button", {
    type: "button",
    class: `bulk-${name}`,
    disabled: true,
    onclick: () => ask(action),
  }, `${action.verb}…`));

  function filter() {
    return allMatching
      ? { ...(pool ? { pool } : {}), ...(state ? { states: [`TASK_STATE_${state}`] } : {}) }
      : { ids: [...picked] };
  }

  function what() {
    return allMatching ? `that match ${describe(pool, state)}` : `of the ${picked.size} selected`;
  }

  function update() {
    everything.textContent = allMatching ? "Clear the selection" : "Select all that match";
    chosen.textContent = allMatching
      ? `All tasks that match ${describe(pool, state)} are selected (on every page).`
      : picked.size ? `${picked.size} selected.` : "";
    for (const button of buttons) button.disabled = !allMatching && !picked.size;
  }

  async function ask(action) {
    status.textContent = "";
    let counted;
    try {
      counted = await call("POST", action.path, { filter: filter(), dry_run: true });
    } catch (err) {
      status.textContent = `${action.verb} refused: ${err.message}`;
      return;
    }
    const matched = Number(counted.matched || 0);
    const missing = counted.unavailable_shards || [];
    const close = () => { dialog.hidden = true; dialog.replaceChildren(); };
    show(dialog,
      h("p", { class: "question" }, matched
        ? `${action.verb} ${matched} ${matched === 1 ? "task" : "tasks"} ${what()}?`
        : `No task ${what()} can be ${action.done}: nothing to do.`),
      missing.length ? h("p", { class: "warning" }, `Not counted: unavailable shards ${missing.join(", ")}.`) : null,
      matched ? h("button", {
        type: "button",
        class: "danger confirm-action",
        onclick: async () => {
          close();
          try {
            const sent = { filter: filter() };
            notice = result(action, await call("POST", action.path, sent), sent);
            window.dispatchEvent(new HashChangeEvent("hashchange")); // the list drawn again, with the result
          } catch (err) {
            status.textContent = `${action.verb} refused: ${err.message}`;
          }
        },
      }, `${action.verb} ${matched} ${matched === 1 ? "task" : "tasks"}`) : null,
      h("button", { type: "button", class: "back", onclick: close }, matched ? "Back" : "Close"));
    dialog.hidden = false;
    dialog.querySelector("button").focus();
  }

  update();
  return h("div", { class: "bulk" }, h("p", { class: "actions" }, everything, " ", buttons, " ", chosen), dialog, status);
}

/** What a bulk action did: its totals, a row per shard, and the shards that could not be asked;
 * when a shard stopped at its time bound, Continue sends the same call again (it changes only
 * what is left). */
function result(action, answer, sent) {
  const shards = answer.shards || [];
  const missing = answer.unavailable_shards || [];
  const again = answer.incomplete ? h("button", {
    type: "button",
    class: "continue",
    onclick: async () => {
      try {
        notice = result(action, await call("POST", action.path, sent), sent);
      } catch (err) {
        notice = h("p", { class: "error", role: "alert" }, `${action.verb} refused: ${err.message}`);
      }
      window.dispatchEvent(new HashChangeEvent("hashchange"));
    },
  }, "Continue") : null;
  return h("div", { class: "bulk-result", role: "status" },
    h("p", null, `${action.verb}: ${answer.changed || 0} of ${answer.matched || 0} matched ${action.done}.`),
    shards.length
      ? table(["shard", "matched", action.done, ""], shards.map((s) => [
        s.shard, String(s.matched || 0), String(s.changed || 0), s.incomplete ? "stopped at its time bound" : "",
      ]), { class: "bulk-shards" })
      : null,
    missing.length ? h("p", { class: "warning" }, `Unavailable shards (not changed; repeat the action when they are back): ${missing.join(", ")}`) : null,
    again ? h("p", { class: "warning" }, "Not finished: a shard stopped at its time bound (what it did is counted). ", again) : null);
}

export async function renderTasks(params) {
  const pool = params.get("pool") || "";
  const state = params.get("state") || "";
  const pageToken = params.get("page_token") || "";
  const previous = (params.get("prev") || "").split(",").filter((t) => t !== "");
  const [listed, who, names] = await Promise.all([
    call("GET", `/v1/tasks${query({
      pool, state: state ? `TASK_STATE_${state}` : "", page_size: PAGE_SIZE, page_token: pageToken, newest_first: true,
    })}`),
    caller(),
    workerNames(),
  ]);
  const tasks = listed.tasks || [];
  // Previous pages: the tokens that led here, kept in the address ("-" for the first page).
  const back = previous.length
    ? h("a", { href: `#/tasks${query({ pool, state, page_token: previous.at(-1) === "-" ? "" : previous.at(-1), prev: previous.slice(0, -1).join(",") })}` }, "← newer")
    : null;
  const next = listed.next_page_token
    ? h("a", { href: `#/tasks${query({ pool, state, page_token: listed.next_page_token, prev: [...previous, pageToken || "-"].join(",") })}` }, "older →")
    : null;
  const list = tasks.length ? table(TASK_HEADERS, taskRows(tasks, names), { class: "task-list" }) : null;
  return h("div", { class: "tasks" },
    h("h1", null, "Tasks ", h("small", { class: "muted" }, "newest first")),
    takeNotice(),
    filterForm(params),
    (listed.unavailable_shards || []).length
      ? h("p", { class: "warning" }, `Unavailable shards (their tasks are missing): ${listed.unavailable_shards.join(", ")}`)
      : null,
    list ? [bulkActions({ who, pool, state, list }), list] : h("p", { class: "muted" }, "No tasks."),
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
    found.length ? table(TASK_HEADERS, taskRows(found, new Map()), { class: "task-list" }) : h("p", { class: "muted" }, "No task has this key."));
}

const OUTCOME_CLASS = { SUCCEEDED: "state-succeeded", FAILED: "state-failed", LOST: "state-failed" };

function attemptRows(attempts, names) {
  return attempts.map((a) => {
    const outcome = String(a.outcome || "").replace(/^ATTEMPT_OUTCOME_/, "");
    return [
      String(a.attempt ?? ""), workerLabel(a.worker_id, names, a.worker_name), when(a.started_at), when(a.ended_at),
      a.duration_ms !== undefined ? duration(Number(a.duration_ms)) : "",
      h("span", { class: OUTCOME_CLASS[outcome] || "" }, outcome), errorCell(a.error),
    ];
  });
}

/** A button that runs `run`, then draws the page again (unless `run` answers false, having gone
 * elsewhere); a refusal is shown in `status`. */
function action(label, cls, status, run) {
  return h("button", {
    type: "button",
    class: cls,
    onclick: async () => {
      try {
        if ((await run()) !== false) window.dispatchEvent(new HashChangeEvent("hashchange")); // drawn again, in its new state
      } catch (err) {
        status.textContent = `${label} refused: ${err.message}`;
      }
    },
  }, label);
}

/** Retry, Cancel and Delete, each where the task's state and the viewer's grants allow it. */
function taskActions(task, who, status) {
  const path = `/v1/tasks/${task.id}`;
  const retry = RETRYABLE.has(task.state) && may(who, "submit", task.pool)
    ? action("Retry", "retry", status, () => call("POST", `${path}/retry`, {}))
    : null;
  const cancel = !TERMINAL.has(task.state) && !task.cancel_requested && may(who, "cancel", task.pool)
    ? action("Cancel", "danger cancel", status, () => call("POST", `${path}/cancel`, {}))
    : null;
  // Delete asks once more on the page itself (no confirm() dialog), then shows the list.
  const remove = TERMINAL.has(task.state) && may(who, "admin", task.pool)
    ? h("button", {
      type: "button",
      class: "delete",
      onclick: (event) => {
        event.target.replaceWith(action("Really delete", "danger delete", status, async () => {
          await call("DELETE", path);
          notice = h("p", { class: "bulk-result", role: "status" }, `Task ${task.id} deleted.`);
          location.hash = `#/tasks${query({ pool: task.pool })}`;
          return false;
        }));
      },
    }, "Delete")
    : null;
  return retry || cancel || remove ? h("p", { class: "actions" }, retry, cancel, remove) : null;
}

/** A handler's last progress: a bar when it is a fraction, the number else; its message; when. */
function progressCell(progress) {
  const value = Number(progress.value ?? 0);
  const fraction = value >= 0 && value <= 1;
  return h("span", { class: "progress" },
    fraction ? h("progress", { max: "1", value: String(value) }) : null,
    ` ${fraction ? `${Math.round(value * 100)}%` : String(value)}`,
    progress.message ? ` — ${progress.message}` : "",
    progress.updated_at ? h("span", { class: "muted" }, " (", when(progress.updated_at), ")") : null);
}

/** "48 tasks"; GetTask lists at most MAX_CHILDREN of them. */
function spawnedCount(n) {
  return n >= MAX_CHILDREN ? `${MAX_CHILDREN} tasks or more` : `${n} ${n === 1 ? "task" : "tasks"}`;
}

async function renderTaskById(id) {
  const [got, who, names] = await Promise.all([
    call("GET", `/v1/tasks/${id}${query({ include_dependents: true, include_attempts: true, include_children: true })}`), caller(), workerNames(),
  ]);
  const task = got.task;
  const children = got.children || [];
  const workflow = await workflowSection(got);
  const status = h("p", { class: "status error", role: "alert" });
  const attempts = got.attempts || [];
  return h("div", { class: "task" },
    h("h1", null, `Task ${task.id}`),
    h("dl", null,
      field("pool", task.pool || ""), field("key", task.key || ""),
      task.group_key ? field("group", task.group_key) : null, field("state", stateName(task.state)),
      field("attempt", `${task.attempt ?? 0} of ${task.max_attempts ?? "?"}`), field("priority", String(task.priority ?? 0)),
      field("worker", workerLabel(task.worker_id, names)), field("created", when(task.created_at)),
      field("run at", when(task.run_at)), field("started", when(task.started_at)),
      field("finished", when(task.finished_at)), field("duration", ranFor(task)),
      field("lease expires", when(task.lease_expires_at)),
      field("timeout", Number(task.timeout_ms) ? `${task.timeout_ms} ms` : "none"),
      field("cancel requested", task.cancel_requested ? "yes" : "no"),
      Number(task.snoozes) ? field("snoozed", `${task.snoozes} time${Number(task.snoozes) === 1 ? "" : "s"}`) : null,
      task.progress ? field("progress", progressCell(task.progress)) : null,
      task.checkpoint ? field("checkpoint", `${atob(task.checkpoint).length} bytes, given to the next attempt`) : null,
      Number(task.parent_id) ? field("parent", taskLink(task.parent_id)) : null,
      children.length ? field("spawned", spawnedCount(children.length)) : null,
      field("depends on", links(task.depends_on)),
      field("dependents", links(got.dependents))),
    taskActions(task, who, status), status,
    task.error ? [h("h2", null, "Error"), h("pre", { class: "error" }, task.error)] : null,
    h("h2", null, "Attempts"),
    attempts.length
      ? table(["attempt", "worker", "started", "ended", "duration", "outcome", "error"], attemptRows(attempts, names), { class: "attempts" })
      : h("p", { class: "muted" }, Number(task.attempt) ? "No attempt history kept for this task." : "Not started yet."),
    h("h2", null, "Payload"), h("pre", { class: "payload" }, bytesText(task.payload_json, task.payload)),
    task.result || task.result_json !== undefined
      ? [h("h2", null, "Result"), h("pre", { class: "result" }, bytesText(task.result_json, task.result))]
      : null,
    workflow);
}
