// Typeahead page: one websocket, one message per keystroke, newest answer wins.
"use strict";

const STAGES = [
  // [key, label, colour]; "network" and "server" are derived, the rest come from the sidecar.
  ["network", "network", "#8e9aaf"],
  ["server", "server", "#6c8ebf"],
  ["cache", "cache", "#b48ead"],
  ["tokenize", "tokenize", "#d08770"],
  ["queue", "queue", "#ebcb8b"],
  ["inference", "inference", "#5e81ac"],
  ["search", "FAISS search", "#88c0d0"],
  ["lexical", "lexical (tantivy)", "#a3be8c"],
];
const SIDECAR_STAGES = ["cache", "tokenize", "queue", "inference", "search", "lexical"];
// Which search leg found a hit: a badge per leg on each result.
const LEGS = { semantic: ["semantic", "found by the embedding (FAISS)"], lexical: ["lexical", "found by the words / prefix (tantivy)"] };
const STRIP_LEN = 50;

const $ = (id) => document.getElementById(id);
const state = {
  ws: null,
  seq: 0,
  shownSeq: -1,
  sentAt: new Map(),      // seq -> performance.now() when sent
  totals: [],             // every answered keystroke of this session (ms)
  budget: 20,
  debounceTimer: null,
  retryMs: 250,
  models: [],             // each column's model id from /config (`embedcar demo --compare` gives two)
};

function connect() {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  // With API keys set the socket needs one: pass on the page's own ?api_key= (no headers in browsers).
  const key = new URLSearchParams(location.search).get("api_key");
  const ws = new WebSocket(`${proto}//${location.host}/ws` + (key ? `?api_key=${encodeURIComponent(key)}` : ""));
  state.ws = ws;
  ws.onopen = () => {
    setStatus("connected", "ok");
    state.retryMs = 250;
    if ($("q").value) sendNow();
  };
  ws.onclose = () => {
    setStatus("disconnected, retrying…", "bad");
    setTimeout(connect, state.retryMs);
    state.retryMs = Math.min(state.retryMs * 2, 5000);
  };
  ws.onmessage = (ev) => onMessage(JSON.parse(ev.data));
}

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = `status ${cls || ""}`;
}

function sendNow() {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return;
  state.seq += 1;
  state.sentAt.set(state.seq, performance.now());
  state.ws.send(JSON.stringify({ seq: state.seq, text: $("q").value, mode: $("mode").value }));
}

function onInput() {
  clearTimeout(state.debounceTimer);
  if ($("debounce").checked) {
    const ms = Math.max(0, Number($("debounce-ms").value) || 0);
    state.debounceTimer = setTimeout(sendNow, ms);
  } else {
    sendNow();
  }
}

function onMessage(msg) {
  if (msg.dropped) {            // superseded on the server: never computed
    state.sentAt.delete(msg.seq);
    return;
  }
  if (msg.error) {
    if (msg.seq === null || msg.seq >= state.shownSeq) showError(`${msg.error.code}: ${msg.error.message}`);
    state.sentAt.delete(msg.seq);
    return;
  }
  if (msg.seq <= state.shownSeq) return;  // an older answer than what is on screen
  const sent = state.sentAt.get(msg.seq);
  const rtt = sent === undefined ? msg.server_ms : performance.now() - sent;
  for (const s of state.sentAt.keys()) if (s <= msg.seq) state.sentAt.delete(s);
  state.shownSeq = msg.seq;
  showError(null);
  // One model: the message is its own column. Compare mode: one column per model, drawn on one
  // scale; each column's bar ends when its own search returned (both run at once).
  const cols = msg.columns || [msg];
  setColumns(cols.length);
  const network = Math.max(0, rtt - msg.server_ms);   // browser <-> demo server, shared by the columns
  const totals = cols.map((c) => network + c.server_ms);
  const scale = Math.max(state.budget * 1.5, ...totals.map((t) => t * 1.05));
  cols.forEach((col, i) => {
    const total = cols.length === 1 ? rtt : totals[i];
    renderResults(part("column", i), col, msg.text, total);
    renderBar(part("lat-col", i), stageBreakdown(col, network), total, scale, col.cache_hit, msg.text);
  });
  if (msg.text) {               // an empty box is not a search: keep it out of the statistics
    state.totals.push(rtt);
    renderStrip();
  }
}

