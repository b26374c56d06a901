// The chat page: conversations in localStorage, answers streamed from /v1/chat/completions with the
// return_token_origins extension (each piece of text with where its token came from), stats after each answer,
// and a replay of the same message with speculation off beside it.
import { renderMarkdown } from "./markdown.js";

const $ = (sel) => document.querySelector(sel);
const KEYS = { conversations: "specdecode.conversations", settings: "specdecode.settings",
               current: "specdecode.current", apiKey: "specdecode.apiKey" };
const DEFAULT_SETTINGS = { system: "", temperature: 0, max_tokens: 1024, colour: true };
const ORIGIN_NAMES = { draft: "draft model", lookup: "lookup / suffix", grammar: "grammar",
                       bonus: "target (bonus)", corrected: "target (corrected)", target: "target" };

function load(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v === null ? fallback : v;
  } catch { return fallback; }
}
function save(key, value) {
  try { localStorage.setItem(key, JSON.stringify(value)); } catch (e) { console.warn("not saved:", e); }
}

let settings = { ...DEFAULT_SETTINGS, ...load(KEYS.settings, {}) };
let conversations = load(KEYS.conversations, []);
let current = conversations.find((c) => c.id === load(KEYS.current, null)) || null;
let apiKey = localStorage.getItem(KEYS.apiKey) || "";
let controller = null; // the AbortController of the answer streaming now

// ---------------------------------------------------------------- the API key, asked for on 401
let keyPrompt = null;
function askForKey() {
  if (!keyPrompt) {
    keyPrompt = new Promise((resolve) => {
      const dialog = $("#api-key-dialog");
      $("#api-key").value = "";
      dialog.addEventListener("close", () => {
        keyPrompt = null;
        const key = $("#api-key").value.trim();
        if (key) { apiKey = key; localStorage.setItem(KEYS.apiKey, key); }
        resolve(Boolean(key));
      }, { once: true });
      dialog.showModal();
    });
  }
  return keyPrompt;
}

async function api(path, options = {}) {
  for (;;) {
    const headers = { ...(options.headers || {}) };
    if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
    const resp = await fetch(path, { ...options, headers });
    if (resp.status !== 401 || !(await askForKey())) return resp;
  }
}

async function errorOf(resp) {
  try {
    const body = await resp.json();
    return body.error?.message || JSON.stringify(body);
  } catch { return `HTTP ${resp.status}`; }
}

// ---------------------------------------------------------------- streaming one answer
// Reads the server-sent events of a chat completion; calls onUpdate(result so far) after each piece of text.
// Returns the answer with its timings and the usage / spec_decode summary of the stream's last chunk.
async function streamAnswer(messages, params, signal, onUpdate) {
  const body = { messages, stream: true, stream_options: { include_usage: true }, return_token_origins: true,
                 temperature: params.temperature, max_tokens: params.max_tokens, seed: params.seed };
  if (!params.speculative) body.speculative_decoding = false;
  const started = performance.now();
  const resp = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal });
  if (!resp.ok) throw new Error(await errorOf(resp));
  const result = { content: "", pieces: [], finish: null, usage: null, spec: null, first: null, last: null, started };
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  const handle = (data) => {
    if (data === "[DONE]") return;
    const event = JSON.parse(data);
    if (event.error) throw new Error(event.error.message);
    if (event.usage) { result.usage = event.usage; result.spec = event.spec_decode || null; }
    const choice = event.choices?.[0];
    if (!choice) return;
    const text = choice.delta?.content || "";
    if (text) {
      const now = performance.now();
      if (result.first === null) result.first = now;
      result.last = now;
      result.content += text;
      const pieces = choice.token_origins || [{ text, origin: "target" }];
      result.pieces.push(...pieces);
      onUpdate(result);
    }
    if (choice.finish_reason) result.finish = choice.finish_reason;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) if (line.startsWith("data:")) handle(line.slice(5).trim());
    }
  }
  return result;
}

function statsOf(result, speculative) {
  const tokens = result.usage?.completion_tokens ?? result.pieces.length;
  const span = (result.last ?? 0) - (result.first ?? 0);
  const counts = {};
  for (const p of result.pieces) counts[p.origin] = (counts[p.origin] || 0) + 1;
  return {
    tokens, speculative,
    ttft_ms: result.first === null ? null : Math.round(result.first - result.started),
    // the decoding rate: tokens after the first one, over the time from the first to the last
    tok_s: tokens > 1 && span > 0 ? (tokens - 1) / (span / 1000) : null,
    drafted: result.spec?.drafted ?? 0, accepted: result.spec?.accepted ?? 0, counts, finish: result.finish,
  };
}

