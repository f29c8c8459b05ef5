// waferscale playground: one page, no build step, talks to this server's OpenAI-compatible API.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], busy: false };

function apiKey() { return $("api-key").value.trim(); }
function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

// ---- settings -> request ------------------------------------------------------------------------------------
function requestBody(messages) {
  const system = $("system").value, seed = $("seed").value.trim(), stop = $("stop").value;
  const body = { model: $("model").value,
                 messages: system.trim() ? [{ role: "system", content: system }, ...messages] : [...messages],
                 temperature: parseFloat($("temperature").value),
                 max_completion_tokens: parseInt($("max-tokens").value, 10) || 256,
                 top_p: parseFloat($("top-p").value) };
  if (seed !== "") body.seed = parseInt(seed, 10);
  if (stop !== "") body.stop = stop;
  if ($("json-mode").checked) body.response_format = { type: "json_object" };
  if ($("stream").checked) { body.stream = true; body.stream_options = { include_usage: true }; }
  return body;
}

// ---- "View code" --------------------------------------------------------------------------------------------
function pyValue(v, indent) {
  const pad = " ".repeat(indent);
  if (v === null) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (typeof v === "string") return JSON.stringify(v);
  if (typeof v === "number") return String(v);
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return "[\n" + v.map((x) => pad + "    " + pyValue(x, indent + 4)).join(",\n") + ",\n" + pad + "]";
  }
  const keys = Object.keys(v);
  if (!keys.length) return "{}";
  return "{" + keys.map((k) => JSON.stringify(k) + ": " + pyValue(v[k], indent)).join(", ") + "}";
}

function pythonCode(body) {
  const base = location.origin + "/v1";
  const lines = ["from openai import OpenAI", "",
    `client = OpenAI(base_url=${JSON.stringify(base)}, api_key=${apiKey() ? JSON.stringify(apiKey()) : '"not-needed"'})`, "",
    (body.stream ? "stream = " : "completion = ") + "client.chat.completions.create("];
  for (const [k, v] of Object.entries(body)) lines.push(`    ${k}=${pyValue(v, 4)},`);
  lines.push(")");
  if (body.stream) {
    lines.push("for chunk in stream:", "    if chunk.choices and chunk.choices[0].delta.content:",
               '        print(chunk.choices[0].delta.content, end="", flush=True)');
  } else {
    lines.push("print(completion.choices[0].message.content)");
  }
  return lines.join("\n");
}

function curlCode(body) {
  const json = JSON.stringify(body, null, 2).replace(/'/g, "'\\''");
  const auth = apiKey() ? ` \\\n  -H "Authorization: Bearer ${apiKey()}"` : "";
  return `curl ${body.stream ? "-N " : ""}${location.origin}/v1/chat/completions \\\n` +
         `  -H "Content-Type: application/json"${auth} \\\n  -d '${json}'`;
}

function showCode(tab) {
  const draft = $("prompt").value.trim() || "Hello!";
  const body = requestBody([...state.messages, { role: "user", content: draft }]);
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t.dataset.tab === tab));
  $("code").textContent = tab === "curl" ? curlCode(body) : pythonCode(body);
  $("code-dialog").dataset.tab = tab;
}

// ---- chat UI ------------------------------------------------------------------------------------------------
function addMessage(role, text) {
  $("empty")?.remove();
  const el = document.createElement("div");
  el.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : $("model").value || "assistant";
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  el.append(who, body);
  $("messages").append(el);
  $("messages").scrollTop = $("messages").scrollHeight;
  return el;
}

function setBadge(el, cls, text, title) {
  let b = el.querySelector(".badges");
  if (!b) { b = document.createElement("div"); b.className = "badges"; el.append(b); }
  let x = b.querySelector("." + cls);
  if (!x) {
    x = document.createElement("span");
    x.className = "badge " + cls;
    const proj = b.querySelector(".proj");  // the projection badge stays last
    if (proj && cls !== "proj") b.insertBefore(x, proj); else b.append(x);
  }
  x.textContent = text;
  if (title) x.title = title;
}

function fmtTime(s) { return s < 1 ? (s * 1000).toFixed(s < 0.01 ? 2 : 0) + " ms" : s.toFixed(2) + " s"; }
function fmtRate(r) { return r >= 100 ? Math.round(r).toLocaleString() : r.toFixed(1); }

function showProjection(el, p) {
  if (!p) return;
  setBadge(el, "proj", `projection on ${p.systems} x ${p.target}: ${fmtRate(p.decode_tokens_per_s_per_user)} tokens/s` +
           ` \u00b7 TTFT ${fmtTime(p.time_to_first_token_s)}` +
           (p.total_time_s != null ? ` \u00b7 total ${fmtTime(p.total_time_s)}` : ""),
           p.note || "projection from the compiler's cost model, not a measurement");
}

function setStats(el, rate, ttftS, tokens) {
  setBadge(el, "speed", `${fmtRate(rate)} tokens/s`);
  setBadge(el, "ttft", `TTFT ${fmtTime(ttftS)}`);
  setBadge(el, "count", `${tokens} token${tokens === 1 ? "" : "s"}`);
}

function finishStats(el, usage, timeInfo, t0, tFirst, tLast, nChunks) {
  const tokens = usage ? usage.completion_tokens : nChunks;
  const decodeS = tFirst && tLast > tFirst ? (tLast - tFirst) / 1000 : 0;
  // tokens after the first, over the time after the first: the decode speed the badge shows live
  const rate = decodeS > 0 && tokens > 1 ? (tokens - 1) / decodeS
             : timeInfo && timeInfo.completion_time > 0 ? tokens / timeInfo.completion_time : 0;
  setStats(el, rate, ((tFirst || performance.now()) - t0) / 1000, tokens);
}

