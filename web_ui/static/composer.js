// Message box mechanics: Enter sends, Shift+Enter inserts a newline, the box grows with its
// content, and the first keystroke of each typing burst is reported once (again every
// `TYPING_REFRESH_MS` while the burst goes on).

const MAX_HEIGHT_PX = 200;
export const TYPING_IDLE_MS = 2000;
// Under the engine's --advisory-ttl-s (30 s): one notice for a long message expired while it
// was typed, and the session's prefetched KV was no longer kept for its turn.
export const TYPING_REFRESH_MS = 15000;

/**
 * Typing-burst detector: a burst starts with a keystroke after at least `idleMs` without one,
 * or in another chat (`target`: a burst's notice names its chat, and one switched to must
 * hear of the typing too). `notify()` is called once per burst, on the first keystroke that
 * leaves text in the box, and again on a keystroke `refreshMs` after the last notice while the
 * burst goes on; it returns whether the notice went out (if not, a later keystroke retries).
 */
export class TypingBurst {
  constructor(idleMs = TYPING_IDLE_MS, now = () => Date.now(), refreshMs = TYPING_REFRESH_MS) {
    this._idleMs = idleMs;
    this._refreshMs = refreshMs;
    this._now = now;
    this._lastKeyAt = -Infinity;
    this._notifiedAt = null;  // when this burst's last notice went out
    this._target = null;  // the chat this burst's notices named
  }

  keystroke(hasText, notify, target = null) {
    const t = this._now();
    if (t - this._lastKeyAt >= this._idleMs || target !== this._target) this._notifiedAt = null;
    this._lastKeyAt = t;
    this._target = target;
    const isDue = this._notifiedAt === null || t - this._notifiedAt >= this._refreshMs;
    if (isDue && hasText && notify()) this._notifiedAt = t;
  }

  /**
   * The conversation changed (a message went out, a reply was saved): the last notice did not
   * cover it. If a burst goes on in the same chat with text in the box, notify now; else the
   * next keystroke does. (Typing the next message through a reply was one burst: its one
   * notice came before the reply existed, and none came after it for `refreshMs`.)
   */
  renew(hasText, notify, target = null) {
    const t = this._now();
    this._notifiedAt = null;
    const isTyping = t - this._lastKeyAt < this._idleMs && target === this._target;
    if (isTyping && hasText && notify()) this._notifiedAt = t;
  }
}

/** Whether key event `ev` belongs to an input method's composition (the Enter that picks a
 * candidate, the Escape that drops one): Safari sends the confirming Enter with isComposing
 * false, and keyCode 229 alone tells it. */
export function isComposing(ev) {
  return ev.isComposing || ev.keyCode === 229;
}

/**
 * Wire a textarea. `onSubmit()` fires on Enter (not Shift+Enter, not mid-IME-composition);
 * `onChange()` after every edit; `onTyping()` once per typing burst (in the chat
 * `typingTarget()` names) and returns true if sent.
 */
export function setupComposer(textarea, { onSubmit, onChange, onTyping, typingTarget = () => null }) {
  const burst = new TypingBurst();

  const autosize = () => {
    textarea.style.height = "auto";
    textarea.style.height = `${Math.min(textarea.scrollHeight, MAX_HEIGHT_PX)}px`;
  };

  textarea.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !isComposing(ev)) {
      ev.preventDefault();
      onSubmit();
    }
  });
  textarea.addEventListener("input", () => {
    autosize();
    onChange();
    burst.keystroke(textarea.value.trim() !== "", onTyping, typingTarget());
  });

  return {
    get value() {
      return textarea.value;
    },
    set value(text) {
      textarea.value = text;
      autosize();
      onChange();
    },
    isBlank: () => textarea.value.trim() === "",
    /** The chat shown changed under the typing (`TypingBurst.renew`). */
    renewTyping: () => burst.renew(textarea.value.trim() !== "", onTyping, typingTarget()),
    clear() {
      textarea.value = "";
      autosize();
    },
    focus: () => textarea.focus(),
  };
}
