// API key prompt: a modal <dialog> that hands the entered key to `onKey(key)`.

/** Wire #auth-dialog; returns `prompt(reason)` to open it (reason is shown as text). */
export function setupAuthDialog({ onKey }) {
  const dialog = document.querySelector("#auth-dialog");
  const form = document.querySelector("#auth-form");
  const reasonEl = document.querySelector("#auth-reason");
  const input = document.querySelector("#api-key-input");

  document.querySelector("#api-key-cancel").addEventListener("click", () => dialog.close());
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = input.value;
    input.value = "";
    dialog.close();
    onKey(key);
  });

  return function prompt(reason = "") {
    reasonEl.textContent = reason
      ? `The server rejected the connection (${reason}). Enter an API key to continue.`
      : "Enter an API key for this server (leave empty to clear the stored one).";
    input.value = "";
    if (!dialog.open) dialog.showModal();
    input.focus();
  };
}
