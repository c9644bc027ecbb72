// The console's shell: log in with an API key, then route #/<section>/<id> to a page module.

import { api, ApiError, auth } from "./api.js";
import { h, replace } from "./dom.js";
import * as adapters from "./adapters.js";
import * as jobs from "./jobs.js";
import * as serving from "./serving.js";
import * as sessions from "./sessions.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const logout = document.getElementById("logout");

// [pattern, page, section]: a page is render(main, params, signal); the signal aborts when the page is left.
const ROUTES = [
  [/^#\/jobs\/([^/]+)$/, jobs.detail, "jobs"],
  [/^#\/jobs$/, jobs.list, "jobs"],
  [/^#\/sessions\/([^/]+)$/, sessions.detail, "sessions"],
  [/^#\/sessions$/, sessions.list, "sessions"],
  [/^#\/adapters\/([^/]+)$/, adapters.detail, "adapters"],
  [/^#\/adapters$/, adapters.list, "adapters"],
  [/^#\/serving$/, serving.fleet, "serving"],
];

let leave = null; // aborts the current page's streams and timers

function loginForm(message) {
  const input = h("input", { id: "key", type: "password", name: "key", autocomplete: "off", spellcheck: "false", required: true, placeholder: "ink_…" });
  const error = h("p", { class: "error", role: "alert" }, message || "");
  const form = h(
    "form",
    { class: "login", "aria-labelledby": "login-title" },
    h("h1", { id: "login-title" }, "Log in"),
    h("p", {}, "Paste an API key of your tenant (", h("code", {}, "inkwell admin create-key"), "). It stays in this tab only."),
    h("label", { for: "key" }, "API key"),
    input,
    h("button", { type: "submit" }, "Log in"),
    error,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    try {
      await api("/v1/jobs?limit=1", { key });
    } catch (exc) {
      error.textContent = exc instanceof ApiError && exc.status === 401 ? "That key was not accepted." : `Could not log in: ${exc.message}`;
      input.focus();
      return;
    }
    auth.set(key);
    if (!location.hash || location.hash === "#/login") location.hash = "#/jobs";
    else route();
  });
  return [form, input];
}

function showLogin(message) {
  leave?.abort();
  nav.hidden = true;
  logout.hidden = true;
  const [form, input] = loginForm(message);
  replace(main, form);
  document.title = "Log in · inkwell console";
  input.focus();
}

async function route() {
  if (!auth.key) return showLogin();
  leave?.abort();
  leave = new AbortController();
  nav.hidden = false;
  logout.hidden = false;
  const hash = location.hash || "#/jobs";
  const found = ROUTES.map(([re, page, section]) => [hash.match(re), page, section]).find(([m]) => m);
  if (!found) {
    location.replace("#/jobs");
    return;
  }
  const [match, page, section] = found;
  for (const a of nav.querySelectorAll("a")) {
    if (a.dataset.section === section) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  replace(main);
  document.title = `${section[0].toUpperCase()}${section.slice(1)} · inkwell console`;
  const signal = leave.signal;
  try {
    await page(main, match.slice(1).map(decodeURIComponent), signal);
  } catch (exc) {
    if (signal.aborted || exc.name === "AbortError") return;
    const text = exc instanceof ApiError && exc.status === 404 ? "Not found (or not yours)." : exc.message;
    main.append(h("p", { class: "error", role: "alert" }, text));
  }
}

window.addEventListener("hashchange", () => {
  route();
  main.focus({ preventScroll: true });
});
window.addEventListener("inkwell:unauthorized", (event) => {
  auth.clear();
  showLogin(`Logged out: ${event.detail}`);
});
logout.addEventListener("click", () => {
  auth.clear();
  showLogin("Logged out.");
});
route();
