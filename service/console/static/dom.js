// Building the DOM without a framework or innerHTML: every text the API returns goes in as a text node.

const SVG_NS = "http://www.w3.org/2000/svg";

function fill(el, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "text") el.textContent = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** An HTML element: h("a", {href: "#/jobs", class: "x"}, "text", otherNode). */
export function h(tag, attrs = {}, ...children) {
  return fill(document.createElement(tag), attrs, children);
}

/** An SVG element (same arguments as h). */
export function s(tag, attrs = {}, ...children) {
  return fill(document.createElementNS(SVG_NS, tag), attrs, children);
}

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${i === 0 ? n : n.toFixed(1)} ${units[i]}`;
}

export function when(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return h("time", { datetime: iso, title: d.toISOString() }, d.toLocaleString());
}

export function num(x, digits = 4) {
  if (x === null || x === undefined) return "—";
  if (typeof x !== "number") return String(x);
  const a = Math.abs(x);
  if (Number.isInteger(x) || (a >= 1000 && a < 1e7)) return Math.round(x).toLocaleString();
  if (a !== 0 && (a < 1e-3 || a >= 1e7)) return x.toExponential(2);
  return String(Number(x.toPrecision(digits)));
}

export function badge(state) {
  return h("span", { class: `badge badge-${state}`, "data-state": state }, state);
}

/** A table with a header row; `rows` are arrays of cells (strings or nodes), or a node for an empty message. */
export function table(headers, rows, attrs = {}) {
  const body = rows.map((cells) => h("tr", {}, cells.map((c) => h("td", {}, c))));
  return h(
    "div",
    { class: "table-wrap" },
    h("table", attrs, h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col" }, t)))), h("tbody", {}, body)),
  );
}

/** A definition list from [term, value] pairs. */
export function facts(pairs) {
  return h("dl", { class: "facts" }, pairs.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}

export function empty(text) {
  return h("p", { class: "empty" }, text);
}

export function short(sha, n = 12) {
  return h("code", { title: sha, class: "sha" }, sha.slice(0, n));
}

/** Replace the children of `el` (null, undefined and false are skipped, as in h). */
export function replace(el, ...children) {
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

/** An alert line and its setter: show(error) displays error.message, show(null) hides it. */
export function problem() {
  const el = h("p", { class: "error", role: "alert", hidden: true });
  const show = (exc) => {
    el.hidden = !exc;
    el.textContent = exc ? exc.message : "";
  };
  return [el, show];
}

const drawnFrom = new WeakMap();

/** Rebuild `el` from `data` only when the data changed since it was last drawn, so a periodic refresh leaves focus,
 * selection and scroll alone while nothing changed. */
export function redraw(el, data, build) {
  const signature = JSON.stringify(data);
  if (drawnFrom.get(el) === signature) return;
  drawnFrom.set(el, signature);
  replace(el, build(data));
}
