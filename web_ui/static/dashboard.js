// Live dashboard: polls the server's own time series (`GET /v1/dashboard?since=T`) and redraws
// SVG charts without reloading the page.
import { api, setupApiKey } from "/static/api.js";
import { LineChart, formatValue } from "/static/chart.js";
import { $, el, hideError, showError } from "/static/view.js";

const RT = "#2f6fed";
const BE = "#e07b24";
const THIRD = "#2e9d6b";
const FOURTH = "#9c5ccf";
const MAX_POINTS = 3600;
const SPAN_S = 300; // the charts show the last five minutes
const GAP_INTERVALS = 3; // samples further apart than this many intervals: an outage, no line
const MAX_RETRY_S = 30; // a server that does not answer is asked again at most this far apart

const state = {
  points: [], targets: {}, intervalS: 1, model: "",
  timer: null, // the next poll, when one is due
  polling: false, // a request is out
  failures: 0, // polls failed in a row
};

const fromTokens = (tier) => (p) => {
  const f = p.prompt_tokens_from;
  if (!f) return null;
  const total = f.device + f.host + f.ssd + f.computed;
  return total > 0 ? f[tier] / total : null;
};

// The charts: what the engine does for RT and BE, then the KV tiers and advisories.
const CHARTS = [
  { id: "rates", title: "Requests finished per second", unit: "/s", series: [
    { key: "rt_per_s", label: "RT", color: RT }, { key: "be_per_s", label: "BE", color: BE }] },
  { id: "ttft", title: "RT time to first token", unit: "s", target: "ttft_s", series: [
    { key: "rt_ttft_p50_s", label: "p50", color: RT }, { key: "rt_ttft_p95_s", label: "p95", color: FOURTH }] },
  { id: "tpot", title: "RT time per output token", unit: "s", target: "tpot_s", series: [
    { key: "rt_tpot_p50_s", label: "p50", color: RT }, { key: "rt_tpot_p95_s", label: "p95", color: FOURTH }] },
  { id: "slo", title: "RT SLO attainment (TTFT and TPOT met)", unit: "%", max: 1, series: [
    { key: "rt_slo_attainment", label: "met", color: THIRD }] },
  { id: "tokens", title: "Output tokens per second", unit: "/s", series: [
    { key: "be_tokens_per_s", label: "BE", color: BE }, { key: "rt_tokens_per_s", label: "RT", color: RT }] },
  { id: "queues", title: "Requests in flight and queued", unit: "", series: [
    { key: "rt_inflight", label: "RT in flight", color: RT },
    { key: "be_inflight", label: "BE in flight", color: BE },
    { key: "be_queued", label: "BE queued", color: FOURTH },
    { key: "engine_waiting", label: "engine waiting", color: THIRD }] },
  { id: "kv", title: "KV occupancy by tier", unit: "%", max: 1, series: [
    { key: "kv_device_used", label: "device", color: RT }, { key: "kv_host_used", label: "host", color: BE },
    { key: "kv_ssd_used", label: "SSD", color: THIRD }] },
  { id: "sources", title: "Where prompt tokens came from", unit: "%", max: 1, series: [
    { key: fromTokens("device"), label: "device", color: RT }, { key: fromTokens("host"), label: "host", color: BE },
    { key: fromTokens("ssd"), label: "SSD", color: THIRD },
    { key: fromTokens("computed"), label: "recomputed", color: FOURTH }] },
  { id: "hits", title: "KV tier hit rate (prompt tokens looked up there and found)", unit: "%", max: 1, series: [
    { key: "kv_host_hit_rate", label: "host", color: BE }, { key: "kv_ssd_hit_rate", label: "SSD", color: THIRD }] },
  { id: "prefetch", title: "Prefetch: lead time and load time", unit: "s", series: [
    { key: "prefetch_lead_s", label: "lead", color: THIRD }, { key: "prefetch_load_s", label: "load", color: BE }] },
  { id: "advisories", title: "Advisories (totals)", unit: "", series: [
    { key: "advisories_sent_total", label: "sent", color: RT },
    { key: "advisories_received_total", label: "received", color: BE },
    { key: "advisories_used_total", label: "used", color: THIRD },
    { key: "advisories_expired_total", label: "expired", color: FOURTH }] },
];

