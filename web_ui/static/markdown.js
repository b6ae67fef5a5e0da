// A small, safe Markdown renderer for model replies.
//
// It builds DOM nodes directly: every piece of text goes in through createTextNode, no string is
// ever parsed as HTML, and links keep only http(s) and mailto targets. So neither the model nor a
// user can inject markup or script, whatever the reply contains.
//
// Supported: fenced code blocks (``` with an optional info string, its first word the language;
// an unterminated fence, as while a reply streams, runs to the end; one indented under a list
// item belongs to it), headings, bullet and numbered lists, block quotes, horizontal
// rules, paragraphs with line breaks, and inline `code`, **bold**, *italic* / _italic_ and
// [links](https://...).

// A fence line: its indent, its characters, and an info string of any words ("```js {2}",
// "```python title=a.py", R Markdown's "```{r}"); a backtick fence's holds no backtick (a line
// "```x```" is inline code).
const FENCE = /^( *)(?:(`{3,})([^`]*)|(~{3,})(.*))$/;
const FENCE_LANG = /^\{?\.?([\w+#.-]+)/; // the info string's first word, braces and dot off
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
    let fence;
    if ((fence = openFence(line, 3))) {
      flushPara();
      i = fencedCode(lines, i, fence, 3, frag);
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
        const text = ordered ? m[2] : m[1];
        appendInline(li, text);
        list.append(li);
        i = itemFences(lines, i + 1, lines[i].search(/\S/), lines[i].length - text.length, li);
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

/** The fence `line` opens, indented `maxIndent` spaces at most: {indent, chars, lang}, or null. */
function openFence(line, maxIndent) {
  const m = FENCE.exec(line);
  if (!m || m[1].length > maxIndent) return null;
  const info = (m[3] ?? m[5]).trim();
  return { indent: m[1].length, chars: m[2] ?? m[4], lang: FENCE_LANG.exec(info)?.[1] ?? "" };
}

/**
 * Append to `parent` the code block `fence` opens at `lines[start]`; returns the index of the
 * line after its closing fence. The code loses the fence's indent (up to as many spaces of
 * each line, CommonMark), so code indented under a list item keeps its own indentation.
 */
function fencedCode(lines, start, fence, maxIndent, parent) {
  const closing = closingFence(fence.chars, maxIndent);
  const strip = new RegExp(`^ {0,${fence.indent}}`);
  const body = [];
  let i = start + 1;
  while (i < lines.length && !closing.test(lines[i])) body.push(lines[i++].replace(strip, ""));
  parent.append(codeBlock(body.join("\n"), fence.lang));
  return i + 1; // past the closing fence, if any
}

/**
 * Append to `li` the fences indented under it from `lines[start]` (a model's "- Install it:"
 * then its commands, 4 spaces in, blank lines between or not); returns the index of the first
 * line not taken. One belongs to the item indented past its marker (`markerIndent`) and 3
 * spaces past its text (`contentIndent`) at most; nearer the margin it ends the list.
 */
function itemFences(lines, start, markerIndent, contentIndent, li) {
  let i = start;
  for (;;) {
    let next = i;
    while (next < lines.length && lines[next].trim() === "") next += 1;
    const fence = next < lines.length ? openFence(lines[next], contentIndent + 3) : null;
    if (!fence || fence.indent <= markerIndent) return i;
    i = fencedCode(lines, next, fence, contentIndent + 3, li);
  }
}

/** The line that closes a block opened by `chars` (CommonMark): indented `maxIndent` spaces at
 * most (3, or 3 past a list item's text), the fence's character at least as many times,
 * nothing after it. An indented fence line with a language inside the code (a snippet about
 * Markdown) does not. */
function closingFence(chars, maxIndent) {
  return new RegExp(`^ {0,${maxIndent}}${chars[0]}{${chars.length},}\\s*$`);
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

// Inline spans, tried in this order where their character (`opens`) is: code, link, bold,
// italic. The patterns are sticky (matched at the span's start, with no copy of the rest of the
// line per marker), and `failsUntil(text, i)` says, of a span that failed at i, before which
// position it fails again (text is one line: no span crosses a newline). Tried again at each
// marker, every unclosed "*" of a long line scanned the rest of it: "*a " * 20000 took over a
// second to render, at every frame of a streaming reply.
const INLINE = [
  {
    opens: "`",
    re: /`([^`\n]+)`/y,
    make: (m) => textEl("code", m[1]),
    failsUntil: (_, i) => i + 1, // (it met a backtick at once, or none is left)
  },
  {
    opens: "[",
    // The target may hold one level of balanced parentheses (Wikipedia's "Python_(language)").
    re: /\[([^\]\n]+)\]\(((?:[^()\s]|\([^()\s]*\))+)\)/y,
    make: (m) => {
      if (!SAFE_URL.test(m[2])) return null;
      const a = node("a");
      a.href = m[2];
      a.rel = "noopener noreferrer nofollow";
      a.target = "_blank";
      appendInline(a, m[1]);
      return a;
    },
    // (a "[" before the "]" that ended this one's text ends its text there too)
    failsUntil: (text, i) => nextOf(text, /[\]\n]/g, i + 1),
  },
  emphasis("strong", "*", /\*\*(?=\S)/y, /\*\*(?=\S)([\s\S]*?\S)\*\*/y),
  emphasis("strong", "_", /__(?=\S)/y, /__(?=\S)([\s\S]*?\S)__(?!\w)/y),
  emphasis("em", "*", /\*(?=\S)/y, /\*(?=\S)([\s\S]*?\S)\*(?!\*)/y),
  emphasis("em", "_", /_(?=\S)/y, /_(?=\S)([\s\S]*?\S)_(?!\w)/y),
];

/** An emphasis span's rule. It closes at the first closer past its opener (`open`), so one
 * opener that finds none means none after it does either: the rule fails to the line's end. */
function emphasis(tag, opens, open, re) {
  return {
    opens,
    re,
    make: (m) => nested(tag, m[1]),
    failsUntil: (text, i) => (stickyTest(open, text, i) ? text.length : i + 1),
  };
}

function stickyTest(re, text, i) {
  re.lastIndex = i;
  return re.test(text);
}

/** Where `re` (global) first matches `text` at or after `from`; the text's length if nowhere. */
function nextOf(text, re, from) {
  re.lastIndex = from;
  return re.exec(text)?.index ?? text.length;
}

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

/** Append `text` (one line) with its inline markup to `parent`. */
function appendInline(parent, text) {
  const failing = INLINE.map(() => 0); // per rule: it fails at any position before this
  let plain = "";
  let i = 0;
  while (i < text.length) {
    const ch = text[i];
    let made = null;
    // Underscores inside a word (snake_case, __dunder__) are text, as in CommonMark.
    const intraword = ch === "_" && i > 0 && /\w/.test(text[i - 1]);
    if (!intraword && (ch === "`" || ch === "[" || ch === "*" || ch === "_")) {
      for (const [r, rule] of INLINE.entries()) {
        if (rule.opens !== ch || i < failing[r]) continue;
        rule.re.lastIndex = i;
        const m = rule.re.exec(text);
        if (m && (made = rule.make(m))) {
          if (plain) parent.append(document.createTextNode(plain));
          plain = "";
          parent.append(made);
          i += m[0].length;
          break;
        }
        failing[r] = rule.failsUntil(text, i);
      }
    }
    if (!made) {
      plain += ch;
      i += 1;
    }
  }
  if (plain) parent.append(document.createTextNode(plain));
}
