// waferscale appliance dashboard: one page, no build step, reads the service's /api with the token it is given.
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "waferscale.appliance.token", ALL_KEY = "waferscale.appliance.show_all";
const REFRESH_MS = 2000;
const ACTIVE = new Set(["QUEUED", "RUNNING"]);
const SVG = "http://www.w3.org/2000/svg";
// gen: bumped by every refresh, so the answers of an older one (a token since replaced) are dropped
const state = { token: localStorage.getItem(TOKEN_KEY) || "", selected: decodeURIComponent(location.hash.slice(1)),
                showAll: localStorage.getItem(ALL_KEY) === "1", jobs: [], rows: [], gen: 0, timer: null, armed: null };

// an element with attributes and children (strings become text: nothing a user wrote is parsed as HTML)
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  e.append(...children.filter((c) => c !== null && c !== undefined));
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---- the API ------------------------------------------------------------------------------------------------
class APIError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, method = "GET") {
  let resp;
  try {
    resp = await fetch(path, { method, headers: { Authorization: "Bearer " + state.token } });
  } catch (e) {
    throw new APIError(0, `cannot reach the appliance at ${location.origin} (${e.message}); retrying`);
  }
  const body = await resp.json().catch(() => null);
  if (!resp.ok) {
    const msg = body && body.error ? body.error.message : `${resp.status} ${resp.statusText}`;
    throw new APIError(resp.status, resp.status === 401 ? "token refused: " + msg : msg);
  }
  return body;
}

// ---- formatting ---------------------------------------------------------------------------------------------
function clock(t) {
  if (!t) return "";
  const d = new Date(t * 1000), now = new Date();
  const hms = d.toLocaleTimeString([], { hour12: false });
  return d.toDateString() === now.toDateString() ? hms : d.toLocaleDateString() + " " + hms;
}
function span(s) {
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}
// how long the job has waited, has run, or ran
function took(j) {
  const now = Date.now() / 1000;
  if (j.state === "QUEUED") return "waiting " + span(now - j.submitted_at);
  if (!j.started_at) return "";
  return span((j.ended_at || now) - j.started_at) + (j.state === "RUNNING" ? " so far" : "");
}
function labels(j) {
  return Object.entries(j.labels || {}).map(([k, v]) => el("span", { class: "label" }, `${k}=${v}`));
}
function stateBadge(s) { return el("span", { class: "state " + s }, s); }
function byQueueOrder(a, b) { return a.priority.localeCompare(b.priority) || a.seq - b.seq; }
function what(j) {
  const s = j.spec || {};
  if (j.kind === "run") {
    const flags = Object.entries(s.flags || {}).filter(([, v]) => v !== null).map(([k, v]) => ` --${k} ${v}`);
    return `wsc run --params ${s.params_name} --mode ${s.mode}${flags.join("")}`;
  }
  if (j.kind === "script") return `python ${s.script} ${(s.args || []).join(" ")}`.trim();
  return `wsc serve --model ${s.model}`;
}

// ---- rendering ----------------------------------------------------------------------------------------------
function showError(msg) {
  $("error").textContent = msg || "";
  $("error").classList.toggle("hidden", !msg);
}

function renderWho(me) {
  $("whoami").textContent = me ? me.user + (me.admin ? " (admin: every user's jobs)" : "") +
                                 (me.quota ? ` · quota ${me.quota}` : "") : "";
  $("whoami").classList.toggle("hidden", !me);
}

function renderPool(pool) {
  const box = $("systems");
  box.replaceChildren();
  if (!pool) { $("pool-summary").textContent = ""; return; }
  $("pool-summary").textContent = `${pool.systems} systems · ${pool.free} free · ${pool.running} running · ` +
                                  `${pool.queued} queued`;
  const known = new Map(state.jobs.map((j) => [j.id, j]));
  for (let s = 0; s < pool.systems; s++) {
    const jid = pool.used[String(s)], j = known.get(jid);
    box.append(el("div", { class: "system " + (jid ? "used" : "free"), "data-system": s,
                           onclick: () => jid && j && select(jid) },
                  el("div", { class: "name" }, "system " + s),
                  el("div", { class: "what mono" }, jid || "free"),
                  jid ? el("div", { class: "who" },
                           j ? `${j.user} · ${j.priority} · ${took(j)}` : "another user's job") : null));
  }
}

function renderQueue(pool) {
  const queued = state.jobs.filter((j) => j.state === "QUEUED").sort(byQueueOrder);
  const hidden = pool ? pool.queued - queued.length : 0;
  $("queue-summary").textContent = queued.length || hidden ? `${pool.queued} waiting` +
    (hidden > 0 ? ` (${hidden} of other users, not shown)` : "") : "";
  $("queue").replaceChildren(...queued.map((j, i) => el("li", { "data-job": j.id, onclick: () => select(j.id) },
    el("span", { class: "pos" }, `#${i + 1}`),
    el("span", {}, el("span", { class: "mono" }, j.id), " ", el("span", { class: "dim" },
       `${j.user} · ${j.priority} · ${j.num_csx} system${j.num_csx > 1 ? "s" : ""} · ${took(j)}`)),
    el("span", {}, ...labels(j)),
    el("span", { class: "reason" }, j.reason))));
  if (!queued.length) $("queue").append(el("li", { class: "empty" }, hidden > 0 ? "None of yours is waiting." :
                                                                   "Nothing is waiting."));
}

