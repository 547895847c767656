"""The playground page at ``GET /``: chat with the served model in a browser.

One self-contained HTML page (inline CSS and JS, no build step, nothing fetched from
another host). It streams ``POST /v1/chat/completions`` with ``fetch`` and a
``ReadableStream`` reader over the server-sent events, with
``stream_options.include_usage``, and shows per answer the time to first token, the
live output tokens/s (content chunks until the usage chunk gives the exact count) and
the prompt tokens read from the KV cache (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>torch_topg playground</title>
<style>
  body { font: 15px/1.45 system-ui, sans-serif; max-width: 50rem; margin: 0 auto; padding: 1rem; }
  header { display: flex; gap: 1rem; align-items: baseline; flex-wrap: wrap; }
  h1 { font-size: 1.2rem; margin: 0; }
  #log { border: 1px solid #ccc; border-radius: 6px; padding: .5rem; min-height: 16rem;
         max-height: 60vh; overflow-y: auto; margin: .75rem 0; }
  .msg { white-space: pre-wrap; overflow-wrap: anywhere; margin: .4rem 0; padding: .4rem .6rem; border-radius: 6px; }
  .user { background: #e8f0fe; } .assistant { background: #f4f4f4; } .error { background: #fde8e8; }
  .stats { font: 12px monospace; color: #555; margin: -.2rem 0 .4rem .6rem; }
  form { display: flex; gap: .5rem; } textarea { flex: 1; font: inherit; }
  label, small { font-size: 13px; color: #444; } input[type=number] { width: 5rem; }
  details { margin: .5rem 0; } #system { width: 100%; }
</style>
</head>
<body>
<header><h1>torch_topg playground</h1><small id="model">model: ...</small></header>
<details><summary><label>settings</label></summary>
  <p><label>system prompt<br><textarea id="system" rows="2"></textarea></label></p>
  <p><label>max tokens <input id="max_tokens" type="number" value="256" min="1"></label>
     <label>temperature <input id="temperature" type="number" value="0.7" min="0" step="0.1"></label>
     <label>API key <input id="key" type="password" placeholder="if --api-key"></label>
     <button type="button" id="clear">clear chat</button></p>
</details>
<div id="log"></div>
<form id="form">
  <textarea id="input" rows="3" placeholder="Message (Enter sends, Shift+Enter: new line)"></textarea>
  <div><button id="send">Send</button><br><button type="button" id="stop" disabled>Stop</button></div>
</form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const CHAT = "/v1/chat/completions";
let history = [];   // [{role, content}] of the finished turns
let model = null;   // from /v1/models
let abort = null;   // AbortController of the answer being streamed

function headers() {
  const h = {"Content-Type": "application/json"};
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

function add(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.textContent = text;
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    const body = await r.json();
    model = body.data[0].id;
    $("model").textContent = "model: " + model;
  } catch (e) { $("model").textContent = "model: unknown (" + e + ")"; }
}

function statsLine(s) {
  // decode rate after the first token; chunks read together say nothing below ~20 ms
  const span = s.last - s.first;
  const rate = s.first && span >= 20 ? (s.tokens - 1) / (span / 1000) : null;
  const parts = [
    "TTFT " + (s.first ? (s.first - s.start).toFixed(0) + " ms" : "-"),
    s.tokens + " tokens" + (s.exact ? "" : " (chunks)"),
    (rate ? rate.toFixed(1) : "-") + " tokens/s",
  ];
  if (s.prompt !== null) parts.push("prompt " + s.prompt + ", cached " + (s.cached ?? 0));
  return parts.join("  \\u00b7  ");
}

async function send(text) {
  const messages = [];
  if ($("system").value.trim()) messages.push({role: "system", content: $("system").value});
  messages.push(...history, {role: "user", content: text});
  add("user", text);
  const out = add("assistant", "");
  const stats = document.createElement("div");
  stats.className = "stats";
  $("log").appendChild(stats);
  const s = {start: performance.now(), first: 0, last: 0, tokens: 0, exact: false, prompt: null, cached: null};
  const body = {messages, stream: true, stream_options: {include_usage: true},
                max_tokens: Number($("max_tokens").value), temperature: Number($("temperature").value)};
  if (model) body.model = model;
  abort = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  let answer = "";
  try {
    const r = await fetch(CHAT, {method: "POST", headers: headers(), body: JSON.stringify(body),
                                 signal: abort.signal});
    if (!r.ok) throw new Error((await r.json()).error?.message || r.statusText);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      buf += decoder.decode(value, {stream: true});
      const lines = buf.split("\\n");
      buf = lines.pop();  // an incomplete line waits for the next read
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices?.[0]?.delta?.content;
        if (delta) {
          const t = performance.now();
          if (!s.first) s.first = t;
          s.last = t; s.tokens += 1;
          answer += delta; out.textContent = answer;
        }
        if (chunk.usage) {
          s.tokens = chunk.usage.completion_tokens; s.exact = true;
          s.prompt = chunk.usage.prompt_tokens;
          s.cached = chunk.usage.prompt_tokens_details?.cached_tokens ?? null;
        }
        stats.textContent = statsLine(s);
        $("log").scrollTop = $("log").scrollHeight;
      }
    }
    history.push({role: "user", content: text}, {role: "assistant", content: answer});
  } catch (e) {
    if (e.name === "AbortError") {  // Stop: keep what came so far
      history.push({role: "user", content: text}, {role: "assistant", content: answer});
      stats.textContent = statsLine(s) + "  \\u00b7  stopped";
    } else {
      out.className = "msg error";
      out.textContent = (answer ? answer + "\\n" : "") + "error: " + e.message;
    }
  } finally {
    abort = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || abort) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => abort && abort.abort());
$("clear").addEventListener("click", () => { history = []; $("log").textContent = ""; });
loadModel();
</script>
</body>
</html>
"""