function statsText(s) {
  const parts = [`${s.tokens} tokens`, `${s.tok_s === null ? "–" : s.tok_s.toFixed(1)} tok/s`];
  if (!s.speculative) parts.push("no speculation");
  else if (s.drafted) parts.push(`acceptance ${(100 * s.accepted / s.drafted).toFixed(0)}% ` +
                                 `(${s.accepted} of ${s.drafted} drafted)`);
  else parts.push("acceptance – (nothing drafted)");
  if (s.ttft_ms !== null) parts.push(`first token ${s.ttft_ms} ms`);
  if (s.finish === "length") parts.push("max tokens reached");
  if (s.stopped) parts.push("stopped");
  return parts.join(" · ");
}

// ---------------------------------------------------------------- rendering
// Wraps each token's text inside the rendered Markdown in a span coloured by its origin. The rendered text is
// the source text with Markdown's syntax left out, in order, so each text node is matched forward against it.
function colourTokens(root, pieces) {
  let src = "";
  const unit = [];
  pieces.forEach((p, i) => { src += p.text; for (let j = 0; j < p.text.length; j++) unit.push(i); });
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const nodes = [];
  while (walker.nextNode()) nodes.push(walker.currentNode);
  let pos = 0;
  for (const node of nodes) {
    const text = node.data;
    const frag = document.createDocumentFragment();
    let run = "", runUnit = null;
    const emit = () => {
      if (!run) return;
      if (runUnit === null) frag.append(run);
      else {
        const span = document.createElement("span");
        span.className = `tok o-${pieces[runUnit].origin}`;
        span.title = ORIGIN_NAMES[pieces[runUnit].origin] || pieces[runUnit].origin;
        span.textContent = run;
        frag.append(span);
      }
      run = "";
    };
    for (let i = 0; i < text.length; i++) {
      let k = pos;
      const near = Math.min(src.length, pos + 24);
      while (k < near && src[k] !== text[i]) k++;
      if (k >= near) { // skipped more syntax than a fence or a link's target: find the text further on
        const at = src.indexOf(text.slice(i, i + 6), pos);
        k = at >= 0 && at - pos < 2048 ? at : -1;
      }
      let u = null;
      if (k >= 0 && k < src.length) { u = unit[k]; pos = k + 1; }
      if (u !== runUnit) { emit(); runUnit = u; }
      run += text[i];
    }
    emit();
    node.replaceWith(frag);
  }
}

function renderContent(el, content, pieces) {
  el.innerHTML = renderMarkdown(content);
  if (pieces && pieces.length) colourTokens(el, pieces);
}

function scrollToEnd(force) {
  const box = $("#messages");
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
}

function answerColumn(title) {
  const col = document.createElement("div");
  col.className = "answer";
  col.innerHTML = `<div class="answer-title"></div><div class="content"></div><div class="stats"></div>`;
  col.querySelector(".answer-title").textContent = title;
  return col;
}

function messageElement(message, index) {
  const el = document.createElement("div");
  el.className = `message ${message.role}`;
  if (message.role === "user") { el.textContent = message.content; return el; }
  if (message.role === "error") { el.textContent = message.content; return el; }
  const answers = document.createElement("div");
  answers.className = "answers";
  const spec = answerColumn("with speculative decoding");
  spec.classList.add("speculative");
  answers.append(spec);
  renderContent(spec.querySelector(".content"), message.content, message.pieces);
  const stats = spec.querySelector(".stats");
  if (message.stats) {
    const line = document.createElement("span");
    line.className = "stats-line";
    line.textContent = statsText(message.stats);
    stats.append(line);
    const replay = document.createElement("button");
    replay.type = "button";
    replay.className = "replay";
    replay.textContent = message.replay ? "Replay again without speculation" : "Replay without speculation";
    replay.title = "Send the same message again, decoded without speculation, and compare";
    replay.addEventListener("click", () => replayWithoutSpeculation(index));
    stats.append(replay);
  }
  el.append(answers);
  if (message.replay) {
    answers.classList.add("side-by-side");
    const plain = answerColumn("without speculation");
    plain.classList.add("plain");
    answers.append(plain);
    renderContent(plain.querySelector(".content"), message.replay.content, message.replay.pieces);
    if (message.replay.stats) plain.querySelector(".stats").textContent = statsText(message.replay.stats);
    if (message.replay.stats && message.stats) {
      const compare = document.createElement("div");
      compare.className = "stats compare";
      compare.textContent = compareText(message, message.replay);
      el.append(compare);
    }
  }
  return el;
}

function compareText(spec, plain) {
  const a = spec.stats.tok_s, b = plain.stats.tok_s;
  const speed = a && b ? `speculation: ${(a / b).toFixed(2)}× the speed without it` : "speed: –";
  const same = spec.content === plain.content ? "identical text" : "the texts differ";
  return `${speed} · ${same}`;
}

function renderConversation() {
  const box = $("#messages");
  box.replaceChildren(...(current ? current.messages.map(messageElement) : []));
  renderSidebar();
  scrollToEnd(true);
}

