// Chat page controller: wires the websocket client to the DOM.
import { ChatClient, newRequestId } from "/static/ws-client.js";
import { isComposing, setupComposer } from "/static/composer.js";
import { setupAuthDialog } from "/static/auth-dialog.js";
import { KEYS, load, store } from "/static/storage.js";
import {
  $, el, formatTimings, hideError, makeBubble, markContextStart, renderReply, renderSessionList,
  sessionTitle, setTimings, showError,
} from "/static/view.js";

const ui = {
  body: document.body, messages: $("#messages"), send: $("#send"), stop: $("#stop"),
  sessionList: $("#session-list"), title: $("#session-title"),
  status: $("#conn-state"), countdown: $("#conn-countdown"),
  sidebarToggle: $("#sidebar-toggle"), backdrop: $("#backdrop"),
  systemBox: $("#system-box"), systemInput: $("#system-input"),
};

const state = {
  sessions: [],
  nextBefore: null, // cursor of the sessions older than those listed (null: all are listed)
  olderListed: false, // pages past the first were listed ("Show older chats")
  currentId: load(KEYS.sessionId) || null,
  pending: new Map(), // request_id -> {sessionId, root, body, raw, streamed, cancelling, frame}
  queued: null, // message content waiting for a freshly opened session
  queuedSystem: null, // the system message that session is opened with
  queuedOpen: null, // the request id of that session's open (its `session` frame names it)
  viewOpen: null, // the request id of the open of the chat to show (`showSession`)
  viewOpenId: null, // the session it opens
  givenBack: null, // the message the composer got back as the connection dropped (`wasReceived`)
  // Renames and deletions sent: request id -> {kind, sessionId} (an error names its frame).
  sessionOps: new Map(),
  blankAfterQueued: false, // "New chat" was clicked while the queued message's session opened
  sentAt: -Infinity, // performance.now() of the last send (see STOP_GRACE_MS)
  stick: true, // keep the conversation scrolled to the bottom while streaming
  restoring: false, // re-opening a remembered session (it may be gone)
  cancelled: new Set(), // request ids we sent `cancel` for
  deleteWhenDone: new Set(), // sessions to delete once their streaming reply has stopped
  // The session shown is being answered by another tab or app (the server said `replying`):
  // no Retry under its last message, and the page opens it again until the reply is in.
  replyingElsewhere: null,
  replyingPoll: 0, // its one timer (one per open, each open started a chain of its own)
  connectionRefused: false, // the last connection was refused (1013): its banner goes once one is taken
  // Messages the server refused or never got, of chats not shown then: session id (NEW_CHAT:
  // a new chat's, its session gone) -> [{content, system}]; back in the composer, one at a
  // time, when the chat is shown with the composer empty (into the one shown, they went to
  // the wrong chat).
  drafts: new Map(),
};
const NEW_CHAT = "";

// How often a session another tab is answering is opened again, to show its reply.
const REPLYING_POLL_MS = 1500;

// Stop takes Send's place while a reply streams: a double-click on Send would land its second
// click on Stop and cancel the reply it just asked for. Stop is disabled this long after a send.
const STOP_GRACE_MS = 500;

const client = new ChatClient();
const composer = setupComposer($("#composer"), {
  onSubmit: submit,
  onChange: refreshControls,
  onTyping: () => Boolean(state.currentId) && client.typing(state.currentId),
  typingTarget: () => state.currentId,
});
const promptForKey = setupAuthDialog({ onKey: (key) => client.setApiKey(key) });

// ---------- helpers ----------

function setCurrentSession(id) {
  state.currentId = id;
  store(KEYS.sessionId, id);
}

function nearBottom() {
  const m = ui.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
}

function scrollToBottom(force = false) {
  if (force || state.stick) ui.messages.scrollTop = ui.messages.scrollHeight;
}

function isGenerating() {
  for (const p of state.pending.values()) if (p.sessionId === state.currentId) return true;
  return false;
}

/** Another tab or app is answering the session shown: the server would refuse a message. */
function answeredElsewhere() {
  return state.currentId !== null && state.replyingElsewhere === state.currentId;
}

