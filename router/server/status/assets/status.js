// fleetroute status page: polls /status/feed every second (while the tab is visible) and draws it.
// No framework and no build step; everything comes from the router (Content-Security-Policy: default-src 'self').
"use strict";
(function () {
  const POLL_MS = 1000;
  const SVG = "http://www.w3.org/2000/svg";
  const EXCLUDED = {
    health_check: "failing health checks", breaker_open: "breaker open", gpu_lost: "GPU lost",
    thermal_throttling: "GPU thermal throttling", xid_errors: "GPU XID errors", ecc_errors: "GPU ECC errors",
  };
  let csrf = "";
  let timer = null;
  let polling = false;
  let points = 180;
  let interval = 1;
  const decisionNodes = new Map(); // decision id -> <li>, kept across polls so an opened one stays open
  // Each endpoint's series: the first feed sends them whole, later ones only the samples taken since (`since`).
  let series = {};
  let query = ""; // "?since=<samples>&pid=<pid>" once we hold every endpoint's series

  // ---- small helpers ---------------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }
  const none = (v) => v === null || v === undefined;
  const num = (v, digits = 1) => (none(v) ? "–" : Number(v).toFixed(Number.isInteger(v) ? 0 : digits));
  const pct = (v) => (none(v) ? "–" : Math.round(v * 100) + "%");
  const dur = (v) => (none(v) ? "–" : v >= 1000 ? (v / 1000).toFixed(v >= 10000 ? 0 : 1) + " s" : Math.round(v) + " ms");
  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

  function say(text, bad) {
    const box = document.getElementById("message");
    box.textContent = text;
    box.className = "message" + (bad ? " bad" : "");
    box.hidden = !text;
  }

  // A sparkline: the newest sample at the right edge, gaps where there was no value, 0 at the bottom.
  function spark(values, top) {
    const width = 64, height = 20;
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "spark");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.setAttribute("aria-hidden", "true");
    const present = (values || []).filter((v) => !none(v));
    if (!present.length) return svg;
    const max = top || Math.max(...present) || 1;
    const step = width / Math.max(points - 1, 1);
    const offset = points - values.length;
    let path = "";
    let pen = false;
    values.forEach((v, i) => {
      if (none(v)) { pen = false; return; }
      const x = (offset + i) * step;
      const y = height - 1 - (Math.min(v, max) / max) * (height - 2);
      path += (pen ? "L" : "M") + x.toFixed(1) + " " + y.toFixed(1);
      pen = true;
    });
    const line = document.createElementNS(SVG, "path");
    line.setAttribute("d", path);
    svg.append(line);
    const title = document.createElementNS(SVG, "title");
    title.textContent = `peak ${num(Math.max(...present), 2)} over the last ${Math.round(values.length * interval / 6) / 10} min`;
    svg.append(title);
    return svg;
  }

  function cell(text, series, top, cls) {
    return el("td", { class: "num " + (cls || "") }, el("span", { class: "value", text }), spark(series, top));
  }

  // ---- endpoints -------------------------------------------------------------------------------------

  function stateKey(e) {
    if (e.state === "draining") return "draining";
    if (e.excluded === "ejected") return "ejected";
    if (e.excluded) return "excluded";
    return "serving";
  }

  function stateCell(e) {
    const key = stateKey(e);
    let text = "serving";
    if (key === "draining") text = "draining";
    else if (key === "ejected") text = `ejected (${(e.ejected_because || "failures").replace(/_/g, " ")}), ${num(e.ejected_for_s, 0)} s left`;
    else if (key === "excluded") text = EXCLUDED[e.excluded] || e.excluded;
    const td = el("td", { class: "state" }, el("span", { class: "pill " + key, text }));
    if (key === "draining" && e.excluded) td.append(el("span", { class: "pill excluded", text: EXCLUDED[e.excluded] || e.excluded }));
    if (e.breaker === "half_open") td.append(el("span", { class: "pill warn", text: "breaker half-open" }));
    if (e.breaker === "open" && e.excluded !== "breaker_open") td.append(el("span", { class: "pill warn", text: "breaker open" }));
    if (!e.excluded && !none(e.slow_start_weight) && e.slow_start_weight < 1) {
      td.append(el("span", { class: "pill warn", text: "slow start " + pct(e.slow_start_weight) }));
    }
    if (e.health_check_error) {
      td.title = "last failed health check: " + e.health_check_error;
      if (e.excluded === "health_check") td.append(el("span", { class: "note", text: e.health_check_error.slice(0, 60) }));
    }
    return td;
  }

  function latencyCell(stats, series) {
    const s = stats || {};
    const text = none(s.p50) ? "–" : `${dur(s.p50)} · ${dur(s.p90)} · ${dur(s.p99)}`;
    const td = cell(text, series, null, "latency");
    td.title = `${s.n || 0} requests (p50 · p90 · p99)`;
    return td;
  }

  function telemetryCell(e) {
    if (e.telemetry) return el("td", { class: "num", title: "source: " + e.telemetry.source, text: num(e.telemetry.age_s) + " s" });
    if (!none(e.telemetry_age_s)) return el("td", { class: "num warn", text: `stale (${num(e.telemetry_age_s, 0)} s)` });
    return el("td", { class: "num warn", text: "none" });
  }

  function actionCell(e) {
    const action = e.state === "draining" ? "resume" : "drain";
    return el("td", { class: "actions" }, el("button", {
      type: "button", class: action, "data-action": action, "data-endpoint": e.id,
      text: action === "drain" ? "Drain" : "Resume", onclick: () => act(e.id, action),
    }));
  }

  const COLUMNS = [
    ["Endpoint", "id (hover: URL)"], ["State", "serving, draining, or why it takes no requests"],
    ["In flight", "this router's requests there now"], ["Waiting", "the engine's queue (telemetry)"],
    ["KV cache", "KV-cache blocks in use (telemetry)"], ["GPU", "GPU utilisation (telemetry)"],
    ["Prefix hit", "the engine's prefix-cache hit rate (telemetry)"],
    ["TTFT p50 · p90 · p99", "time to first byte at the router, recent requests"],
    ["ITL p50 · p90 · p99", "mean gap between streamed chunks, per request, recent requests"],
    ["Req/s", "answers per second, last 10 s"], ["Telemetry", "age of the last report"], ["", ""],
  ];

  function renderModel(m, feed) {
    const p = m.policy;
    const policy = `policy ${p.name} · ${p.strategy}` + (p.preset ? ` · preset ${p.preset}` : "");
    const head = el("h2", {}, el("span", { class: "model-name", text: m.model }),
      el("span", { class: "policy", "data-policy": p.name, text: policy }),
      el("span", { class: "routable", text: `${m.routable} of ${m.endpoints.length} routable` }),
      m.panic ? el("span", { class: "pill excluded", text: "panic: routing to all" }) : null);
    const header = el("tr", {}, ...COLUMNS.map(([name, title]) => el("th", { title, text: name })));
    const body = el("tbody", {});
    for (const e of m.endpoints) {
      const s = feed.series[e.id] || {};
      const t = e.telemetry;
      const lat = e.latency || {};
      body.append(el("tr", { "data-endpoint": e.id, "data-state": stateKey(e) },
        el("td", { class: "id", title: e.url + (e.weight !== 1 ? ` (weight ${e.weight})` : ""), text: e.id }),
        stateCell(e),
        cell(num(e.in_flight, 0), s.in_flight),
        cell(t ? num(t.num_waiting, 0) : "–", s.waiting),
        cell(t ? pct(t.kv_cache_usage) : "–", s.kv_cache, 1),
        cell(t ? pct(t.gpu_util) : "–", s.gpu_util, 1),
        el("td", { class: "num", text: t ? pct(t.prefix_cache_hit_rate) : "–" }),
        latencyCell(lat.ttft_ms, s.ttft_ms),
        latencyCell(lat.itl_ms, s.itl_ms),
        cell(num(e.requests_per_s, 1), s.requests_per_s),
        telemetryCell(e),
        actionCell(e)));
    }
    const section = el("section", { class: "model", "data-model": m.model }, head,
      el("table", { class: "endpoints" }, el("thead", {}, header), body));
    if (m.admission) section.append(renderAdmission(m.admission));
    return section;
  }

  function renderAdmission(a) {
    const rows = a.classes.map((c) => el("tr", { "data-class": c.name }, el("td", { text: c.name }),
      el("td", { class: "num", text: num(c.queued, 0) }), el("td", { class: "num", text: num(c.admitted_per_s) }),
      el("td", { class: "num", text: num(c.shed_per_s) })));
    const s = a.series || {};
    const labelled = (label, series) => el("span", { class: "labelled" }, el("span", { text: label }), spark(series));
    return el("div", { class: "admission" },
      el("h3", { text: `Admission: at most ${a.max_concurrent_per_endpoint} in flight per endpoint, queue of ${a.max_queue}` }),
      el("table", { class: "classes" },
        el("thead", {}, el("tr", {}, ...["Priority class", "Queued", "Admitted/s", "Shed/s"].map((t) => el("th", { text: t })))),
        el("tbody", {}, ...rows)),
      el("div", { class: "sparks" }, labelled("queued", s.queued), labelled("admitted/s", s.admitted_per_s),
        labelled("shed/s", s.shed_per_s)));
  }

  async function act(id, action) {
    const question = action === "drain"
      ? `Drain ${id}? New requests stop going to it; requests in flight finish.`
      : `Resume ${id}? It takes new requests again.`;
    if (!window.confirm(question)) return;
    try {
      const response = await fetch(`/status/endpoints/${encodeURIComponent(id)}/${action}`, {
        method: "POST", headers: { "X-Fleetroute-CSRF": csrf }, credentials: "same-origin", cache: "no-store",
      });
      const body = await response.json().catch(() => ({}));
      if (!response.ok) throw new Error((body.error && body.error.message) || "HTTP " + response.status);
      say(`${id} is ${body.state}.`);
    } catch (err) {
      say(`${action} ${id} failed: ${err.message}`, true);
    }
    poll();
  }

  // ---- routing decisions -----------------------------------------------------------------------------

  function renderDecisions(feed) {
    const list = document.getElementById("decisions");
    const x = feed.explain;
    document.getElementById("decisions-note").textContent = feed.decisions.length
      ? `The ${feed.decisions.length} newest of ${x.kept} kept (sample rate ${x.sample_rate}); open one for its explanation.`
      : x.sample_rate || x.kept
        ? "None yet."
        : "None recorded: set explain.sampleRate, or send x-fleetroute-explain with the admin token.";
    const wanted = new Set(feed.decisions.map((d) => d.id));
    for (const [id, node] of decisionNodes) {
      if (!wanted.has(id)) { node.remove(); decisionNodes.delete(id); }
    }
    let previous = null;
    for (const d of feed.decisions) {
      let node = decisionNodes.get(d.id);
      if (!node) { node = decisionNode(d); decisionNodes.set(d.id, node); }
      // A decision is listed from its start: its pick, status and duration arrive as the request goes.
      node.querySelector(".endpoint").textContent = d.endpoint || "none";
      node.querySelector(".reason").textContent = d.reason;
      node.querySelector(".why").textContent = d.why;
      node.querySelector(".status").textContent = none(d.status) ? "in progress" : String(d.status);
      node.querySelector(".duration").textContent = dur(d.duration_ms);
      if (previous === null) { if (list.firstChild !== node) list.prepend(node); }
      else if (previous.nextSibling !== node) previous.after(node);
      previous = node;
    }
  }

  function decisionNode(d) {
    const details = el("details", { "data-decision": d.id },
      el("summary", {},
        el("span", { class: "time", text: clock(d.time) }), el("span", { class: "model-name", text: d.model }),
        el("span", { class: "arrow", text: "→" }), el("span", { class: "endpoint" }), el("span", { class: "reason" }),
        el("span", { class: "status" }), el("span", { class: "duration" })),
      el("p", { class: "why" }),
      el("div", { class: "record", text: "loading…" }));
    details.addEventListener("toggle", () => {
      if (details.open && !details.dataset.loaded) loadDecision(details, d.id);
    });
    return el("li", {}, details);
  }

  async function loadDecision(details, id) {
    details.dataset.loaded = "1";
    const box = details.querySelector(".record");
    try {
      const response = await fetch(`/status/decisions/${encodeURIComponent(id)}`, { credentials: "same-origin", cache: "no-store" });
      const record = await response.json();
      if (!response.ok) throw new Error((record.error && record.error.message) || "HTTP " + response.status);
      box.replaceChildren(...renderRecord(record));
    } catch (err) {
      box.textContent = "could not load it: " + err.message;
      delete details.dataset.loaded;
    }
  }

  function fact(value) {
    if (none(value)) return "–";
    if (typeof value === "number") return num(value, 3);
    return typeof value === "object" ? JSON.stringify(value) : String(value);
  }

  function renderRecord(r) {
    const out = [el("p", { class: "meta", text: `policy ${r.policy} (${r.strategy}) · request ${r.request_id} · recorded: ${r.recorded.join(", ")}` })];
    if (r.stickiness) out.push(el("p", { class: "meta", text: "stickiness: " + JSON.stringify(r.stickiness) }));
    if (r.admission) out.push(el("p", { class: "meta", text: "admission: " + JSON.stringify(r.admission) }));
    r.attempts.forEach((a, i) => {
      out.push(el("h4", { text: `Attempt ${i + 1}: ${a.endpoint || "no endpoint"} · ${a.reason}` + (a.outcome ? ` · ${a.outcome}` : "") + (a.status ? ` · ${a.status}` : "") }));
      out.push(el("p", { class: "why", text: a.why }));
      const left = Object.entries(a.pool.left_out || {}).map(([id, why]) => `${id} (${why})`).join(", ");
      const skipped = Object.entries(a.excluded || {}).map(([id, why]) => `${id} (${why})`).join(", ");
      out.push(el("p", { class: "meta", text: `pool: ${a.pool.routable} routable` + (a.pool.panic ? ", in panic" : "") + (left ? `; left out: ${left}` : "") + (skipped ? `; excluded for this request: ${skipped}` : "") }));
      const keys = [...new Set(a.candidates.flatMap((c) => Object.keys(c)).filter((k) => k !== "id"))];
      if (a.candidates.length) {
        out.push(el("table", { class: "candidates" },
          el("thead", {}, el("tr", {}, el("th", { text: "candidate" }), ...keys.map((k) => el("th", { text: k })))),
          el("tbody", {}, ...a.candidates.map((c) => el("tr", { class: c.id === a.endpoint ? "chosen" : "" },
            el("td", { text: c.id }), ...keys.map((k) => el("td", { text: fact(c[k]) })))))));
      }
      if (a.candidates_omitted) out.push(el("p", { class: "meta", text: `${a.candidates_omitted} more candidates not shown` }));
    });
    out.push(el("details", { class: "raw" }, el("summary", { text: "full record (JSON)" }),
      el("pre", { text: JSON.stringify(r, null, 2) })));
    return out;
  }

  // ---- the loop --------------------------------------------------------------------------------------

  // Merge the feed's series into ours; false when an endpoint is new to us (the next feed sends them whole).
  function mergeSeries(feed) {
    const partial = feed.history.series_since !== null;
    const merged = {};
    let complete = true;
    for (const [id, fresh] of Object.entries(feed.series)) {
      const known = series[id];
      if (!partial) { merged[id] = fresh; continue; }
      if (!known || !fresh) { complete = false; merged[id] = fresh || {}; continue; }
      merged[id] = {};
      for (const [name, values] of Object.entries(fresh)) {
        merged[id][name] = (known[name] || []).concat(values).slice(-points);
      }
    }
    series = merged; // endpoints that left are dropped
    return complete;
  }

  function render(feed) {
    points = feed.history.points;
    query = mergeSeries(feed) ? `?since=${feed.history.samples}&pid=${feed.pid}` : "";
    feed.series = series;
    interval = feed.history.interval_s;
    csrf = feed.session.csrf;
    document.getElementById("logout").hidden = !feed.session.cookie;
    const policies = [...new Set(feed.models.map((m) => `${m.policy.name} (${m.policy.strategy})`))];
    document.getElementById("policies").textContent = policies.length ? "policy: " + policies.join(", ") : "no endpoints";
    document.getElementById("models").replaceChildren(...feed.models.map((m) => renderModel(m, feed)));
    renderDecisions(feed);
    const conn = document.getElementById("conn");
    conn.textContent = `updated ${clock(feed.time)} · pid ${feed.pid} · snapshot ${feed.snapshot_version}`;
    conn.className = "conn";
    const h = feed.history;
    document.getElementById("footer").textContent =
      `Sparklines: the last ${Math.round(h.points * h.interval_s / 60)} minutes, one point per ${h.interval_s} s. ` +
      `Percentiles: requests that ended in the last ${Math.round(h.latency_window_s / 60)} minutes (at most ` +
      `${h.latency_samples} per endpoint). TTFT is measured at the router from the request's arrival; ITL is each ` +
      `stream's mean gap between the chunks the router forwarded. This router process's view (pid ${feed.pid}).`;
  }

  async function poll() {
    if (polling) return;
    polling = true;
    clearTimeout(timer);
    try {
      const response = await fetch("/status/feed" + query, { credentials: "same-origin", cache: "no-store" });
      if (response.status === 401) { window.location.reload(); return; } // the session ended: the login form
      if (!response.ok) throw new Error("HTTP " + response.status);
      render(await response.json());
    } catch (err) {
      const conn = document.getElementById("conn");
      conn.textContent = "no answer from the router: " + err.message;
      conn.className = "conn bad";
    } finally {
      polling = false;
      if (!document.hidden) timer = setTimeout(poll, POLL_MS);
    }
  }

  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
  document.getElementById("logout").addEventListener("click", async () => {
    await fetch("/status/logout", { method: "POST", headers: { "X-Fleetroute-CSRF": csrf }, credentials: "same-origin" });
    window.location.assign("/status");
  });
  poll();
})();
