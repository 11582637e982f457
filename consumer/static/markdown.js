// A tiny Markdown subset for model answers: paragraphs, headings, fenced code blocks, inline code,
// bold/italic and lists. Everything is HTML-escaped before any markup is added, and no link or raw HTML
// syntax is supported at all: model output is untrusted text.
//
// Streaming: IncrementalMarkdown splits the growing answer into blocks and renders each finished block
// once; only the unfinished tail is shown as plain text. Block boundaries depend only on the text before
// them, so rendering block by block gives exactly what rendering the whole answer at once gives.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$/;
const BULLET = /^ {0,3}[-*+][ \t]+(.*)$/;
const ORDERED = /^ {0,3}(\d{1,9})[.)][ \t]+(.*)$/;
const RULE = /^ {0,3}([-*_])([ \t]*\1){2,}[ \t]*$/;

// Inline markup on one line of plain text: code spans first (their content is literal), then strong and
// emphasis on the escaped remainder. Delimiters must hug non-space text, so "2 * 3 * 4" stays as is.
export function renderInline(text) {
  let out = "";
  let i = 0;
  while (i < text.length) {
    const tick = text.indexOf("`", i);
    if (tick < 0) break;
    let run = 1;
    while (text[tick + run] === "`") run++;
    const fence = "`".repeat(run);
    let close = text.indexOf(fence, tick + run);
    // A closing run must be exactly as long as the opening one.
    while (close >= 0 && text[close + run] === "`") close = text.indexOf(fence, close + run + 1);
    if (close < 0) {
      out += emphasis(escapeHtml(text.slice(i, tick + run)));
      i = tick + run;
      continue;
    }
    out += emphasis(escapeHtml(text.slice(i, tick)));
    let code = text.slice(tick + run, close);
    if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ")) code = code.slice(1, -1);
    out += `<code>${escapeHtml(code)}</code>`;
    i = close + run;
  }
  return out + emphasis(escapeHtml(text.slice(i)));
}

// Runs on escaped text, so the only "<" and ">" are the tags added here: emphasis may not contain any, which
// keeps every tag pair properly nested whatever the delimiters look like.
function emphasis(html) {
  return html
    .replace(/(\*\*|__)(?=\S)([\s\S]*?\S)\1/g, "<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*<>])([^*<>]*?[^\s*<>])\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^_\w])_(?=[^\s_<>])([^_<>]*?[^\s_<>])_(?![_\w])/g, "$1<em>$2</em>");
}

function renderList(items, ordered, start) {
  const tag = ordered ? "ol" : "ul";
  const attr = ordered && start !== 1 ? ` start="${start}"` : "";
  const lis = items.map((lines) => `<li>${lines.map(renderInline).join("<br>")}</li>`).join("");
  return `<${tag}${attr}>${lis}</${tag}>`;
}

// One block (text between blank lines, or one fenced code block) to HTML.
export function renderBlock(block) {
  const lines = block.replace(/\r$/gm, "").split("\n");
  const fence = FENCE.exec(lines[0]);
  if (fence) {
    const lang = lines[0].slice(fence[0].length).trim().split(/\s/)[0];
    let body = lines.slice(1);
    const last = body.length ? body[body.length - 1].trim() : "";
    if (last.startsWith(fence[1]) && last.replace(/[`~]/g, "") === "") body = body.slice(0, -1);
    const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
    return `<pre><code${cls}>${escapeHtml(body.join("\n"))}</code></pre>`;
  }
  let html = "";
  let para = [];
  let list = null; // { ordered, start, items: [[line, ...], ...] }
  const flushPara = () => {
    if (para.length) html += `<p>${para.map(renderInline).join("<br>")}</p>`;
    para = [];
  };
  const flushList = () => {
    if (list) html += renderList(list.items, list.ordered, list.start);
    list = null;
  };
  for (const line of lines) {
    let m;
    if ((m = HEADING.exec(line))) {
      flushPara();
      flushList();
      const level = m[1].length;
      html += `<h${level}>${renderInline(m[2])}</h${level}>`;
    } else if (RULE.test(line)) {
      flushPara();
      flushList();
      html += "<hr>";
    } else if ((m = BULLET.exec(line)) || (m = ORDERED.exec(line))) {
      const ordered = m.length === 3;
      flushPara();
      if (list && list.ordered !== ordered) flushList();
      if (!list) list = { ordered, start: ordered ? Number(m[1]) : 1, items: [] };
      list.items.push([ordered ? m[2] : m[1]]);
    } else if (list && /^[ \t]+\S/.test(line)) {
      list.items[list.items.length - 1].push(line.trim()); // an indented continuation of the last item
    } else if (line.trim() !== "") {
      flushList();
      para.push(line.trim());
    }
  }
  flushPara();
  flushList();
  return html;
}

// Splits text into blocks: [start, end) ranges of finished blocks, and where the unfinished tail starts.
// A block ends at a blank line (outside code fences) or at a code fence's closing line; a fence opening
// also ends the block before it. Only complete lines (ending in "\n") are ever considered.
export class BlockSplitter {
  constructor() {
    this.scan = 0; // start of the first line not yet looked at
    this.start = 0; // start of the block being accumulated (= start of the unfinished tail)
    this.fence = null; // the opening fence's marker while inside a code block
  }

  // Feeds the whole text so far (it only ever grows); returns the ranges of blocks finished by it.
  push(text) {
    const done = [];
    let nl;
    while ((nl = text.indexOf("\n", this.scan)) >= 0) {
      const line = text.slice(this.scan, nl).replace(/\r$/, "");
      const lineStart = this.scan;
      this.scan = nl + 1;
      if (this.fence) {
        const t = line.trim();
        if (t.startsWith(this.fence) && t.replace(/[`~]/g, "") === "" && lineStart !== this.start) {
          done.push([this.start, nl]);
          this.start = this.scan;
          this.fence = null;
        }
        continue;
      }
      const fence = FENCE.exec(line);
      if (fence) {
        if (lineStart > this.start) done.push([this.start, lineStart - 1]);
        this.start = lineStart;
        this.fence = fence[1];
      } else if (line.trim() === "") {
        if (lineStart > this.start) done.push([this.start, lineStart - 1]);
        this.start = this.scan;
      }
    }
    return done;
  }
}

