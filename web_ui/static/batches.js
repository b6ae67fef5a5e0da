// Batch jobs page: upload a JSONL file and run it, watch progress, see failed lines, cancel,
// download the output and error files. Everything goes through the OpenAI Batch API plus
// Antiphon's `GET /v1/batches/{id}/errors`.
import { api, request, setupApiKey } from "/static/api.js";
import { $, el, formatAge, hideError, showError } from "/static/view.js";

const FINISHED = new Set(["completed", "failed", "expired", "cancelled"]);
const POLL_MS = 1000;

const state = { batches: [], selected: null, timer: null };

function progress(b) {
  const c = b.request_counts || { total: 0, completed: 0, failed: 0 };
  return { done: c.completed + c.failed, ...c };
}

function progressBar(b) {
  const p = progress(b);
  const wrap = el("div", "progress");
  const bar = el("progress");
  bar.max = Math.max(1, p.total);
  bar.value = p.done;
  const text = p.total ? `${p.done} / ${p.total}${p.failed ? ` · ${p.failed} failed` : ""}` : "–";
  wrap.append(bar, el("span", "progress-text", text));
  return wrap;
}

function renderRows() {
  const rows = state.batches.map((b) => {
    const tr = el("tr");
    tr.dataset.batchId = b.id;
    tr.dataset.status = b.status;
    if (b.id === state.selected) tr.classList.add("selected");
    const name = (b.metadata && b.metadata.filename) || b.id;
    const link = el("button", "link-btn", name);
    link.type = "button";
    link.title = b.id;
    link.addEventListener("click", () => select(b.id));
    const cells = [link, el("span", `status status-${b.status}`, b.status), progressBar(b),
      el("span", "muted", formatAge(b.created_at)), el("span")];
    for (const c of cells) {
      const td = el("td");
      td.append(c);
      tr.append(td);
    }
    return tr;
  });
  $("#batch-rows").replaceChildren(...rows);
  $("#no-batches").hidden = rows.length > 0;
}

async function renderDetail() {
  const b = state.batches.find((x) => x.id === state.selected);
  $("#detail").hidden = !b;
  if (!b) return;
  $("#detail-id").textContent = b.id;
  $("#detail").dataset.status = b.status;
  const p = progress(b);
  const whole = b.errors && b.errors.data ? ` · ${b.errors.data.map((e) => e.message).join("; ")}` : "";
  $("#detail-summary").textContent =
    `${b.status} · ${p.completed} completed, ${p.failed} failed of ${p.total}${whole}`;
  $("#download-results").hidden = !b.output_file_id;
  $("#download-errors").hidden = !b.error_file_id;
  $("#cancel-batch").hidden = !["validating", "in_progress"].includes(b.status);
  const errors = await api(`/v1/batches/${encodeURIComponent(b.id)}/errors?limit=200`);
  const rows = errors.data.map((e) => {
    const tr = el("tr");
    for (const v of [e.line, e.custom_id ?? "–", e.code, e.message]) tr.append(el("td", "", v));
    return tr;
  });
  if (errors.has_more) {
    const more = el("td", "muted", "More failed lines: download the error file.");
    more.colSpan = 4;
    rows.push(el("tr"));
    rows[rows.length - 1].append(more);
  }
  $("#error-rows").replaceChildren(...rows);
  $("#no-errors").hidden = rows.length > 0;
}

async function refresh() {
  clearTimeout(state.timer);
  // One poll at a time: a refresh while another awaits the server (an upload, a cancel, a
  // key) started a second polling loop.
  const run = state.refreshRun = (state.refreshRun || 0) + 1;
  try {
    state.batches = (await api("/v1/batches?limit=50")).data;
    if ($("#error").dataset.code === "disconnected") hideError(); // reached it again
    renderRows();
    await renderDetail();
  } catch (err) {
    showError(err.code || "error", err.message);
  }
  if (run !== state.refreshRun) return; // a later refresh polls on
  if (state.batches.some((b) => !FINISHED.has(b.status))) state.timer = setTimeout(refresh, POLL_MS);
}