function refreshControls() {
  const focused = document.activeElement;
  const generating = isGenerating();
  ui.stop.hidden = !generating;
  ui.send.hidden = generating;
  // While a new session opens for a queued message, a second message waits in the composer.
  // And while another tab answers the session, the message waits in the composer.
  ui.send.disabled = !client.connected || composer.isBlank() || state.queued !== null
    || answeredElsewhere();
  const current = [...state.pending.values()].filter((p) => p.sessionId === state.currentId);
  ui.stop.disabled = (current.length > 0 && current.every((p) => p.cancelling))
    || performance.now() - state.sentAt < STOP_GRACE_MS;
  ui.body.dataset.generating = String(generating);
  refreshRegenerate(generating);
  // A control clicked or pressed that this hid, disabled or removed (Send as the reply starts,
  // Stop once pressed or the reply is in, Regenerate) took the focus with it to the top of the
  // page, and a keyboard user had to tab back down: it goes to the composer.
  const isControl = focused === ui.send || focused === ui.stop
    || focused?.classList.contains("regenerate");
  if (isControl && (!focused.isConnected || focused.hidden || focused.disabled)) composer.focus();
}

/**
 * Offer to answer the conversation's last user message again, under its last message, while
 * nothing streams: "Regenerate" under a reply, "Retry" under a message left without one (the
 * server went down or the engine failed while answering it).
 */
function refreshRegenerate(generating) {
  const msgs = ui.messages.querySelectorAll(":scope > .msg");
  const last = msgs[msgs.length - 1];
  let label = null;
  const elsewhere = answeredElsewhere();
  if (state.currentId && !generating && client.connected && last && !elsewhere) {
    if (last.classList.contains("user")) label = "Retry";
    else if (!last.classList.contains("failed")) label = "Regenerate";
    else if (last.dataset.accepted === "true") label = "Retry"; // its message was kept
  }
  const note = elsewhere && !generating ? "Being answered in another tab or app…" : null;
  const shown = label ?? note;
  const row = ui.messages.querySelector(":scope > .msg-actions");
  if (row && shown !== null && row === ui.messages.lastElementChild
      && row.firstElementChild.textContent === shown) return;
  row?.remove();
  if (note !== null) {
    const actions = el("div", "msg-actions");
    actions.append(el("span", "msg-note replying-note", note));
    ui.messages.append(actions);
    return;
  }
  if (label === null) return;
  const button = el("button", "btn btn-ghost regenerate", label);
  button.type = "button";
  button.title = label === "Retry" ? "Ask for a reply to your last message"
    : "Replace the last reply with a new one";
  button.addEventListener("click", regenerate);
  const actions = el("div", "msg-actions");
  actions.append(button);
  ui.messages.append(actions);
}

function renderSessions() {
  renderSessionList(ui.sessionList, state.sessions, state.currentId,
    { onPick: pickSession, onRename: renameSession, onDelete: deleteSession });
  const older = $("#sessions-older");
  older.hidden = state.nextBefore === null;
  older.disabled = false;
}

function upsertSession(session) {
  const i = state.sessions.findIndex((s) => s.session_id === session.session_id);
  if (i >= 0) state.sessions[i] = { ...state.sessions[i], ...session };
  else state.sessions.push({ num_messages: 0, ...session });
}

/** Keep a message the server refused or never got for the chat it was written in (`key`;
 * several new chats' first messages share NEW_CHAT, each given back in turn). */
function keepDraft(key, entry, lost = false) {
  const kept = state.drafts.get(key) ?? [];
  // (`lost`: given back as the connection dropped, it may have been received: `wasReceived`)
  kept.push({ content: entry.content, system: entry.system, lost,
              usersBefore: entry.usersBefore });
  state.drafts.set(key, kept);
  if (key === (state.currentId ?? NEW_CHAT)) restoreDraft(key); // (a new chat is shown)
}

/** Whether `messages` (a chat as the server keeps it) hold `given` (a message given back as
 * the connection dropped, `{content, usersBefore}`) after all: the server took it, and its
 * `accepted` was lost with the connection. Offered again, Enter sent it twice. */
function wasReceived(messages, given) {
  const users = messages.filter((m) => m.role === "user");
  return users.length > (given.usersBefore ?? Infinity) && users.at(-1).content === given.content;
}

/** Drop what was given back for `sessionId` as the connection dropped and the server holds
 * after all (`wasReceived`): from the composer, where the chat is shown, and its drafts. */
function forgetReceived(sessionId, messages) {
  const given = state.givenBack;
  if (given?.sessionId === sessionId) {
    state.givenBack = null;
    if (wasReceived(messages, given) && composer.value === given.content) composer.clear();
  }
  const kept = state.drafts.get(sessionId);
  if (kept === undefined) return;
  const left = kept.filter((d) => !(d.lost && wasReceived(messages, d)));
  if (left.length) state.drafts.set(sessionId, left);
  else state.drafts.delete(sessionId);
}

