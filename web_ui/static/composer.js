// Message box mechanics: Enter sends, Shift+Enter inserts a newline, the box grows with its
// content, and the first keystroke of each typing burst is reported once (again every
// `TYPING_REFRESH_MS` while the burst goes on).

const MAX_HEIGHT_PX = 200;
export const TYPING_IDLE_MS = 2000;
// Under the engine's --advisory-ttl-s (30 s): one notice for a long message expired while it
// was typed, and the session's prefetched KV was no longer kept for its turn.
export const TYPING_REFRESH_MS = 15000;

/**
 * Typing-burst detector: a burst starts with a keystroke after at least `idleMs` without one.
 * `notify()` is called once per burst, on the first keystroke that leaves text in the box, and
 * again on a keystroke `refreshMs` after the last notice while the burst goes on; it returns
 * whether the notice went out (if not, a later keystroke retries).
 */
export class TypingBurst {
  constructor(idleMs = TYPING_IDLE_MS, now = () => Date.now(), refreshMs = TYPING_REFRESH_MS) {
    this._idleMs = idleMs;
    this._refreshMs = refreshMs;
    this._now = now;
    this._lastKeyAt = -Infinity;
    this._notifiedAt = null;  // when this burst's last notice went out
  }

  keystroke(hasText, notify) {
    const t = this._now();
    if (t - this._lastKeyAt >= this._idleMs) this._notifiedAt = null;
    this._lastKeyAt = t;
    const isDue = this._notifiedAt === null || t - this._notifiedAt >= this._refreshMs;
    if (isDue && hasText && notify()) this._notifiedAt = t;
  }
}

/**
 * Wire a textarea. `onSubmit()` fires on Enter (not Shift+Enter, not mid-IME-composition);
 * `onChange()` after every edit; `onTyping()` once per typing burst and returns true if sent.
 */
export function setupComposer(textarea, { onSubmit, onChange, onTyping }) {
  const burst = new TypingBurst();

  const autosize = () => {
    textarea.style.height = "auto";
    textarea.style.height = `${Math.min(textarea.scrollHeight, MAX_HEIGHT_PX)}px`;
  };

  textarea.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      onSubmit();
    }
  });
  textarea.addEventListener("input", () => {
    autosize();
    onChange();
    burst.keystroke(textarea.value.trim() !== "", onTyping);
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
    clear() {
      textarea.value = "";
      autosize();
    },
    focus: () => textarea.focus(),
  };
}
