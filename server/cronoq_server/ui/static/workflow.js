// A task's workflow as a graph: its parent, the tasks it spawned (theirs on demand), the tasks it
// depends on and those that depend on it. Laid out here in layers, left to right (longest path,
// long edges through placeholder points, barycenter ordering), and drawn as SVG elements whose
// text is text nodes: a key is never parsed as markup.
import { call, query } from "./api.js";
import { h, svg } from "./dom.js";
import { stateName } from "./tasks.js";

const MAX_NODES = 200; // drawn at most: the rest are counted under the graph
const NODE_W = 168;
const NODE_H = 22;
const GAP_Y = 6;
const PASS_H = 4; // the slot a long edge takes in a layer it crosses
const LAYER_GAP = 88;
const MARGIN = 8;
const LABEL_CHARS = 22;
const SWEEPS = 4;
const AT_ONCE = 6; // calls in flight while expanding a generation
const IDS_PER_CALL = 50;

/** Ids (decimal text up to 2^64) in numeric order. */
function byId(a, b) {
  return a.length - b.length || (a < b ? -1 : a > b ? 1 : 0);
}

function nonzero(id) {
  return id && id !== "0" ? String(id) : "";
}

/** The workflow around `got` (a GetTask answer with children and dependents): the nodes drawn, by id. */
class Workflow {
  constructor(got) {
    this.focus = got.task.id;
    this.tasks = new Map(); // id -> task (or {id} when it could not be read)
    this.generation = new Map(); // spawned tasks: 1 for the focus's children, 2 for theirs...
    this.asked = new Set([this.focus]); // tasks whose children are known
    this.extra = (got.dependents || []).map((id) => ({ from: this.focus, to: String(id), kind: "depends" }));
    this.notDrawn = 0;
    this.add(got.task);
  }

  /** Adds a task (replacing one that could not be read); true when it was not drawn yet. */
  add(task, generation) {
    const known = this.tasks.get(task.id);
    if (!known && this.tasks.size >= MAX_NODES) {
      this.notDrawn += 1;
      return false;
    }
    if (!known || known.unread) this.tasks.set(task.id, task);
    if (generation && !this.generation.has(task.id)) this.generation.set(task.id, generation);
    return !known;
  }

  /** Edges: parent -> child ("spawned"), dependency -> dependent ("depends"), between drawn nodes. */
  edges() {
    const out = new Map();
    const link = (from, to, kind) => {
      if (from !== to && this.tasks.has(from) && this.tasks.has(to)) out.set(`${kind} ${from} ${to}`, { from, to, kind });
    };
    for (const task of this.tasks.values()) {
      if (nonzero(task.parent_id)) link(String(task.parent_id), task.id, "spawned");
      for (const dep of task.depends_on || []) link(String(dep), task.id, "depends");
    }
    for (const e of this.extra) link(e.from, e.to, e.kind);
    return [...out.values()];
  }

  /** The spawned tasks of the deepest generation drawn whose own children are not asked yet. */
  frontier() {
    const deepest = Math.max(0, ...this.generation.values());
    return [...this.generation].filter(([id, g]) => g === deepest && !this.asked.has(id)).map(([id]) => id);
  }
}

/** Adds the tasks named around the focus, then its children (so that many children leave room
 * for them): the parent (read with its children, which usually hold the focus's dependencies
 * and dependents) and the rest by id, 50 a call; one that cannot be read is drawn without a state. */
async function readNeighbours(wf, got) {
  const task = got.task;
  const parent = nonzero(task.parent_id);
  const wanted = [parent, ...(task.depends_on || []).map(String), ...wf.extra.map((e) => e.to)].filter((id) => id && id !== wf.focus);
  const found = new Map((got.children || []).map((child) => [child.id, child]));
  if (parent) {
    try {
      const got = await call("GET", `/v1/tasks/${parent}${query({ include_children: true })}`);
      for (const t of [got.task, ...(got.children || [])]) found.set(t.id, t);
    } catch {
      // not readable (another pool, deleted): drawn without a state
    }
  }
  const rest = [...new Set(wanted.filter((id) => !found.has(id)))];
  for (let i = 0; i < rest.length; i += IDS_PER_CALL) {
    const ids = rest.slice(i, i + IDS_PER_CALL);
    const params = new URLSearchParams([["page_size", String(ids.length)], ...ids.map((id) => ["filter.ids", id])]);
    try {
      for (const t of (await call("GET", `/v1/tasks?${params}`)).tasks || []) found.set(t.id, t);
    } catch {
      // as above
    }
  }
  for (const id of new Set(wanted)) wf.add(found.get(id) || { id, unread: true });
  for (const child of got.children || []) wf.add(child, 1);
}

/** Asks each task of the frontier for its children (a few calls at a time); true when some were added. */
async function expand(wf) {
  const frontier = wf.frontier();
  let added = false;
  for (let i = 0; i < frontier.length; i += AT_ONCE) {
    const answers = await Promise.all(frontier.slice(i, i + AT_ONCE).map((id) => call("GET", `/v1/tasks/${id}${query({ include_children: true })}`)
      .then((got) => ({ id, children: got.children || [] }), () => ({ id, children: [] }))));
    for (const { id, children } of answers) {
      wf.asked.add(id);
      for (const child of children) added = wf.add(child, wf.generation.get(id) + 1) || added;
    }
  }
  return added;
}

