// tidal's live page: the batch step by step (GET /ui/events) and a playground (the OpenAI
// chat API, streamed). Plain browser JavaScript, no dependencies, nothing from a CDN.
"use strict";

const $ = (id) => document.getElementById(id);
const STEPS_SHOWN = 160;          // columns of the step strip
const TIMELINE_S = 300;           // seconds of throughput / latency history
const state = { steps: [], lastStep: {}, history: [], prev: null, model: null, snap: null };

// ---- the API key: asked once, kept in this browser, sent as a header ---------------------
$("api-key").value = localStorage.getItem("tidal-api-key") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("tidal-api-key", $("api-key").value);
  connect();
});
function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// ---- tabs --------------------------------------------------------------------------------
document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === b));
  $("batch").hidden = b.dataset.tab !== "batch";
  $("play").hidden = b.dataset.tab !== "play";
  if (b.dataset.tab === "batch") drawAll();
}));

function setStatus(text, kind) {
  const s = $("status");
  s.textContent = text;
  s.className = "status " + (kind || "");
}

// ---- the feed: server-sent events read through fetch (EventSource cannot send a header) ---
let feed = null;
async function connect() {
  if (feed) feed.abort();
  feed = new AbortController();
  try {
    const resp = await fetch("/ui/events", { headers: headers(), signal: feed.signal });
    if (!resp.ok) {
      const body = await resp.json().catch(() => ({}));
      const msg = (body.error && body.error.message) || resp.statusText;
      setStatus(resp.status === 401 ? "API key needed" : msg, "bad");
      if (resp.status !== 401) setTimeout(connect, 2000);
      return;
    }
    setStatus("live", "ready");
    for await (const data of sseData(resp)) onSnapshot(JSON.parse(data));
    setStatus("reconnecting", "bad");
  } catch (e) {
    if (e.name === "AbortError") return;
    setStatus("reconnecting", "bad");
  }
  setTimeout(connect, 1000);
}

// Server-sent events from a fetch response: each event's `data: ` payload, in order (the
// live feed and the chat stream both arrive so).
async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 2);
      if (event.startsWith("data: ")) yield event.slice(6);
    }
  }
}

// ---- one snapshot -----------------------------------------------------------------------
function onSnapshot(snap) {
  if (snap.error) { setStatus("engine: " + snap.error, "bad"); return; }
  setStatus("live", "ready");
  state.snap = snap;
  if (snap.model && state.model !== snap.model) { state.model = snap.model; $("model").textContent = snap.model; }
  snap.cores.forEach((core, index) => {
    if (!core.view) return;
    const seen = state.lastStep[index] || -1;
    for (const step of core.view.steps) {
      if (step.step_id > seen) state.steps.push(Object.assign({ core: index }, step));
    }
    if (core.view.steps.length) state.lastStep[index] = core.view.steps[core.view.steps.length - 1].step_id;
  });
  state.steps = state.steps.slice(-STEPS_SHOWN);
  const s = snap.stats;
  if (state.prev) {
    const dt = snap.time - state.prev.time;
    if (dt > 0) state.history.push({
      t: snap.time,
      gen: (s.generation_tokens - state.prev.stats.generation_tokens) / dt,
      prompt: (s.prompt_tokens - state.prev.stats.prompt_tokens) / dt,
      steps: (s.num_steps - state.prev.stats.num_steps) / dt,
      ttft50: snap.latency.ttft.p50, ttft90: snap.latency.ttft.p90,
      itl50: snap.latency.itl.p50, itl90: snap.latency.itl.p90,
    });
  }
  state.prev = snap;
  state.history = state.history.filter((h) => h.t > snap.time - TIMELINE_S);
  if (!$("batch").hidden) drawAll();
}

