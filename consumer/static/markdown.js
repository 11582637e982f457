// Model answers as Markdown: markdown-it (vendor/, pinned; CommonMark plus GitHub's tables and
// strikethrough), configured for untrusted text: a prompt injection writes HTML and `javascript:` links.
// - raw HTML is off (`html: false`): tags are shown as text;
// - links only to http(s) and mailto (validateLink); any other link is shown as its text, and the links that
//   are kept open in a new tab without a referrer;
// - no images (an image URL is a request to wherever the text says, a beacon), no link reference
//   definitions (a definition at the end would change a link rendered before it: see streaming below).
//
// Streaming: IncrementalMarkdown renders each finished top-level block once and never again; only the
// unfinished last block is shown, as plain text, until it is finished too. A top-level block is finished
// when the next one has begun: CommonMark's block structure is decided line by line and never reopens a
// closed block (reference definitions, the one exception, are off), so rendering block by block gives
// exactly what rendering the whole answer at once gives (renderMarkdown; the tests compare them).

import markdownit from "./vendor/markdown-it.min.js";

const SAFE_LINK = /^(https?:|mailto:)/i;

const md = markdownit({ html: false, linkify: false, typographer: false });
md.disable(["image", "reference"]);
md.validateLink = (url) => SAFE_LINK.test(url.trim());
// A link whose destination failed validateLink keeps an empty href: show its text without a link.
md.core.ruler.push("rsb_links", (state) => {
  for (const token of state.tokens) {
    if (token.type !== "inline" || !token.children) continue;
    let dropped = false;
    token.children = token.children.filter((t) => {
      if (t.type === "link_open") {
        dropped = !SAFE_LINK.test(t.attrGet("href") || "");
        if (dropped) return false;
        t.attrSet("target", "_blank");
        t.attrSet("rel", "noopener noreferrer nofollow");
      } else if (t.type === "link_close" && dropped) {
        dropped = false; // links do not nest: this is the dropped one's end
        return false;
      }
      return true;
    });
  }
});

// The whole text at once, exactly as the incremental renderer ends up showing it.
export function renderMarkdown(text) {
  return md.render(text);
}

// Line ends as markdown-it counts them (it reads \r\n, \r and \n as one line end each).
const LINE_END = /\r\n?|\n/g;

// Where the complete lines of a text end (a "\r" at the very end may be half of a "\r\n": not yet).
function completeLines(text) {
  const last = text.endsWith("\r") ? text.length - 2 : text.length - 1;
  if (last < 0) return 0;
  return Math.max(text.lastIndexOf("\n", last), text.lastIndexOf("\r", last)) + 1;
}

function lineOffset(text, line) {
  LINE_END.lastIndex = 0;
  for (let i = 0; i < line; i++) {
    if (!LINE_END.exec(text)) return text.length;
  }
  return line === 0 ? 0 : LINE_END.lastIndex;
}

// Renders a growing answer: finished blocks become HTML once, in order, in `blocksEl`; the unfinished last
// block is plain text in `tailEl` (white-space: pre-wrap). A text that does not extend the previous one (a
// `reset` took text back) is rendered again from its start.
export class IncrementalMarkdown {
  constructor(blocksEl, tailEl) {
    this.blocksEl = blocksEl;
    this.tailEl = tailEl;
    this.clear();
  }

  clear() {
    this.blocksEl.textContent = "";
    this.tailEl.textContent = "";
    this.text = "";
    this.committed = 0; // where the text not yet rendered as blocks starts
    this.parsedTo = 0; // how much of the text the last parse looked at
    this.tailText = ""; // what tailEl shows
    this.finished = false;
  }

  // Called once per animation frame with the whole answer so far.
  update(text, finished = false) {
    if (text === this.text && finished === this.finished) return;
    if (text.length < this.text.length || !text.startsWith(this.text) || this.finished) this.clear();
    this.text = text;
    this.finished = finished;
    // Only complete lines decide where a block ends: "- " could still become "---".
    const end = finished ? text.length : completeLines(text);
    if (end > this.parsedTo || finished) {
      this.parsedTo = end;
      const region = text.slice(this.committed, end);
      const tokens = md.parse(region, {});
      const starts = [];
      tokens.forEach((t, i) => {
        if (t.level === 0 && t.nesting !== -1) starts.push(i);
      });
      const keep = finished ? starts.length : starts.length - 1;
      if (keep > 0) {
        const upTo = finished ? tokens.length : starts[keep];
        this.blocksEl.insertAdjacentHTML("beforeend", md.renderer.render(tokens.slice(0, upTo), md.options, {}));
        this.committed = finished ? end : this.committed + lineOffset(region, tokens[starts[keep]].map[0]);
      } else if (finished) {
        this.committed = end;
      }
    }
    const tail = text.slice(this.committed);
    if (tail === this.tailText) return;
    const node = this.tailEl.firstChild;
    if (node && this.tailText && tail.startsWith(this.tailText)) {
      node.appendData(tail.slice(this.tailText.length)); // the common case: cheaper than replacing it all
    } else {
      this.tailEl.textContent = tail;
    }
    this.tailText = tail;
  }
}