/** The chat shown (`key`) gets back a message kept for it, when the composer is empty. */
function restoreDraft(key) {
  const kept = state.drafts.get(key);
  if (kept === undefined || !composer.isBlank()) return;
  const draft = kept.shift();
  if (!kept.length) state.drafts.delete(key);
  composer.value = draft.content;
  if (key === NEW_CHAT) ui.systemInput.value = draft.system ?? "";
  refreshControls();
}

function showBlankChat() {
  state.viewOpen = null; // (an open in flight no longer decides what is shown)
  setCurrentSession(null);
  ui.messages.replaceChildren();
  ui.title.textContent = "New chat";
  ui.systemInput.value = ""; // a new chat starts without one
  ui.systemBox.hidden = false;
  renderSessions();
}

function setSidebar(open) {
  ui.body.classList.toggle("sidebar-open", open);
  ui.backdrop.hidden = !open;
  ui.sidebarToggle.setAttribute("aria-expanded", String(open));
}

function addAssistantBubble(requestId, sessionId, text = "") {
  const bubble = makeBubble("assistant", text, requestId);
  if (!text) bubble.root.classList.add("waiting");
  // Redrawn at every frame while it streams, inside the conversation's live region: screen
  // readers wait for the whole reply (`finishEntry`) rather than read each redraw.
  bubble.root.setAttribute("aria-busy", "true");
  const entry = {
    sessionId, root: bubble.root, body: bubble.body, raw: text, streamed: text !== "",
    cancelling: false, frame: 0,
  };
  state.pending.set(requestId, entry);
  ui.messages.append(bubble.root);
  return entry;
}

function finishEntry(requestId, { cls = null, note = null } = {}) {
  const entry = state.pending.get(requestId);
  if (!entry) return;
  state.pending.delete(requestId);
  entry.root.classList.remove("waiting", "streaming");
  entry.root.removeAttribute("aria-busy");
  if (cls) entry.root.classList.add(cls);
  if (entry.raw === "") entry.root.classList.add("empty");
  if (note) entry.root.append(el("div", "msg-note", note));
  refreshControls();
}

// ---------- user actions ----------

/** Render a streaming reply now (its first piece) or at the next frame (later pieces). */
function renderEntry(entry, now = false) {
  if (now) {
    cancelAnimationFrame(entry.frame);
    entry.frame = 0;
    renderReply(entry.body, entry.raw);
  } else if (!entry.frame) {
    entry.frame = requestAnimationFrame(() => {
      entry.frame = 0;
      renderReply(entry.body, entry.raw);
      scrollToBottom();
    });
  }
}

/** Open `id` to show it. Only the `session` frame answering the latest such open (or a new
 * chat's, `openForQueued`) sets what the page shows, and none once "+ New chat" blanked it:
 * an open's answer landing after the user had gone on (a sidebar pick, the resync when the
 * page is shown again, then a click on "+ New chat") took the view back, and the next
 * message went into that chat. */
function showSession(id) {
  state.viewOpen = newRequestId();
  state.viewOpenId = id;
  return client.openSession(id, null, state.viewOpen);
}

function pickSession(id) {
  setSidebar(false);
  if (!client.connected) showError("disconnected", "Not connected to the server; reconnecting…");
  else showSession(id);
}

function renameSession(id, title) {
  if (!sessionOp("rename", id, { title })) {
    showError("disconnected", "Not connected to the server; the title was not changed.");
  }
}

/** Send a session's rename or deletion, named so that an error about it is known as such. */
function sessionOp(kind, sessionId, fields = {}) {
  const requestId = newRequestId();
  const sent = client.send({ type: `session.${kind}`, session_id: sessionId, ...fields,
                             request_id: requestId });
  if (sent) state.sessionOps.set(requestId, { kind, sessionId });
  return sent;
}

/** Open a new session for the queued first message: only the frame answering this open
 * takes it (one opened just before, from the sidebar, got it, and a refusal deleted it).
 * `again`: the same open once more after a reconnect, under its request id, which the server
 * answers with the session it made, if it made one before the connection dropped (a new id
 * left that one behind, empty). */
function openForQueued(again = false) {
  if (!again || state.queuedOpen === null) state.queuedOpen = newRequestId();
  client.openSession(null, state.queuedSystem, state.queuedOpen);
}

function deleteSession(id) {
  const s = state.sessions.find((x) => x.session_id === id);
  if (!window.confirm(`Delete “${sessionTitle(s)}” and all its messages?`)) return;
  if (!client.connected) {
    showError("disconnected", "Not connected to the server; nothing was deleted.");
    return;
  }
  // The server keeps a session while it answers: stop the reply, delete when it has stopped.
  if (cancelReplies(id) > 0) state.deleteWhenDone.add(id);
  else sessionOp("delete", id);
}

