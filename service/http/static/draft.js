// The playground's "start from a draft" control (docs/playground.md, docs/edit-in-place.md).
//
// The draft text is tokenized by POST /playground/draft, exactly as the server tokenizes an initial_canvas text
// (as content, no BOS), and its tokens are shown as cells: a click pins or unpins one, a shift-click sets the
// range from the last clicked cell to this one. "blanks before the draft" puts that many blanks (-1: no draft
// token, the position starts from noise) first: the fill-in-the-middle form. The request carries
//   initial_canvas: the text (no blanks) or the ids with the blanks (the text form has none)
//   pinned:         true when every draft position is pinned, else the pinned [start, end) ranges; absent if none
// Pins are kept by token index, so changing the blanks shifts them with their tokens.
"use strict";
const dgDraft = (onUnauthorized) => {
  const $ = dg.el;
  // text: the text ids/pieces belong to (null: unknown after an error); pins: pinned token indexes; anchor: the
  // last clicked one; inflight: {text, promise} of the tokenization under way
  const D = { text: "", ids: [], pieces: [], pins: new Set(), anchor: null, inflight: null, timer: 0 };

  function blanks() {
    const v = $("blanks").value.trim();
    const n = v === "" ? 0 : Number(v);
    if (!Number.isInteger(n) || n < 0) throw "blanks: a whole number, 0 or more";
    return n;
  }

  // the draft's tokens for the text in the box: one call per text, applied if the box still holds that text;
  // rejects with {message} naming the draft
  function tokenize() {
    const text = $("draft").value;
    if (text === D.text) return Promise.resolve();
    if (!D.inflight || D.inflight.text !== text) D.inflight = { text, promise: fetchTokens(text) };
    return D.inflight.promise;
  }

  async function fetchTokens(text) {
    let got = { ids: [], pieces: [] };
    try {
      if (text !== "") got = await dg.call("/playground/draft", { text });
    } catch (e) {
      if (e.status === 401) onUnauthorized();
      if ($("draft").value === text) { D.text = null; set([], []); message("draft: " + e.message); }
      throw { message: "draft: " + e.message };
    } finally {
      if (D.inflight && D.inflight.text === text) D.inflight = null;
    }
    if ($("draft").value === text) { D.text = text; set(got.ids, got.pieces); message(""); }
  }

  function set(ids, pieces) {
    D.ids = ids;
    D.pieces = pieces;
    for (const k of [...D.pins]) if (k >= ids.length) D.pins.delete(k);
    if (D.anchor !== null && D.anchor >= ids.length) D.anchor = null;
    render();
  }

  function message(msg) { $("draft-msg").textContent = msg; }

  function render() {
    let n = 0;
    try { n = blanks(); message(""); } catch (e) { message(String(e)); }
    const box = $("draft-cells");
    box.replaceChildren();
    for (let p = 0; p < n; p++) {
      box.append(cell("cell blank", "░", "position " + p + ": a blank (starts from noise)"));
    }
    D.ids.forEach((id, k) => {
      const on = D.pins.has(k);
      const c = cell("cell draft-token" + (on ? " pinned" : ""), label(D.pieces[k]),
        "position " + (n + k) + ", token " + id + (on ? ": pinned" : ": not pinned") + " (click to toggle)");
      c.dataset.k = k;
      c.tabIndex = 0;
      c.setAttribute("role", "checkbox");
      c.setAttribute("aria-checked", on ? "true" : "false");
      box.append(c);
    });
    $("pins").textContent = D.ids.length === 0 ? "" : D.pins.size === 0 ? "nothing pinned"
      : "pinned: " + JSON.stringify(shape(n).pinned);
  }

  function cell(cls, text, title) {
    const c = document.createElement("span");
    c.className = cls;
    c.textContent = text;
    c.title = title;
    c.setAttribute("aria-label", title);
    return c;
  }

  function label(piece) {
    const t = (piece || "").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
    return t.trim() === "" ? "␣".repeat(Math.max(1, t.length)) : t;
  }

  function toggle(k, range) {
    const on = !D.pins.has(k);
    const [a, b] = range && D.anchor !== null ? [Math.min(D.anchor, k), Math.max(D.anchor, k)] : [k, k];
    for (let j = a; j <= b; j++) on ? D.pins.add(j) : D.pins.delete(j);
    D.anchor = k;
    render();
    const again = $("draft-cells").querySelector("[data-k='" + k + "']");
    if (again) again.focus();
  }

  // initial_canvas and pinned for n blanks before the tokens, and the draft's ids and pinned positions
  function shape(n) {
    const draft = Array(n).fill(-1).concat(D.ids);
    const positions = [...D.pins].sort((a, b) => a - b).map((k) => n + k);
    const ranges = [];
    for (const p of positions) {
      const last = ranges[ranges.length - 1];
      if (last && last[1] === p) last[1] = p + 1; else ranges.push([p, p + 1]);
    }
    const all = n === 0 && D.ids.length > 0 && positions.length === D.ids.length;
    return {
      initial_canvas: n === 0 ? D.text : draft,
      pinned: all ? true : ranges.length ? ranges : undefined,
      draft,
      positions,
    };
  }

  function onCell(ev) {
    const c = ev.target.closest("[data-k]");
    if (c) toggle(Number(c.dataset.k), ev.shiftKey);
  }

  $("draft").addEventListener("input", () => {
    clearTimeout(D.timer);
    D.timer = setTimeout(() => tokenize().catch(() => {}), 250);
  });
  $("blanks").addEventListener("input", render);
  $("draft-cells").addEventListener("click", onCell);
  $("draft-cells").addEventListener("keydown", (ev) => {
    if (ev.key !== " " && ev.key !== "Enter") return;
    ev.preventDefault();
    onCell(ev);
  });
  $("pin-all").addEventListener("click", () => { D.ids.forEach((_, k) => D.pins.add(k)); render(); });
  $("pin-none").addEventListener("click", () => { D.pins.clear(); D.anchor = null; render(); });

  return {
    // the request's draft, up to date with the boxes: null without one, else {initial_canvas, pinned (or
    // undefined), draft: its ids (-1 blanks), positions: the pinned draft positions}; throws a message
    async request() {
      clearTimeout(D.timer);
      const n = blanks();
      while ($("draft").value !== D.text) await tokenize();
      if (D.ids.length === 0 && n === 0) return null;
      return shape(n);
    },
    pieces() { return D.ids.map((id, k) => [id, D.pieces[k]]); },  // [id, text] of the draft's tokens
    retry() { if (D.text === null) tokenize().catch(() => {}); },  // after a new token: tokenize again
  };
};