/**
 * Places `ids` and `edges` ({from, to, kind}) in layers left to right: a node's layer is one
 * more than its furthest predecessor's (a node with no predecessor sits just before its first
 * successor); an edge across several layers passes through a point in each (so nodes make room
 * for it); each layer is ordered by the mean position of its neighbours, sweeping both ways.
 * Returns {at: Map id -> {x, y} (top left), paths: [{edge, d}], width, height}.
 */
export function layout(ids, edges) {
  const succ = new Map(ids.map((id) => [id, []]));
  const pred = new Map(ids.map((id) => [id, []]));
  for (const e of edges) {
    succ.get(e.from).push(e.to);
    pred.get(e.to).push(e.from);
  }
  // Longest path from the sources, in topological order (Kahn); nodes on a cycle, which the
  // server does not make, go after the rest rather than loop.
  const layer = new Map();
  const waiting = new Map(ids.map((id) => [id, pred.get(id).length]));
  const ready = ids.filter((id) => !waiting.get(id));
  const order = [];
  while (ready.length) {
    const id = ready.shift();
    order.push(id);
    layer.set(id, Math.max(0, ...pred.get(id).map((p) => layer.get(p) + 1)));
    for (const s of succ.get(id)) {
      waiting.set(s, waiting.get(s) - 1);
      if (!waiting.get(s)) ready.push(s);
    }
  }
  const deepest = Math.max(0, ...layer.values());
  for (const id of ids) if (!layer.has(id)) layer.set(id, deepest + 1);
  for (const id of order.reverse()) {
    if (!pred.get(id).length && succ.get(id).length) layer.set(id, Math.min(...succ.get(id).map((s) => layer.get(s))) - 1);
  }
  const count = Math.max(0, ...layer.values()) + 1;
  const layers = Array.from({ length: count }, () => []);
  for (const id of [...ids].sort(byId)) layers[layer.get(id)].push(id);
  // Each edge as a chain of steps between adjacent layers, through a pass point per layer crossed.
  const up = new Map(ids.map((id) => [id, []]));
  const down = new Map(ids.map((id) => [id, []]));
  const chains = edges.map((edge, n) => {
    const chain = [edge.from];
    for (let l = layer.get(edge.from) + 1; l < layer.get(edge.to); l += 1) {
      const pass = `pass ${n} ${l}`;
      layers[l].push(pass);
      up.set(pass, []);
      down.set(pass, []);
      chain.push(pass);
    }
    chain.push(edge.to);
    for (let i = 1; i < chain.length; i += 1) {
      down.get(chain[i - 1]).push(chain[i]);
      up.get(chain[i]).push(chain[i - 1]);
    }
    return { edge, chain };
  });
  const position = new Map();
  const number = (l) => layers[l].forEach((id, i) => position.set(id, i));
  layers.forEach((_, l) => number(l));
  const reorder = (l, neighbours) => {
    const mean = new Map(layers[l].map((id) => {
      const near = neighbours.get(id);
      return [id, near.length ? near.reduce((sum, n) => sum + position.get(n), 0) / near.length : position.get(id)];
    }));
    layers[l].sort((a, b) => mean.get(a) - mean.get(b)); // stable: ties keep their order
    number(l);
  };
  for (let sweep = 0; sweep < SWEEPS; sweep += 1) {
    for (let l = 1; l < count; l += 1) reorder(l, up);
    for (let l = count - 2; l >= 0; l -= 1) reorder(l, down);
  }
  // Each layer a column, centred on the tallest.
  const isPass = (id) => id.startsWith("pass ");
  const slot = (id) => (isPass(id) ? PASS_H : NODE_H) + GAP_Y;
  const heights = layers.map((ids_) => ids_.reduce((sum, id) => sum + slot(id), 0));
  const tallest = Math.max(0, ...heights);
  const at = new Map();
  layers.forEach((column, l) => {
    let y = MARGIN + (tallest - heights[l]) / 2;
    for (const id of column) {
      at.set(id, { x: MARGIN + l * (NODE_W + LAYER_GAP), y: y + (isPass(id) ? (PASS_H - NODE_H) / 2 : 0) });
      y += slot(id);
    }
  });
  // A pair joined both ways (spawned and depends on) gets its two edges apart.
  const kinds = new Map();
  for (const e of edges) kinds.set(`${e.from} ${e.to}`, (kinds.get(`${e.from} ${e.to}`) || 0) + 1);
  const paths = chains.map(({ edge, chain }) => {
    const apart = kinds.get(`${edge.from} ${edge.to}`) > 1 ? (edge.kind === "spawned" ? -3 : 3) : 0;
    const mid = (id) => at.get(id).y + NODE_H / 2 + apart;
    let x = at.get(chain[0]).x + NODE_W;
    let y = mid(chain[0]);
    let d = `M${x} ${y}`;
    for (const id of chain.slice(1)) {
      const next = at.get(id);
      const bend = Math.max(LAYER_GAP / 2, Math.abs(next.x - x) / 2);
      d += ` C${x + bend} ${y} ${next.x - bend} ${mid(id)} ${next.x} ${mid(id)}`;
      x = next.x;
      y = mid(id);
      if (isPass(id)) {
        x += NODE_W;
        d += ` L${x} ${y}`;
      }
    }
    return { edge, d };
  });
  return { at, paths, width: 2 * MARGIN + count * NODE_W + (count - 1) * LAYER_GAP, height: 2 * MARGIN + tallest - GAP_Y };
}

