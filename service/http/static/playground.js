// The playground (docs/playground.md): one streamed request with drafts, drawn as it denoises.
//
// The request is POST /v1/completions or /v1/chat/completions with stream: true and drafts: true. Each
// "dgserve.draft" event is the current block's argmax canvas after one denoising step: its row is redrawn, a
// position that changed since the previous step shown as "changing", one that kept its token as "settled" (the
// first step's canvas is all "noise"). A block chunk's dgserve.block carries the committed token ids and the
// block's stats (steps, mean entropy, time): the row turns "committed", positions past the tokens it returned
// (cut by EOS, a stop string or max_tokens) "cut". Token texts come from POST /playground/pieces, once per id.
// The same request with the same seed gives the same drafts, so "Replay" redraws the same animation.
// A request may start from a draft (draft.js: initial_canvas and pinned, docs/edit-in-place.md): draft position p
// is position p mod C of block p div C (C: the canvas length, a draft frame's length), and a pinned position is
// drawn "pinned" in every frame, with the draft's token in its title.
"use strict";
(() => {
  const $ = dg.el;
  const pieces = new Map();  // token id → its text
  // last: the last request with its seed and view (its draft and pinned positions), for Replay; C: canvas length
  const S = { abort: null, last: null, rows: [], frames: [], committed: [], text: "", view: null, C: 0 };
  const auth = dg.authUi(() => { loadModel(); draft.retry(); });
  const draft = dgDraft(() => auth.show(dg.token() ? "the token was not accepted" : ""));

  const mode = () => document.querySelector("input[name=mode]:checked").value;
  const num = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };

  function setMode() {
    for (const e of document.querySelectorAll(".chat-only")) e.disabled = mode() !== "chat";
  }

  // the request from the form: {b: its body, view: {draft ids, pinned positions}}; throws a message
  async function request() {
    const b = body(), d = await draft.request(), view = { draft: [], positions: [] };
    if (d) {
      b.initial_canvas = d.initial_canvas;
      if (d.pinned !== undefined) b.pinned = d.pinned;
      Object.assign(view, { draft: d.draft, positions: d.positions });
      for (const [id, piece] of draft.pieces()) pieces.set(id, piece);
    }
    return { b, view };
  }

  // the request body from the form's prompt and knobs; throws a message for bad JSON fields
  function body() {
    const b = { stream: true, drafts: true };
    const text = $("prompt").value;
    if (mode() === "chat") {
      const sys = $("system").value.trim();
      b.messages = (sys ? [{ role: "system", content: sys }] : []).concat([{ role: "user", content: text }]);
    } else {
      b.prompt = text;
    }
    for (const k of ["max_tokens", "max_denoising_steps", "t_min", "t_max", "entropy_bound"]) {
      if (num(k) !== undefined) b[k] = num(k);
    }
    const seed = $("seed").value.trim();  // digits stay a string: exact past 2^53 (dg.json writes them)
    if (seed !== "") b.seed = /^[0-9]+$/.test(seed) ? seed : Number(seed);
    const rf = $("response_format").value;
    if (rf === "json_object") b.response_format = { type: "json_object" };
    if (rf === "json_schema") {
      b.response_format = { type: "json_schema", json_schema: { name: "output", schema: parse("schema") } };
    }
    if (mode() === "chat" && $("tool_choice").value) {
      b.tools = parse("tools");
      b.tool_choice = $("tool_choice").value;
    }
    return b;
  }

  function parse(id) {
    try { return JSON.parse($(id).value); } catch (e) { throw id + ": not valid JSON (" + e.message + ")"; }
  }

  function route(b) { return b.messages ? "/v1/chat/completions" : "/v1/completions"; }

  function curl(b) {
    const json = dg.json(b).replace(/'/g, "'\\''");
    const auth = dg.token() ? " \\\n  -H \"Authorization: Bearer $DGSERVE_TOKEN\"" : "";
    return "curl -N " + location.origin + route(b) + " \\\n  -H 'Content-Type: application/json'" + auth +
      " \\\n  -d '" + json + "'";
  }

  // ------------------------------------------------------------------ drawing

  function row(index) {
    while (S.rows.length <= index) {
      const r = document.createElement("div");
      r.className = "block";
      r.dataset.index = S.rows.length;
      const head = document.createElement("div");
      head.className = "head";
      const cells = document.createElement("div");
      cells.className = "cells";
      r.append(head, cells);
      $("canvas").append(r);
      S.rows.push({ el: r, head, cells, ids: null, steps: 0 });
    }
    return S.rows[index];
  }

  function paint(r, ids, state) {  // state(i, id) → the cell's class
    while (r.cells.children.length < ids.length) {
      const c = document.createElement("span");
      r.cells.append(c);
    }
    const C = S.C || ids.length, base = Number(r.el.dataset.index) * C;
    ids.forEach((id, i) => {
      const c = r.cells.children[i], p = base + i;
      const pinned = S.view.pinned.has(p);
      c.className = "cell " + state(i, id) + (pinned ? " pinned" : "");
      c.textContent = show(pieces.get(id), id);
      c.title = "position " + i + ", token " + id;
      const want = S.view.draft[p];
      if (pinned) c.title += ": pinned to draft position " + p + ", token " + want + " " + show(pieces.get(want), want);
      c.setAttribute("aria-label", c.title);
    });
  }

  function show(piece, id) {
    if (piece === undefined) return "#" + id;
    const t = piece.replace(/\n/g, "⏎").replace(/\t/g, "⇥");
    return t.trim() === "" ? "␣".repeat(Math.max(1, t.length)) : t;
  }

  async function learn(ids) {
    const missing = [...new Set(ids.filter((id) => !pieces.has(id)))];
    if (!missing.length) return;
    const got = await dg.call("/playground/pieces", { ids: missing });
    missing.forEach((id, i) => pieces.set(id, got.pieces[i]));
  }

  async function onDraft(d) {
    await learn(d.token_ids);
    const r = row(d.block_index), prev = r.ids;
    S.C = S.C || d.token_ids.length;
    paint(r, d.token_ids, (i, id) => (prev === null ? "noise" : prev[i] === id ? "settled" : "moving"));
    r.ids = d.token_ids;
    r.steps = d.step;
    r.head.textContent = "block " + d.block_index + " · step " + d.step + " · entropy " + dg.fmt(d.mean_entropy, 3);
    S.frames.push([d.block_index, d.step].concat(d.token_ids));
    $("canvas").dataset.frames = S.frames.length;
  }

  async function onBlock(b) {
    await learn(b.token_ids);
    const r = row(b.index), canvas = r.ids || b.token_ids;
    const ids = b.token_ids.concat(canvas.slice(b.token_ids.length));
    paint(r, ids, (i) => (i < b.token_ids.length ? "committed" : "cut"));
    r.el.classList.add("done");
    r.head.textContent = "block " + b.index + " · " + b.denoising_steps + " steps · entropy " +
      dg.fmt(b.mean_entropy, 3) + " · " + dg.fmt(b.denoise_ms, 1) + " ms · " + b.tokens + " tokens · " +
      dg.fmt(b.tokens_per_forward, 2) + " tok/forward";
    S.committed.push(...b.token_ids);
  }

  function onText(chunk) {
    const c = chunk.choices && chunk.choices[0];
    if (!c) return;
    let t = c.text !== undefined ? c.text : (c.delta.reasoning_content || "") + (c.delta.content || "");
    if (c.delta && c.delta.tool_calls) t += JSON.stringify(c.delta.tool_calls);
    S.text += t;
    $("text").textContent = S.text;
  }

  // ------------------------------------------------------------------ the request

  async function run(b, view) {
    S.rows = []; S.frames = []; S.committed = []; S.text = ""; S.C = 0;
    S.view = { draft: view.draft, pinned: new Set(view.positions) };
    $("canvas").replaceChildren();
    $("text").textContent = "";
    Object.assign($("canvas").dataset, { state: "running", frames: 0, frameLog: "", committed: "", text: "", seed: "",
      draft: JSON.stringify(view.draft), pinned: JSON.stringify(view.positions) });
    $("curl").value = curl(b);
    busy(true);
    status("running…");
    S.abort = new AbortController();
    try {
      const r = await fetch(route(b), {
        method: "POST", headers: dg.headers(true), body: dg.json(b), signal: S.abort.signal,
      });
      if (r.status === 401) auth.show("the token was not accepted");
      if (!r.ok) throw await dg.error(r);
      const seed = r.headers.get("X-Dgserve-Seed") || "";  // its decimal digits, kept a string (dg.json)
      // replay: the same request with the seed it ran with
      S.last = { b: Object.assign({}, b, seed ? { seed } : {}), view };
      $("curl").value = curl(S.last.b);
      $("canvas").dataset.seed = seed;
      await read(r.body);
      Object.assign($("canvas").dataset, {  // what was drawn, for a test to read back
        frameLog: JSON.stringify(S.frames), committed: JSON.stringify(S.committed), text: S.text, state: "done",
      });
      status("done · seed " + seed + " · " + S.frames.length + " draft frames");
    } catch (e) {
      $("canvas").dataset.state = "error";
      status(e.name === "AbortError" ? "stopped" : "error: " + (e.message || e), true);
    } finally {
      busy(false);
    }
  }

  async function read(stream) {  // server-sent events, handled one at a time in order
    const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, end);
        buf = buf.slice(end + 2);
        await handle(ev);
      }
    }
  }

  async function handle(ev) {
    let name = "", data = "";
    for (const line of ev.split("\n")) {
      if (line.startsWith("event: ")) name = line.slice(7);
      if (line.startsWith("data: ")) data += line.slice(6);
    }
    if (!data || data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw { message: chunk.error.message };
    const x = chunk.dgserve || {};
    if (name === "dgserve.draft") return onDraft(x.draft);
    if (x.block) await onBlock(x.block);
    onText(chunk);
  }

  function busy(on) {
    $("run").disabled = on;
    $("stop").disabled = !on;
    $("replay").disabled = on || !S.last;
  }

  function status(msg, bad) {
    $("status").textContent = msg;
    $("status").className = bad ? "bad" : "";
  }

  async function loadModel() {
    try {
      const m = await dg.call("/v1/models");
      $("model").textContent = m.data.map((x) => x.id).join(", ");
      auth.hide();
    } catch (e) {
      if (e.status === 401) auth.show(dg.token() ? "the token was not accepted" : "");
      else $("model").textContent = e.message;
    }
  }

  $("form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    let req;
    $("run").disabled = true;  // (while the draft's tokens are fetched)
    try { req = await request(); } catch (e) { $("run").disabled = false; return status(e.message || String(e), true); }
    run(req.b, req.view);
  });
  $("replay").addEventListener("click", () => S.last && run(S.last.b, S.last.view));
  $("stop").addEventListener("click", () => S.abort && S.abort.abort());
  $("copy").addEventListener("click", () => navigator.clipboard.writeText($("curl").value));
  for (const r of document.querySelectorAll("input[name=mode]")) r.addEventListener("change", setMode);
  setMode();
  loadModel();
})();