function newSession() {
  setSidebar(false);
  // A first message whose session is opening goes to it all the same (dropped, it was lost,
  // and its session left empty); the blank chat comes once it is sent.
  state.blankAfterQueued = state.queued !== null;
  showBlankChat(); // the session is opened once a message is sent: no empty sessions
  restoreDraft(NEW_CHAT);
  refreshControls();
  composer.focus();
}

function sendMessage(content, { opened = false, system = null } = {}) {
  const requestId = newRequestId();
  const usersBefore = ui.messages.querySelectorAll(":scope > .msg.user").length;
  const user = makeBubble("user", content, requestId);
  ui.messages.append(user.root);
  const entry = addAssistantBubble(requestId, state.currentId);
  entry.content = content; // back into the composer if the server refuses it
  entry.userRoot = user.root;
  entry.opened = opened; // the session was opened for this message: gone if it is refused
  entry.system = system; // (the system message it was opened with, given back with it)
  entry.usersBefore = usersBefore; // (the chat's user messages before it: `wasReceived`)
  markSent();
  if (!client.sendMessage(state.currentId, content, requestId)) {
    finishEntry(requestId, { cls: "failed", note: "Not sent: connection lost." });
    return;
  }
  entry.root.classList.add("streaming");
  scrollToBottom(true);
  refreshControls();
}

/** Answer the last user message again; the reply shown under it (if any) gives way. */
function regenerate() {
  if (!state.currentId || isGenerating() || state.queued !== null) return;
  if (!client.connected) {
    showError("disconnected", "Not connected to the server; reconnecting…");
    return;
  }
  hideError();
  const msgs = ui.messages.querySelectorAll(":scope > .msg");
  const last = msgs[msgs.length - 1];
  if (last?.classList.contains("assistant")) last.remove();
  const requestId = newRequestId();
  const entry = addAssistantBubble(requestId, state.currentId);
  entry.regenerate = true;
  markSent();
  if (!client.send({ type: "regenerate", session_id: state.currentId, request_id: requestId })) {
    finishEntry(requestId, { cls: "failed", note: "Not sent: connection lost." });
    return;
  }
  entry.root.classList.add("streaming");
  scrollToBottom(true);
  refreshControls();
}

/** Why the server would refuse `content` for its size, or null. The page is served with the
 * server's limits: a message over the websocket's frame limit closed the connection (1009)
 * with no word of why, cutting every reply on it. */
function overLimit(content, what = "message") {
  const limits = ui.body.dataset;
  const maxChars = Number(limits.maxContentChars) || Infinity;
  const maxBytes = Number(limits.maxFrameBytes) || Infinity;
  const chars = [...content].length; // (code points, as the server counts them)
  if (chars > maxChars) return `The ${what} has ${chars} characters; the limit is ${maxChars}.`;
  const frame = JSON.stringify({
    type: "message", session_id: state.currentId ?? "s_" + "0".repeat(32), content,
    request_id: newRequestId(),
  });
  const bytes = new TextEncoder().encode(frame).length;
  if (bytes > maxBytes) return `The ${what} takes ${bytes} bytes to send; the limit is ${maxBytes}.`;
  return null;
}

function submit() {
  const content = composer.value;
  if (composer.isBlank() || isGenerating() || state.queued !== null || answeredElsewhere()) return;
  if (!client.connected) {
    showError("disconnected", "Not connected to the server; reconnecting…");
    return;
  }
  const system = state.currentId ? "" : ui.systemInput.value.trim(); // (a new chat's)
  const tooLarge = overLimit(content) ?? (system ? overLimit(system, "system message") : null);
  if (tooLarge !== null) {
    showError("too_large", tooLarge);
    return;
  }
  hideError();
  composer.clear();
  composer.renewTyping(); // the next message's typing tells of this one
  if (state.currentId) {
    sendMessage(content);
  } else {
    state.queued = content;
    state.queuedSystem = ui.systemInput.value.trim() || null;
    state.blankAfterQueued = false;
    markSent();
    openForQueued();
  }
  refreshControls();
}

function markSent() {
  state.sentAt = performance.now();
  setTimeout(refreshControls, STOP_GRACE_MS + 10); // Stop's grace is over
}

/** Ask the server to stop every reply of `sessionId` still streaming; how many there were. */
function cancelReplies(sessionId) {
  let streaming = 0;
  for (const [rid, p] of state.pending) {
    if (p.sessionId !== sessionId) continue;
    streaming += 1;
    if (!p.cancelling && (p.cancelling = client.cancel(rid))) state.cancelled.add(rid);
  }
  return streaming;
}