// The whole text at once, block by block, exactly as the incremental renderer ends up showing it.
export function renderMarkdown(text) {
  const splitter = new BlockSplitter();
  let html = "";
  for (const [a, b] of splitter.push(text)) html += renderBlock(text.slice(a, b));
  const tail = text.slice(splitter.start);
  if (tail.trim() !== "") html += renderBlock(tail.replace(/\n$/, ""));
  return html;
}

// Renders a growing answer into `container`: finished blocks become Markdown once, in order, in
// `container.blocks`; the unfinished tail is plain text in `container.tail` (white-space: pre-wrap).
export class IncrementalMarkdown {
  constructor(blocksEl, tailEl) {
    this.blocksEl = blocksEl;
    this.tailEl = tailEl;
    this.splitter = new BlockSplitter();
    this.text = "";
    this.rendered = 0; // length of text already on screen
    this.tailText = ""; // what tailEl shows
  }

  // Called once per animation frame with the whole answer so far.
  update(text, finished = false) {
    if (text.length === this.rendered && !finished) return;
    this.text = text;
    this.rendered = text.length;
    let html = "";
    for (const [a, b] of this.splitter.push(text)) html += renderBlock(text.slice(a, b));
    if (html) this.blocksEl.insertAdjacentHTML("beforeend", html);
    const tail = text.slice(this.splitter.start);
    if (finished) {
      // The last block is finished too: render it like the others.
      if (tail.trim() !== "") this.blocksEl.insertAdjacentHTML("beforeend", renderBlock(tail.replace(/\n$/, "")));
      this.splitter.start = text.length;
      this.splitter.scan = text.length;
      this.tailEl.textContent = "";
    } else if (tail !== this.tailText) {
      const node = this.tailEl.firstChild;
      if (node && tail.startsWith(this.tailText)) {
        node.appendData(tail.slice(this.tailText.length)); // the common case: cheaper than replacing it all
      } else {
        this.tailEl.textContent = tail;
      }
    }
    this.tailText = finished ? "" : tail;
  }
}