function renderSidebar() {
  const list = $("#conversations");
  list.replaceChildren(...conversations.map((c) => {
    const li = document.createElement("li");
    if (current && c.id === current.id) li.classList.add("current");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    open.title = c.title;
    open.addEventListener("click", () => { if (!controller) { current = c; save(KEYS.current, c.id); renderConversation(); } });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "×";
    del.setAttribute("aria-label", `Delete “${c.title}”`);
    del.addEventListener("click", () => {
      if (controller) return;
      conversations = conversations.filter((x) => x !== c);
      if (current === c) current = null;
      persist();
      renderConversation();
    });
    li.append(open, del);
    return li;
  }));
}

function persist() {
  save(KEYS.conversations, conversations);
  save(KEYS.current, current ? current.id : null);
}

// Renders at most once per frame, however fast the chunks come.
function throttled(fn) {
  let queued = false;
  return () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; fn(); });
  };
}

function setBusy(busy) {
  $("#send").hidden = busy;
  $("#stop").hidden = !busy;
  for (const b of document.querySelectorAll(".replay")) b.disabled = busy;
}

function conversationMessages(upTo) {
  const history = current.messages.slice(0, upTo)
    .filter((m) => m.role === "user" || m.role === "assistant")
    .map((m) => ({ role: m.role, content: m.content }));
  return settings.system.trim() ? [{ role: "system", content: settings.system }, ...history] : history;
}

window.addEventListener("unhandledrejection", (e) => console.error(e.reason));

async function send(text) {
  if (!current) {
    current = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
                title: text.split("\n")[0].slice(0, 60) || "New chat", messages: [] };
    conversations.unshift(current);
  }
  current.messages.push({ role: "user", content: text });
  const params = { temperature: Number(settings.temperature), max_tokens: Number(settings.max_tokens),
                   seed: Math.floor(Math.random() * 2 ** 31), speculative: true };
  const answer = { role: "assistant", content: "", pieces: [], params };
  current.messages.push(answer);
  persist();
  renderConversation();
  const index = current.messages.length - 1;
  const el = $("#messages").lastElementChild;
  await fill(answer, el.querySelector(".answer.speculative"), conversationMessages(index), params, index);
}

// Streams an answer into ``target`` (the message, or its replay) shown in ``column``; saves and redraws.
async function fill(target, column, messages, params, index) {
  const content = column.querySelector(".content");
  const stats = column.querySelector(".stats");
  stats.textContent = "";
  let result = { content: "", pieces: [], first: null, last: null, started: performance.now() };
  let stopped = false;
  const draw = throttled(() => { renderContent(content, result.content, result.pieces); scrollToEnd(false); });
  controller = new AbortController();
  setBusy(true);
  try {
    result = await streamAnswer(messages, params, controller.signal, (r) => { result = r; draw(); });
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else {
      target.content = result.content;
      current.messages.splice(index + 1, 0, { role: "error", content: `Error: ${e.message}` });
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  target.content = result.content;
  target.pieces = result.pieces;
  if (result.first !== null || stopped) {
    target.stats = statsOf(result, params.speculative);
    target.stats.stopped = stopped;
  }
  persist();
  renderConversation();
}

async function replayWithoutSpeculation(index) {
  if (controller) return;
  const message = current.messages[index];
  const params = { ...(message.params || { temperature: settings.temperature, max_tokens: settings.max_tokens,
                                           seed: 0 }), speculative: false };
  message.replay = { content: "", pieces: [] };
  renderConversation();
  const el = $("#messages").children[index];
  await fill(message.replay, el.querySelector(".answer.plain"), conversationMessages(index), params, index);
}

// ---------------------------------------------------------------- controls
function submit() {
  const input = $("#input");
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = "";
  send(text);
}

function applySettings() {
  document.body.classList.toggle("colour", Boolean(settings.colour));
}

function init() {
  $("#composer").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  $("#input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  $("#stop").addEventListener("click", () => controller?.abort());
  $("#new-chat").addEventListener("click", () => {
    if (controller) return;
    current = null;
    persist();
    renderConversation();
    $("#input").focus();
  });
  $("#settings-button").addEventListener("click", () => {
    $("#system-prompt").value = settings.system;
    $("#temperature").value = settings.temperature;
    $("#max-tokens").value = settings.max_tokens;
    $("#colour-tokens").checked = Boolean(settings.colour);
    $("#settings").showModal();
  });
  $("#settings-form").addEventListener("submit", () => {
    const t = Number($("#temperature").value), m = Math.floor(Number($("#max-tokens").value));
    settings = { system: $("#system-prompt").value,
                 temperature: Number.isFinite(t) && t >= 0 ? t : DEFAULT_SETTINGS.temperature,
                 max_tokens: Number.isFinite(m) && m >= 1 ? m : DEFAULT_SETTINGS.max_tokens,
                 colour: $("#colour-tokens").checked };
    save(KEYS.settings, settings);
    applySettings();
  });
  $("#forget-key").addEventListener("click", () => { apiKey = ""; localStorage.removeItem(KEYS.apiKey); });
  applySettings();
  renderConversation();
  api("/v1/models").then(async (resp) => {
    if (resp.ok) $("#model-name").textContent = (await resp.json()).data?.[0]?.id || "";
  }).catch(() => {});
}

init();