function stop() {
  cancelReplies(state.currentId);
  refreshControls();
}

// ---------- server messages ----------

const handlers = {
  sessions(msg) {
    const listed = Array.isArray(msg.sessions) ? msg.sessions : [];
    const nextBefore = msg.has_more && typeof msg.next_before === "string" ? msg.next_before : null;
    if (msg.before) { // a page of older sessions: added below those listed
      const known = new Set(state.sessions.map((s) => s.session_id));
      state.sessions.push(...listed.filter((s) => !known.has(s.session_id)));
      state.olderListed = true;
      state.nextBefore = nextBefore;
    } else if (state.olderListed) {
      // A refresh of the most recent page: the older pages the user opened stay listed, and
      // so does the cursor past the oldest of them. One listed before that now falls within
      // the fresh page's span (or a page that is all of them) and is not in it was deleted
      // elsewhere: kept, it stayed in the sidebar for good, and opened only an error. (One
      // of an older page, past the fresh page's span, is not listed again: deleted
      // elsewhere, it stays until it is opened, and leaves then.)
      const fresh = new Set(listed.map((s) => s.session_id));
      const last = listed[listed.length - 1];
      const older = (s) => msg.has_more && (s.updated_at < last.updated_at
        || (s.updated_at === last.updated_at && s.session_id < last.session_id));
      state.sessions = [...listed, ...state.sessions.filter(
        (s) => !fresh.has(s.session_id) && older(s))];
    } else {
      state.sessions = listed;
      state.nextBefore = nextBefore;
    }
    const current = state.sessions.find((s) => s.session_id === state.currentId);
    if (current) ui.title.textContent = sessionTitle(current);
    renderSessions();
  },

  session(msg) {
    const s = msg.session || {};
    const forView = msg.request_id !== undefined
      && (msg.request_id === state.viewOpen || msg.request_id === state.queuedOpen);
    if (!forView) { // an open the user has gone on from: listed, not shown
      if (s.session_id) upsertSession(s);
      renderSessions();
      return;
    }
    state.restoring = false;
    // Opened again to see whether another tab's reply is in: the reader's scroll stays.
    const polled = answeredElsewhere() && s.session_id === state.currentId;
    setCurrentSession(s.session_id || null);
    ui.title.textContent = sessionTitle(s);
    // Replies still streaming for this session stay visible after a re-open; the reply a
    // regenerate is replacing, which the server keeps until the new one is in, does not.
    const mine = [...state.pending.values()].filter((p) => p.sessionId === s.session_id);
    const kept = Array.isArray(msg.messages) ? [...msg.messages] : [];
    if (mine.some((p) => p.regenerate) && kept.at(-1)?.role === "assistant") kept.pop();
    // A reply the server saved before its `done` came (the session was opened meanwhile) is
    // shown once, in its streaming bubble (both were shown, until the chat was opened again).
    else if (mine.some((p) => p.root.dataset.accepted === "true" && kept.at(-2)?.role === "user"
                       && kept.at(-2).content === p.content)
             && kept.at(-1)?.role === "assistant") kept.pop();
    const bubbles = kept.map((m) => {
      const { root } = makeBubble(m.role, m.content ?? "");
      if (m.finish_reason === "cancelled") root.classList.add("cancelled"); // cut short
      // How a reply ended, as its live timings line says it: cut at max_tokens, or cancelled.
      if (m.role === "assistant" && ["length", "cancelled"].includes(m.finish_reason)) {
        root.append(el("div", "msg-note finish-note", m.finish_reason));
      }
      // A conversation an app held over the websocket API with tools: calls and results.
      if (m.role === "tool") root.prepend(el("div", "msg-note tool-note", "Tool result"));
      const calls = Array.isArray(m.tool_calls) ? m.tool_calls : [];
      if (calls.length && !m.content) root.classList.add("calls-only");
      for (const call of calls) {
        const fn = call?.function ?? {};
        root.append(el("div", "msg-note tool-note", `Called ${fn.name}(${fn.arguments ?? ""})`));
      }
      return root;
    });
    bubbles.push(...mine.map((p) => p.root));
    // The session's system message, which the model sees first (set when it was created).
    if (typeof s.system === "string" && s.system) {
      bubbles.unshift(el("div", "system-note", `System: ${s.system}`));
    }
    ui.systemBox.hidden = Boolean(s.session_id);
    const stick = !polled || nearBottom();
    ui.messages.replaceChildren(...bubbles);
    markContextStart(ui.messages, s.context_start);
    const elsewhere = msg.replying === true && mine.length === 0 && s.session_id;
    state.replyingElsewhere = elsewhere ? s.session_id : null;
    // The reply another tab or app was giving, which refused this one's message, is in.
    const box = $("#error");
    if (!box.hidden && box.dataset.code === "session_busy" && !elsewhere) hideError();
    if (state.replyingElsewhere !== null) {
      // A hidden tab asks again when the user comes back to it (`comeBack`).
      const id = state.replyingElsewhere;
      clearTimeout(state.replyingPoll);
      state.replyingPoll = setTimeout(() => {
        if (state.replyingElsewhere === id && state.currentId === id && client.connected
            && !document.hidden) {
          showSession(id);
        }
      }, REPLYING_POLL_MS);
    }
    if (s.session_id) upsertSession(s);
    renderSessions();
    if (s.session_id) forgetReceived(s.session_id, Array.isArray(msg.messages) ? msg.messages : []);
    if (s.session_id) restoreDraft(s.session_id);
    refreshControls();
    scrollToBottom(stick); // with the Regenerate row refreshControls drew
    if (state.queued !== null && s.session_id && msg.request_id === state.queuedOpen) {
      const content = state.queued;
      state.queued = null;
      sendMessage(content, { opened: true, system: state.queuedSystem });
      if (state.blankAfterQueued) newSession(); // its reply streams on in the sidebar's chat
    }
  },

  accepted(msg) {
    const entry = state.pending.get(msg.request_id);
    if (!entry) return;
    entry.root.dataset.accepted = "true"; // the server keeps the message, whatever happens next
    if (typeof msg.prompt_tokens === "number") entry.root.dataset.promptTokens = msg.prompt_tokens;
    client.listSessions(); // its count and the title the first message gave
  },

  token(msg) {
    let entry = state.pending.get(msg.request_id);
    if (!entry) {
      if (msg.session_id !== state.currentId) return;
      entry = addAssistantBubble(msg.request_id, msg.session_id);
    }
    state.stick = nearBottom();
    entry.root.classList.remove("waiting");
    entry.root.classList.add("streaming");
    const first = !entry.streamed;
    entry.raw += String(msg.text ?? "");
    entry.streamed = true;
    renderEntry(entry, first);
    scrollToBottom();
  },

  done(msg) {
    let entry = state.pending.get(msg.request_id);
    if (!entry && msg.session_id === state.currentId) {
      entry = addAssistantBubble(msg.request_id, msg.session_id);
    }
    if (!entry) return;
    state.stick = nearBottom();
    if (typeof msg.text === "string" && (msg.text !== "" || !entry.streamed)) entry.raw = msg.text;
    renderEntry(entry, true);
    const line = formatTimings(msg);
    if (line) setTimings(entry.root, line);
    const cancelled = msg.finish_reason === "cancelled";
    finishEntry(msg.request_id, { cls: cancelled ? "cancelled" : null });
    if (entry.regenerate && entry.raw === "" && msg.session_id === state.currentId) {
      showSession(msg.session_id); // stopped before its first word: the old reply stays
    }
    if (msg.session_id === state.currentId) {
      markContextStart(ui.messages, msg.context_start);
      composer.renewTyping(); // a notice that covers the reply, if the next one is being typed
    }
    scrollToBottom();
    if (state.deleteWhenDone.delete(msg.session_id)) sessionOp("delete", msg.session_id);
    client.listSessions();
  },

  "session.renamed"(msg) {
    state.sessionOps.delete(msg.request_id);
    const s = msg.session || {};
    upsertSession(s);
    if (s.session_id === state.currentId) ui.title.textContent = sessionTitle(s);
    renderSessions();
  },

  "session.deleted"(msg) {
    state.sessionOps.delete(msg.request_id);
    state.sessions = state.sessions.filter((s) => s.session_id !== msg.session_id);
    if (msg.session_id === state.currentId) showBlankChat();
    else renderSessions();
  },

  error(msg) {
    // Cancelling a reply that finished meanwhile is not worth a banner.
    if (msg.code === "request_not_found" && state.cancelled.delete(msg.request_id)) return;
    const op = state.sessionOps.get(msg.request_id);
    if (op !== undefined) {
      state.sessionOps.delete(msg.request_id);
      if (msg.code !== "session_not_found") {
        showError(msg.code, msg.message);
        return;
      }
      // Deleted meanwhile (another tab): gone from the list; the chat shown is left alone
      // unless it was that one (a deletion of it wanted no more).
      if (op.kind !== "delete") showError(msg.code, msg.message);
      state.sessions = state.sessions.filter((x) => x.session_id !== op.sessionId);
      if (op.sessionId === state.currentId) showBlankChat();
      else renderSessions();
      return;
    }
    // (the open of the chat shown: an earlier one's, or a typing notice's, leaves it be)
    const isViewOpen = Boolean(msg.request_id) && msg.request_id === state.viewOpen;
    const isTypingGone = msg.code === "session_not_found" && !msg.request_id;
    const silent = msg.code === "session_not_found" && (isViewOpen ? state.restoring
      : !msg.request_id);
    if (!silent) showError(msg.code, msg.message);
    // A typing notice's chat is gone: the one shown, deleted elsewhere, or one left since.
    // Opened again, the chat shown is blanked if it is gone (left shown, every message sent
    // to it came back refused), and shown as it is if not.
    if (isTypingGone && state.currentId && !isGenerating()) showSession(state.currentId);
    if (state.queued !== null && msg.request_id === state.queuedOpen) {
      // The session a new chat's first message waited for was refused (the key's sessions at
      // their limit, a system message too long): the message goes back to the composer.
      if (composer.isBlank()) composer.value = state.queued;
      state.queued = null;
      state.blankAfterQueued = false;
      refreshControls();
    }
    if (msg.request_id && state.pending.has(msg.request_id)) {
      const entry = state.pending.get(msg.request_id);
      // A reply stopped for a deletion, ended by an error: the deletion goes ahead (left
      // waiting, it went ahead without asking at the chat's next reply)
      if (state.deleteWhenDone.delete(entry.sessionId)) sessionOp("delete", entry.sessionId);
      // The engine refused an accepted message (bad_message): the server took it back.
      if (msg.code === "bad_message") entry.root.dataset.accepted = "false";
      // A message refused goes back to the composer, to fix and send again (the banner says
      // why), and leaves the conversation as the server keeps it; one accepted is kept by the
      // server, and "Retry" asks for its reply again.
      // A chat not shown (the user went on to another) gets it back when it is shown again.
      const refused = entry.content && entry.root.dataset.accepted !== "true";
      const shown = entry.sessionId === state.currentId;
      if (refused && (composer.isBlank() || !shown)) {
        finishEntry(msg.request_id);
        entry.root.remove();
        entry.userRoot?.remove();
        // A session opened for this message alone would stay behind empty. Its chat is
        // blank again, with the system message typed for it (the deletion cleared that).
        if (entry.opened) {
          client.send({ type: "session.delete", session_id: entry.sessionId });
          if (shown) {
            showBlankChat();
            ui.systemInput.value = entry.system ?? "";
          }
        } else if (msg.code === "session_busy" && shown) resync(); // another tab is answering
        else if (msg.code === "session_not_found" && shown) showSession(entry.sessionId); // gone:
        // the open's own refusal blanks the chat, and the message starts a new one
        if (shown) composer.value = entry.content;
        else keepDraft(entry.opened ? NEW_CHAT : entry.sessionId, entry);
        refreshControls();
        return;
      }
      finishEntry(msg.request_id, { cls: "failed", note: `${msg.code}: ${msg.message}` });
      if (entry.regenerate && entry.sessionId === state.currentId) {
        showSession(entry.sessionId); // what the server kept (the old reply, if any)
      }
    } else if (msg.code === "session_not_found" && isViewOpen) {
      // A remembered or listed session that no longer exists: start fresh (a new chat's
      // first message waiting for its session still goes to it: it was dropped), and no
      // longer listed.
      state.restoring = false;
      state.sessions = state.sessions.filter((s) => s.session_id !== state.viewOpenId);
      showBlankChat();
    }
  },
};

