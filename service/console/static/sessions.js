// Training sessions: the open ones, and one session's step, metrics over steps and requests in flight.

import { api, poll, seg } from "./api.js";
import { Chart } from "./chart.js";
import { badge, empty, facts, h, problem, redraw, replace, table, when } from "./dom.js";

const MAX_METRIC_CHARTS = 6;

export async function list(main, _params, signal) {
  const rows = h("div", { "aria-live": "polite" });
  const [alert, show] = problem();
  main.append(h("h1", {}, "Training sessions"), alert, rows);
  await poll(
    async () => {
      const { data } = await api("/v1/sessions", { signal });
      data.sort((a, b) => (a.state === "closed") - (b.state === "closed") || b.created_at.localeCompare(a.created_at));
      redraw(rows, data, () =>
        data.length
          ? table(
              ["Session", "State", "Base model", "Adapter", "Step", "In flight", "Last active"],
              data.map((sn) => [
                h("a", { href: `#/sessions/${seg(sn.id)}`, class: "mono" }, sn.id),
                badge(sn.state),
                sn.base_model,
                h("a", { href: `#/adapters/${seg(sn.adapter_name)}` }, sn.adapter_name),
                String(sn.step),
                String(sn.pending),
                when(sn.last_active_at),
              ]),
              { id: "sessions-table", "aria-label": "Training sessions" },
            )
          : empty("No training sessions. Open one with client.sessions.create(...) or POST /v1/sessions."),
      );
    },
    2000,
    signal,
    show,
  );
}

/** Per metric name, its [step, value] points from the session's history (loss first). */
function series(points) {
  const byName = new Map();
  for (const point of points) {
    for (const [name, value] of Object.entries(point.metrics)) {
      const key = `${point.kind} ${name}`;
      if (!byName.has(key)) byName.set(key, []);
      byName.get(key).push([point.step, value]);
    }
  }
  return [...byName.entries()].sort(([a], [b]) => !a.includes("loss") - !b.includes("loss"));
}

export async function detail(main, [id], signal) {
  const head = h("div");
  const charts = h("div", { class: "charts" });
  const futures = h("div");
  const [alert, show] = problem();
  const drawn = new Map(); // metric key -> Chart
  main.append(
    h("p", { class: "crumbs" }, h("a", { href: "#/sessions" }, "Sessions"), " / "),
    head,
    alert,
    h("section", {}, h("h2", {}, "Metrics over steps"), charts),
    h("section", {}, h("h2", {}, "Requests in flight"), futures),
  );
  let closed = false;
  await poll(
    async () => {
      if (closed) return;
      const [sn, history] = await Promise.all([api(`/v1/sessions/${seg(id)}`, { signal }), api(`/v1/sessions/${seg(id)}/history`, { signal })]);
      redraw(head, sn, () => [
        h("div", { class: "title-row" }, h("h1", {}, "Session ", h("span", { class: "mono" }, sn.id)), badge(sn.state)),
        h("p", { class: "progress-line", id: "session-step" }, `step ${sn.step} · ${sn.pending} in flight`),
        facts([
          ["Base model", sn.base_model],
          ["Adapter", h("a", { href: `#/adapters/${seg(sn.adapter_name)}` }, sn.adapter_name)],
          ["LoRA", `rank ${sn.lora.rank}, alpha ${sn.lora.alpha}, ${(sn.lora.targets || []).join(", ")}`],
          ["Seed", String(sn.seed)],
          ["Created", when(sn.created_at)],
          ["Last active", when(sn.last_active_at)],
          ["Closed", sn.closed_code ? `${sn.closed_code}: ${sn.closed_reason}` : "—"],
        ]),
      ]);
      for (const [key, points] of series(history.points).slice(0, MAX_METRIC_CHARTS)) {
        if (!drawn.has(key)) {
          const chart = new Chart({ title: key, series: [{ name: key, dots: points.length < 30 }] });
          drawn.set(key, chart);
          charts.querySelector(".empty")?.remove();
          charts.append(chart.el);
        }
        drawn.get(key).set(key, points);
      }
      if (!drawn.size) replace(charts, empty("No training requests yet."));
      redraw(futures, history.pending, () =>
        history.pending.length
          ? table(["Future", "Kind", "Submitted"], history.pending.map((f) => [h("code", {}, f.id), f.kind, when(f.created_at)]), { id: "futures-table", class: "compact" })
          : empty("Nothing in flight."),
      );
      closed = sn.state === "closed";
    },
    2000,
    signal,
    show,
  );
}
