// moe-mesh status page: polls /status.json every 2 s and renders it. Values come from the
// cluster, so they only ever reach the page through textContent and setAttribute.
"use strict";
(() => {
  const REFRESH_MS = 2000;
  const TIMEOUT_MS = 5000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const DASH = "—";

  const $ = (id) => document.getElementById(id);
  const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : 0);
  const str = (v) => (v === null || v === undefined ? "" : String(v));
  const orDash = (v) => (str(v) === "" ? DASH : str(v));
  const list = (v) => (Array.isArray(v) ? v : []);
  const obj = (v) => (v && typeof v === "object" && !Array.isArray(v) ? v : {});

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // ---- formatting ----
  function fmtInt(v) {
    return Math.round(num(v)).toLocaleString("en-US");
  }
  function fmtBytes(v) {
    let n = num(v);
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(n >= 100 ? 0 : n >= 10 ? 1 : 2)} ${units[i]}`;
  }
  function fmtPct(ratio) {
    const p = num(ratio) * 100;
    return `${p.toFixed(p > 0 && p < 10 ? 1 : 0)}%`;
  }
  function fmtUs(v) {
    const us = num(v);
    if (us < 1000) return `${Math.round(us)} µs`;
    const ms = us / 1000;
    if (ms < 1000) return `${ms.toFixed(ms < 10 ? 2 : ms < 100 ? 1 : 0)} ms`;
    return `${(ms / 1000).toFixed(2)} s`;
  }
  function fmtRate(v) {
    const n = num(v);
    return n === 0 ? "0" : n.toFixed(n >= 100 ? 0 : n >= 10 ? 1 : 2);
  }
  function fmtAxis(v) {
    const n = num(v);
    if (n >= 10000) return `${+(n / 1000).toFixed(1)}k`;
    return String(+n.toFixed(n >= 10 ? 0 : 2));
  }
  function fmtClock(date) {
    const pad = (n) => String(n).padStart(2, "0");
    return `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
  }
  function fmtAgo(seconds) {
    const s = Math.round(seconds);
    if (s <= 0) return "now";
    if (s < 60) return `-${s}s`;
    return s % 60 === 0 ? `-${s / 60}m` : `-${Math.floor(s / 60)}m${s % 60}s`;
  }

  function setText(id, text) {
    $(id).textContent = text;
  }
  // A usage meter turns amber from 80 % and red from 95 %; a plain one (a hit rate) stays blue.
  function meterFill(fill, ratio, usage = true) {
    const r = Math.min(Math.max(num(ratio), 0), 1);
    fill.style.width = `${(r * 100).toFixed(1)}%`;
    fill.classList.toggle("high", usage && r >= 0.8 && r < 0.95);
    fill.classList.toggle("full", usage && r >= 0.95);
  }
  function meter(ratio, usage = true) {
    const track = el("div", "meter");
    const fill = el("div", "fill");
    meterFill(fill, ratio, usage);
    track.append(fill);
    return track;
  }
  // kind: "up", "warn" or "down"; the text says the same as the colour.
  function statusPill(kind, text) {
    const pill = el("span", `pill pill-${kind}`);
    pill.append(el("span", "dot"), el("span", "", text));
    return pill;
  }
  function valueWithUnit(id, value, unit) {
    const node = $(id);
    node.replaceChildren(document.createTextNode(value));
    if (unit) node.append(el("span", "unit", unit));
  }

  // Sections are rebuilt only when their data changed, so text stays selectable between polls.
  const drawn = new Map();
  function whenChanged(key, value, draw) {
    const seen = JSON.stringify(value);
    if (drawn.get(key) === seen) return;
    drawn.set(key, seen);
    draw(value);
  }

  // ---- header ----
  const STATES = {
    serving: ["pill-up", "serving"],
    not_serving: ["pill-warn", "not serving"],
    unreachable: ["pill-down", "unreachable"],
  };

  function renderHeader(data, core) {
    const model = str(data.model);
    setText("model", orDash(model));
    setText("version", data.version ? `v${str(data.version)}` : "");
    const state = str(core.state);
    const [cls, label] = STATES[state] || ["pill-unknown", state || "unknown"];
    const pill = $("core-state");
    pill.className = `pill ${cls}`;
    pill.dataset.state = state || "unknown";
    setText("core-state-text", `core ${label}`);
    document.title = `${label} · ${model || "moe-mesh"} · moe-mesh status`;

    const problems = list(core.problems).map(str).filter(Boolean);
    const showProblems = state !== "serving" && problems.length > 0;
    $("problems").hidden = !showProblems;
    whenChanged("problems", problems, (items) => {
      $("problem-list").replaceChildren(...items.map((p) => el("li", "", p)));
    });
  }

  // ---- summary tiles, caches, requests ----
  function lastThroughput(data) {
    const points = list(data.throughput);
    return points.length ? obj(points[points.length - 1]) : null;
  }

  function renderSummary(data, core) {
    const running = num(core.running);
    const waiting = num(core.waiting);
    setText("running", fmtInt(running));
    setText("waiting", fmtInt(waiting));
    const last = lastThroughput(data);
    valueWithUnit("gen-rate", last ? fmtRate(last.generation_tok_s) : DASH, last ? "tok/s" : "");
    valueWithUnit("prompt-rate", last ? fmtRate(last.prompt_tok_s) : DASH, last ? "tok/s" : "");

    const kvBytes = num(core.kv_cache_bytes);
    const kvCap = num(core.kv_cache_capacity_bytes);
    if (kvCap > 0) {
      valueWithUnit("kv-tile", fmtPct(kvBytes / kvCap), fmtBytes(kvBytes));
      setText("kv-text", `${fmtBytes(kvBytes)} of ${fmtBytes(kvCap)} (${fmtPct(kvBytes / kvCap)})`);
    } else {
      valueWithUnit("kv-tile", fmtBytes(kvBytes), "");
      setText("kv-text", `${fmtBytes(kvBytes)} (no capacity limit reported)`);
    }
    meterFill($("kv-meter"), kvCap > 0 ? kvBytes / kvCap : 0);

    const prefix = obj(core.prefix_cache);
    const lookups = num(prefix.lookups);
    const hasRate = typeof prefix.hit_rate === "number" && lookups > 0;
    valueWithUnit("prefix-tile", hasRate ? fmtPct(prefix.hit_rate) : DASH, hasRate ? `of ${fmtInt(lookups)}` : "");
    setText("prefix-rate", hasRate ? fmtPct(prefix.hit_rate) : "no lookups yet");
    setText("prefix-hits", `${fmtInt(prefix.hits)} of ${fmtInt(lookups)} lookups · ${fmtInt(prefix.hit_tokens)} tokens reused`);
    setText("prefix-entries", fmtInt(prefix.entries));
    const pBytes = num(prefix.bytes);
    const pBudget = num(prefix.budget_bytes);
    const pText = pBudget > 0 ? `${fmtBytes(pBytes)} of ${fmtBytes(pBudget)} (${fmtPct(pBytes / pBudget)})` : fmtBytes(pBytes);
    setText("prefix-bytes", pText);
    meterFill($("prefix-meter"), pBudget > 0 ? pBytes / pBudget : 0);
    setText("requests", `${fmtInt(running)} running · ${fmtInt(waiting)} waiting`);
    setText("tokens-total", `${fmtInt(core.prompt_tokens_total)} prompt · ${fmtInt(core.generation_tokens_total)} generated`);
  }

  // An unreachable core reports zeros; they are not measurements, so they show as dashes.
  function blankCoreFigures() {
    const ids = ["running", "waiting", "kv-tile", "prefix-tile", "kv-text", "prefix-rate", "prefix-hits"];
    for (const id of [...ids, "prefix-entries", "prefix-bytes", "requests", "tokens-total"]) setText(id, DASH);
    meterFill($("kv-meter"), 0);
    meterFill($("prefix-meter"), 0);
  }

  // ---- cluster map ----
  function clusterRow(row) {
    const tr = el("tr", row.kind === "down" ? "is-down" : "");
    tr.dataset.name = row.name;
    tr.dataset.status = row.kind === "down" ? "down" : "up";
    const name = el("td");
    name.append(el("strong", "", orDash(row.name)));
    if (row.role) name.append(el("span", "role", row.role));
    const addr = el("td", "mono", orDash(row.address));
    if (row.host) addr.append(el("span", "sub", row.host));
    const status = el("td");
    status.append(statusPill(row.kind, row.statusText));
    const error = el("td", row.error ? "err" : "muted", orDash(row.error));
    tr.append(name, addr, el("td", "mono", orDash(row.layers)), el("td", "mono", orDash(row.experts)));
    tr.append(el("td", "num", row.minReplicas), status, error);
    return tr;
  }

  function renderCluster(data, core) {
    const gateway = obj(data.gateway);
    const state = str(core.state);
    const problems = list(core.problems).map(str).filter(Boolean);
    let coreError = "";
    if (state === "unreachable") coreError = problems[0] || "core does not answer";
    else if (state !== "serving" && problems.length) {
      coreError = `${problems.length} problem${problems.length > 1 ? "s" : ""} (listed above)`;
    }
    const rows = [
      {
        name: "core", role: "", address: str(core.address), host: str(core.host),
        layers: "", experts: "", minReplicas: DASH,
        kind: state === "serving" ? "up" : state === "not_serving" ? "warn" : "down",
        statusText: state === "serving" ? "up" : state === "not_serving" ? "up · not serving" : "down",
        error: coreError,
      },
      {
        name: "gateway", role: "", address: str(gateway.address), host: str(gateway.host),
        layers: "", experts: "", minReplicas: DASH, kind: gateway.up !== false ? "up" : "down",
        statusText: gateway.up !== false ? "up" : "down", error: "",
      },
    ];
    for (const raw of list(data.workers)) {
      const w = obj(raw);
      rows.push({
        name: str(w.name), role: "expert worker", address: str(w.address), host: str(w.host),
        layers: str(w.layers), experts: str(w.experts),
        minReplicas: w.min_replicas === undefined || w.min_replicas === null ? DASH : fmtInt(w.min_replicas),
        kind: w.up === true ? "up" : "down", statusText: w.up === true ? "up" : "down",
        error: str(w.last_error),
      });
    }
    whenChanged("cluster", rows, (items) => $("cluster-body").replaceChildren(...items.map(clusterRow)));
  }

  // ---- expert workers ----
  function workerRow(w) {
    const tr = el("tr", w.up === true ? "" : "is-down");
    tr.dataset.name = str(w.name);
    tr.dataset.status = w.up === true ? "up" : "down";
    const status = el("td");
    status.append(statusPill(w.up === true ? "up" : "down", w.up === true ? "up" : "down"));

    const hitCell = el("td");
    const hits = num(w.cache_hits);
    const misses = num(w.cache_misses);
    if (typeof w.cache_hit_rate === "number") {
      const box = el("div", "cellbar");
      box.append(el("span", "txt", fmtPct(w.cache_hit_rate)), meter(w.cache_hit_rate, false));
      hitCell.append(box, el("span", "sub", `${fmtInt(hits)} hits · ${fmtInt(misses)} misses`));
    } else {
      hitCell.append(el("span", "muted", "no accesses"));
    }

    const read = el("td", "num", `${num(w.read_gbps).toFixed(2)} GB/s`);
    read.append(el("span", "sub", `${fmtBytes(w.bytes_read)} read`));

    const memCell = el("td");
    const budget = num(w.memory_budget_bytes);
    const resident = num(w.resident_bytes);
    if (budget > 0) {
      const box = el("div", "cellbar");
      box.append(el("span", "txt", `${fmtBytes(resident)} / ${fmtBytes(budget)}`), meter(resident / budget, false));
      memCell.append(box, el("span", "sub", `${fmtPct(resident / budget)} of budget`));
    } else if (resident > 0) {
      memCell.append(el("span", "", fmtBytes(resident)), el("span", "sub", "no budget: all resident"));
    } else {
      memCell.append(el("span", "muted", w.up === true ? "all resident" : DASH));
    }

    const name = el("td");
    name.append(el("strong", "", orDash(w.name)));
    const errors = el("td", num(w.errors) > 0 ? "num err" : "num", fmtInt(w.errors));
    tr.append(name, status, hitCell, read, memCell, el("td", "num", fmtInt(w.calls)), errors);
    tr.append(el("td", "num", fmtInt(w.retries)));
    return tr;
  }

  function renderWorkers(data) {
    const workers = list(data.workers).map(obj);
    $("workers-empty").hidden = workers.length > 0;
    $("workers").hidden = workers.length === 0;
    whenChanged("workers", workers, (items) => $("workers-body").replaceChildren(...items.map(workerRow)));
  }

  // ---- per-layer hop latency ----
  function renderLayers(data) {
    const layers = list(data.layers)
      .map(obj)
      .sort((a, b) => num(a.layer) - num(b.layer));
    const any = layers.some((l) => num(l.calls) > 0);
    $("layers-empty").hidden = any;
    $("layers").hidden = !any;
    whenChanged("layers", any ? layers : [], (items) => {
      const top = Math.max(1, ...items.map((l) => Math.max(num(l.p99_us), num(l.p50_us))));
      const rows = items.map((l) => {
        const row = el("div", "layer-row");
        row.dataset.layer = str(l.layer);
        const calls = num(l.calls);
        row.title = `layer ${str(l.layer)}: ${fmtInt(calls)} calls, p50 ${fmtUs(l.p50_us)}, p99 ${fmtUs(l.p99_us)}`;
        const track = el("div", "track");
        const p99 = el("div", "bar p99");
        const p50 = el("div", "bar p50");
        p99.style.width = `${((num(l.p99_us) / top) * 100).toFixed(2)}%`;
        p50.style.width = `${((num(l.p50_us) / top) * 100).toFixed(2)}%`;
        track.append(p99, p50);
        const vals = el("div", "vals");
        if (calls > 0) {
          vals.append(el("b", "", fmtUs(l.p50_us)), document.createTextNode(` / ${fmtUs(l.p99_us)}`));
        } else {
          vals.textContent = "no calls";
        }
        row.append(el("div", "lbl", `L${str(l.layer)}`), track, vals);
        return row;
      });
      $("layers").replaceChildren(...rows);
    });
  }

  // ---- throughput chart ----
  function niceCeil(v) {
    if (v <= 0) return 1;
    const base = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 4, 6, 8, 10]) if (m * base >= v) return m * base;
    return 10 * base;
  }
  function tickStep(span) {
    for (const s of [10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600]) if (span / s <= 5) return s;
    return 7200;
  }

  function drawThroughput(view) {
    const { points, now, width } = view;
    const box = $("throughput");
    const series = [
      ["generation", "generation_tok_s", "generation"],
      ["prompt", "prompt_tok_s", "prompt"],
    ];
    const left = 44;
    const right = 10;
    const bandH = 58;
    const titleH = 18;
    const gap = 12;
    const axisH = 18;
    const height = series.length * (titleH + bandH) + (series.length - 1) * gap + axisH;
    const plotW = width - left - right;
    const t0 = points[0].t;
    const t1 = Math.max(now, points[points.length - 1].t);
    const span = Math.max(t1 - t0, 1);
    const x = (t) => left + ((t - t0) / span) * plotW;

    const root = svg("svg", {
      viewBox: `0 0 ${width} ${height}`,
      width,
      height,
      role: "img",
      "aria-label": "generation and prompt tokens per second",
    });
    series.forEach(([label, key, cls], i) => {
      const top = i * (titleH + bandH + gap);
      const y0 = top + titleH;
      const values = points.map((p) => num(p[key]));
      const yMax = niceCeil(Math.max(...values) * 1.1);
      const y = (v) => y0 + bandH - (v / yMax) * bandH;
      const latest = values[values.length - 1];
      root.append(svg("text", { x: left, y: top + 12, class: "series-title" }, `${label} · ${fmtRate(latest)} tok/s`));
      root.append(
        svg("text", { x: width - right, y: top + 12, class: "axis-text", "text-anchor": "end" },
          `peak ${fmtRate(Math.max(...values))}`),
      );
      for (const v of [0, yMax / 2, yMax]) {
        root.append(svg("line", { x1: left, x2: width - right, y1: y(v), y2: y(v), class: "grid-line" }));
        root.append(
          svg("text", { x: left - 6, y: y(v) + 3, class: "axis-text", "text-anchor": "end" }, fmtAxis(v)),
        );
      }
      const coords = points.map((p, j) => `${x(p.t).toFixed(1)},${y(values[j]).toFixed(1)}`);
      const line = `M${coords.join("L")}`;
      const base = (y0 + bandH).toFixed(1);
      const area = `${line}L${x(points[points.length - 1].t).toFixed(1)},${base}L${x(t0).toFixed(1)},${base}Z`;
      root.append(svg("path", { d: area, class: `area ${cls}` }));
      root.append(svg("path", { d: line, class: `line ${cls}`, "data-series": label }));
      const last = points[points.length - 1];
      root.append(svg("circle", { cx: x(last.t), cy: y(latest), r: 2.5, class: cls }));
    });
    const step = tickStep(span);
    const axisY = height - 4;
    for (let ago = 0; ago <= span + 1e-6; ago += step) {
      const tx = x(t1 - ago);
      if (tx < left - 1) break;
      const anchor = ago === 0 ? "end" : tx - left < 20 ? "start" : "middle";
      root.append(svg("text", { x: tx, y: axisY, class: "axis-text", "text-anchor": anchor }, fmtAgo(ago)));
    }
    box.replaceChildren(root);
  }

  function renderThroughput(data) {
    const points = list(data.throughput)
      .map(obj)
      .filter((p) => typeof p.t === "number" && Number.isFinite(p.t))
      .sort((a, b) => a.t - b.t);
    const any = points.length > 0;
    $("throughput-empty").hidden = any;
    $("throughput").hidden = !any;
    if (!any) {
      drawn.delete("throughput");
      return;
    }
    const width = Math.max(280, Math.floor($("throughput").clientWidth || 560));
    const now = num(data.time) || points[points.length - 1].t;
    whenChanged("throughput", { points, now, width }, drawThroughput);
  }

  // ---- polling ----
  let lastData = null;
  let lastOk = null;

  function render(data) {
    const d = obj(data);
    const core = obj(d.core);
    renderHeader(d, core);
    renderSummary(d, core);
    if (str(core.state) === "unreachable") blankCoreFigures();
    renderCluster(d, core);
    renderWorkers(d);
    renderLayers(d);
    renderThroughput(d);
  }

  function showBanner(message) {
    const banner = $("banner");
    const since = lastOk ? `showing data from ${fmtClock(lastOk)}` : "no data yet";
    banner.textContent = `Cannot fetch /status.json (${message}); ${since}, retrying every ${REFRESH_MS / 1000} s.`;
    banner.hidden = false;
  }

  async function fetchStatus() {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), TIMEOUT_MS);
    try {
      const response = await fetch("/status.json", {
        credentials: "same-origin",
        cache: "no-store",
        headers: { Accept: "application/json" },
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      return await response.json();
    } catch (error) {
      throw new Error(error && error.name === "AbortError" ? "timed out" : str(error && error.message) || "error");
    } finally {
      clearTimeout(timer);
    }
  }

  async function refresh() {
    let data;
    try {
      data = await fetchStatus();
    } catch (error) {
      showBanner(error.message);
      setTimeout(refresh, REFRESH_MS);
      return;
    }
    lastOk = new Date();
    lastData = data;
    $("banner").hidden = true;
    setText("updated", fmtClock(lastOk));
    try {
      render(data);
    } catch (error) {
      console.error("status page: cannot render /status.json", error);
    }
    setTimeout(refresh, REFRESH_MS);
  }

  let resizeTimer = 0;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => lastData && renderThroughput(obj(lastData)), 150);
  });

  refresh();
})();
