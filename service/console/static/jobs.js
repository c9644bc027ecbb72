// Jobs: the list with filters, and one job live from its event stream (curves, events, cancel).

import { api, poll, seg, sleep, stream } from "./api.js";
import { Chart } from "./chart.js";
import { badge, empty, facts, h, num, problem, redraw, replace, table, when } from "./dom.js";

const STATES = ["queued", "running", "succeeded", "failed", "cancelled"];
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const PAGE = 50;
const EVENTS_SHOWN = 300;
// Numbers in a progress event that are RL signals (drawn on their own chart when a job reports them).
const RL_KEY = /reward|kl/i;
const filters = { state: "", adapter_name: "", base_model: "" };

function adapterCell(job) {
  const name = h("a", { href: `#/adapters/${seg(job.adapter_name)}` }, job.adapter_name);
  return job.adapter_version ? [name, h("span", { class: "muted" }, ` @${job.adapter_version}`)] : name;
}

function progressText(job) {
  const p = job.progress;
  return `${p.step.toLocaleString()} / ${p.max_steps.toLocaleString()}`;
}

export async function list(main, _params, signal) {
  let shown = PAGE;
  const rows = h("div", { "aria-live": "polite" });
  const more = h("button", { type: "button", class: "quiet", hidden: true }, "Show more");
  const [alert, show] = problem();
  const field = (name, label, control) => h("div", { class: "field" }, h("label", { for: `f-${name}` }, label), control);
  const state = h("select", { id: "f-state", name: "state" }, h("option", { value: "" }, "any"), STATES.map((st) => h("option", { value: st, selected: filters.state === st }, st)));
  const adapter = h("input", { id: "f-adapter_name", name: "adapter_name", value: filters.adapter_name, placeholder: "any" });
  const base = h("input", { id: "f-base_model", name: "base_model", value: filters.base_model, placeholder: "any" });
  const form = h(
    "form",
    { class: "filters", role: "search", "aria-label": "Filter jobs" },
    field("state", "State", state),
    field("adapter_name", "Adapter", adapter),
    field("base_model", "Base model", base),
    h("button", { type: "submit" }, "Filter"),
  );

  async function refresh() {
    const query = new URLSearchParams({ limit: String(shown) });
    for (const [k, v] of Object.entries(filters)) if (v) query.set(k, v);
    const page = await api(`/v1/jobs?${query}`, { signal });
    more.hidden = !page.next_cursor || shown >= 200;
    redraw(rows, page.data, () =>
      page.data.length
        ? table(
            ["Job", "Adapter", "State", "Step", "Loss", "Created"],
            page.data.map((job) => [
              h("a", { href: `#/jobs/${seg(job.id)}`, class: "mono" }, job.id),
              adapterCell(job),
              [badge(job.state), job.cancel_requested && !TERMINAL.has(job.state) ? h("span", { class: "muted" }, " cancelling") : null],
              progressText(job),
              num(job.progress.loss),
              when(job.created_at),
            ]),
            { id: "jobs-table", "aria-label": "Jobs" },
          )
        : empty(Object.values(filters).some(Boolean) ? "No jobs match these filters." : "No jobs yet. Submit one with sdk.train(...) or POST /v1/jobs."),
    );
  }

  const apply = () => {
    filters.state = state.value;
    filters.adapter_name = adapter.value.trim();
    filters.base_model = base.value.trim();
    shown = PAGE;
    refresh().catch(show);
  };
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    apply();
  });
  state.addEventListener("change", apply);
  more.addEventListener("click", () => {
    shown = Math.min(200, shown + PAGE);
    refresh().catch(show);
  });
  main.append(h("h1", {}, "Jobs"), form, alert, rows, more);
  await poll(refresh, 3000, signal, show);
}

/** The cancel control: a button, then an inline confirmation (no dialog). */
function cancelControl(job, onCancelled) {
  const box = h("div", { class: "actions" });
  const ask = () => {
    const yes = h("button", { type: "button", class: "danger", id: "confirm-cancel" }, "Yes, cancel it");
    const no = h("button", { type: "button", class: "quiet" }, "Keep it");
    yes.addEventListener("click", async () => {
      yes.disabled = true;
      try {
        onCancelled(await api(`/v1/jobs/${seg(job.id)}/cancel`, { method: "POST" }));
      } catch (exc) {
        replace(box, h("p", { class: "error", role: "alert" }, exc.message));
      }
    });
    no.addEventListener("click", () => show());
    replace(box, h("span", {}, "Cancel this job? "), yes, no);
    yes.focus();
  };
  const show = () => {
    if (TERMINAL.has(job.state) || job.cancel_requested) {
      replace(box, job.cancel_requested && !TERMINAL.has(job.state) ? h("span", { class: "muted" }, "Cancel requested; the worker stops at its next step.") : null);
      return;
    }
    const button = h("button", { type: "button", class: "danger", id: "cancel-job" }, "Cancel job");
    button.addEventListener("click", ask);
    replace(box, button);
  };
  show();
  const shown = (j) => `${j.state}|${j.cancel_requested}`;
  const update = (next) => {
    const changed = shown(next) !== shown(job);
    job = next;
    if (changed) show(); // a progress event leaves the button (and its focus, or an open confirmation) alone
  };
  return { el: box, update };
}

