// DOM rendering helpers. Dynamic text is only ever set through textContent or the DOM-building
// Markdown renderer; nothing here parses strings as HTML.
import { isComposing } from "/static/composer.js";
import { renderMarkdown } from "/static/markdown.js";

export const $ = (sel) => document.querySelector(sel);

export function el(tag, className = "", text = null) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== null && text !== undefined) node.textContent = String(text);
  return node;
}

/** Compact age of a unix-seconds timestamp: "now", "5m", "3h", "2d", or a date. */
export function formatAge(unixSeconds) {
  if (typeof unixSeconds !== "number" || !Number.isFinite(unixSeconds)) return "";
  const secs = Math.max(0, Date.now() / 1000 - unixSeconds);
  if (secs < 60) return "now";
  if (secs < 3600) return `${Math.floor(secs / 60)}m`;
  if (secs < 86400) return `${Math.floor(secs / 3600)}h`;
  if (secs < 7 * 86400) return `${Math.floor(secs / 86400)}d`;
  return new Date(unixSeconds * 1000).toLocaleDateString();
}

export function sessionTitle(session) {
  const t = session && typeof session.title === "string" ? session.title.trim() : "";
  return t || "New chat";
}

/**
 * Rebuild the sidebar list. `actions.onPick(id)` fires on click, `actions.onRename(id, title)`
 * after an inline edit, `actions.onDelete(id)` from the delete button.
 */
export function renderSessionList(listEl, sessions, currentId, actions) {
  if (listEl.querySelector(".session-title-input")) {
    // A title being typed: the list is redrawn once the edit ends (redrawn now, the input
    // went, and with it what was typed, at every reply's start and end)
    pendingRedraws.set(listEl, () => renderSessionList(listEl, sessions, currentId, actions));
    return;
  }
  pendingRedraws.delete(listEl);
  const sorted = [...sessions].sort((a, b) => (b.updated_at || 0) - (a.updated_at || 0));
  const items = sorted.map((s) => {
    const li = el("li", "session-row");
    li.dataset.sessionId = s.session_id;
    const btn = el("button", "session-item");
    btn.type = "button";
    if (s.session_id === currentId) {
      btn.classList.add("active");
      btn.setAttribute("aria-current", "true");
    }
    btn.append(el("span", "session-name", sessionTitle(s)));
    const meta = [];
    if (typeof s.num_messages === "number") meta.push(`${s.num_messages} msg`);
    const age = formatAge(s.updated_at ?? s.created_at);
    if (age) meta.push(age);
    btn.append(el("span", "session-meta", meta.join(" · ")));
    btn.addEventListener("click", () => actions.onPick(s.session_id));
    const rename = iconButton("session-rename", "\u270E", `Rename “${sessionTitle(s)}”`);
    rename.addEventListener("click", () => editTitle(li, s, actions.onRename));
    const del = iconButton("session-delete", "\u2715", `Delete “${sessionTitle(s)}”`);
    del.addEventListener("click", () => actions.onDelete(s.session_id));
    const tools = el("span", "session-tools");
    tools.append(rename, del);
    li.append(btn, tools);
    return li;
  });
  if (items.length === 0) items.push(el("li", "session-empty", "No chats yet"));
  listEl.replaceChildren(...items);
}

const pendingRedraws = new WeakMap(); // list element -> its redraw held back by an edit

function iconButton(className, glyph, label) {
  const b = el("button", `btn btn-ghost icon-btn ${className}`, glyph);
  b.type = "button";
  b.title = label;
  b.setAttribute("aria-label", label);
  return b;
}

/** Swap a session row for a title input: Enter saves, Escape or leaving it cancels. */
function editTitle(li, session, onRename) {
  const input = el("input", "session-title-input");
  input.value = sessionTitle(session);
  input.maxLength = 200;
  input.setAttribute("aria-label", "Session title");
  const children = [...li.childNodes];
  let done = false;
  const finish = (save) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    li.replaceChildren(...children);
    // The redraw held back, once a click that ended the edit (its mousedown blurred the
    // input) has landed: drawn now, it took the row being clicked.
    const list = li.parentElement;
    if (list) setTimeout(() => pendingRedraws.get(list)?.(), 300);
    if (save && title && title !== sessionTitle(session)) onRename(session.session_id, title);
  };
  input.addEventListener("keydown", (ev) => {
    if (isComposing(ev)) return; // (the Enter or Escape is the input method's)
    if (ev.key === "Enter") {
      ev.preventDefault();
      finish(true);
    } else if (ev.key === "Escape") {
      ev.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(false));
  li.replaceChildren(input);
  input.focus();
  input.select();
}

/** A chat bubble; returns handles to its parts. Replies render as Markdown, user text as is. */
export function makeBubble(role, text = "", requestId = null) {
  const isUser = role === "user";
  const root = el("div", `msg ${isUser ? "user" : "assistant"}`);
  if (requestId) root.dataset.requestId = requestId;
  const body = el("div", isUser ? "bubble" : "bubble markdown", isUser ? text : null);
  if (!isUser) renderReply(body, text);
  root.append(body);
  return { root, body };
}

/**
 * Mark where the model's view of a long conversation starts: a note before the message at
 * `index` (the server's `context_start`) among the messages in `listEl`; none when it is 0.
 */
export function markContextStart(listEl, index) {
  listEl.querySelector(":scope > .context-cut")?.remove();
  const first = Number.isInteger(index) && index > 0
    ? listEl.querySelectorAll(":scope > .msg")[index] : undefined;
  if (!first) return;
  const note = el("div", "context-cut",
    "The conversation outgrew the model's context: it no longer sees the messages above.");
  note.setAttribute("role", "note");
  first.before(note);
}

/** (Re)render a reply's Markdown into its bubble body. */
export function renderReply(body, text) {
  body.replaceChildren(renderMarkdown(text));
}

/** Set (or replace) the timing line under a bubble. */
export function setTimings(root, line) {
  let meta = root.querySelector(":scope > .timings");
  if (!meta) {
    meta = el("div", "timings");
    root.append(meta);
  }
  meta.textContent = line;
}

/** The per-reply timing line from a `done` frame; null when there is nothing to show. */
export function formatTimings(done) {
  const parts = [];
  const t = done.timings || {};
  const completion = done.usage ? done.usage.completion_tokens : null;
  if (typeof t.ttft_s === "number" && Number.isFinite(t.ttft_s)) {
    parts.push(`TTFT ${Math.round(t.ttft_s * 1000)} ms`);
  }
  const decode = typeof t.total_s === "number" && typeof t.ttft_s === "number" ? t.total_s - t.ttft_s : 0;
  if (typeof completion === "number" && completion > 1 && decode > 1e-6) {
    const rate = completion / decode;
    parts.push(`${rate >= 100 ? Math.round(rate) : rate.toFixed(1)} tok/s`);
  }
  if (typeof completion === "number") parts.push(`${completion} tokens`);
  if (done.finish_reason && done.finish_reason !== "stop") parts.push(String(done.finish_reason));
  return parts.length ? parts.join(" · ") : null;
}

/** Show the error banner with a code and message (both rendered as text). */
export function showError(code, message) {
  const box = $("#error");
  box.querySelector(".error-code").textContent = code || "error";
  box.querySelector(".error-message").textContent = message || "";
  box.dataset.code = code || "error";
  box.hidden = false;
}

export function hideError() {
  const box = $("#error");
  box.hidden = true;
  delete box.dataset.code;
}