function shortened(text) {
  return text.length > LABEL_CHARS ? `${text.slice(0, LABEL_CHARS - 1)}…` : text;
}

function arrow(kind) {
  return svg("marker", {
    id: `workflow-arrow-${kind}`, class: `arrow ${kind}`, viewBox: "0 0 10 10", refX: 10, refY: 5,
    markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse",
  }, svg("path", { d: "M0 0 L10 5 L0 10 z" }));
}

function node(task, place, focus) {
  const state = task.unread ? "unknown" : stateName(task.state).toLowerCase();
  const described = task.unread
    ? `Task ${task.id} (not readable)`
    : [`Task ${task.id}`, task.key ? `key ${task.key}` : null, `pool ${task.pool}`, stateName(task.state)].filter(Boolean).join(" · ");
  return svg("a", {
    href: `#/task/${encodeURIComponent(task.id)}`, class: `node state-${state}${task.id === focus ? " current" : ""}`,
    "data-id": task.id, "data-state": state, "aria-label": described, "aria-current": task.id === focus ? "page" : null,
  },
  svg("title", null, described),
  // A nested svg clips a label too wide for its box.
  svg("svg", { x: place.x, y: place.y, width: NODE_W, height: NODE_H },
    svg("rect", { x: 0.5, y: 0.5, width: NODE_W - 1, height: NODE_H - 1, rx: 4 }),
    svg("text", { x: 7, y: NODE_H / 2 + 4 }, shortened(task.key || task.id))));
}

/** The graph of `wf` as an SVG element: edges under the nodes, each node a link to its task. */
function drawing(wf) {
  const ids = [...wf.tasks.keys()];
  const edges = wf.edges();
  const placed = layout(ids, edges);
  return svg("svg", {
    class: "workflow-graph", width: placed.width, height: placed.height, viewBox: `0 0 ${placed.width} ${placed.height}`,
    role: "group", "aria-label": `workflow of task ${wf.focus}: ${ids.length} tasks`, "data-nodes": ids.length, "data-edges": edges.length,
  },
  svg("defs", null, arrow("spawned"), arrow("depends")),
  svg("g", { class: "edges" }, placed.paths.map(({ edge, d }) => svg("path", {
    d, class: `edge ${edge.kind}`, "marker-end": `url(#workflow-arrow-${edge.kind})`, "data-from": edge.from, "data-to": edge.to,
  }))),
  svg("g", { class: "nodes" }, ids.map((id) => node(wf.tasks.get(id), placed.at.get(id), wf.focus))));
}

const LEGEND_STATES = ["pending", "blocked", "running", "succeeded", "failed", "cancelled", "expired"];

function legend() {
  return h("p", { class: "legend workflow-legend" },
    h("span", { class: "edge-key spawned" }, "spawned"), h("span", { class: "edge-key depends" }, "depends on (runs after)"),
    LEGEND_STATES.map((state) => h("span", { class: `state-key state-${state}` }, state)));
}

/** The task page's Workflow section, or null for a task with no parent, children, dependencies
 * or dependents. */
export async function workflowSection(got) {
  const task = got.task;
  if (!nonzero(task.parent_id) && !(got.children || []).length && !(task.depends_on || []).length && !(got.dependents || []).length) return null;
  const wf = new Workflow(got);
  await readNeighbours(wf, got);
  const box = h("div", { class: "workflow-box" }, drawing(wf));
  const note = h("p", { class: "muted workflow-note" });
  const more = h("button", { type: "button", class: "workflow-expand" }, "Show what they spawned");
  const size = h("small", null);
  const update = () => {
    box.replaceChildren(drawing(wf));
    size.textContent = `${wf.tasks.size} tasks`;
    more.hidden = !wf.frontier().length || wf.tasks.size >= MAX_NODES;
    note.textContent = wf.notDrawn ? `${wf.notDrawn} more not drawn (at most ${MAX_NODES} tasks are).` : "";
  };
  more.addEventListener("click", async () => {
    more.disabled = true;
    const added = await expand(wf);
    update();
    more.disabled = false;
    if (!added) note.textContent = `${note.textContent} The tasks of the last generation spawned nothing.`.trim();
  });
  update();
  return h("section", { class: "workflow" },
    h("h2", null, "Workflow ", size),
    legend(), box, h("p", { class: "actions" }, more), note);
}
