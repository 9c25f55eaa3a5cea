// The live dashboard (docs/playground.md): polls /metrics (Prometheus text, the same registry Prometheus scrapes)
// and draws time series with uPlot. Counters become rates and histograms become percentiles and means over the
// last WINDOW seconds, from the difference between the newest scrape and the one WINDOW seconds before it.
"use strict";
(() => {
  const $ = dg.el;
  const POLL_MS = 2000, WINDOW_S = 30, KEEP = 300;  // KEEP points: 10 minutes
  const scrapes = [];  // {t (seconds), m: Map name → [{labels, value}]}
  const P = "dgserve_";

  // Prometheus text exposition → Map name → [{labels: {k: v}, value}]
  function parse(text) {
    const m = new Map();
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const x = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/);
      if (!x) continue;
      const labels = {};
      for (const l of (x[3] || "").matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
      if (!m.has(x[1])) m.set(x[1], []);
      m.get(x[1]).push({ labels, value: Number(x[4]) });
    }
    return m;
  }

  const sum = (s, name) => (s.m.get(name) || []).reduce((a, x) => a + x.value, 0);
  const has = (s, name) => s.m.has(name);

  // cumulative bucket counts of a histogram, summed over label sets: [[le, count], ...] ascending
  function buckets(s, name) {
    const by = new Map();
    for (const x of s.m.get(name + "_bucket") || []) {
      const le = x.labels.le === "+Inf" ? Infinity : Number(x.labels.le);
      by.set(le, (by.get(le) || 0) + x.value);
    }
    return [...by.entries()].sort((a, b) => a[0] - b[0]);
  }

  // the q-quantile of the observations between scrapes a and b (linear within a bucket, as histogram_quantile)
  function quantile(q, a, b, name) {
    const nb = buckets(b, name), oa = new Map(buckets(a, name));
    const d = nb.map(([le, c]) => [le, c - (oa.get(le) || 0)]);
    const total = d.length ? d[d.length - 1][1] : 0;
    if (total <= 0) return null;
    const rank = q * total;
    let lo = 0, prev = 0;
    for (const [le, c] of d) {
      if (c >= rank) {
        if (le === Infinity) return lo;
        return lo + (le - lo) * (c === prev ? 0 : (rank - prev) / (c - prev));
      }
      lo = le; prev = c;
    }
    return lo;
  }

  function mean(a, b, name) {
    const n = sum(b, name + "_count") - sum(a, name + "_count");
    return n > 0 ? (sum(b, name + "_sum") - sum(a, name + "_sum")) / n : null;
  }

  function rate(a, b, name) {
    const dt = b.t - a.t;
    return dt > 0 ? Math.max(0, sum(b, name) - sum(a, name)) / dt : null;
  }

  const ms = (x) => (x === null ? null : x * 1000);
  const pct = (x) => (x === null ? null : x * 100);

  // each chart: title, unit, series [label, (a, b) → value]
  const CHARTS = [
    ["throughput", "tokens/s", [["generated", (a, b) => rate(a, b, P + "generation_tokens_total")],
      ["prompt", (a, b) => rate(a, b, P + "prompt_tokens_total")]]],
    ["latency", "ms", [
      ["first block p50", (a, b) => ms(quantile(0.5, a, b, P + "time_to_first_block_seconds"))],
      ["first block p99", (a, b) => ms(quantile(0.99, a, b, P + "time_to_first_block_seconds"))],
      ["per block p50", (a, b) => ms(quantile(0.5, a, b, P + "block_seconds"))],
      ["per block p99", (a, b) => ms(quantile(0.99, a, b, P + "block_seconds"))]]],
    ["steps per block", "steps", [["mean", (a, b) => mean(a, b, P + "denoise_steps_per_block")],
      ["p99", (a, b) => quantile(0.99, a, b, P + "denoise_steps_per_block")]]],
    ["tokens per forward", "tokens", [["mean", (a, b) => mean(a, b, P + "tokens_per_forward")]]],
    ["requests", "requests", [["running", (a, b) => sum(b, P + "num_requests_running")],
      ["waiting", (a, b) => sum(b, P + "num_requests_waiting")]]],
    ["caches", "%", [["KV cache used", (a, b) => pct(sum(b, P + "kv_cache_usage_perc"))],
      ["prefix-cache hits", (a, b) => {
        const q = sum(b, P + "prefix_cache_queries_total") - sum(a, P + "prefix_cache_queries_total");
        return q > 0 ? pct((sum(b, P + "prefix_cache_hits_total") - sum(a, P + "prefix_cache_hits_total")) / q) : null;
      }]]],
  ];
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#ca8a04"];
  // the tiles: totals since the server started
  const TILES = [
    ["requests", (s) => sum(s, P + "request_finish_total"), 0],
    ["tokens generated", (s) => sum(s, P + "generation_tokens_total"), 0],
    ["blocks", (s) => sum(s, P + "denoise_steps_per_block_count"), 0],
    ["denoising steps", (s) => sum(s, P + "denoise_steps_per_block_sum"), 0],
    ["running", (s) => sum(s, P + "num_requests_running"), 0],
    ["waiting", (s) => sum(s, P + "num_requests_waiting"), 0],
    ["KV cache %", (s) => pct(sum(s, P + "kv_cache_usage_perc")), 1],
  ];

  const data = CHARTS.map((c) => [[]].concat(c[2].map(() => [])));
  let plots = null;

  function makePlots() {
    const width = Math.min(560, Math.max(280, ($("charts").clientWidth - 24) / 2));
    plots = CHARTS.map(([title, unit, series], i) => {
      const div = document.createElement("div");
      div.className = "chart";
      div.id = "chart-" + i;
      $("charts").append(div);
      return new uPlot({
        title: title + " (" + unit + ")", width, height: 180,
        series: [{}].concat(series.map(([label], k) => ({ label, stroke: COLORS[k], width: 2, spanGaps: false }))),
        axes: [{}, { size: 56 }],
      }, data[i], div);
    });
  }

  function tiles(s) {
    const box = $("tiles");
    if (!box.children.length) {
      for (const [label] of TILES) {
        const t = document.createElement("div");
        t.className = "tile";
        const v = document.createElement("b"), l = document.createElement("span");
        l.textContent = label;
        t.append(v, l);
        box.append(t);
      }
    }
    TILES.forEach(([label, f, digits], i) => {
      const v = box.children[i].firstChild;
      v.textContent = dg.fmt(f(s), digits);
      v.dataset.value = f(s);
    });
  }

  async function poll() {
    let text;
    try {
      const r = await fetch("/metrics", { headers: dg.headers(false) });
      if (!r.ok) throw await dg.error(r);
      text = await r.text();
    } catch (e) {
      $("status").textContent = "cannot read /metrics: " + (e.message || e);
      return;
    }
    const s = { t: Date.now() / 1000, m: parse(text) };
    scrapes.push(s);
    while (scrapes.length > 2 && scrapes[1].t <= s.t - WINDOW_S) scrapes.shift();
    const a = scrapes[0];
    CHARTS.forEach((c, i) => {
      data[i][0].push(s.t);
      c[2].forEach(([, f], k) => data[i][k + 1].push(a === s ? null : f(a, s)));
      if (data[i][0].length > KEEP) data[i].forEach((col) => col.shift());
    });
    tiles(s);
    if (!plots) makePlots();
    plots.forEach((p, i) => p.setData(data[i]));
    $("tiles").dataset.polls = Number($("tiles").dataset.polls) + 1;
    $("status").textContent = has(s, P + "num_requests_running") ? "live" : "no engine metrics yet";
  }

  poll();
  setInterval(poll, POLL_MS);
})();