// ---------- wiring ----------

/** Say the connection's `text` in the status line, and `countdown` after it. The state is a
 * live region, set only when it changes; the countdown is not: a screen reader read out every
 * tick of it. */
function setStatus(text, countdown = "") {
  if (ui.status.textContent !== text) ui.status.textContent = text;
  ui.countdown.textContent = countdown;
}

// While a reconnect waits, the status counts down to it.
let countdown = null;
function showReconnecting(retryInMs) {
  clearInterval(countdown);
  const at = Date.now() + retryInMs;
  const show = () => {
    const left = Math.max(1, Math.ceil((at - Date.now()) / 1000));
    setStatus("Reconnecting", ` in ${left}s…`);
  };
  show();
  countdown = setInterval(show, 1000);
}

client.addEventListener("open", () => {
  clearInterval(countdown);
  ui.body.dataset.connected = "true";
  setStatus("Connected");
  const box = $("#error");
  // (a server that was shutting down has been replaced by one that serves)
  const gone = ["disconnected", "unauthorized", "shutting_down"];
  if (!box.hidden && gone.includes(box.dataset.code)) hideError();
  client.listSessions();
  // A new chat's first message still waiting for its session is sent to a new one, or to the
  // one its open made before the connection dropped (the chat shown meanwhile, picked just
  // before it, gives way: left waiting, it was lost for good).
  state.restoring = Boolean(state.currentId) && state.queued === null;
  if (state.queued !== null) openForQueued(true);
  else if (state.currentId) showSession(state.currentId);
  refreshControls();
});

