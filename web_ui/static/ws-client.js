// Websocket client for the Antiphon chat protocol (`/v1/ws`).
//
// Owns the socket, reconnects with exponential backoff, and surfaces auth failures.
// Events (all CustomEvent, payload in `detail`):
//   "open"          {}                        socket connected
//   "accepted"      {}                        the server's first frame that is not an error:
//                                             it took the connection (one over its limits is
//                                             refused in an error frame, then closed)
//   "close"         {code, reason, retryInMs} socket closed; retryInMs is null when not retrying
//   "message"       <server message object>   every decoded server frame
//   "auth-required" {reason}                  close code 4401 or an "unauthorized" error

import { KEYS, load, store } from "/static/storage.js";

const AUTH_CLOSE_CODE = 4401;
const BACKOFF_MIN_MS = 500;
const BACKOFF_MAX_MS = 15000;

/** A request id matching the server's id pattern: `r-` + 16 hex chars. */
export function newRequestId() {
  const bytes = new Uint8Array(8);
  crypto.getRandomValues(bytes);
  return "r-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** The websocket URL for this page's origin, with the stored API key if any. */
export function defaultUrl(apiKey) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  let url = `${scheme}://${location.host}/v1/ws`;
  if (apiKey) url += `?api_key=${encodeURIComponent(apiKey)}`;
  return url;
}

export class ChatClient extends EventTarget {
  constructor({ urlFor = defaultUrl } = {}) {
    super();
    this._urlFor = urlFor;
    this._apiKey = load(KEYS.apiKey);
    this._ws = null;
    this._attempt = 0;
    this._retryTimer = null;
    this._authBlocked = false; // stop retrying until a (new) key is given
    // Skip the rest of a backoff wait when the network comes back.
    window.addEventListener("online", () => this.retryNow());
  }

  /** Skip the rest of a backoff wait (the network came back, the user came back to the page);
   * nothing while connected or connecting, or until a new API key after an auth failure. */
  retryNow() {
    if (!this._ws && !this._authBlocked) this.connect();
  }

  get connected() {
    return this._ws !== null && this._ws.readyState === WebSocket.OPEN;
  }

  /** True after an auth failure, until a new key is set. */
  get authRequired() {
    return this._authBlocked;
  }

  connect() {
    clearTimeout(this._retryTimer);
    this._retryTimer = null;
    if (this._ws) return;
    let ws;
    try {
      ws = new WebSocket(this._urlFor(this._apiKey));
    } catch (err) {
      this._scheduleRetry(0, String(err));
      return;
    }
    this._ws = ws;
    let accepted = false;
    ws.addEventListener("open", () => {
      if (this._ws !== ws) return;
      this._emit("open", {});
    });
    ws.addEventListener("message", (ev) => {
      if (this._ws !== ws) return;
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return; // not our protocol; ignore
      }
      if (!msg || typeof msg !== "object") return;
      if (msg.type === "error" && msg.code === "unauthorized") this._authFailed(msg.message);
      if (msg.type !== "error" && !accepted) {
        // The backoff starts again only now: reset at "open", a server over its connection
        // limits (which opens, refuses in a frame and closes) was asked twice a second.
        accepted = true;
        this._attempt = 0;
        this._emit("accepted", {});
      }
      this._emit("message", msg);
    });
    ws.addEventListener("close", (ev) => {
      if (this._ws !== ws) return;
      this._ws = null;
      if (ev.code === AUTH_CLOSE_CODE) this._authFailed(ev.reason);
      this._scheduleRetry(ev.code, ev.reason);
    });
    // "error" is always followed by "close"; nothing to do here.
  }

  /** Replace the API key (empty clears it) and reconnect right away. */
  setApiKey(key) {
    this._apiKey = key.trim();
    store(KEYS.apiKey, this._apiKey);
    this._authBlocked = false;
    this._attempt = 0;
    this.reconnectNow();
  }

  reconnectNow() {
    if (this._ws) {
      const old = this._ws;
      this._ws = null;
      old.close(1000, "reconnect");
      this._emit("close", { code: 1000, reason: "reconnect", retryInMs: 0 });
    }
    this.connect();
  }

  /** Send one protocol message; returns false when the socket is not open. */
  send(msg) {
    if (!this.connected) return false;
    this._ws.send(JSON.stringify(msg));
    return true;
  }

  /** The most recent sessions, or the page after a listing's `next_before` cursor. */
  listSessions(before = null) {
    return this.send(before === null ? { type: "session.list" } : { type: "session.list", before });
  }

  /** Open `sessionId`, or a new session (null) whose model sees `system` first, if given;
   * the `session` frame (or error) answering it names `requestId`, if given. */
  openSession(sessionId = null, system = null, requestId = null) {
    const frame = { type: "session.open", session_id: sessionId };
    if (sessionId === null && system) frame.system = system;
    if (requestId !== null) frame.request_id = requestId;
    return this.send(frame);
  }

  sendMessage(sessionId, content, requestId) {
    return this.send({ type: "message", session_id: sessionId, content, request_id: requestId });
  }

  typing(sessionId) {
    return this.send({ type: "typing", session_id: sessionId });
  }

  cancel(requestId) {
    return this.send({ type: "cancel", request_id: requestId });
  }

  _authFailed(reason) {
    if (this._authBlocked) return;
    this._authBlocked = true;
    this._emit("auth-required", { reason: reason || "" });
  }

  _scheduleRetry(code, reason) {
    let retryInMs = null;
    if (!this._authBlocked) {
      const base = Math.min(BACKOFF_MAX_MS, BACKOFF_MIN_MS * 2 ** this._attempt);
      retryInMs = Math.round(base * (0.75 + Math.random() * 0.5));
      this._attempt += 1;
      this._retryTimer = setTimeout(() => this.connect(), retryInMs);
    }
    this._emit("close", { code, reason: reason || "", retryInMs });
  }

  _emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }
}
