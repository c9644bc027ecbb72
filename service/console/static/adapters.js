// The adapter registry: adapters, their immutable versions and files (download in either layout), aliases and their
// history (from the tenant's audit log).

import { all, api, download, poll, seg } from "./api.js";
import { bytes, empty, facts, h, problem, redraw, short, table, when } from "./dom.js";

const LAYOUTS = ["sglang", "peft"];
const WEIGHTS = "adapter_model.safetensors";

function aliasChips(aliases) {
  const entries = Object.entries(aliases);
  return entries.length ? h("span", { class: "chips" }, entries.map(([a, v]) => h("span", { class: "chip", "data-alias": a }, `${a} → ${v}`))) : "—";
}

export async function list(main, _params, signal) {
  const rows = h("div", { "aria-live": "polite" });
  const [alert, show] = problem();
  main.append(h("h1", {}, "Adapters"), alert, rows);
  await poll(
    async () => {
      const adapters = await all("/v1/adapters", { signal });
      redraw(rows, adapters, () =>
        adapters.length
          ? table(
              ["Adapter", "Base model", "Latest", "Versions", "Aliases", "Updated"],
              adapters.map((a) => [h("a", { href: `#/adapters/${seg(a.name)}` }, a.name), a.base_model, a.latest_version ?? "—", String(a.num_versions), aliasChips(a.aliases), when(a.updated_at)]),
              { id: "adapters-table", "aria-label": "Adapters" },
            )
          : empty("No adapters yet: a job publishes one when it succeeds, or import one with POST /v1/adapters/import."),
      );
    },
    5000,
    signal,
    show,
  );
}

function producer(version) {
  const lineage = version.lineage;
  if (lineage.source === "job" && lineage.job_id) return ["job ", h("a", { href: `#/jobs/${seg(lineage.job_id)}`, class: "mono" }, lineage.job_id)];
  const session = version.metrics?.session_id;
  if (lineage.source === "session" && session) return ["session ", h("a", { href: `#/sessions/${seg(session)}`, class: "mono" }, session)];
  return lineage.source;
}

function weightsSha(version) {
  const file = version.files.find((f) => f.layout === "sglang" && f.path === WEIGHTS) || version.files[0];
  return file ? short(file.sha256) : "—";
}

function filesPanel(name, version) {
  const rows = LAYOUTS.flatMap((layout) =>
    version.files
      .filter((f) => f.layout === layout)
      .map((f) => {
        const button = h("button", { type: "button", class: "quiet small" }, "Download");
        button.addEventListener("click", async () => {
          button.disabled = true;
          try {
            await download(`/v1/adapters/${seg(name)}/versions/${version.version}/files/${layout}/${seg(f.path)}`, `${name}-${version.version}-${layout}-${f.path}`);
          } finally {
            button.disabled = false;
          }
        });
        return [layout, h("code", {}, f.path), bytes(f.size), h("code", { class: "sha-full" }, f.sha256), button];
      }),
  );
  return h(
    "section",
    { class: "panel", id: "files-panel", "aria-label": `Files of version ${version.version}` },
    h("h3", {}, `Version ${version.version}: files in both layouts`),
    table(["Layout", "File", "Size", "sha256", ""], rows, { class: "compact" }),
  );
}

function aliasHistory(name, audit) {
  const entries = audit.filter((e) => e.action.startsWith("adapter.alias.") && e.target.startsWith(`${name}@`));
  if (!entries.length) return empty("No alias changes yet.");
  return table(
    ["When", "Alias", "Change", "By key"],
    entries.map((e) => {
      const alias = e.target.slice(name.length + 1);
      const change = e.action === "adapter.alias.set" ? (e.data.from ? `${e.data.from} → ${e.data.to}` : `set to ${e.data.to}`) : `removed (was ${e.data.was})`;
      return [when(e.created_at), alias, change, e.actor ? h("code", {}, e.actor) : "—"];
    }),
    { id: "alias-history", class: "compact" },
  );
}

