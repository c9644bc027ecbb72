// The serving fleet: each worker's load (in flight, requests, tokens/s) and which of your adapters it holds.

import { api, poll, seg } from "./api.js";
import { empty, h, num, problem, redraw, table } from "./dom.js";

function resident(adapters) {
  if (!adapters.length) return h("span", { class: "muted" }, "none of yours");
  return h(
    "span",
    { class: "chips" },
    adapters.map((a) => h("a", { class: "chip", href: `#/adapters/${seg(a.name)}`, "data-adapter": `${a.name}@${a.version}` }, `${a.name}@${a.version}`)),
  );
}

function load(worker) {
  const share = Math.min(1, worker.inflight / worker.max_inflight);
  return h("span", { class: "load" }, h("meter", { min: 0, max: worker.max_inflight, value: worker.inflight, "aria-label": `${worker.name} queue depth` }), ` ${worker.inflight} / ${worker.max_inflight}`, share >= 1 ? h("span", { class: "error" }, " full") : null);
}

export async function fleet(main, _params, signal) {
  const workers = h("div", { "aria-live": "polite" });
  const starting = h("div");
  const [alert, show] = problem();
  main.append(
    h("h1", {}, "Serving"),
    h("p", { class: "muted" }, "Workers start on the first request for their base model and are shared by every tenant; only your own adapters are listed on them."),
    alert,
    starting,
    workers,
  );
  await poll(
    async () => {
      const status = await api("/v1/serving/workers", { signal });
      redraw(starting, status.starting, (bases) => (bases.length ? h("p", { class: "progress-line" }, `Starting workers for ${bases.join(", ")}…`) : []));
      redraw(workers, status.data, (data) =>
        data.length
          ? table(
              ["Worker", "Base model", "Device", "Engine", "Up", "In flight", "Requests", "Tokens", "Tokens/s", "Your adapters resident"],
              data.map((w) => [
                h("span", { class: "mono", "data-worker": w.name }, w.name),
                w.base_model,
                w.device,
                w.engine,
                w.alive ? "yes" : h("span", { class: "error" }, "no"),
                load(w),
                w.requests.toLocaleString(),
                w.tokens.toLocaleString(),
                num(w.tokens_per_s, 3),
                resident(w.adapters),
              ]),
              { id: "workers-table", "aria-label": "Serving workers" },
            )
          : empty("No serving workers yet: they start on the first request for a base model."),
      );
    },
    2000,
    signal,
    show,
  );
}
