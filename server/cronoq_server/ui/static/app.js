// The dashboard's entry point: hash routes (#/overview, #/tasks?…, #/task/<id or key>, #/live,
// #/schedules, #/workers), the token form shown when the API answers 401, and the search box.
import { ApiError, caller, serverInfo, setToken, token } from "./api.js";
import { LOCAL_ZONE, h, show } from "./dom.js";
import { renderLive } from "./live.js";
import { renderOverview, shardTitle } from "./overview.js";
import { renderSchedules } from "./schedules.js";
import { renderTask, renderTasks } from "./tasks.js";
import { renderWorkers } from "./workers.js";

const VIEWS = {
  overview: () => renderOverview(),
  tasks: (params) => renderTasks(params),
  task: (params, rest) => renderTask(decodeURIComponent(rest.join("/"))),
  schedules: () => renderSchedules(),
  workers: () => renderWorkers(),
};

const main = document.getElementById("main");
const standby = document.getElementById("standby");
const serverLabel = document.getElementById("server");
const tokenForm = document.getElementById("token-form");
const signOut = document.getElementById("sign-out");
document.getElementById("zone").textContent = LOCAL_ZONE; // the zone a time shown on hover is in

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, search] = raw.split("?", 2);
  return { path: path || "overview", params: new URLSearchParams(search || "") };
}

const REFRESH_MS = 5000; // the overview re-reads the snapshot this often while the tab is visible
let refreshTimer = 0;
let generation = 0; // a render that finishes after a newer one started is dropped
let stopLive = null; // ends the live view's stream when another view is drawn

// A standby reads its shard from its leader (changes are refused there): the page says so.
async function showRole() {
  try {
    const info = await serverInfo();
    const role = info.role === "ROLE_STANDBY" ? "standby" : "leader";
    const term = Number(info.term) ? ` · term ${info.term}` : ""; // 0 on SQLite: nothing to tell
    serverLabel.textContent = `${shardTitle(info.shard, info.shard_number)} · ${role}${term}`;
    standby.hidden = info.role !== "ROLE_STANDBY";
    const of = info.shard_number ? ` of shard ${info.shard}` : "";
    standby.textContent = standby.hidden ? "" : `This server is a standby${of}: `
      + `its pages are read from its leader (${info.leader || "not known yet"}); `
      + "changes (Retry, Cancel, Delete, Pause, Resume) and the Live view need the leader's own dashboard.";
  } catch {
    serverLabel.textContent = "";
    standby.hidden = true; // a missing token is asked for by the view
  }
}

async function render(refresh = false) {
  clearTimeout(refreshTimer);
  if (!refresh) showRole(); // not on the overview's own refresh: one call fewer every 5 s
  if (stopLive) stopLive();
  stopLive = null;
  const { path, params } = parseHash();
  const [first, ...rest] = path.split("/");
  const view = first in VIEWS || first === "live" ? first : "overview";
  const mine = ++generation;
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("active", link.dataset.view === view || (view === "task" && link.dataset.view === "tasks"));
  }
  signOut.hidden = !token();
  tokenForm.hidden = true;
  if (!refresh) {
    show(main, h("p", { class: "muted" }, "Loading…"));
    delete main.dataset.view; // names the view drawn, so not the last one while this one loads
  }
  const started = performance.now();
  try {
    let content;
    if (view === "live") {
      await caller(); // a token that is needed and missing shows the form first
      if (mine !== generation) return;
      const live = renderLive(params);
      stopLive = live.stop;
      content = live.view;
    } else {
      content = await VIEWS[view](params, rest);
    }
    if (mine !== generation) return;
    show(main, content);
    main.dataset.loadedMs = String(Math.round(performance.now() - started)); // this view's calls and drawing
    main.dataset.pageMs = String(Math.round(performance.now())); // since the page's navigation began
    main.dataset.view = view;
    if (view === "overview") refreshTimer = setTimeout(refreshOverview, REFRESH_MS);
  } catch (err) {
    if (mine !== generation) return;
    if (err instanceof ApiError && err.status === 401) {
      show(main, h("p", { class: "warning" }, token() ? "That token was refused." : "A token is needed."));
      tokenForm.hidden = false;
      tokenForm.elements.token.focus();
    } else {
      show(main, h("p", { class: "error", role: "alert" }, err instanceof ApiError ? `${err.code}: ${err.message}` : String(err)));
    }
    main.dataset.view = "error";
    if (view === "overview" && tokenForm.hidden) refreshTimer = setTimeout(refreshOverview, REFRESH_MS);
  }
}

function refreshOverview() {
  if (document.hidden) refreshTimer = setTimeout(refreshOverview, REFRESH_MS);
  else render(true);
}

tokenForm.addEventListener("submit", (event) => {
  event.preventDefault();
  setToken(tokenForm.elements.token.value.trim());
  tokenForm.reset();
  render();
});

signOut.addEventListener("click", () => {
  setToken("");
  render();
});

document.getElementById("search").addEventListener("submit", (event) => {
  event.preventDefault();
  const q = event.target.elements.q.value.trim();
  if (q) location.hash = `#/task/${encodeURIComponent(q)}`;
});

window.addEventListener("hashchange", () => render());
render();