export async function detail(main, [name], signal) {
  const head = h("div");
  const aliases = h("div");
  const history = h("div");
  const versions = h("div");
  const files = h("div");
  const [alert, show] = problem();
  let selected = null;

  const aliasName = h("input", { id: "alias-name", name: "alias", required: true, placeholder: "prod", autocomplete: "off" });
  const aliasVersion = h("select", { id: "alias-version", name: "version" });
  const aliasForm = h(
    "form",
    { class: "filters", "aria-label": "Set an alias" },
    h("div", { class: "field" }, h("label", { for: "alias-name" }, "Alias"), aliasName),
    h("div", { class: "field" }, h("label", { for: "alias-version" }, "Version"), aliasVersion),
    h("button", { type: "submit", id: "alias-set" }, "Set alias"),
  );
  aliasForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      await api(`/v1/adapters/${seg(name)}/aliases/${seg(aliasName.value.trim())}`, { method: "PUT", body: { version: Number(aliasVersion.value) } });
      show(null);
      await refresh();
    } catch (exc) {
      show(exc);
    }
  });

  async function removeAlias(alias) {
    try {
      await api(`/v1/adapters/${seg(name)}/aliases/${seg(alias)}`, { method: "DELETE" });
      await refresh();
    } catch (exc) {
      show(exc);
    }
  }

  function showFiles(version) {
    selected = version.version;
    redraw(files, version, () => filesPanel(name, version));
  }

  async function refresh() {
    const [adapter, list, audit] = await Promise.all([
      api(`/v1/adapters/${seg(name)}`, { signal }),
      all(`/v1/adapters/${seg(name)}/versions`, { signal }),
      all("/v1/audit", { signal, max: 1000 }),
    ]);
    redraw(head, adapter, () => [
      h("h1", {}, "Adapter ", h("span", { class: "mono" }, adapter.name)),
      facts([
        ["Base model", adapter.base_model],
        ["Latest version", adapter.latest_version ?? "—"],
        ["Versions", String(adapter.num_versions)],
        ["Created", when(adapter.created_at)],
        ["Use it as", h("code", {}, `model="${adapter.base_model}:${adapter.name}[@version|@alias]"`)],
      ]),
    ]);
    const current = aliasVersion.value;
    redraw(aliasVersion, list.map((v) => v.version), (numbers) => numbers.map((n) => h("option", { value: n, selected: String(n) === current }, `v${n}`)));
    redraw(aliases, adapter.aliases, () =>
      Object.keys(adapter.aliases).length
        ? table(
            ["Alias", "Version", ""],
            Object.entries(adapter.aliases).map(([a, v]) => {
              const remove = h("button", { type: "button", class: "quiet small", "aria-label": `Remove alias ${a}` }, "Remove");
              remove.addEventListener("click", () => removeAlias(a));
              return [h("code", { "data-alias": a }, a), h("span", { "data-alias-version": a }, String(v)), remove];
            }),
            { id: "aliases-table", class: "compact" },
          )
        : empty("No aliases."),
    );
    redraw(history, audit, () => aliasHistory(name, audit));
    redraw(versions, list, () =>
      table(
        ["Version", "Created", "Size", "sha256 (weights)", "Produced by", "Aliases", ""],
        list.map((v) => {
          const open = h("button", { type: "button", class: "quiet small", "aria-label": `Files of version ${v.version}` }, "Files");
          open.addEventListener("click", () => {
            showFiles(v);
            files.querySelector("h3")?.setAttribute("tabindex", "-1");
            files.querySelector("h3")?.focus();
          });
          return [h("span", { "data-version": v.version }, `v${v.version}`), when(v.created_at), bytes(v.size_bytes), weightsSha(v), producer(v), v.aliases.join(", ") || "—", open];
        }),
        { id: "versions-table" },
      ),
    );
    const shown = list.find((v) => v.version === selected);
    redraw(files, shown || null, () => (shown ? filesPanel(name, shown) : []));
  }

  main.append(
    h("p", { class: "crumbs" }, h("a", { href: "#/adapters" }, "Adapters"), " / "),
    head,
    alert,
    h("div", { class: "columns" }, h("section", {}, h("h2", {}, "Aliases"), aliases, aliasForm), h("section", {}, h("h2", {}, "Alias history"), history)),
    h("section", {}, h("h2", {}, "Versions"), versions, files),
  );
  await poll(refresh, 5000, signal, show);
}
