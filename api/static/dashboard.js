// The routeledger dashboard: reads the guarded /v1 endpoints of the API that served it, and
// follows GET /v1/dashboard/stream for live updates. Nothing is fetched from anywhere else.
//
// The stream is read with fetch() rather than EventSource, because EventSource cannot send the
// Authorization header, and a key in a URL leaks into logs and history.

const KEY_STORE = "routeledger.apiKey";
const SAMPLE_WINDOW_MS = 30 * 60 * 1000;
const MAX_POINTS_PER_SERIES = 400;
const PREVIEW_EVERY_MS = 5000;
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"];

const state = {
  overview: null,
  samples: [], // [at_ms, worker, digest, tok_s, bench]
  names: {}, // digest -> model name
  lastId: null,
  selected: null, // worker id whose rows are shown
  openTask: null,
  previewAt: 0,
};

// -- small helpers ---------------------------------------------------------------------------------

const $ = (sel) => document.querySelector(sel);

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) el.setAttribute(k, String(v));
  for (const c of children.flat()) if (c) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

const clock = (ms) => (ms ? new Date(ms).toLocaleTimeString([], { hour12: false }) : "–");

function ago(ms) {
  if (!ms) return "";
  let s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  s %= 60;
  if (m < 60) return `${m}m ${s}s`;
  return `${Math.floor(m / 60)}h ${m % 60}m`;
}

const num = (v, digits = 1) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const short = (id) => (id ? id.slice(0, 8) : "–");
const modelName = (digest) => state.names[digest] || (digest ? digest.slice(0, 12) : "?");

function fill(tbody, rows, columns, emptyText) {
  tbody.replaceChildren(
    ...(rows.length ? rows : [h("tr", {}, h("td", { colspan: columns, class: "empty" }, emptyText))]),
  );
}

// -- the API, with the key asked for once ------------------------------------------------------------

let keyPrompt = null;

function askKey(message) {
  if (keyPrompt) return keyPrompt;
  const dialog = $("#key-dialog");
  $("#key-error").textContent = message || "";
  keyPrompt = new Promise((resolve) => {
    $("#key-form").onsubmit = (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY_STORE, $("#key-input").value.trim());
      dialog.close();
      keyPrompt = null;
      $("#forget-key").hidden = false;
      resolve();
    };
  });
  dialog.showModal();
  $("#key-input").focus();
  return keyPrompt;
}

