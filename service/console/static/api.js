// The API as the pages use it: the key from sessionStorage as a bearer header, errors as ApiError.

import { readEvents } from "./sse.js";

const KEY = "inkwell.apiKey";

/** The API key of this browser tab: sessionStorage only (gone with the tab), never a URL or a cookie. */
export const auth = {
  get key() {
    return sessionStorage.getItem(KEY);
  },
  set(key) {
    sessionStorage.setItem(KEY, key);
  },
  clear() {
    sessionStorage.removeItem(KEY);
  },
};

export class ApiError extends Error {
  constructor(status, code, message, details = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details;
  }
}

async function request(path, { method = "GET", body, signal, key = auth.key, accept = "application/json" } = {}) {
  const headers = { Authorization: `Bearer ${key}`, Accept: accept };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
    cache: "no-store",
  });
  if (response.ok) return response;
  let error = { code: "http_error", message: `${response.status} ${response.statusText}` };
  try {
    error = (await response.json()).error || error;
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401 && key === auth.key) {
    window.dispatchEvent(new CustomEvent("inkwell:unauthorized", { detail: error.message }));
  }
  throw new ApiError(response.status, error.code, error.message, error.details || {});
}

/** JSON of a route (null for 204). */
export async function api(path, options = {}) {
  const response = await request(path, options);
  return response.status === 204 ? null : response.json();
}

/** Every item of a paged list route, following next_cursor (at most `max` items). */
export async function all(path, { signal, max = 1000 } = {}) {
  const items = [];
  let cursor = null;
  do {
    const sep = path.includes("?") ? "&" : "?";
    const page = await api(`${path}${sep}limit=200${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ""}`, { signal });
    items.push(...page.data);
    cursor = page.next_cursor;
  } while (cursor && items.length < max);
  return items;
}

/** A server-sent event stream of the API: yields {id, event, data (parsed JSON)} until the server ends it. */
export async function* stream(path, { signal } = {}) {
  const response = await request(path, { signal, accept: "text/event-stream" });
  for await (const event of readEvents(response)) {
    yield { ...event, data: JSON.parse(event.data) };
  }
}

/** Save a file the API streams (with the key in its header) under `filename`. */
export async function download(path, filename) {
  const blob = await (await request(path, { accept: "application/octet-stream" })).blob();
  const url = URL.createObjectURL(blob);
  const a = Object.assign(document.createElement("a"), { href: url, download: filename });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

/** Path segment escaping for names and ids taken from the API. */
export const seg = encodeURIComponent;

/** Resolves after `ms`, or at once when `signal` aborts. */
export function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

/** Runs `refresh` now and every `ms` until `signal` aborts (the page was left); a failed refresh goes to `onError`
 * (null after one that worked) and the next one is tried all the same. */
export async function poll(refresh, ms, signal, onError = () => {}) {
  while (!signal.aborted) {
    try {
      await refresh();
      onError(null);
    } catch (exc) {
      if (signal.aborted) return;
      onError(exc);
    }
    await sleep(ms, signal);
  }
}
