// API key prompt: a modal <dialog>, built here for every page, that hands the entered key to
// `onKey(key)`.
import { el } from "/static/view.js";

function buildDialog() {
  const dialog = el("dialog", "auth-dialog");
  dialog.id = "auth-dialog";
  const form = el("form");
  form.id = "auth-form";
  form.method = "dialog";
  const reason = el("p", "muted");
  reason.id = "auth-reason";
  const input = el("input");
  Object.assign(input, { id: "api-key-input", type: "password", autocomplete: "off",
    spellcheck: false, placeholder: "API key" });
  input.setAttribute("aria-label", "API key");
  const cancel = el("button", "btn btn-ghost", "Cancel");
  Object.assign(cancel, { id: "api-key-cancel", type: "button" });
  const save = el("button", "btn btn-primary", "Save & connect");
  Object.assign(save, { id: "api-key-save", type: "submit" });
  const actions = el("div", "dialog-actions");
  actions.append(cancel, save);
  form.append(el("h2", "", "API key required"), reason, input, actions);
  dialog.append(form);
  document.body.append(dialog);
  return { dialog, form, reason, input, cancel };
}

/** Add the API key dialog to the page; returns `prompt(reason)` to open it (reason shown as
 * text). */
export function setupAuthDialog({ onKey }) {
  const { dialog, form, reason: reasonEl, input, cancel } = buildDialog();

  cancel.addEventListener("click", () => dialog.close());
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = input.value;
    input.value = "";
    dialog.close();
    onKey(key);
  });

  return function prompt(reason = "") {
    reasonEl.textContent = reason
      ? `The server refused the request (${reason}). Enter an API key to continue.`
      : "Enter an API key for this server (leave empty to clear the stored one).";
    if (!dialog.open) {
      // Cleared only as it opens: a page that polls asks again while the user types.
      input.value = "";
      dialog.showModal();
      input.focus();
    }
  };
}