async function api(path, options = {}) {
  for (;;) {
    const key = sessionStorage.getItem(KEY_STORE);
    const headers = { Accept: "application/json", ...(options.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    const res = await fetch(path, { ...options, headers });
    if (res.status !== 401) return res;
    await askKey(key ? "That key was refused; try another." : "");
  }
}

async function getJSON(path) {
  const res = await api(path);
  const body = await res.json();
  if (!res.ok) throw new Error(body?.error?.message || `${res.status} ${res.statusText}`);
  return body;
}

// -- the fleet ------------------------------------------------------------------------------------------

function renderFleet() {
  const o = state.overview;
  const rows = o.workers.map((w) => {
    const busy = w.busy ?? 0;
    const slots = w.slots ?? 0;
    const bar = h("span", { class: "bar" }, h("span"));
    bar.firstChild.style.width = `${slots ? Math.min(100, (100 * busy) / slots) : 0}%`;
    const models = w.models.length
      ? w.models.map((m) =>
          h("span", { class: `model${m.serving ? "" : " idle"}`, title: m.serving ? m.digest : `${m.digest} (held, not served)` },
            m.loaded ? h("span", { class: "dot" }, "● ") : "", m.name),
        )
      : h("span", { class: "muted" }, "none");
    return h(
      "tr",
      {
        class: `clickable${state.selected === w.id ? " selected" : ""}`,
        dataset: { worker: w.id },
        on: { click: () => selectWorker(w.id) },
      },
      h("td", {}, h("b", {}, w.id)),
      h("td", {}, h("span", { class: `status ${w.status}` }, w.status), " since ", clock(w.since), h("span", { class: "muted" }, ` (${ago(w.since)})`)),
      h("td", { class: "slots" }, bar, `${w.busy ?? "?"} / ${w.slots ?? "?"}`, slotTasks(w)),
      h("td", {}, models),
      h("td", { class: "muted" }, w.lease_age_s === null ? "expired" : `renewed ${num(w.lease_age_s)}s ago`),
      h("td", { class: "muted" }, machine(w.resources)),
    );
  });
  fill($("#fleet tbody"), rows, 6, "no worker has ever registered");
  renderWorkerDetail();
}

// Each busy slot names its task, as the task rows do (the same short id); a click opens it there.
function slotTasks(w) {
  if (!w.running.length) return "";
  return h("span", { class: "slot-tasks" }, w.running.map((r) =>
    h("span", {
      class: `slot-task mono${r.background ? " muted" : ""}`,
      dataset: { task: r.task_id },
      title: `${r.task_id} · ${r.model}${r.background ? " (a benchmark)" : ""}, running for ${ago(r.started_at)}`,
      on: { click: (ev) => { ev.stopPropagation(); showTask(r.task_id); } },
    }, r.background ? `bench ${short(r.task_id)}` : short(r.task_id)),
  ));
}

// Opens a task's breakdown and brings its row into view (a slot's task may be filtered out).
function showTask(id) {
  if (state.selected && !state.overview.tasks.some((t) => t.task_id === id && (t.worker === state.selected || t.expected_worker === state.selected))) {
    state.selected = null;
    renderFleet();
    drawChart();
  }
  if (state.openTask !== id) openTask(id);
  document.querySelector(`#tasks tr[data-task="${CSS.escape(id)}"]`)?.scrollIntoView({ block: "center" });
}

// What a worker could read of its machine (its lease's while it is live); "-" when nothing.
function machine(r) {
  if (!r) return "-";
  const gib = (v) => (v == null ? "?" : (v / 2 ** 30).toFixed(1));
  const parts = [];
  if (r.cpu_percent != null) parts.push(`cpu ${Math.round(r.cpu_percent)}%`);
  if (r.mem_total_bytes != null) parts.push(`mem ${gib(r.mem_used_bytes)}/${gib(r.mem_total_bytes)} GiB`);
  if (r.gpu_percent != null) parts.push(`gpu ${Math.round(r.gpu_percent)}%`);
  if (r.vram_total_bytes != null) parts.push(`vram ${gib(r.vram_used_bytes)}/${gib(r.vram_total_bytes)} GiB`);
  return parts.length ? parts.join(" · ") : "-";
}

function selectWorker(id) {
  state.selected = state.selected === id ? null : id;
  renderFleet();
  renderTasks();
  drawChart();
}

function renderWorkerDetail() {
  const box = $("#worker-detail");
  const w = state.overview?.workers.find((x) => x.id === state.selected);
  if (!w) {
    box.hidden = true;
    box.replaceChildren();
    return;
  }
  const bySeries = new Map();
  for (const s of state.samples) {
    if (s[1] !== w.id) continue;
    const e = bySeries.get(s[2]) || { n: 0, sum: 0, last: null, at: 0 };
    e.n += 1;
    e.sum += s[3];
    if (s[0] >= e.at) [e.last, e.at] = [s[3], s[0]];
    bySeries.set(s[2], e);
  }
  const speedRows = [...bySeries.entries()].map(([digest, e]) =>
    h("tr", { dataset: { model: modelName(digest) } }, h("td", {}, modelName(digest)), h("td", { class: "num" }, num(e.last)),
      h("td", { class: "num" }, num(e.sum / e.n)), h("td", { class: "num" }, e.n), h("td", { class: "muted" }, `${clock(e.at)} (${ago(e.at)} ago)`)),
  );
  const running = w.running.length
    ? w.running.map((r) => `${short(r.task_id)} ${r.model} (for ${ago(r.started_at)})`).join(", ")
    : "nothing";
  const table = h("table", { class: "worker-speed" },
    h("thead", {}, h("tr", {}, h("th", {}, "model"), h("th", { class: "num" }, "last tok/s"), h("th", { class: "num" }, "mean tok/s"), h("th", { class: "num" }, "samples"), h("th", {}, "newest"))),
    h("tbody", {}, speedRows.length ? speedRows : h("tr", {}, h("td", { colspan: 5, class: "empty" }, "no speed samples in the window"))),
  );
  box.replaceChildren(
    h("h3", {}, `${w.id}: its rows`, h("button", { type: "button", on: { click: () => selectWorker(w.id) } }, "show all workers")),
    h("p", {}, `running now: ${running}`),
    table,
  );
  box.hidden = false;
}

function renderModels() {
  const rows = state.overview.models.map((m) =>
    h("tr", { dataset: { model: m.name } },
      h("td", {}, h("b", {}, m.name)),
      h("td", { class: "num" }, m.capacity),
      h("td", {}, m.holders.map((w) => `${m.loaded_on.includes(w) ? "● " : ""}${w}`).join(", ")),
      h("td", { class: "num" }, m.queued ?? "?"),
      h("td", { class: "num" }, m.running ?? "?"),
    ),
  );
  fill($("#models tbody"), rows, 5, "no live worker serves a model");
}

function renderIncidents() {
  const rows = state.overview.incidents.map((i) =>
    h("tr", {},
      h("td", {}, clock(i.at)),
      h("td", {}, h("span", { class: `status ${i.type === "TaskReclaimed" ? "reclaimed" : i.type === "TaskStalled" ? "stalled" : "dead"}` }, i.type.replace("Task", ""))),
      h("td", { class: "mono" }, short(i.task_id)),
      h("td", {}, i.model),
      h("td", {}, i.detail),
    ),
  );
  fill($("#incidents tbody"), rows, 5, "none recently");
}

// -- API keys ---------------------------------------------------------------------------------------------

const KEYS_EVERY_MS = 5000;
const ofLimit = (used, limit) => (limit ? `${used} / ${limit}` : `${used}`);

async function renderKeys() {
  try {
    const { keys } = await getJSON("/v1/dashboard/keys");
    const rows = keys.map((k) =>
      h("tr", {},
        h("td", {}, h("b", {}, k.name)),
        h("td", { class: "num" }, k.requests),
        h("td", { class: "num" }, ofLimit(k.tokens_today, k.limits.tokens_per_day)),
        h("td", { class: "num" }, ofLimit(k.queued, k.limits.max_queued)),
        h("td", { class: "num", title: Object.entries(k.refused_by).map(([l, n]) => `${l}: ${n}`).join(", ") }, k.refused),
        h("td", { class: "num" }, k.limits.rpm ?? "–"),
      ),
    );
    fill($("#keys tbody"), rows, 6, "no API keys configured");
  } catch (err) {
    fill($("#keys tbody"), [], 6, `could not read the keys: ${err.message}`);
  }
}

// -- recent tasks -----------------------------------------------------------------------------------------

function renderTasks() {
  const sel = state.selected;
  const tasks = state.overview.tasks.filter((t) => !sel || t.worker === sel || (!t.worker && t.expected_worker === sel));
  const filter = $("#task-filter");
  filter.hidden = !sel;
  if (sel) filter.replaceChildren(`Only tasks ${sel} ran (or is expected to run).`, h("button", { type: "button", on: { click: () => selectWorker(sel) } }, "show all"));
  const rows = tasks.map((t) =>
    h("tr", { class: `clickable${state.openTask === t.task_id ? " selected" : ""}`, dataset: { task: t.task_id, worker: t.worker || "" }, on: { click: () => openTask(t.task_id) } },
      h("td", {}, clock(t.submitted_at)),
      h("td", { class: "mono" }, short(t.task_id)),
      h("td", {}, t.auto ? `auto → ${t.model}` : t.model),
      h("td", {}, t.domain),
      h("td", {}, h("span", { class: `status ${t.status}` }, t.status)),
      h("td", { class: "expected" }, t.expected_worker || h("span", { class: "muted" }, "–")),
      h("td", { class: "ran-on" }, ranOn(t)),
      h("td", { class: "ranking" }, ranking(t)),
      h("td", { class: "num" }, num(t.decode_tps)),
      h("td", { class: "num" }, t.wall_ms === null ? "–" : `${num(t.wall_ms / 1000)}s`),
    ),
  );
  fill($("#tasks tbody"), rows, 10, sel ? `no recent task ran on ${sel}` : "no task yet");
}

// Who took it (its claim), and, when that is not the worker the router expected, why.
function ranOn(t) {
  const taker = t.taker || t.worker;
  if (!taker) return h("span", { class: "muted" }, "–");
  const differs = t.expected_worker && taker !== t.expected_worker;
  return h("span", {},
    h("span", { class: `taker${differs ? " changed" : ""}` }, taker),
    differs ? h("div", { class: "reason" }, t.reason || `expected ${t.expected_worker}; the ledger read back does not say why`) : "",
  );
}

// Each candidate's expected finish, best first: the expected one marked, the taker in bold.
function ranking(t) {
  if (!t.ranking.length) return "–";
  const taker = t.taker || t.worker;
  return t.ranking.flatMap((r, i) => {
    const text = `${r.worker} ${num(r.expected_finish_s)}s${r.worker === t.expected_worker ? " (expected)" : ""}`;
    return [i ? " · " : "", r.worker === taker ? h("b", { class: "took" }, text) : h("span", {}, text)];
  });
}

async function openTask(id) {
  const box = $("#task-detail");
  if (state.openTask === id) {
    state.openTask = null;
    box.hidden = true;
    renderTasks();
    return;
  }
  state.openTask = id;
  renderTasks();
  box.hidden = false;
  box.replaceChildren(h("p", { class: "muted" }, "loading…"));
  try {
    const t = await getJSON(`/v1/tasks/${encodeURIComponent(id)}`);
    const r = t.routing;
    box.replaceChildren(
      h("h3", {}, `task ${id}`),
      h("p", { class: "summary" }, h("b", {}, t.status), ` · ${t.model} · ${t.domain} · ran on `, h("b", {}, t.worker || "–"),
        ` · attempts ${t.attempts}`, t.timings?.wall_ms ? ` · wall ${num(t.timings.wall_ms / 1000)}s` : ""),
      r ? breakdown(r.candidates || []) : h("p", { class: "muted" }, "no routing breakdown recorded"),
      r?.auto ? autoTable(r.auto.models || []) : "",
    );
  } catch (err) {
    box.replaceChildren(h("p", { class: "error" }, `could not load the task: ${err.message}`));
  }
}

// -- the preview and breakdowns ---------------------------------------------------------------------------

function breakdown(candidates) {
  const termNames = [...new Set(candidates.flatMap((c) => Object.keys(c.terms || {})))];
  const terms = h("table", { class: "terms" },
    h("thead", {}, h("tr", {}, h("th", {}, "candidate"), h("th", { class: "num" }, "expected finish s"), termNames.map((n) => h("th", { class: "num" }, n)))),
    h("tbody", {}, candidates.map((c) =>
      h("tr", { dataset: { worker: c.worker } }, h("td", {}, h("b", {}, c.worker)), h("td", { class: "num" }, num(c.expected_finish_s, 2)),
        termNames.map((n) => h("td", { class: "num" }, typeof c.terms[n] === "number" ? num(c.terms[n], 2) : String(c.terms[n] ?? "–")))),
    )),
  );
  const fields = h("table", { class: "breakdown" },
    h("thead", {}, h("tr", {}, h("th", {}, "candidate"), h("th", {}, "field"), h("th", { class: "num" }, "value"), h("th", { class: "num" }, "n"), h("th", {}, "source"), h("th", { class: "num" }, "age"))),
    h("tbody", {}, candidates.flatMap((c) =>
      Object.entries(c.fields || {}).map(([name, f], i) =>
        h("tr", { class: i === 0 ? "group" : "" }, h("td", {}, i === 0 ? c.worker : ""), h("td", {}, name),
          h("td", { class: "num" }, num(f.value, 2)), h("td", { class: "num" }, f.n), h("td", { class: "source" }, f.source),
          h("td", { class: "num" }, f.age_s === null ? "–" : ago(Date.now() - f.age_s * 1000))),
      ),
    )),
  );
  return h("div", {}, terms, h("p", { class: "muted" }, "every estimate, with its own sample count and source:"), fields);
}

function autoTable(models) {
  return h("div", {}, h("p", { class: "muted" }, "auto weighed these models:"),
    h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "model"), h("th", { class: "num" }, "rank"), h("th", { class: "num" }, "utility"), h("th", { class: "num" }, "expected finish s"), h("th", {}, "best worker"), h("th", {}, "quality (source)"))),
      h("tbody", {}, models.map((m) =>
        // A bound model could not win and its queue was not laid out: at most this utility, at least this finish.
        h("tr", {}, h("td", {}, m.model), h("td", { class: "num" }, m.rank), h("td", { class: "num" }, (m.bound ? "≤ " : "") + num(m.utility, 3)),
          h("td", { class: "num" }, (m.bound ? "≥ " : "") + num(m.expected_finish_s, 2)), h("td", {}, m.best_worker),
          h("td", {}, `${num(m.quality?.value, 2)} (${m.quality?.source ?? "?"})`)),
      )),
    ),
  );
}