function renderJobs() {
  const tbody = $("jobs").querySelector("tbody");
  tbody.replaceChildren(...state.jobs.map((j) => el("tr",
    { "data-job": j.id, class: j.id === state.selected ? "selected" : "", onclick: () => select(j.id) },
    el("td", { class: "id", title: what(j) }, j.id, el("div", { class: "dim" }, `${j.kind} · ${j.user}`)),
    el("td", {}, stateBadge(j.state)),
    el("td", {}, j.priority),
    el("td", {}, String(j.num_csx), j.systems && j.systems.length ? el("div", { class: "dim" }, "on " +
       j.systems.join(", ")) : null),
    el("td", { class: "labels" }, ...labels(j)),
    el("td", {}, clock(j.submitted_at)),
    el("td", {}, clock(j.started_at), el("div", { class: "dim" }, took(j))),
    el("td", { class: "reason" }, j.reason))));
  $("jobs").classList.toggle("hidden", !state.jobs.length);
  $("jobs-empty").textContent = state.showAll ? "No jobs yet." : "No queued or running jobs.";
  $("jobs-empty").classList.toggle("hidden", state.jobs.length > 0);
}

function renderDetail(j, rows) {
  $("detail-empty").classList.toggle("hidden", !!j);
  $("detail-body").classList.toggle("hidden", !j);
  if (!j) return;
  $("d-id").textContent = j.id;
  $("d-state").replaceWith(Object.assign(stateBadge(j.state), { id: "d-state" }));
  $("d-reason").textContent = j.reason + (j.cancel_at && ACTIVE.has(j.state) ? " · cancel requested" : "");
  const facts = [["user", j.user], ["kind", j.kind], ["command", what(j)], ["priority", j.priority],
                 ["systems", `${j.num_csx} asked` + (j.systems && j.systems.length ? `, on ${j.systems.join(", ")}`
                                                                                    : "")],
                 ["attempts", String(j.attempts)], ["submitted", clock(j.submitted_at)],
                 ["started", clock(j.started_at) || "not yet"], ["ended", j.ended_at ? clock(j.ended_at) +
                  (j.exit_code !== null ? ` (exit code ${j.exit_code})` : "") : "not yet"]];
  const lab = labels(j);
  if (lab.length) facts.push(["labels", ...lab]);
  $("d-facts").replaceChildren(...facts.flatMap(([k, ...v]) => [el("span", { class: "k" }, k),
                                                                el("span", { class: "v" }, ...v)]));
  const cancel = $("cancel");
  cancel.classList.toggle("hidden", !ACTIVE.has(j.state));
  cancel.disabled = !!j.cancel_at;
  if (j.cancel_at) { cancel.textContent = "Cancelling\u2026"; cancel.classList.remove("armed"); }
  else if (state.armed !== j.id) { cancel.textContent = "Cancel job"; cancel.classList.remove("armed"); }
  const log = $("log"), atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = j.log_tail.length ? j.log_tail.join("\n") : "(no output yet)";
  if (atEnd) log.scrollTop = log.scrollHeight;  // follow the tail unless the reader scrolled up
  $("events").replaceChildren(...j.events.map((e) => el("li", {}, el("span", { class: "t" }, clock(e.at)),
    el("span", {}, stateBadge(e.state)), el("span", {}, e.reason))));
  drawLoss(rows);
}

