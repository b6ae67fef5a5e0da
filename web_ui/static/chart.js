// Line charts drawn as SVG directly (no chart library): time on x, one polyline per series,
// optional dashed target line, a legend with each series' latest value. Labels are text nodes.

const SVG = "http://www.w3.org/2000/svg";
const W = 600;
const H = 200;
const PAD = { left: 46, right: 10, top: 10, bottom: 22 };

function svgEl(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

/** A compact number: 0.0123 -> "0.012", 1234 -> "1.2k". */
export function formatValue(v, unit = "") {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  const a = Math.abs(v);
  let s;
  if (unit === "%") s = `${(v * 100).toFixed(a >= 0.995 || a === 0 ? 0 : 1)}`;
  else if (unit === "s" && a < 1) return `${Math.round(v * 1000)} ms`;
  else if (a >= 1e6) s = `${(v / 1e6).toFixed(1)}M`;
  else if (a >= 1e3) s = `${(v / 1e3).toFixed(1)}k`;
  else if (a >= 100 || Number.isInteger(v)) s = `${Math.round(v)}`;
  else if (a >= 10) s = v.toFixed(1);
  else s = v.toPrecision(2);
  return unit === "%" ? `${s}%` : unit ? `${s} ${unit}` : s;
}

/** Y-axis top: `fixedMax`, else a round number above the data (and the target). */
function niceMax(values, fixedMax, target) {
  if (fixedMax !== undefined) return fixedMax;
  const top = Math.max(0, ...values, target ?? 0);
  if (top <= 0) return 1;
  const mag = 10 ** Math.floor(Math.log10(top));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * mag >= top) return step * mag;
  return 10 * mag;
}

export class LineChart {
  /**
   * `opts`: {title, unit ("", "s", "%", "/s"), series: [{key, label, color}], max?, target?,
   * spanS?, gapS?}. `key` reads a point's field, or a function of the point; points further
   * apart in time than `gapS` (an outage) are not joined.
   */
  constructor(container, opts) {
    this.opts = opts;
    this.card = document.createElement("section");
    this.card.className = "chart-card";
    this.card.dataset.chart = opts.id;
    const head = document.createElement("h2");
    head.textContent = opts.title;
    this.legend = document.createElement("div");
    this.legend.className = "chart-legend";
    this.svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": opts.title });
    this.card.append(head, this.legend, this.svg);
    container.append(this.card);
  }

  value(point, s) {
    const v = typeof s.key === "function" ? s.key(point) : point[s.key];
    return typeof v === "number" && Number.isFinite(v) ? v : null;
  }

  /** Redraw from `points` (oldest first, each with `t` in unix seconds). */
  update(points) {
    const { series, unit = "", target } = this.opts;
    const span = this.opts.spanS ?? 300;
    const now = points.length ? points[points.length - 1].t : Date.now() / 1000;
    const shown = points.filter((p) => p.t >= now - span);
    const values = shown.flatMap((p) => series.map((s) => this.value(p, s))).filter((v) => v !== null);
    const max = niceMax(values, this.opts.max, target);
    const x = (t) => PAD.left + ((t - (now - span)) / span) * (W - PAD.left - PAD.right);
    const y = (v) => H - PAD.bottom - (Math.min(v, max) / max) * (H - PAD.top - PAD.bottom);

    const parts = [];
    for (let i = 0; i <= 4; i += 1) {
      const v = (max * i) / 4;
      parts.push(svgEl("line", { x1: PAD.left, x2: W - PAD.right, y1: y(v), y2: y(v), class: "grid" }));
      const label = svgEl("text", { x: PAD.left - 6, y: y(v) + 4, class: "axis", "text-anchor": "end" });
      label.textContent = formatValue(v, unit === "/s" ? "" : unit);
      parts.push(label);
    }
    for (const ago of [span, span / 2, 0]) {
      const label = svgEl("text", {
        x: x(now - ago), y: H - 6, class: "axis",
        "text-anchor": ago === span ? "start" : ago === 0 ? "end" : "middle",
      });
      label.textContent = ago === 0 ? "now" : ago >= 120 ? `-${+(ago / 60).toFixed(1)} min` : `-${ago} s`;
      parts.push(label);
    }
    if (typeof target === "number") {
      parts.push(svgEl("line", {
        x1: PAD.left, x2: W - PAD.right, y1: y(target), y2: y(target), class: "target",
      }));
    }
    for (const s of series) {
      // A gap (null, or no samples for longer than `gapS`) breaks the line rather than
      // drawing through zero or across an outage.
      let run = [];
      const flush = () => {
        if (run.length === 1) {
          const [px, py] = run[0];
          parts.push(svgEl("circle", { cx: px, cy: py, r: 2.5, fill: s.color, "data-series": s.label }));
        } else if (run.length > 1) {
          parts.push(svgEl("polyline", {
            points: run.map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`).join(" "),
            fill: "none", stroke: s.color, "stroke-width": 2, "data-series": s.label,
          }));
        }
        run = [];
      };
      const gap = this.opts.gapS ?? Infinity;
      let lastT = -Infinity;
      for (const p of shown) {
        const v = this.value(p, s);
        if (v === null || p.t - lastT > gap) flush();
        if (v !== null) run.push([x(p.t), y(v)]);
        lastT = p.t;
      }
      flush();
    }
    this.svg.replaceChildren(...parts);
    this.svg.dataset.points = String(shown.length);
    this.renderLegend(shown);
  }

  renderLegend(shown) {
    const { series, unit = "", target } = this.opts;
    const items = series.map((s) => {
      let latest = null;
      for (let i = shown.length - 1; i >= 0 && latest === null; i -= 1) latest = this.value(shown[i], s);
      const item = document.createElement("span");
      item.className = "legend-item";
      item.dataset.series = s.label;
      item.dataset.latest = latest === null ? "" : String(latest);
      const swatch = document.createElement("i");
      swatch.style.background = s.color;
      item.append(swatch, document.createTextNode(`${s.label} ${formatValue(latest, unit)}`));
      return item;
    });
    if (typeof target === "number") {
      const item = document.createElement("span");
      item.className = "legend-item legend-target";
      item.textContent = `target ${formatValue(target, unit)}`;
      items.push(item);
    }
    this.legend.replaceChildren(...items);
  }
}