function drawAll() {
  const snap = state.snap;
  if (!snap) return;
  const s = snap.stats;
  const views = snap.cores.map((c) => c.view).filter(Boolean);
  const sum = (f) => views.reduce((a, v) => a + f(v), 0);
  const maxSeqs = sum((v) => v.max_num_seqs), budget = views.length ? views[0].max_num_batched_tokens : 0;
  const last = state.steps.length ? state.steps[state.steps.length - 1] : null;
  setCard("seqs", `${s.num_running} / ${maxSeqs}`, "seqs-bar", s.num_running / (maxSeqs || 1));
  setCard("budget", last ? `${last.num_tokens} / ${budget}` : "–", "budget-bar", last ? last.num_tokens / (budget || 1) : 0);
  const blocks = sum((v) => v.num_kv_blocks), used = sum((v) => v.kv_blocks_used), cached = sum((v) => v.kv_blocks_cached);
  $("kv").textContent = `${used} / ${cached} / ${Math.max(0, blocks - used - cached)}`;
  $("kv-used").style.width = pct(used / (blocks || 1));
  $("kv-cached").style.width = pct(cached / (blocks || 1));
  $("waiting").textContent = s.num_waiting;
  const prio = {};
  views.forEach((v) => Object.entries(v.waiting_by_priority || {}).forEach(([p, n]) => { prio[p] = (prio[p] || 0) + n; }));
  const prios = Object.keys(prio).sort((a, b) => a - b);
  $("waiting-prio").textContent = prios.length ? prios.map((p) => `priority ${p}: ${prio[p]}`).join(", ") : "by priority: none waiting";
  $("hits").textContent = s.prefix_cache_queries ? pct(s.prefix_cache_hits / s.prefix_cache_queries) : "–";
  $("preemptions").textContent = s.num_preemptions || 0;
  const h = state.history[state.history.length - 1];
  $("steps-rate").textContent = h ? `${h.steps.toFixed(0)} steps/s` : "steps/s";
  drawSteps(budget);
  detailOf(last, budget, maxSeqs);
  drawTimeline($("throughput"), [["gen", "#36c48f", "generated"], ["prompt", "#f5a524", "prompt"]], 1);
  drawTimeline($("latency"), [["ttft50", "#4c9aff", "TTFT p50"], ["ttft90", "#9cc4ff", "TTFT p90"],
                              ["itl50", "#f5a524", "ITL p50"], ["itl90", "#ffd28a", "ITL p90"]], 1000);
  const warnings = views.flatMap((v) => v.warnings || []);
  $("warnings").innerHTML = warnings.length
    ? warnings.slice(-10).reverse().map((w) => `<li>${escapeHtml(w)}</li>`).join("")
    : '<li class="none">none</li>';
  coresTable(snap);
}

function setCard(id, text, barId, fraction) {
  $(id).textContent = text;
  $(barId).style.width = pct(fraction);
}
const pct = (x) => (100 * Math.max(0, Math.min(1, x || 0))).toFixed(1) + "%";
const escapeHtml = (t) => t.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

function fitCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== width * ratio) { canvas.width = width * ratio; canvas.height = height * ratio; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return [ctx, width, height];
}

// The step strip: one column per step, its requests stacked (prefill chunks orange, decodes
// blue), the column's height the tokens it used of the budget (a square root scale, so that a
// step of a few decodes still shows next to a full prefill).
function drawSteps(budget) {
  const [ctx, width, height] = fitCanvas($("steps"));
  const steps = state.steps, col = width / STEPS_SHOWN;
  const scale = (tokens) => (height - 14) * Math.sqrt(Math.min(1, tokens / (budget || 1)));
  steps.forEach((step, i) => {
    const x = width - (steps.length - i) * col;
    let y = height;
    const total = scale(step.num_tokens);
    for (const r of step.requests) {
      const h = Math.max(1, total * r.num_tokens / (step.num_tokens || 1));
      ctx.fillStyle = r.prefill ? "#f5a524" : "#4c9aff";
      ctx.fillRect(x + 1, y - h, Math.max(1, col - 2), h);
      y -= h;
    }
    if (step.preempted && step.preempted.length) {
      ctx.fillStyle = "#ff5d5d";
      ctx.fillRect(x, 0, Math.max(2, col), 6);
    }
  });
}

function detailOf(step, budget, maxSeqs) {
  if (!step) return;
  const prefills = step.requests.filter((r) => r.prefill), decodes = step.requests.length - prefills.length;
  const chunks = prefills.map((r) => `…${r.req_id.slice(-10)}:${r.num_tokens}`).join(" ");
  $("step-detail").textContent =
    `step ${step.step_id}: ${step.num_tokens}/${budget} tokens, ${step.requests.length}/${maxSeqs} sequences, ` +
    `${(step.seconds * 1000).toFixed(1)} ms · ${decodes} decode(s)` +
    (prefills.length ? ` · ${prefills.length} prefill chunk(s): ${chunks}` : "") +
    (step.preempted && step.preempted.length ? ` · preempted: ${step.preempted.join(" ")}` : "");
}