function summary(job) {
  const lineage = [
    ["Adapter", adapterCell(job)],
    ["Base model", job.base_model],
    ["Method", job.method],
    ["Dataset", h("code", {}, job.dataset_id)],
    ["Eval dataset", job.eval_dataset_id ? h("code", {}, job.eval_dataset_id) : "—"],
    ["Attempts", String(job.attempts)],
    ["Last checkpoint", job.last_checkpoint_step === null ? "—" : `step ${job.last_checkpoint_step}`],
    ["Created", when(job.created_at)],
    ["Started", when(job.started_at)],
    ["Finished", when(job.finished_at)],
  ];
  if (job.error) lineage.push(["Error", h("span", { class: "error" }, `${job.error.code}: ${job.error.message}`)]);
  return facts(lineage);
}

function keyValues(obj, id) {
  return table(
    ["Name", "Value"],
    Object.entries(obj).map(([k, v]) => [h("code", {}, k), typeof v === "object" && v !== null ? JSON.stringify(v) : String(v)]),
    { id, class: "compact" },
  );
}

export async function detail(main, [id], signal) {
  let job = await api(`/v1/jobs/${seg(id)}`, { signal });
  const state = h("span", { id: "job-state" }, badge(job.state));
  const progress = h("p", { id: "job-progress", class: "progress-line" });
  const facts_ = h("div");
  const cancel = cancelControl(job, (next) => render(next));
  const loss = new Chart({ title: "Loss", yLabel: "loss (nats/token)", series: [{ name: "loss", label: "train loss" }, { name: "eval_loss", label: "eval loss", dots: true }] });
  const charts = h("div", { class: "charts" }, loss.el);
  let rl = null;
  const events = h("tbody");
  const [alert, show] = problem();

  function render(next) {
    job = next;
    redraw(state, [job.state, job.cancel_requested], () => [badge(job.state), job.cancel_requested && !TERMINAL.has(job.state) ? h("span", { class: "muted" }, " cancelling") : null]);
    const p = job.progress;
    progress.textContent = `step ${progressText(job)} · loss ${num(p.loss)} · ${p.tokens_per_s ? `${num(p.tokens_per_s, 3)} tokens/s` : "— tokens/s"}`;
    redraw(facts_, { ...job, progress: null }, () => summary(job));
    cancel.update(job);
  }

  function onEvent(event) {
    const { type, data } = event;
    if (type === "progress") {
      loss.add("loss", data.step, data.loss);
      const rlKeys = Object.keys(data).filter((k) => RL_KEY.test(k) && typeof data[k] === "number");
      if (rlKeys.length && !rl) {
        rl = new Chart({ title: "Reward and KL", series: rlKeys.map((k) => ({ name: k })) });
        charts.append(rl.el);
      }
      for (const k of rlKeys) rl.add(k, data.step, data[k]);
      render({ ...job, progress: { ...job.progress, step: data.step, loss: data.loss, tokens_per_s: data.tokens_per_s ?? job.progress.tokens_per_s } });
    } else if (type === "eval") {
      loss.add("eval_loss", data.step, data.eval_loss);
    }
    events.prepend(h("tr", { "data-type": type }, h("td", {}, when(event.created_at)), h("td", {}, h("span", { class: `etype etype-${type}` }, type)), h("td", {}, event.message)));
    while (events.rows.length > EVENTS_SHOWN) events.lastElementChild.remove();
  }

  render(job);
  main.append(
    h("p", { class: "crumbs" }, h("a", { href: "#/jobs" }, "Jobs"), " / "),
    h("div", { class: "title-row" }, h("h1", {}, "Job ", h("span", { class: "mono" }, job.id)), state),
    progress,
    cancel.el,
    alert,
    charts,
    h("div", { class: "columns" }, h("section", {}, h("h2", {}, "Details"), facts_), h("section", {}, h("h2", {}, "Hyper-parameters"), keyValues(job.hyperparameters, "hyperparameters"), h("h2", {}, "LoRA"), keyValues(job.lora, "lora"))),
    h("section", {}, h("h2", {}, "Events"), h("div", { class: "table-wrap" }, h("table", { id: "events", class: "compact" }, h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Time"), h("th", { scope: "col" }, "Type"), h("th", { scope: "col" }, "Message"))), events))),
  );

  // Follow the event stream from the first event; reconnect after the last one seen until the job has ended.
  let after = 0;
  while (!signal.aborted) {
    try {
      for await (const event of stream(`/v1/jobs/${seg(id)}/events/stream?after=${after}`, { signal })) {
        after = Number(event.id);
        onEvent(event.data);
        if (event.data.type === "state") render(await api(`/v1/jobs/${seg(id)}`, { signal }));
      }
      show(null);
      render(await api(`/v1/jobs/${seg(id)}`, { signal }));
      if (TERMINAL.has(job.state)) return;
    } catch (exc) {
      if (signal.aborted) return;
      show(new Error(`Lost the event stream (${exc.message}); reconnecting…`));
    }
    await sleep(1000, signal);
  }
}
