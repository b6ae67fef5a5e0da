// A small, safe Markdown renderer for model replies.
//
// It builds DOM nodes directly: every piece of text goes in through createTextNode, no string is
// ever parsed as HTML, and links keep only http(s) and mailto targets. So neither the model nor a
// user can inject markup or script, whatever the reply contains.
//
// Supported: fenced code blocks (``` with an optional language; an unterminated fence, as while a
// reply streams, runs to the end), headings, bullet and numbered lists, block quotes, horizontal
// rules, paragraphs with line breaks, and inline `code`, **bold**, *italic* / _italic_ and
// [links](https://...).

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const SAFE_URL = /^(https?:\/\/|mailto:)/i;

function node(tag, className = "") {
  const el = document.createElement(tag);
  if (className) el.className = className;
  return el;
}

// Block quotes nest this deep at most; deeper markers stay text (each level re-renders the
// lines inside it, and thousands of levels would exhaust the call stack).
const MAX_QUOTE_DEPTH = 16;

/** Render `text` into a new DocumentFragment (`depth`: block quotes around it). */
export function renderMarkdown(text, depth = 0) {
  const frag = document.createDocumentFragment();
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  let para = [];

  const flushPara = () => {
    if (para.length === 0) return;
    const p = node("p");
    para.forEach((line, k) => {
      if (k > 0) p.append(document.createElement("br"));
      appendInline(p, line);
    });
    frag.append(p);
    para = [];
  };

  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      flushPara();
      const fence = m[1];
      const body = [];
      i += 1;
      const closing = closingFence(fence);
      while (i < lines.length && !closing.test(lines[i])) body.push(lines[i++]);
      i += 1; // the closing fence, if any
      frag.append(codeBlock(body.join("\n"), m[2]));
    } else if ((m = HEADING.exec(line))) {
      flushPara();
      const h = node(`h${Math.min(6, m[1].length + 2)}`, "md-heading");
      appendInline(h, m[2]);
      frag.append(h);
      i += 1;
    } else if (RULE.test(line)) {
      flushPara();
      frag.append(node("hr"));
      i += 1;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      flushPara();
      const ordered = !BULLET.test(line);
      const pattern = ordered ? NUMBERED : BULLET;
      const list = node(ordered ? "ol" : "ul");
      if (ordered) list.start = Number(NUMBERED.exec(line)[1]);
      while (i < lines.length && (m = pattern.exec(lines[i]))) {
        const li = node("li");
        appendInline(li, ordered ? m[2] : m[1]);
        list.append(li);
        i += 1;
      }
      frag.append(list);
    } else if (QUOTE.test(line)) {
      flushPara();
      const quoted = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        quoted.push(m[1]);
        i += 1;
      }
      const q = node("blockquote");
      const inner = quoted.join("\n");
      q.append(depth < MAX_QUOTE_DEPTH ? renderMarkdown(inner, depth + 1)
        : document.createTextNode(inner));
      frag.append(q);
    } else if (line.trim() === "") {
      flushPara();
      i += 1;
    } else {
      para.push(line);
      i += 1;
    }
  }
  flushPara();
  return frag;
}

/** The line that closes a block opened by `fence` (CommonMark): indented 3 spaces at most, the
 * fence's character at least as many times, nothing after it. An indented fence line with a
 * language inside the code (a snippet about Markdown) does not. */
function closingFence(fence) {
  return new RegExp(`^ {0,3}${fence[0]}{${fence.length},}\\s*$`);
}

/** Put `text` on the clipboard: the Clipboard API where the page may use it (a secure
 * context: https or localhost), else a selected off-screen textarea and the copy command. */
async function copyText(text) {
  if (navigator.clipboard) return navigator.clipboard.writeText(text);
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  Object.assign(area.style, { position: "fixed", top: "-1000px", opacity: "0" });
  document.body.append(area);
  area.select();
  try {
    if (!document.execCommand("copy")) throw new Error("copy refused");
  } finally {
    area.remove();
  }
}

function codeBlock(code, lang) {
  const wrap = node("div", "md-code");
  const head = node("div", "md-code-head");
  head.append(document.createTextNode(lang || "code"));
  const copy = node("button", "md-copy btn btn-ghost");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.addEventListener("click", async () => {
    try {
      await copyText(code);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Copy failed";
    }
    setTimeout(() => (copy.textContent = "Copy"), 1500);
  });
  head.append(copy);
  const pre = node("pre");
  const c = node("code");
  if (lang) c.dataset.lang = lang;
  c.textContent = code;
  pre.append(c);
  wrap.append(head, pre);
  return wrap;
}

// Inline spans, tried in this order at each position: code, link, bold, italic.
const INLINE = [
  { re: /^`([^`\n]+)`/, make: (m) => textEl("code", m[1]) },
  {
    // The target may hold one level of balanced parentheses (Wikipedia's "Python_(language)").
    re: /^\[([^\]\n]+)\]\(((?:[^()\s]|\([^()\s]*\))+)\)/,
    make: (m) => {
      if (!SAFE_URL.test(m[2])) return null;
      const a = node("a");
      a.href = m[2];
      a.rel = "noopener noreferrer nofollow";
      a.target = "_blank";
      appendInline(a, m[1]);
      return a;
    },
  },
  { re: /^\*\*(?=\S)([\s\S]*?\S)\*\*/, make: (m) => nested("strong", m[1]) },
  { re: /^__(?=\S)([\s\S]*?\S)__(?!\w)/, make: (m) => nested("strong", m[1]) },
  { re: /^\*(?=\S)([\s\S]*?\S)\*(?!\*)/, make: (m) => nested("em", m[1]) },
  { re: /^_(?=\S)([\s\S]*?\S)_(?!\w)/, make: (m) => nested("em", m[1]) },
];

function textEl(tag, text) {
  const el = node(tag);
  el.textContent = text;
  return el;
}

function nested(tag, text) {
  const el = node(tag);
  appendInline(el, text);
  return el;
}

/** Append `text` with its inline markup to `parent`. */
function appendInline(parent, text) {
  let plain = "";
  let i = 0;
  while (i < text.length) {
    const ch = text[i];
    let made = null;
    // Underscores inside a word (snake_case, __dunder__) are text, as in CommonMark.
    const intraword = ch === "_" && i > 0 && /\w/.test(text[i - 1]);
    if (!intraword && (ch === "`" || ch === "[" || ch === "*" || ch === "_")) {
      const rest = text.slice(i);
      for (const rule of INLINE) {
        const m = rule.re.exec(rest);
        if (m && (made = rule.make(m))) {
          if (plain) parent.append(document.createTextNode(plain));
          plain = "";
          parent.append(made);
          i += m[0].length;
          break;
        }
      }
    }
    if (!made) {
      plain += ch;
      i += 1;
    }
  }
  if (plain) parent.append(document.createTextNode(plain));
}