client.addEventListener("accepted", () => {
  // A server over its connection limits refused the last connection (too_many_requests,
  // then closed): this one it took.
  const box = $("#error");
  if (!box.hidden && box.dataset.code === "too_many_requests" && state.connectionRefused) {
    hideError();
  }
  state.connectionRefused = false;
});

client.addEventListener("close", (ev) => {
  ui.body.dataset.connected = "false";
  const { code, reason, retryInMs } = ev.detail;
  clearInterval(countdown);
  if (client.authRequired) setStatus("API key required");
  else if (retryInMs === null) setStatus("Disconnected");
  else showReconnecting(retryInMs);
  if (code === 1013) state.connectionRefused = true;  // over the server's connection limits
  if (code === 1009) {  // a frame over the server's limit (one past the page's own check)
    showError("too_large", `The server closed the connection: a message was too large (${reason}).`);
    if (state.queued !== null) { // (sent again at every reconnect, it closed each one)
      if (composer.isBlank()) composer.value = state.queued;
      if (!state.currentId) ui.systemInput.value = state.queuedSystem ?? "";
      state.queued = null;
    }
  }
  for (const [rid, entry] of [...state.pending.entries()]) {
    // A message the server never said it kept goes back to the composer of its chat (the
    // session, opened again once connected, shows what the server kept): it was lost.
    if (entry.content && entry.root.dataset.accepted !== "true") {
      if (entry.sessionId === state.currentId && composer.isBlank()) {
        composer.value = entry.content;
        state.givenBack = { sessionId: entry.sessionId, content: entry.content,
                            usersBefore: entry.usersBefore };
      } else keepDraft(entry.sessionId, entry, true);
    }
    finishEntry(rid, { cls: "failed", note: "Connection lost before the reply finished." });
  }
  // A rename or deletion in flight is answered on this socket or not at all; so is a
  // deletion waiting for a reply to stop (asked again, if still wanted).
  state.sessionOps.clear();
  state.deleteWhenDone.clear();
  refreshControls();
});