function syncPreviewModels() {
  const select = $("#preview-model");
  const names = ["auto", ...state.overview.models.map((m) => m.name)];
  const have = [...select.options].map((o) => o.value);
  if (have.join("\n") === names.join("\n")) return;
  const current = select.value;
  select.replaceChildren(...names.map((n) => h("option", { value: n }, n)));
  select.value = names.includes(current) ? current : names[1] || "auto";
}

async function runPreview() {
  const model = $("#preview-model").value;
  if (!model) return;
  state.previewAt = Date.now();
  const params = new URLSearchParams({ model, domain: $("#preview-domain").value || "general" });
  const tokens = $("#preview-tokens").value;
  if (tokens) params.set("tokens", tokens);
  const box = $("#preview");
  try {
    const p = await getJSON(`/v1/route/preview?${params}`);
    const plan = p.plan || {};
    box.replaceChildren(
      h("p", { class: "summary" }, "For ", h("b", {}, p.model), ` (${(p.digest || "").slice(0, 12)}), domain ${plan.domain}: `,
        h("b", { class: "taker" }, plan.taker), ` would take it; wait ${num(plan.expected_wait_s, 2)}s, finish ${num(plan.expected_finish_s, 2)}s.`,
        h("span", { class: "muted" }, ` As of ${clock(Date.now())}.`)),
      breakdown(p.candidates || []),
      plan.auto ? autoTable(plan.auto.models || []) : "",
      h("details", {}, h("summary", {}, "the queue plan"), h("pre", { class: "mono" }, JSON.stringify(plan.queue, null, 1))),
    );
    box.dataset.model = p.model;
  } catch (err) {
    box.replaceChildren(h("p", { class: "error" }, err.message));
  }
}