function stageBreakdown(col, network) {
  const t = col.timings_ns || {};
  const out = {};
  let sidecar = 0;
  for (const k of SIDECAR_STAGES) {
    out[k] = (t[k] || 0) / 1e6;
    sidecar += out[k];
  }
  out.server = Math.max(0, col.server_ms - sidecar);   // demo server + sidecar glue (the demo runs its sidecar in-process; over gRPC elsewhere)
  out.network = network;
  return out;
}

// The i-th block of a kind ("column": results, "lat-col": latency bar); the first is the page's own.
function part(kind, i) {
  return document.querySelectorAll(`.${kind}`)[i];
}

// Compare mode: a copy of the first column's blocks for each further model (ids stay on the first,
// which is the page without --compare).
function setColumns(n) {
  for (const [box, kind] of [["columns", "column"], ["lat-cols", "lat-col"]]) {
    const have = document.querySelectorAll(`.${kind}`);
    for (let i = have.length; i < n; i++) {
      const copy = have[0].cloneNode(true);
      for (const el of [copy, ...copy.querySelectorAll("[id]")]) el.removeAttribute("id");
      copy.querySelector(".results")?.replaceChildren();
      $(box).append(copy);
    }
  }
  if (n < 2) return;
  document.body.classList.add("compare");
  $("compare-note").hidden = false;
  $("agree-note").hidden = false;
  for (const el of document.querySelectorAll(".col-head")) el.hidden = false;
  for (const el of document.querySelectorAll(".lat-col .col-model")) el.hidden = false;
  for (let i = 0; i < n; i++) if (state.models[i]) showModel(i, state.models[i]);
}

// A model's variant id, "name@version/variant": the name stands out, the rest tells versions apart.
function showModel(i, id) {
  for (const el of [part("column", i).querySelector(".col-model"), part("lat-col", i).querySelector(".col-model")]) {
    if (el.dataset.model === id) continue;
    const at = id.indexOf("@");
    const name = document.createElement("strong");
    name.textContent = at < 0 ? id : id.slice(0, at);
    const rest = document.createElement("span");
    rest.className = "muted";
    rest.textContent = at < 0 ? "" : id.slice(at);
    el.replaceChildren(name, rest);
    el.dataset.model = id;
    el.title = id;
  }
}

function fmt(ms) {
  return ms >= 10 ? `${ms.toFixed(0)} ms` : `${ms.toFixed(1)} ms`;
}

function renderResults(column, col, text, total) {
  const ol = column.querySelector(".results");
  ol.dataset.query = text;
  if (col.model) showModel([...document.querySelectorAll(".column")].indexOf(column), col.model);
  column.querySelector(".col-ms").textContent = text ? fmt(total) : "";
  const agree = column.querySelector(".agree");
  agree.hidden = !col.aisles;
  if (col.aisles) {
    const a = col.aisles;
    agree.textContent = `${a.count}/${a.of} in ${a.aisle}`;
    agree.className = `agree ${a.count * 2 > a.of ? "high" : "low"}`;
    agree.title = `${a.count} of ${a.of} results lie in “${a.aisle}”, the aisle most common among this column's top 3 (coherence, not relevance)`;
  }
  ol.replaceChildren(...col.results.map((r) => {
    const li = document.createElement("li");
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = r.title;
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = [r.aisle, r.department].filter(Boolean).join(" · ");
    const legs = document.createElement("span");
    legs.className = "legs";
    for (const leg of r.legs || []) {
      const b = document.createElement("span");
      const [label, why] = LEGS[leg] || [leg, leg];
      b.className = `leg leg-${leg}`;
      b.textContent = label;
      b.title = why;
      legs.append(b);
    }
    for (const attr of r.matched || []) {
      const b = document.createElement("span");
      b.className = "leg leg-attr";
      b.textContent = `✓ ${attr}`;
      b.title = `carries “${attr}”, an attribute you typed: products carrying every typed attribute rank first`;
      legs.append(b);
    }
    meta.append(legs);
    const score = document.createElement("span");
    score.className = "score";
    score.textContent = r.score.toFixed(3);
    li.append(title, meta, score);
    return li;
  }));
}

