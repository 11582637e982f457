// partial-json.js: the partial value of a JSON text that arrives in pieces (a structured answer, a tool
// call's arguments), kept up to date in O(new characters) per piece. The twin of rsb/_partial_json.py: the
// same states, the same rules, the same tests (tests/consumer/test_static_js.py).
//
//   const p = new PartialJSON();
//   p.feed('{"items": [{"name": "Ad');   p.value  // {items: [{name: "Ad"}]}
//   p.feed('a"}]}');                     p.done   // true
//
// Re-parsing the accumulated text after every delta costs O(n) per delta, O(n²) in all. This reads each
// character once: open containers are real objects and arrays, mutated in place, and only what the next
// piece may still change waits (half an escape, a number without its end, a literal without its last
// letter). For a prefix of a valid document `value` shows: containers from their opening bracket with every
// member completed; an object member once its value has begun; a string growing as its characters arrive (an
// escape once complete, a surrogate pair's high half with its low half); true/false/null once spelled out; a
// number once something follows it, at the top level once end() says the text is over. Reading `value` joins
// the one string still open.

const WS = /[ \t\n\r]*/y;
const STRING_RUN = /[^"\\\x00-\x1f]+/y;
const NUMBER_RUN = /[-+0-9.eE]+/y;
const NUMBER = /^-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$/;
const HEX4 = /^[0-9a-fA-F]{4}/;
const ESCAPES = { '"': '"', "\\": "\\", "/": "/", b: "\b", f: "\f", n: "\n", r: "\r", t: "\t" };
const LITERALS = { t: ["true", true], f: ["false", false], n: ["null", null] };

// What may come next (outside a string, whitespace too).
const VALUE = 0; // a value (the document's, an array element after ",", an object member's after ":")
const VALUE_OR_CLOSE = 1; // just after "["
const KEY = 2; // just after "," in an object
const KEY_OR_CLOSE = 3; // just after "{"
const COLON = 4;
const COMMA_OR_CLOSE = 5;
const STRING = 6; // inside a string (a key or a value)
const END = 7; // the document is complete: only whitespace may follow

// An own property, as JSON.parse makes it: assigning "__proto__" would set the object's prototype instead.
function setMember(obj, key, value) {
  if (key === "__proto__") Object.defineProperty(obj, key, { value, writable: true, enumerable: true, configurable: true });
  else obj[key] = value;
}

export class PartialJSON {
  constructor() {
    this.state = VALUE;
    this.open = []; // [{container, isObject, key}]
    this.root = undefined;
    this.started = false;
    this.rest = ""; // text read but not yet consumed: what the next piece may change
    this.doneChars = 0; // characters consumed before `rest` (for error positions)
    this.pieces = []; // the open string's decoded text
    this.isKey = false;
    this.high = ""; // a high surrogate escape waiting for its low half
    this.final = false;
    this.error = null;
  }

  // A whole JSON value was read (only whitespace may follow).
  get done() {
    return this.state === END;
  }

  // The document so far (undefined before it begins): the live object, mutated as text arrives.
  get value() {
    if (this.state === STRING && !this.isKey) {
      const s = this.pieces.join("");
      this.pieces = [s];
      this.place(s);
    }
    return this.root;
  }

  // The text is over: a number at the top level is complete now (an unfinished document stays unfinished).
  end() {
    this.final = true;
    this.feed("");
  }

  // Throws a SyntaxError on invalid JSON, and on every later call.
  feed(text) {
    if (this.error) throw new SyntaxError(this.error);
    const buf = this.rest ? this.rest + text : text;
    let i;
    try {
      i = this.consume(buf);
    } catch (e) {
      this.error = e.message;
      throw e;
    }
    this.doneChars += i;
    this.rest = buf.slice(i);
  }

  consume(buf) {
    const n = buf.length;
    let i = 0;
    while (i < n) {
      const state = this.state;
      if (state === STRING) {
        STRING_RUN.lastIndex = i;
        const m = STRING_RUN.exec(buf);
        if (m) {
          this.flushHigh();
          this.pieces.push(m[0]);
          i = STRING_RUN.lastIndex;
          continue;
        }
        const c = buf[i];
        if (c === '"') {
          this.closeString();
          i += 1;
        } else if (c === "\\") {
          if (i + 1 >= n) break;
          const esc = buf[i + 1];
          if (esc === "u") {
            if (i + 6 > n) {
              if (!HEX4.test(buf.slice(i + 2) + "0000")) this.fail(i, "a \\u escape needs four hex digits");
              break;
            }
            const hex = buf.slice(i + 2, i + 6);
            if (!HEX4.test(hex)) this.fail(i, "a \\u escape needs four hex digits");
            this.codeUnit(parseInt(hex, 16));
            i += 6;
          } else if (Object.hasOwn(ESCAPES, esc)) {
            this.flushHigh();
            this.pieces.push(ESCAPES[esc]);
            i += 2;
          } else {
            this.fail(i, `invalid escape \\${esc}`);
          }
        } else {
          this.fail(i, "a control character in a string");
        }
        continue;
      }
      WS.lastIndex = i;
      WS.exec(buf);
      i = WS.lastIndex;
      if (i >= n) break;
      const c = buf[i];
      if (state === VALUE || state === VALUE_OR_CLOSE) {
        if (c === "]" && state === VALUE_OR_CLOSE) {
          this.closeContainer();
          i += 1;
        } else if (c === '"') {
          this.attach("");
          this.beginString(false);
          i += 1;
        } else if (c === "{" || c === "[") {
          const container = c === "{" ? {} : [];
          this.attach(container);
          this.open.push({ container, isObject: c === "{", key: "" });
          this.state = c === "{" ? KEY_OR_CLOSE : VALUE_OR_CLOSE;
          i += 1;
        } else if (Object.hasOwn(LITERALS, c)) {
          const [word, lit] = LITERALS[c];
          const got = buf.slice(i, i + word.length);
          if (got !== word) {
            if (got.length < word.length && word.startsWith(got)) break; // the rest of the word is still to come
            this.fail(i, "an unknown literal");
          }
          this.attach(lit);
          this.afterValue();
          i += word.length;
        } else if (c === "-" || (c >= "0" && c <= "9")) {
          NUMBER_RUN.lastIndex = i;
          const run = NUMBER_RUN.exec(buf)[0];
          if (i + run.length === n && !this.final) break; // more digits may follow
          if (!NUMBER.test(run)) this.fail(i, `an invalid number ${JSON.stringify(run)}`);
          this.attach(Number(run));
          this.afterValue();
          i += run.length;
        } else {
          this.fail(i, `unexpected ${JSON.stringify(c)} where a value should be`);
        }
      } else if (state === KEY || state === KEY_OR_CLOSE) {
        if (c === '"') this.beginString(true);
        else if (c === "}" && state === KEY_OR_CLOSE) this.closeContainer();
        else this.fail(i, `unexpected ${JSON.stringify(c)} where a key should be`);
        i += 1;
      } else if (state === COLON) {
        if (c !== ":") this.fail(i, `unexpected ${JSON.stringify(c)} where ':' should be`);
        this.state = VALUE;
        i += 1;
      } else if (state === COMMA_OR_CLOSE) {
        const top = this.open[this.open.length - 1];
        if (c === ",") this.state = top.isObject ? KEY : VALUE;
        else if (c === (top.isObject ? "}" : "]")) this.closeContainer();
        else this.fail(i, `unexpected ${JSON.stringify(c)} after a member`);
        i += 1;
      } else {
        this.fail(i, `unexpected ${JSON.stringify(c)} after the document`);
      }
    }
    return i;
  }

  fail(i, what) {
    throw new SyntaxError(`invalid JSON at character ${this.doneChars + i}: ${what}`);
  }

  // A value begins where the state says: the document, the next element, the current member.
  attach(value) {
    if (!this.open.length) {
      this.root = value;
      this.started = true;
      return;
    }
    const top = this.open[this.open.length - 1];
    if (top.isObject) setMember(top.container, top.key, value);
    else top.container.push(value);
  }

  // Replaces the value begun last (an open string's current text).
  place(value) {
    if (!this.open.length) {
      this.root = value;
      return;
    }
    const top = this.open[this.open.length - 1];
    if (top.isObject) setMember(top.container, top.key, value);
    else top.container[top.container.length - 1] = value;
  }

  afterValue() {
    this.state = this.open.length ? COMMA_OR_CLOSE : END;
  }

  closeContainer() {
    this.open.pop();
    this.afterValue();
  }

  beginString(isKey) {
    this.state = STRING;
    this.isKey = isKey;
    this.pieces = [];
    this.high = "";
  }

  codeUnit(cp) {
    if (cp >= 0xd800 && cp < 0xdc00) {
      this.flushHigh();
      this.high = String.fromCharCode(cp);
    } else if (cp >= 0xdc00 && cp < 0xe000 && this.high) {
      this.pieces.push(this.high + String.fromCharCode(cp));
      this.high = "";
    } else {
      this.flushHigh();
      this.pieces.push(String.fromCharCode(cp));
    }
  }

  // A high surrogate not followed by its low half stays what it is (as JSON.parse keeps it).
  flushHigh() {
    if (this.high) {
      this.pieces.push(this.high);
      this.high = "";
    }
  }

  closeString() {
    this.flushHigh();
    const s = this.pieces.join("");
    this.pieces = [];
    if (this.isKey) {
      this.open[this.open.length - 1].key = s;
      this.state = COLON;
    } else {
      this.place(s);
      this.afterValue();
    }
  }
}