// -- the chart: an SVG line chart, drawn here (no library) -------------------------------------------------

function niceStep(range, ticks) {
  const raw = range / ticks;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / mag;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
}

function drawChart() {
  const box = $("#chart");
  const width = Math.max(400, box.clientWidth || 800);
  const height = 280;
  const pad = { l: 48, r: 16, t: 12, b: 28 };
  const series = new Map();
  for (const s of state.samples) {
    const key = `${s[1]}\u0000${s[2]}`;
    if (!series.has(key)) series.set(key, { worker: s[1], digest: s[2], points: [] });
    series.get(key).points.push(s);
  }
  const keys = [...series.keys()].sort();
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "decode tokens per second over time" });
  let drawn = 0;
  if (!keys.length) {
    root.append(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "no speed samples yet"));
  } else {
    const now = Date.now();
    const t0 = Math.min(...state.samples.map((s) => s[0]));
    // The axis ends now, so that a quiet spell shows as one; a young window spans 20 s at least.
    const t1 = Math.max(now, t0 + 20_000);
    const yMax = Math.max(1, ...state.samples.map((s) => s[3])) * 1.1;
    const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * (width - pad.l - pad.r);
    const y = (v) => height - pad.b - (v / yMax) * (height - pad.t - pad.b);
    const step = niceStep(yMax, 5);
    for (let v = 0; v <= yMax; v += step) {
      root.append(svg("line", { class: "grid", x1: pad.l, x2: width - pad.r, y1: y(v), y2: y(v) }));
      root.append(svg("text", { x: pad.l - 6, y: y(v) + 4, "text-anchor": "end" }, Number(v.toFixed(1))));
    }
    const tStep = niceStep(t1 - t0, 6);
    for (let t = Math.ceil(t0 / tStep) * tStep; t <= t1; t += tStep) {
      root.append(svg("text", { x: x(t), y: height - 8, "text-anchor": "middle" }, clock(t)));
    }
    root.append(svg("line", { class: "axis", x1: pad.l, x2: pad.l, y1: pad.t, y2: height - pad.b }));
    root.append(svg("line", { class: "axis", x1: pad.l, x2: width - pad.r, y1: height - pad.b, y2: height - pad.b }));
    keys.forEach((key, i) => {
      const s = series.get(key);
      const color = PALETTE[i % PALETTE.length];
      s.color = color;
      const pts = s.points.slice(-MAX_POINTS_PER_SERIES);
      const g = svg("g", { class: `series${state.selected && state.selected !== s.worker ? " dim" : ""}`, "data-worker": s.worker, "data-model": modelName(s.digest) });
      g.append(svg("polyline", { stroke: color, points: pts.map((p) => `${x(p[0]).toFixed(1)},${y(p[3]).toFixed(1)}`).join(" ") }));
      for (const p of pts) {
        g.append(svg("circle", { class: p[4] ? "bench" : "task", cx: x(p[0]).toFixed(1), cy: y(p[3]).toFixed(1), r: 3.2, fill: color, stroke: color },
          svg("title", {}, `${s.worker} · ${modelName(s.digest)}: ${num(p[3])} tok/s at ${clock(p[0])}${p[4] ? " (benchmark)" : ""}`)));
        drawn += 1;
      }
      root.append(g);
    });
  }
  root.dataset.points = String(drawn);
  root.dataset.series = String(keys.length);
  box.replaceChildren(root);
  $("#legend").replaceChildren(...keys.map((key) => {
    const s = series.get(key);
    const last = s.points[s.points.length - 1];
    const sw = h("span", { class: "swatch" });
    sw.style.background = s.color;
    return h("span", { class: "legend-item", dataset: { worker: s.worker } }, sw, `${s.worker} · ${modelName(s.digest)}: ${num(last[3])} tok/s (n=${s.points.length})`);
  }));
}

