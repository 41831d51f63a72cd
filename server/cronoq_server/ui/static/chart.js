// Line charts drawn as SVG elements (createElementNS; no library, no inline style: the CSP
// allows none). Colours come from the CSS classes of the lines.
import { h, svg as s } from "./dom.js";

const WIDTH = 600;
const HEIGHT = 170;
const PAD = { left: 48, right: 10, top: 10, bottom: 22 };

/** 1, 2 or 5 times a power of ten, at least `value` (the top of the y axis). */
function niceTop(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((top) => top >= value);
}

function label(value) {
  if (value >= 1000) return `${+(value / 1000).toFixed(1)}k`;
  return String(+value.toFixed(value < 10 ? 2 : 0));
}

/** The y axis: linear from 0 to a nice top, or (log) powers of ten from `floor` up, so that one
 * outlier does not flatten every other value; `at(v)` is the fraction of the height for v. */
function axis(values, log, floor) {
  const highest = Math.max(0, ...values);
  if (!log) {
    const top = niceTop(highest);
    return { at: (v) => v / top, ticks: [0, top / 2, top] };
  }
  const low = Math.log10(floor);
  const high = Math.max(low + 1, Math.ceil(Math.log10(Math.max(highest, floor))));
  const ticks = [];
  for (let p = low; p <= high; p += 1) ticks.push(10 ** p);
  return { at: (v) => (Math.log10(Math.max(v, floor)) - low) / (high - low), ticks };
}

/**
 * A chart of `lines` ({label, cls, values, summary}: one value per bucket, null for none; the
 * legend shows `summary`, else the last value) over buckets of `bucketMs`, the last ending now;
 * `unit` labels the x axis; `note` follows the legend; `log` draws the y axis in powers of ten
 * from `floor` (values below it drawn at it).
 */
export function lineChart({ title, unit, bucketMs, lines, name, note, log = false, floor = 1 }) {
  const count = Math.max(0, ...lines.map((line) => line.values.length));
  const scale = axis(lines.flatMap((line) => line.values.filter((v) => v !== null)), log, floor);
  const plotW = WIDTH - PAD.left - PAD.right;
  const plotH = HEIGHT - PAD.top - PAD.bottom;
  const x = (i) => PAD.left + (count > 1 ? (i / (count - 1)) * plotW : plotW);
  const y = (v) => PAD.top + plotH - scale.at(v) * plotH;
  const svg = s("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, class: "chart", role: "img", "aria-label": title, "data-scale": log ? "log" : "linear" });
  for (const tick of scale.ticks) {
    const at = y(tick);
    svg.appendChild(s("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: at, y2: at, class: "grid" }));
    svg.appendChild(s("text", { x: PAD.left - 6, y: at + 4, class: "axis", "text-anchor": "end" }, label(tick)));
  }
  const minutes = Math.round((count * bucketMs) / 60000);
  svg.appendChild(s("text", { x: PAD.left, y: HEIGHT - 6, class: "axis" }, `-${minutes} min`));
  svg.appendChild(s("text", { x: WIDTH - PAD.right, y: HEIGHT - 6, class: "axis", "text-anchor": "end" }, "now"));
  svg.appendChild(s("text", { x: PAD.left + plotW / 2, y: HEIGHT - 6, class: "axis", "text-anchor": "middle" }, unit));
  for (const line of lines) {
    // Runs of known values are drawn as separate polylines: a bucket with no value is a gap.
    let run = [];
    const flush = () => {
      if (run.length === 1) svg.appendChild(s("circle", { cx: run[0][0], cy: run[0][1], r: 1.5, class: `dot ${line.cls}` }));
      else if (run.length) svg.appendChild(s("polyline", { points: run.map((p) => p.join(",")).join(" "), class: `series ${line.cls}` }));
      run = [];
    };
    line.values.forEach((v, i) => {
      if (v === null) flush();
      else run.push([x(i).toFixed(1), y(v).toFixed(1)]);
    });
    flush();
  }
  const last = (line) => {
    if (line.summary !== undefined) return line.summary === null ? "–" : label(line.summary);
    const known = line.values.filter((v) => v !== null);
    return known.length ? label(known.at(-1)) : "–";
  };
  return h("figure", { class: "chart-box", "data-chart": name },
    h("figcaption", null, title),
    svg,
    h("p", { class: "legend" }, lines.map((line) => h("span", { class: `key ${line.cls}` }, `${line.label} ${last(line)}`)),
      note ? h("span", { class: "muted" }, note) : null));
}