function select(id) {
  state.selected = id;
  renderRows();
  renderDetail().catch((err) => showError(err.code || "error", err.message));
}

const ENDPOINTS = ["/v1/chat/completions", "/v1/completions"];

/** A JSONL line's `url` if it is an endpoint a batch may have, or null (blank, not JSON, none,
 * or another url: that line fails alone when the batch runs). */
function urlOf(line) {
  if (!line.trim()) return null;
  try {
    const url = JSON.parse(line).url;
    return ENDPOINTS.includes(url) ? url : null;
  } catch {
    return null; // the server reports bad lines
  }
}

/** The endpoint of a batch of `file`: the url of its first line that names one a batch may
 * have, read a piece at a time (lines may be long), as `antiphon batch submit` finds it;
 * chat completions if none does. */
async function firstUrl(file) {
  const decoder = new TextDecoder();
  const step = 1 << 16;
  let rest = "";
  for (let offset = 0; offset < file.size; offset += step) {
    rest += decoder.decode(await file.slice(offset, offset + step).arrayBuffer(), { stream: true });
    const lines = rest.split("\n");
    rest = lines.pop(); // the line the piece cut, if any
    for (const line of lines) {
      const url = urlOf(line);
      if (url) return url;
    }
  }
  return urlOf(rest) || "/v1/chat/completions";
}

async function upload(ev) {
  ev.preventDefault();
  const file = $("#batch-file").files[0];
  if (!file) return;
  const status = $("#upload-status");
  $("#submit-batch").disabled = true;
  hideError();
  try {
    status.textContent = "Uploading…";
    const form = new FormData();
    form.append("purpose", "batch");
    form.append("file", file, file.name);
    const endpoint = await firstUrl(file);
    const uploaded = await api("/v1/files", { method: "POST", form });
    status.textContent = "Starting…";
    const batch = await api("/v1/batches", {
      method: "POST",
      json: {
        input_file_id: uploaded.id, endpoint, completion_window: "24h",
        metadata: { filename: file.name.slice(0, 512) },
      },
    });
    status.textContent = `Started ${batch.id}.`;
    $("#upload-form").reset();
    state.selected = batch.id;
    await refresh();
  } catch (err) {
    status.textContent = "";
    showError(err.code || "error", err.message);
  } finally {
    $("#submit-batch").disabled = false;
  }
}

/** Fetch a file with the API key and hand it to the browser as a download. */
async function download(fileId, name) {
  try {
    const blob = await (await request(`/v1/files/${encodeURIComponent(fileId)}/content`)).blob();
    const a = el("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  } catch (err) {
    showError(err.code || "error", err.message);
  }
}

function selectedBatch() {
  return state.batches.find((x) => x.id === state.selected);
}

$("#upload-form").addEventListener("submit", upload);
$("#download-results").addEventListener("click", () => {
  const b = selectedBatch();
  if (b && b.output_file_id) download(b.output_file_id, `${b.id}.results.jsonl`);
});
$("#download-errors").addEventListener("click", () => {
  const b = selectedBatch();
  if (b && b.error_file_id) download(b.error_file_id, `${b.id}.errors.jsonl`);
});
$("#cancel-batch").addEventListener("click", async () => {
  const b = selectedBatch();
  if (!b || !window.confirm(`Cancel ${b.id}? Finished items keep their results.`)) return;
  try {
    await api(`/v1/batches/${encodeURIComponent(b.id)}/cancel`, { method: "POST" });
    await refresh();
  } catch (err) {
    showError(err.code || "error", err.message);
  }
});
$("#error .error-close").addEventListener("click", hideError);
const askKey = setupApiKey(() => refresh());
$("#api-key-button").addEventListener("click", () => askKey(""));
refresh();