// -- live updates -----------------------------------------------------------------------------------------

function setConn(kind, text) {
  const el = $("#conn");
  el.dataset.state = kind;
  el.textContent = text || kind;
}

function sizeGiB(n) {
  return `${(n / 2 ** 30).toFixed(n < 2 ** 30 ? 2 : 1)} GiB`;
}

// Redis memory against its limit and the archive, one line; its colour says when to act.
function renderStorage(r, a) {
  const el = $("#storage");
  if (!r) return;
  const mem = r.ratio === null
    ? `Redis ${sizeGiB(r.used_bytes)}, no limit`
    : `Redis ${sizeGiB(r.used_bytes)} of ${sizeGiB(r.max_bytes)} (${Math.round(r.ratio * 100)}%)`;
  el.dataset.level = r.level;
  el.textContent = `${mem} · archive: ${a ? a.summary : "?"}`;
  el.title = r.warning || "";
}

function onOverview(o) {
  state.overview = o;
  Object.assign(state.names, o.names || {});
  const p = o.projection || {};
  $("#projection").textContent = p.lag_entries === null || p.lag_entries === undefined
    ? `projection: ${p.status}`
    : `projector ${p.lag_entries} entries behind (${num((p.lag_ms || 0) / 1000)}s)`;
  renderStorage(o.redis, o.archive);
  renderFleet();
  renderModels();
  renderIncidents();
  renderTasks();
  syncPreviewModels();
  if (Date.now() - state.previewAt > PREVIEW_EVERY_MS) runPreview();
  document.body.dataset.ready = "1";
}