// the loss by step: a polyline in an SVG sized to its box, with a few round ticks on each axis
function drawLoss(rows) {
  state.rows = rows;
  const chart = $("loss"), byStep = new Map();
  for (const r of rows) if (Number.isFinite(r.step) && Number.isFinite(r.loss)) byStep.set(r.step, r.loss);
  const pts = [...byStep.entries()].sort((a, b) => a[0] - b[0]);  // (a resumed run repeats steps: the last wins)
  const W = chart.clientWidth || 480, H = chart.clientHeight || 220, m = { l: 50, r: 16, t: 14, b: 26 };
  chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
  chart.replaceChildren();
  chart.dataset.points = pts.length;
  const last = pts[pts.length - 1];
  $("loss-last").textContent = last ? `step ${last[0]} · ${last[1].toFixed(4)}` : "";
  if (!pts.length) {
    chart.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "note" },
                     "no metrics yet: a run writes a row each logged step"));
    return;
  }
  let [x0, x1] = extent(pts.map((p) => p[0])), [y0, y1] = extent(pts.map((p) => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  const pad = (y1 - y0) * 0.05 || Math.abs(y0) * 0.05 || 1;
  y0 -= pad; y1 += pad;
  const X = (x) => m.l + (x - x0) / (x1 - x0) * (W - m.l - m.r);
  const Y = (y) => H - m.b - (y - y0) / (y1 - y0) * (H - m.t - m.b);
  for (const t of ticks(y0, y1, 4)) {
    chart.append(svg("line", { x1: m.l, x2: W - m.r, y1: Y(t), y2: Y(t), class: "grid" }),
                 svg("text", { x: m.l - 6, y: Y(t) + 4, "text-anchor": "end", class: "axis" }, fmt(t)));
  }
  for (const t of ticks(x0, x1, 6).filter(Number.isInteger)) {
    chart.append(svg("text", { x: X(t), y: H - 8, "text-anchor": "middle", class: "axis" }, String(t)));
  }
  const line = pts.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ");
  chart.append(svg("polyline", { class: "line", points: line }),
               svg("circle", { cx: X(last[0]), cy: Y(last[1]), r: 3.5, class: "dot" }));
}
function extent(v) { return v.reduce(([lo, hi], x) => [Math.min(lo, x), Math.max(hi, x)], [Infinity, -Infinity]); }
function ticks(lo, hi, n) {
  const raw = (hi - lo) / n, p = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((k) => k * p).find((s) => s >= raw);
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
  return out;
}
function fmt(v) { return Math.abs(v) >= 100 ? v.toFixed(0) : +v.toPrecision(3) + ""; }

// ---- refresh ------------------------------------------------------------------------------------------------
// signed out (no token, or a refused one): only the token box and the error
function clearViews() {
  document.body.classList.add("signed-out");
  state.jobs = [];
  renderWho(null); renderPool(null); renderQueue(null); renderJobs(); renderDetail(null, []);
}

async function refresh() {
  const gen = ++state.gen;
  clearTimeout(state.timer);
  if (!state.token) {
    clearViews();
    showError("No token: paste one above. `wsc appliance token create USER --out FILE` makes one; the admin's " +
              "is in the service's STATE_DIR/admin.token.");
    return;
  }
  try {
    const sel = state.selected;
    const [me, pool, jobs, job, metrics] = await Promise.all([
      api("/api/whoami"), api("/api/pool"), api("/api/jobs" + (state.showAll ? "?all=true" : "")),
      sel ? api(`/api/jobs/${encodeURIComponent(sel)}`).catch(lostJob) : null,
      sel ? api(`/api/jobs/${encodeURIComponent(sel)}/metrics`).catch(lostJob) : null]);
    if (gen !== state.gen) return;
    document.body.classList.remove("signed-out");
    state.jobs = jobs.data;
    if (!sel && state.jobs.length) {  // show something at once: the first running job, else the first
      select((state.jobs.find((j) => j.state === "RUNNING") || state.jobs[0]).id);
      return;
    }
    renderWho(me); renderPool(pool); renderQueue(pool); renderJobs();
    renderDetail(job, metrics ? metrics.data : []);
    showError(job === null && sel ? `job ${sel}: ${state.lost}` : null);
    $("updated").textContent = "updated " + clock(Date.now() / 1000);
  } catch (e) {
    if (gen !== state.gen) return;
    showError(e.message);
    if (e.status === 401) { clearViews(); return; }  // no use asking again until the token changes
  }
  state.timer = setTimeout(refresh, REFRESH_MS);
}

// a selected job that is gone or not this user's: unselect it and say why
function lostJob(e) {
  if (e.status !== 403 && e.status !== 404) throw e;
  state.lost = e.message;
  state.selected = "";
  history.replaceState(null, "", location.pathname);
  return null;
}

function select(id) {
  state.selected = id;
  state.armed = null;
  history.replaceState(null, "", "#" + encodeURIComponent(id));
  refresh();
}

// two clicks: the first arms the button for a few seconds, the second asks the service to cancel
async function cancelSelected() {
  const id = state.selected;
  if (state.armed !== id) {
    state.armed = id;
    $("cancel").textContent = "Click again to cancel";
    $("cancel").classList.add("armed");
    setTimeout(() => {
      if (state.armed !== id) return;
      state.armed = null;
      $("cancel").textContent = "Cancel job";
      $("cancel").classList.remove("armed");
    }, 4000);
    return;
  }
  state.armed = null;
  try {
    await api(`/api/jobs/${encodeURIComponent(id)}/cancel`, "POST");
  } catch (e) {
    showError(`cancel ${id}: ${e.message}`);
    return;
  }
  refresh();
}

function init() {
  $("token").value = state.token;
  $("show-all").checked = state.showAll;
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.token = $("token").value.trim();
    localStorage.setItem(TOKEN_KEY, state.token);
    state.selected = "";
    history.replaceState(null, "", location.pathname);
    refresh();
  });
  $("forget").addEventListener("click", () => {
    localStorage.removeItem(TOKEN_KEY);
    state.token = $("token").value = "";
    refresh();
  });
  $("show-all").addEventListener("change", () => {
    state.showAll = $("show-all").checked;
    localStorage.setItem(ALL_KEY, state.showAll ? "1" : "0");
    refresh();
  });
  $("cancel").addEventListener("click", cancelSelected);
  window.addEventListener("resize", () => drawLoss(state.rows));
  refresh();
}

init();
