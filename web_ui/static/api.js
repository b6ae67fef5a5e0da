// REST calls of the dashboard and batch pages: the stored API key goes in the Authorization
// header, error bodies become `ApiError`s with the server's code and message, and a 401 asks for
// a key through the page's dialog.
import { setupAuthDialog } from "/static/auth-dialog.js";
import { KEYS, load, store } from "/static/storage.js";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let askForKey = null;

/** Wire the page's API-key dialog; `onKey()` runs after a new key is stored (e.g. refresh). */
export function setupApiKey(onKey) {
  askForKey = setupAuthDialog({
    onKey: (key) => {
      store(KEYS.apiKey, key.trim());
      onKey();
    },
  });
  return askForKey;
}

function authHeaders() {
  const key = load(KEYS.apiKey);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** fetch `path`; `json` is sent as a JSON body, `form` as multipart. Returns the Response. */
export async function request(path, { method = "GET", json, form } = {}) {
  const headers = authHeaders();
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form;
  }
  let res;
  try {
    res = await fetch(path, { method, headers, body });
  } catch (err) {
    throw new ApiError(0, "disconnected", `Cannot reach the server (${err.message}).`);
  }
  if (res.ok) return res;
  let code = `http_${res.status}`;
  let message = res.statusText || "request failed";
  try {
    const err = (await res.json()).error;
    if (err && err.code) ({ code, message } = err);
  } catch {
    /* not a JSON error body */
  }
  if (res.status === 401 && askForKey) askForKey(message);
  throw new ApiError(res.status, code, message);
}

/** `request` and decode its JSON answer. */
export async function api(path, opts = {}) {
  return (await request(path, opts)).json();
}
