// Message box mechanics: Enter sends, Shift+Enter inserts a newline, the box grows with its
// content, and the first keystroke of each typing burst is reported once.

const MAX_HEIGHT_PX = 200;
export const TYPING_IDLE_MS = 2000;

/**
 * Typing-burst detector: a burst starts with a keystroke after at least `idleMs` without one.
 * `notify()` is called at most once per burst, on the first keystroke that leaves text in the
 * box; it returns whether the notice went out (if not, a later keystroke of the burst retries).
 */
export class TypingBurst {
  constructor(idleMs = TYPING_IDLE_MS, now = () => Date.now()) {
    this._idleMs = idleMs;
    this._now = now;
    this._lastKeyAt = -Infinity;
    this._notified = false;
  }

  keystroke(hasText, notify) {
    const t = this._now();
    if (t - this._lastKeyAt >= this._idleMs) this._notified = false;
    this._lastKeyAt = t;
    if (!this._notified && hasText) this._notified = Boolean(notify());
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