function renderBar(root, stages, total, scale, cacheHit, text) {
  const q = (cls) => root.querySelector(`.${cls}`);
  const segs = q("segments");
  segs.replaceChildren(...STAGES.filter(([k]) => stages[k] > 0).map(([k, label, colour]) => {
    const d = document.createElement("div");
    d.className = "seg";
    d.dataset.stage = k;
    d.style.width = `${(100 * stages[k]) / scale}%`;
    d.style.background = colour;
    d.title = `${label}: ${fmt(stages[k])}`;
    return d;
  }));
  q("budget-line").style.left = `${(100 * state.budget) / scale}%`;
  q("budget-shown").textContent = String(state.budget);
  const over = total > state.budget;
  q("bar").className = `bar ${over ? "over" : "within"}`;
  const tot = q("total");
  tot.textContent = fmt(total);
  tot.className = `total ${over ? "over" : "within"}`;
  q("cache-badge").hidden = !cacheHit;
  q("query-shown").textContent = text ? `“${text}”` : "";
  q("legend").replaceChildren(...STAGES.map(([k, label, colour]) => {
    const li = document.createElement("li");
    li.innerHTML = `<i style="background:${colour}"></i>`;
    li.append(`${label} ${fmt(stages[k] || 0)}`);
    return li;
  }));
}

function percentile(values, p) {
  if (!values.length) return NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const idx = Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1);
  return sorted[Math.max(0, idx)];
}

function renderStrip() {
  const recent = state.totals.slice(-STRIP_LEN);
  const scale = Math.max(state.budget * 1.5, ...recent);
  const strip = $("strip");
  const bars = recent.map((ms) => {
    const d = document.createElement("div");
    d.className = `tick ${ms > state.budget ? "over" : "within"}`;
    d.style.height = `${Math.max(2, (100 * ms) / scale)}%`;
    d.title = fmt(ms);
    return d;
  });
  const line = $("strip-budget");
  line.style.bottom = `${(100 * state.budget) / scale}%`;
  strip.replaceChildren(line, ...bars);
  const p50 = percentile(state.totals, 50);
  const p95 = percentile(state.totals, 95);
  $("p50").textContent = fmt(p50);
  $("p95").textContent = fmt(p95);
  $("p95").className = p95 > state.budget ? "over" : "within";
  $("count").textContent = String(state.totals.length);
}

function showError(text) {
  const el = $("error");
  el.hidden = !text;
  el.textContent = text || "";
}

async function loadConfig() {
  try {
    const cfg = await (await fetch("/config")).json();
    state.budget = Number(cfg.budget_ms) || state.budget;
    if (cfg.mode) $("mode").value = cfg.mode;
    $("budget").value = String(state.budget);
    for (const el of document.querySelectorAll(".budget-shown")) el.textContent = String(state.budget);
    const parts = [cfg.backend && `backend: ${cfg.backend}`, cfg.model && `model: ${cfg.model}`,
                   cfg.compare && `compared with: ${cfg.compare}`, cfg.index && `index: ${cfg.index}`].filter(Boolean);
    $("info").textContent = parts.join(" · ");
    if (cfg.compare) {
      state.models = [cfg.model, cfg.compare];
      setColumns(2);
    }
  } catch (_) { /* defaults are fine */ }
}

$("q").addEventListener("input", onInput);
$("mode").addEventListener("change", () => { if ($("q").value) sendNow(); });
$("budget").addEventListener("change", () => {
  const v = Number($("budget").value);
  if (v > 0) state.budget = v;
  for (const el of document.querySelectorAll(".budget-shown")) el.textContent = String(state.budget);
  if (state.totals.length) renderStrip();
});
loadConfig().finally(connect);