// Each chart gets options of its own: `redraw` sets `target` to the target's value there, and
// CHARTS keeps the name of the field it comes from.
const charts = CHARTS.map((c) => new LineChart($("#charts"), { ...c }));

function tile(label, value, id) {
  const t = el("div", "tile");
  t.dataset.tile = id;
  t.append(el("span", "tile-value", value), el("span", "tile-label", label));
  return t;
}

function renderTiles() {
  const p = state.points[state.points.length - 1] || {};
  const count = (v) => (typeof v === "number" ? String(Math.round(v)) : "–");
  $("#tiles").replaceChildren(
    tile("model", state.model || "–", "model"),
    tile("policy", p.policy || "–", "policy"),
    tile("RT in flight", count(p.rt_inflight), "rt_inflight"),
    tile("BE in flight · queued", `${count(p.be_inflight)} · ${count(p.be_queued)}`, "be"),
    tile("BE tokens/s", formatValue(p.be_tokens_per_s), "be_tokens_per_s"),
    tile("TTFT · TPOT targets",
      `${formatValue(state.targets.ttft_s, "s")} · ${formatValue(state.targets.tpot_s, "s")}`, "targets"),
    tile("advisories sent · used",
      `${count(p.advisories_sent_total)} · ${count(p.advisories_used_total)}`, "advisories"),
  );
}

function redraw() {
  for (const [i, chart] of charts.entries()) {
    const target = CHARTS[i].target;
    chart.opts.target = target ? state.targets[target] : undefined;
    chart.opts.spanS = SPAN_S;
    chart.opts.gapS = GAP_INTERVALS * state.intervalS;
    chart.update(state.points);
  }
  renderTiles();
}

/** Seconds to the next poll: the sampling interval, doubled per failure in a row (to
 * `MAX_RETRY_S`), so a server that is down is not asked again every interval. */
function nextPollS() {
  const base = Math.max(0.25, state.intervalS);
  return state.failures ? Math.min(MAX_RETRY_S, base * 2 ** state.failures) : base;
}

// While the server is unreachable, the status counts down to the next try.
let countdown = null;
function showRetrying(at) {
  const show = () => {
    const left = Math.max(1, Math.ceil((at - Date.now()) / 1000));
    $("#live-status").textContent = `Offline, retrying in ${left} s…`;
  };
  show();
  countdown = setInterval(show, 1000);
}

async function poll() {
  clearInterval(countdown);
  clearTimeout(state.timer);
  state.timer = null;
  if (document.hidden || state.polling) return; // a hidden tab does not poll; shown, it does
  state.polling = true;
  try {
    const last = state.points.length ? state.points[state.points.length - 1].t : null;
    const data = await api(`/v1/dashboard${last === null ? "" : `?since=${last}`}`);
    state.intervalS = data.interval_s;
    state.targets = data.targets;
    state.model = data.model;
    state.points.push(...data.points);
    if (state.points.length > MAX_POINTS) state.points.splice(0, state.points.length - MAX_POINTS);
    redraw();
    const box = $("#error");
    if (!box.hidden) hideError();
    $("#live-status").textContent = "Live";
    document.body.dataset.connected = "true";
    state.failures = 0;
  } catch (err) {
    state.failures += 1;
    document.body.dataset.connected = "false";
    if (err.status === 401) $("#live-status").textContent = "API key required";
    else showRetrying(Date.now() + nextPollS() * 1000);
    showError(err.code || "error", err.message);
  } finally {
    state.polling = false;
  }
  if (!document.hidden) state.timer = setTimeout(poll, nextPollS() * 1000);
}

document.addEventListener("visibilitychange", () => {
  if (!document.hidden && state.timer === null) poll();
});

const askKey = setupApiKey(() => poll());
$("#api-key-button").addEventListener("click", () => askKey(""));
$("#error .error-close").addEventListener("click", hideError);
redraw();
poll();