function onSamples(found) {
  const cutoff = Date.now() - SAMPLE_WINDOW_MS;
  state.samples = state.samples.concat(found).filter((s) => s[0] >= cutoff);
  drawChart();
  if (state.selected) renderWorkerDetail();
}

function dispatch(block) {
  let kind = "message";
  let id = null;
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event: ")) kind = line.slice(7);
    else if (line.startsWith("id: ")) id = line.slice(4);
    else if (line.startsWith("data: ")) data.push(line.slice(6));
  }
  if (id) state.lastId = id;
  if (!data.length) return;
  const body = JSON.parse(data.join("\n"));
  if (kind === "overview") onOverview(body);
  else if (kind === "samples") onSamples(body.samples);
  else if (kind === "error") setConn("error", body.message);
}

async function follow() {
  for (;;) {
    try {
      const after = state.lastId ? `?after=${encodeURIComponent(state.lastId)}` : "";
      const res = await api(`/v1/dashboard/stream${after}`, { headers: { Accept: "text/event-stream" } });
      if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
      setConn("live");
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          dispatch(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
        }
      }
    } catch (err) {
      setConn("reconnecting", `reconnecting (${err.message})`);
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
}

// The first paint. Without API keys the page carries the overview (a JSON data block): the tables
// are filled now, before the load event, when a headless screenshot is taken. Otherwise (or when
// the server had no answer in time) the overview and the samples are asked for at once, and the
// tables are filled as soon as the overview comes, not after the samples and the stream's first
// event, which the page used to wait for.
function carriedOverview() {
  const block = document.getElementById("first-overview");
  if (!block) return false;
  onOverview(JSON.parse(block.textContent));
  block.remove();
  return true;
}

async function firstPaint() {
  const overview = state.overview ? Promise.resolve() : getJSON("/v1/dashboard/overview").then(
    (o) => {
      if (!state.overview) onOverview(o);
    },
    (err) => setConn("error", `could not load the overview: ${err.message}`),
  );
  try {
    const s = await getJSON(`/v1/dashboard/samples?since=${Date.now() - SAMPLE_WINDOW_MS}`);
    state.samples = s.samples;
    Object.assign(state.names, s.names);
    state.lastId = s.last_id;
  } catch (err) {
    setConn("error", `could not load samples: ${err.message}`);
  }
  drawChart();
  await overview;
}

async function start() {
  carriedOverview();
  $("#forget-key").hidden = !sessionStorage.getItem(KEY_STORE);
  $("#forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    location.reload();
  });
  $("#preview-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    runPreview();
  });
  window.addEventListener("resize", () => drawChart());
  await Promise.all([firstPaint(), renderKeys()]);
  setInterval(renderKeys, KEYS_EVERY_MS);
  follow();
}

start();
