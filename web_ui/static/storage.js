// Small localStorage wrapper; storage can be unavailable (private mode, disabled), in which
// case values simply live for this page only.

export const KEYS = { apiKey: "antiphon.apiKey", sessionId: "antiphon.sessionId" };

export function load(key) {
  try {
    return localStorage.getItem(key) || "";
  } catch {
    return "";
  }
}

/** Store `value`, or remove the entry when it is empty/null. */
export function store(key, value) {
  try {
    if (value) localStorage.setItem(key, value);
    else localStorage.removeItem(key);
  } catch {
    /* unavailable: ignore */
  }
}
