// Shared by the playground and the dashboard (docs/playground.md): the API token and same-origin JSON calls.
// The token the user types is kept in this tab's sessionStorage only (gone when the tab closes) and sent as
// "Authorization: Bearer"; the server never stores it. Every call is same-origin with Content-Type
// application/json, so it passes the server's Host / Origin / Content-Type checks like any client's call.
"use strict";
const dg = {
  TOKEN_KEY: "dgserve-token",
  token() { return sessionStorage.getItem(dg.TOKEN_KEY) || ""; },
  setToken(t) { t ? sessionStorage.setItem(dg.TOKEN_KEY, t) : sessionStorage.removeItem(dg.TOKEN_KEY); },
  headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (dg.token()) h["Authorization"] = "Bearer " + dg.token();
    return h;
  },
  // fetch a JSON API route; throws {status, message} on an error answer
  async call(path, body) {
    const init = body === undefined ? { headers: dg.headers(false) }
      : { method: "POST", headers: dg.headers(true), body: JSON.stringify(body) };
    const r = await fetch(path, init);
    if (!r.ok) throw await dg.error(r);
    return r.json();
  },
  async error(r) {
    let message = r.status + " " + r.statusText;
    try { message = (await r.json()).error.message || message; } catch (e) { /* not JSON */ }
    return { status: r.status, message };
  },
  // The JSON text of a request body. A seed is 64 bits, past the 2^53 a JS number holds exactly, so the pages keep
  // it as a decimal string and it is written here as that exact integer literal (every other field as
  // JSON.stringify writes it): Replay and the curl line carry the seed's exact digits.
  json(b) {
    if (typeof b.seed !== "string" || !/^[0-9]+$/.test(b.seed)) return JSON.stringify(b);
    const rest = Object.assign({}, b);
    delete rest.seed;
    const json = JSON.stringify(rest);
    return json.slice(0, -1) + (json === "{}" ? "" : ",") + '"seed":' + b.seed.replace(/^0+(?=[0-9])/, "") + "}";
  },
  el(id) { return document.getElementById(id); },
  fmt(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    return Number(x).toFixed(digits === undefined ? 2 : digits);
  },
  // the token prompt: shown after a 401, hidden once a call with the token succeeds
  authUi(onToken) {
    const box = dg.el("auth"), input = dg.el("token");
    dg.el("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      dg.setToken(input.value.trim());
      input.value = "";
      onToken();
    });
    return { show(msg) { box.hidden = false; dg.el("auth-msg").textContent = msg || ""; input.focus(); },
             hide() { box.hidden = true; } };
  },
};
