// Line charts drawn as inline SVG: series of (step, value) points that grow while a job or session runs.

import { h, num, s } from "./dom.js";

const FALLBACK_WIDTH = 640; // before the chart is on the page; then its own width in CSS pixels
const H = 240;
const M = { left: 60, right: 16, top: 14, bottom: 38 };
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

/** About `count` round tick values covering [lo, hi]. */
function ticks(lo, hi, count = 5) {
  const span = hi - lo;
  const raw = span / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((st) => span / st <= count) || 10 * mag;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function extent(values, pad) {
  let lo = Math.min(...values);
  let hi = Math.max(...values);
  if (lo === hi) {
    const d = Math.abs(lo) * 0.1 || 1;
    lo -= d;
    hi += d;
  } else {
    const d = (hi - lo) * pad;
    lo -= d;
    hi += d;
  }
  return [lo, hi];
}

/** A chart of named series; add() points as they arrive, and it redraws at most every 100 ms. */
export class Chart {
  /** series: [{name, label, dots}] (dots: draw a marker per point, for sparse series like eval loss). */
  constructor({ title, series, xLabel = "step", yLabel = "" }) {
    this.title = title;
    this.xLabel = xLabel;
    this.yLabel = yLabel;
    this.series = series.map((sr, i) => ({ ...sr, color: COLORS[i % COLORS.length], points: [] }));
    this.svg = s("svg", { height: H, role: "img", class: "chart-svg" });
    const legend = h(
      "ul",
      { class: "legend" },
      this.series.map((sr) =>
        h("li", {}, s("svg", { width: 14, height: 14, "aria-hidden": "true" }, s("rect", { width: 14, height: 14, rx: 3, fill: sr.color })), sr.label || sr.name),
      ),
    );
    this.el = h("figure", { class: "chart", "data-chart": title }, h("figcaption", {}, title), this.svg, legend);
    this.pending = null;
    new ResizeObserver(() => this.schedule()).observe(this.svg); // drawn at its width: text never scales
    this.draw();
  }

  add(name, x, y) {
    if (typeof y !== "number" || !Number.isFinite(y)) return;
    const sr = this.series.find((c) => c.name === name);
    if (!sr) return;
    sr.points.push([x, y]);
    this.schedule();
  }

  set(name, points) {
    const sr = this.series.find((c) => c.name === name);
    if (!sr) return;
    sr.points = points.filter(([, y]) => typeof y === "number" && Number.isFinite(y));
    this.schedule();
  }

  get count() {
    return this.series.reduce((n, sr) => n + sr.points.length, 0);
  }

  schedule() {
    if (this.pending === null) this.pending = setTimeout(() => this.draw(), 100);
  }

  draw() {
    this.pending = null;
    const W = Math.round(this.svg.getBoundingClientRect().width) || FALLBACK_WIDTH;
    this.svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const all = this.series.flatMap((sr) => sr.points);
    const plot = [];
    if (!all.length) {
      plot.push(s("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "chart-empty" }, "waiting for the first point…"));
      this.svg.setAttribute("aria-label", `${this.title}: no points yet`);
    } else {
      const [x0, x1] = extent(all.map((p) => p[0]), 0);
      const [y0, y1] = extent(all.map((p) => p[1]), 0.05);
      const sx = (x) => M.left + ((x - x0) / (x1 - x0)) * (W - M.left - M.right);
      const sy = (y) => H - M.bottom - ((y - y0) / (y1 - y0)) * (H - M.top - M.bottom);
      for (const t of ticks(y0, y1)) {
        plot.push(s("line", { x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t), class: "grid" }));
        plot.push(s("text", { x: M.left - 6, y: sy(t) + 4, "text-anchor": "end", class: "tick" }, num(t, 3)));
      }
      for (const t of ticks(x0, x1).filter((v) => Number.isInteger(v) || x1 - x0 > 10)) {
        plot.push(s("line", { x1: sx(t), x2: sx(t), y1: H - M.bottom, y2: H - M.bottom + 4, class: "axis" }));
        plot.push(s("text", { x: sx(t), y: H - M.bottom + 16, "text-anchor": "middle", class: "tick" }, num(t, 3)));
      }
      plot.push(s("line", { x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, class: "axis" }));
      plot.push(s("line", { x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom, class: "axis" }));
      for (const sr of this.series) {
        const pts = sr.points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`);
        const g = s("g", { "data-series": sr.name, "data-points": sr.points.length });
        if (pts.length) g.append(s("polyline", { points: pts.join(" "), fill: "none", stroke: sr.color, "stroke-width": 2, "vector-effect": "non-scaling-stroke" }));
        if (sr.dots || sr.points.length === 1) {
          for (const [x, y] of sr.points) g.append(s("circle", { cx: sx(x), cy: sy(y), r: 3.5, fill: sr.color }));
        }
        plot.push(g);
      }
      const last = this.series.filter((sr) => sr.points.length).map((sr) => `${sr.label || sr.name} ${num(sr.points.at(-1)[1])} at ${this.xLabel} ${sr.points.at(-1)[0]}`);
      this.svg.setAttribute("aria-label", `${this.title}: ${all.length} points; last ${last.join(", ")}`);
    }
    plot.push(s("text", { x: (M.left + W - M.right) / 2, y: H - 6, "text-anchor": "middle", class: "label" }, this.xLabel));
    if (this.yLabel) plot.push(s("text", { x: 14, y: (M.top + H - M.bottom) / 2, "text-anchor": "middle", class: "label", transform: `rotate(-90 14 ${(M.top + H - M.bottom) / 2})` }, this.yLabel));
    this.svg.replaceChildren(...plot);
    this.el.dataset.points = String(all.length);
  }
}