client.addEventListener("auth-required", (ev) => {
  setStatus("API key required");
  showError("unauthorized", ev.detail.reason || "The server requires an API key.");
  promptForKey(ev.detail.reason);
});

client.addEventListener("message", (ev) => {
  const handler = handlers[ev.detail.type];
  if (handler) handler(ev.detail);
});

$("#composer-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  submit();
});
ui.stop.addEventListener("click", stop);
$("#new-session").addEventListener("click", newSession);
$("#sessions-older").addEventListener("click", (ev) => {
  if (state.nextBefore !== null && client.listSessions(state.nextBefore)) ev.currentTarget.disabled = true;
});
ui.sidebarToggle.addEventListener("click", () => setSidebar(!ui.body.classList.contains("sidebar-open")));
ui.backdrop.addEventListener("click", () => setSidebar(false));
$("#error .error-close").addEventListener("click", hideError);
$("#api-key-button").addEventListener("click", () => promptForKey(""));
ui.messages.addEventListener("scroll", () => (state.stick = nearBottom()));
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && !isComposing(ev)) setSidebar(false);
});

/** Show the current session as the server keeps it, and the list: another tab or app may have
 * moved it on meanwhile. Not while a reply of it streams here. */
function resync() {
  if (!client.connected || document.hidden) return;
  client.listSessions();
  if (state.currentId && !isGenerating() && state.queued === null) {
    showSession(state.currentId);
  }
}
// When the user comes back to the page (another tab, another window) it resyncs, or, while
// the server is away, tries it again at once rather than at the end of its backoff wait.
let away = false;
function comeBack() {
  if (!away || document.hidden) return;
  away = false;
  if (client.connected) resync();
  else client.retryNow();
}
document.addEventListener("visibilitychange", () => {
  if (document.hidden) away = true;
  else comeBack();
});
window.addEventListener("blur", () => (away = true));
window.addEventListener("focus", comeBack);

renderSessions();
ui.systemBox.hidden = Boolean(state.currentId); // a blank chat's, until a session shows
refreshControls();
client.connect();