async function send(text) {
  if (state.busy || !text.trim()) return;
  state.busy = true;
  $("send").disabled = true;
  state.messages.push({ role: "user", content: text });
  const body = requestBody(state.messages);
  addMessage("user", text);
  const el = addMessage("assistant", "");
  const bodyEl = el.querySelector(".body");
  const t0 = performance.now();
  let tFirst = null, tLast = null, n = 0, answer = "";
  try {
    const resp = await fetch("/v1/chat/completions",
                             { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({ error: { message: resp.statusText } }));
      if (resp.status === 401) $("key-wrap").classList.remove("hidden");
      throw new Error(`${resp.status}: ${err.error ? err.error.message : resp.statusText}`);
    }
    if (!body.stream) {
      const data = await resp.json();
      answer = data.choices[0].message.content || JSON.stringify(data.choices[0].message.tool_calls || "");
      bodyEl.textContent = answer;
      const ti = data.time_info || {}, tokens = data.usage.completion_tokens;
      setStats(el, ti.completion_time > 0 ? tokens / ti.completion_time : 0,
               (ti.queue_time || 0) + (ti.prompt_time || 0), tokens);
      showProjection(el, data.wafer_projection);
    } else {
      const reader = resp.body.getReader();
      const dec = new TextDecoder();
      let buf = "", usage = null, timeInfo = null;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const line = buf.slice(0, cut).trim();
          buf = buf.slice(cut + 2);
          if (!line.startsWith("data:")) continue;
          const payload = line.slice(5).trim();
          if (payload === "[DONE]") continue;
          const chunk = JSON.parse(payload);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          if (chunk.time_info) timeInfo = chunk.time_info;
          if (chunk.wafer_projection) showProjection(el, chunk.wafer_projection);
          const c = chunk.choices && chunk.choices[0];
          const piece = c && c.delta && c.delta.content;
          if (piece) {
            const now = performance.now();
            if (tFirst === null) tFirst = now;
            tLast = now;
            n += 1;
            answer += piece;
            bodyEl.textContent = answer;
            const el_s = (now - tFirst) / 1000;
            setBadge(el, "speed", `${el_s > 0 ? fmtRate((n - 1) / el_s) : "\u2026"} tokens/s`);
            $("messages").scrollTop = $("messages").scrollHeight;
          }
        }
      }
      finishStats(el, usage, timeInfo, t0, tFirst, tLast, n);
    }
    state.messages.push({ role: "assistant", content: answer });
  } catch (e) {
    el.classList.add("error");
    bodyEl.textContent = String(e.message || e);
    state.messages.pop();
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

// ---- models and the projection card -------------------------------------------------------------------------
async function loadModels() {
  const resp = await fetch("/v1/models", { headers: headers() });
  if (resp.status === 401) { $("key-wrap").classList.remove("hidden"); return; }
  const data = await resp.json();
  $("model").innerHTML = "";
  for (const m of data.data) {
    const o = document.createElement("option");
    o.value = o.textContent = m.id;
    $("model").append(o);
  }
  await loadModelInfo();
}

async function loadModelInfo() {
  const id = $("model").value;
  if (!id) return;
  const resp = await fetch("/v1/models/" + encodeURIComponent(id), { headers: headers() });
  if (!resp.ok) return;
  const p = (await resp.json()).wafer_projection;
  if (!p) { $("projection-card").classList.add("hidden"); return; }
  const a = p.assumptions || {};
  const kv = (k, v) => `<div class="kv"><span>${k}</span><b>${v}</b></div>`;
  $("projection-body").innerHTML =
    kv("target", `${p.systems} x ${p.target}`) + kv("strategy", p.strategy.replace(/_/g, " ")) +
    kv("decode / user", `${fmtRate(p.decode_tokens_per_s_per_user)} tokens/s`) +
    kv("time to first token", fmtTime(p.time_to_first_token_s)) +
    kv("aggregate", `${fmtRate(p.aggregate_decode_tokens_per_s)} tokens/s`) +
    kv("users at full speed", p.users_at_full_speed) +
    kv("clock", a.clock_hz ? (a.clock_hz / 1e9).toFixed(2) + " GHz" : "?") +
    `<div class="note">A projection from the compiler's cost model for this model on the target, not a ` +
    `measurement. Assumptions: GET /v1/models/${id}.</div>`;
  $("projection-card").classList.remove("hidden");
}

// ---- wiring -------------------------------------------------------------------------------------------------
function init() {
  for (const id of ["temperature", "top-p"]) {
    const sync = () => { $(id + "-v").textContent = $(id).value; };
    $(id).addEventListener("input", sync);
    sync();
  }
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("messages").innerHTML = '<div class="empty" id="empty">Conversation cleared.</div>';
  });
  $("view-code").addEventListener("click", () => { showCode("python"); $("code-dialog").showModal(); });
  document.querySelectorAll(".tab").forEach((t) => t.addEventListener("click", () => showCode(t.dataset.tab)));
  $("close-code").addEventListener("click", () => $("code-dialog").close());
  $("copy-code").addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText($("code").textContent));
  $("model").addEventListener("change", loadModelInfo);
  $("api-key").addEventListener("change", loadModels);
  loadModels().catch((e) => console.error(e));
}

init();