function drawTimeline(canvas, series, unit) {
  const [ctx, width, height] = fitCanvas(canvas);
  const hist = state.history;
  if (hist.length < 2) return;
  const t1 = hist[hist.length - 1].t, t0 = t1 - TIMELINE_S;
  let max = 0;
  for (const h of hist) for (const [key] of series) if (h[key] != null) max = Math.max(max, h[key] * unit);
  max = max > 0 ? max * 1.15 : 1;
  ctx.font = "11px system-ui"; ctx.fillStyle = "#8a96a3";
  ctx.fillText(max.toFixed(max < 10 ? 1 : 0), 4, 12);
  series.forEach(([key, color, label], k) => {
    ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
    let started = false;
    for (const h of hist) {
      if (h[key] == null) continue;
      const x = (h.t - t0) / TIMELINE_S * width, y = height - (h[key] * unit) / max * (height - 4);
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    }
    ctx.stroke();
    const lastValue = [...hist].reverse().find((h) => h[key] != null);
    ctx.fillStyle = color;
    ctx.fillText(`${label} ${lastValue ? (lastValue[key] * unit).toFixed(unit > 1 ? 0 : 1) : "–"}`, 60 + k * 110, 12);
  });
}

function coresTable(snap) {
  $("cores-box").hidden = snap.cores.length < 2;
  if (snap.cores.length < 2) return;
  $("cores").querySelector("tbody").innerHTML = snap.cores.map((c, i) =>
    `<tr><td>${i}</td><td>${c.stats.num_running}</td><td>${c.stats.num_waiting}</td>` +
    `<td>${pct(c.stats.kv_cache_usage)}</td><td>${c.stats.num_steps}</td></tr>`).join("");
}
window.addEventListener("resize", drawAll);

// ---- the playground -----------------------------------------------------------------------
const chat = [];
$("clear").addEventListener("click", () => { chat.length = 0; $("messages").innerHTML = ""; });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("composer").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  chat.push({ role: "user", content: text });
  addMessage("user").textContent = text;
  await answer();
});

function addMessage(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  $("messages").appendChild(div);
  return div;
}

async function modelName() {
  if (state.model) return state.model;
  const resp = await fetch("/v1/models", { headers: headers() });
  const body = await resp.json();
  state.model = body.data[0].id;
  $("model").textContent = state.model;
  return state.model;
}

async function answer() {
  const box = addMessage("assistant");
  const textBox = document.createElement("div");
  const meta = document.createElement("div");
  meta.className = "meta";
  box.append(textBox, meta);
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat);
  const body = {
    model: await modelName(), messages, stream: true, logprobs: true, top_logprobs: 5,
    temperature: Number($("temperature").value), top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value), stream_options: { include_usage: true },
  };
  const schema = $("schema").value.trim();
  if (schema) {
    try {
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(schema) } };
    } catch (err) {
      box.classList.add("error"); textBox.textContent = "the JSON schema does not parse: " + err.message; return;
    }
  }
  const start = performance.now();
  let first = null, tokens = 0, reply = "", finish = null, usage = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || resp.statusText);
    }
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.finish_reason) finish = choice.finish_reason;
        const content = (choice.delta && choice.delta.content) || "";
        // a chunk's logprobs name each token it carries (text held back for a split
        // character comes with a later chunk's content)
        const lps = (choice.logprobs && choice.logprobs.content) || [];
        if (!content && !lps.length) continue;
        if (first === null) first = performance.now();
        reply += content;
        if (lps.length) {
          for (const lp of lps) { textBox.appendChild(tokenSpan(lp)); tokens += 1; }
        } else {
          textBox.appendChild(document.createTextNode(content)); tokens += 1;
        }
      }
    }
  } catch (err) {
    box.classList.add("error");
    textBox.appendChild(document.createTextNode((reply ? "\n" : "") + "error: " + err.message));
    return;
  }
  chat.push({ role: "assistant", content: reply });
  const end = performance.now();
  if (usage && usage.completion_tokens) tokens = usage.completion_tokens;
  const ttft = first === null ? null : first - start;
  const rate = first !== null && tokens > 1 ? (tokens - 1) / ((end - first) / 1000) : null;
  meta.textContent = `TTFT ${ttft === null ? "–" : ttft.toFixed(0) + " ms"} · ${tokens} tokens` +
    (rate ? ` · ${rate.toFixed(1)} tokens/s` : "") + (finish ? ` · finish: ${finish}` : "");
}

function tokenSpan(lp) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = lp.token;
  const alternatives = (lp.top_logprobs || []).map((t) => `${JSON.stringify(t.token)} ${t.logprob.toFixed(3)}`).join("\n");
  span.title = `logprob ${lp.logprob.toFixed(4)} (p = ${Math.exp(lp.logprob).toFixed(3)})` +
    (alternatives ? "\ntop:\n" + alternatives : "");
  return span;
}

connect();
