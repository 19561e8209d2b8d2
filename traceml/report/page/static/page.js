// traceml page: renders one snapshot document (the report model plus series)
// into the dashboard (polling api/snapshot beside it) or final_summary.html (embedded).
// Plain DOM, SVG and canvas; nothing is fetched from anywhere else.
"use strict";
(function () {
  // The stacked parts of a step (every phase, then wait) as [column, name, colour],
  // from the phase table the document carries (traceml/phases.py).
  let PHASES = [];
  let WAITING = new Set();  // columns whose time is mostly waiting for other ranks
  const RANK_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
    "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
  const ABOVE = "#ff4f9a";  // many-rank heatmap: above the colour scale
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const SECTIONS = [["step_time", "Step Time"], ["step_memory", "Step Memory"],
    ["process", "Process"], ["system", "System"], ["throughput", "Throughput"],
    ["ending", "Ending"]];
  // The throughput numbers shown, as [key, unit] (traceml/report/text.py THROUGHPUT_UNITS).
  const RATES = [["samples_per_s", "samples/s"], ["tokens_per_s", "tokens/s"],
    ["achieved_tflops", "TFLOP/s"], ["mfu_pct", "MFU"]];
  const SVG_NS = "http" + "://www.w3.org/2000/svg";
  const state = { doc: null, renders: 0, laneViews: {}, lanesDrawn: null, clipIds: 0 };

  function $(id) { return document.getElementById(id); }

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    for (const child of [].concat(children || [])) {
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function sv(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fill(id, children) { $(id).replaceChildren(...[].concat(children)); }

  function fmtMs(v) {
    if (v === null || v === undefined) return "–";
    if (v >= 100) return v.toFixed(0);
    return v >= 10 ? v.toFixed(1) : v.toFixed(2);
  }

  function fmtBytes(v) {
    if (v === null || v === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
  }

  function fmtDuration(s) {
    s = Math.floor(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return h + ":" + String(m).padStart(2, "0") + ":" + String(sec).padStart(2, "0");
  }

  // As format_ranks in traceml/diagnosis/finding.py (which shows 4 in a sentence; a
  // header's rank list shows 8): a finding may name hundreds of ranks.
  function ranksText(ranks, limit = 8) {
    const shown = ranks.slice(0, limit).map((r) => "r" + r).join(", ");
    return ranks.length > limit ? `${shown} +${ranks.length - limit} more` : shown;
  }

  function sevBadge(sev) { return el("span", { class: "sev " + sev }, sev); }

  function renderHeader(doc) {
    const meta = doc.summary.meta;
    const nodes = doc.summary.system.scope.num_nodes;
    fill("run", [`session ${meta.session_id} · ${meta.world_size} rank(s) on ${nodes} node(s)` +
      ` · ${meta.device} · ${fmtDuration(doc.elapsed_s)}`]);
    const status = $("status");
    if (doc.ended) {
      status.className = "status ended";
      status.textContent = meta.exit_code === null ? "ended" : "ended · exit " + meta.exit_code;
    } else {
      status.className = "status running";
      status.textContent = "running · live";
    }
  }

  function renderVerdict(doc) {
    const p = doc.summary.primary;
    const title = SECTIONS.find((s) => s[0] === p.section);
    const where = (title ? title[1] : p.section) + (p.ranks.length ? " · " + ranksText(p.ranks) : "");
    const kicker = doc.ended ? "Final verdict" : "Current diagnosis (recent steps)";
    const box = $("verdict");
    box.className = "verdict " + p.severity;
    box.dataset.label = p.label;
    box.dataset.final = doc.ended ? "true" : "false";
    box.replaceChildren(
      el("div", { class: "kicker" }, kicker),
      el("div", {}, [el("span", { class: "label" }, p.label + " "), sevBadge(p.severity),
        el("span", { class: "run" }, "  " + where)]),
      el("div", { class: "why" }, p.why),
      p.next ? el("div", { class: "next" }, "Next: " + p.next) : "",
      ...endingLines(doc, p));
  }

  // How the run ended besides the verdict: a stall that cleared stays in view.
  function endingLines(doc, primary) {
    const ending = doc.summary.ending;
    if (!ending) return [];
    return ending.findings.filter((f) => !(primary.section === "ending" && f.kind === primary.kind))
      .map((f) => el("div", { class: "ending " + f.severity, "data-kind": f.kind },
        [el("span", { class: "label" }, f.label + " "), sevBadge(f.severity),
          el("span", {}, " " + f.why)]));
  }

  // Many ranks (doc.wide): spreads across ranks and the worst ranks, no row per rank.
  function renderSpreadTable(doc) {
    const wide = doc.wide, steps = doc.summary.step_time.scope.num_steps || 0;
    const cols = PHASES.map((p) => p[0]).concat(["total_ms"]).filter((c) => c in wide.phases);
    if (!cols.length) { fill("table", el("p", { class: "empty" }, "Waiting for the first steps…")); return; }
    $("table-title").textContent = `Step time across ${wide.num_ranks} ranks, ms: each rank's ` +
      `median of ${steps} aligned steps`;
    const name = (c) => c.replace("_ms", "");
    const head = el("tr", {}, [el("th", {}, "")].concat(cols.map((c) => el("th", {}, name(c)))));
    const row = (key, label, cell) => el("tr", { "data-spread": key },
      [el("td", {}, label)].concat(cols.map((c) => el("td", {}, cell(wide.phases[c])))));
    const spreads = el("table", { "data-table": "spread" }, [el("thead", {}, head), el("tbody", {}, [
      row("median", "median", (s) => fmtMs(s.median)), row("p90", "p90", (s) => fmtMs(s.p90)),
      row("worst", "worst", (s) => fmtMs(s.worst_ranks[0].value)),
      row("worst-rank", "worst rank", (s) => "r" + s.worst_ranks[0].rank)])]);
    const k = Math.max(...cols.map((c) => wide.phases[c].worst_ranks.length));
    const worst = el("table", { "data-table": "worst" }, [
      el("thead", {}, el("tr", {}, [el("th", {}, "phase")].concat(
        Array.from({ length: k }, (_, i) => el("th", {}, "#" + (i + 1)))))),
      el("tbody", {}, cols.map((c) => el("tr", { "data-worst-phase": c }, [el("td", {}, name(c))]
        .concat(wide.phases[c].worst_ranks.map((v) => el("td", { "data-rank": String(v.rank) },
          `r${v.rank} ${fmtMs(v.value)}`))))))]);
    const out = [spreads, el("h2", {}, `The ${k} worst ranks by each phase, ms (their median)`), worst];
    const last = wide.last_step;
    if (last) {
      out.push(el("p", { class: "why", "data-last-step": String(last.worst_ranks[0].rank) },
        `Newest step: median ${Math.round(last.median)}, lowest ${last.worst_ranks[0].value} ` +
        `(r${last.worst_ranks[0].rank})`));
    }
    fill("table", out);
  }

  function renderTable(doc) {
    if (doc.wide) { renderSpreadTable(doc); return; }
    const rows = doc.phases;
    if (!rows.length) {
      const watch = doc.summary.meta.mode === "watch";
      fill("table", el("p", { class: "empty" }, watch ?
        "traceml watch times no steps: System and Process only." : "Waiting for the first steps…"));
      return;
    }
    const steps = doc.summary.step_time.scope.num_steps || 0;
    $("table-title").textContent = `Step time per rank, ms: median / worst of ${steps} aligned steps`;
    const cols = PHASES.map((p) => p[0]).concat(["total_ms"]);
    const head = el("tr", {}, ["rank", "node", "step"].concat(cols.map((c) => c.replace("_ms", "")))
      .map((h) => el("th", {}, h)));
    const body = rows.map((r) => el("tr", { "data-rank": String(r.rank) }, [
      el("td", {}, "r" + r.rank), el("td", {}, r.node_rank === null ? "–" : "n" + r.node_rank),
      el("td", {}, r.last_step === null ? "–" : String(r.last_step))].concat(cols.map((c) => {
      const text = c in r.median_ms ? fmtMs(r.median_ms[c]) + " / " + fmtMs(r.worst_ms[c]) : "–";
      return el("td", cellMark(doc, r.rank, c, rows.length), text);
    }))));
    const worst = el("tr", { class: "worst" }, [el("td", {}, "most time"), el("td", {}, ""),
      el("td", {}, "")].concat(cols.map((c) => el("td", {}, !(c in doc.worst_ranks) ? "–" :
        "r" + doc.worst_ranks[c] + (WAITING.has(c) ? " (waiting)" : "")))));
    const key = el("p", { class: "key", "data-key": "table" }, "Red: what the verdict blames. " +
      "Bold: the rank with the most time in a phase. Italic: the most time in collectives, " +
      "mostly waiting for a slower rank rather than work of its own.");
    fill("table", [el("table", {}, [el("thead", {}, head), el("tbody", {}, body.concat([worst]))]),
      key]);
  }

  // How a phase-table cell is marked: "hot" where a Step Time finding blames that rank's
  // phase; else, for the rank with the most time in a column, "waited" in a column of
  // waiting (communication: the rank that waits for a straggler has the most) or "most".
  function cellMark(doc, rank, column, numRanks) {
    const label = ((doc.blamed || {})[String(rank)] || {})[column];
    if (label) return { class: "hot", title: `${label}: r${rank}` };
    if (numRanks < 2 || doc.worst_ranks[column] !== rank) return {};
    if (WAITING.has(column)) {
      return { class: "waited", title: "The most time in collectives: mostly waiting for " +
        "slower ranks, not this rank's own work" };
    }
    return { class: "most", title: "The most time of the ranks in this phase" };
  }

  function axes(svg, box, yMax, yFmt, xs) {
    const { x0, y0, w, h } = box;
    svg.append(sv("line", { x1: x0, y1: y0 + h, x2: x0 + w, y2: y0 + h, stroke: "#d0d7de" }));
    for (const f of [0, 0.5, 1]) {
      const y = y0 + h - f * h;
      svg.append(sv("line", { x1: x0, y1: y, x2: x0 + w, y2: y, stroke: "#eaeef2" }));
      svg.append(sv("text", { x: x0 - 4, y: y + 3, "text-anchor": "end" }, yFmt(f * yMax)));
    }
    if (xs.length) {
      svg.append(sv("text", { x: x0, y: y0 + h + 12 }, "step " + xs[0]));
      svg.append(sv("text", { x: x0 + w, y: y0 + h + 12, "text-anchor": "end" },
        "step " + xs[xs.length - 1]));
    }
  }

  function xScale(lo, hi, box) {
    const span = Math.max(1, hi - lo);
    return (x) => box.x0 + ((x - lo) / span) * box.w;
  }

  function stepRange(ranks) {
    let lo = Infinity, hi = -Infinity;
    for (const r of ranks) {
      if (r.step.length) { lo = Math.min(lo, r.step[0]); hi = Math.max(hi, r.step[r.step.length - 1]); }
    }
    return lo === Infinity ? [0, 1] : [lo, hi];
  }

  function usePhaseTable(table) {
    PHASES = table.filter((p) => p.kind === "phase" || p.kind === "wait")
      .map((p) => [p.column, p.name, p.colour]);
    WAITING = new Set(table.filter((p) => p.waits).map((p) => p.column));
    const select = $("heat-phase");
    if (select.options.length) return;
    for (const p of table.filter((p) => p.kind !== "compute")) {
      select.append(el("option", { value: p.column }, p.name));
    }
  }

  function renderLegend() {
    fill("legend", PHASES.map(([, name, color]) => el("span", {}, [
      el("span", { class: "swatch", style: "background:" + color }), name])));
  }

  function phaseChart(r, lo, hi, yMax) {
    const box = { x0: 40, y0: 6, w: 270, h: 110 };
    const svg = sv("svg", { viewBox: "0 0 320 134", role: "img" });
    axes(svg, box, yMax, fmtMs, [lo, hi]);
    const x = xScale(lo, hi, box);
    const y = (v) => box.y0 + box.h - (Math.min(v, yMax) / yMax) * box.h;
    const base = r.step.map(() => 0);
    for (const [key, name, color] of PHASES) {
      const top = base.map((b, i) => b + (r[key][i] || 0));
      const upper = r.step.map((s, i) => `${x(s).toFixed(1)},${y(top[i]).toFixed(1)}`);
      const lower = r.step.map((s, i) => `${x(s).toFixed(1)},${y(base[i]).toFixed(1)}`).reverse();
      if (r.step.length === 1) {
        upper.push(`${(x(r.step[0]) + 3).toFixed(1)},${y(top[0]).toFixed(1)}`);
        lower.unshift(`${(x(r.step[0]) + 3).toFixed(1)},${y(base[0]).toFixed(1)}`);
      }
      svg.append(sv("path", { d: "M" + upper.concat(lower).join("L") + "Z", fill: color,
        "fill-opacity": "0.85", "data-phase": name }));
      top.forEach((v, i) => { base[i] = v; });
    }
    const last = r.step.length ? r.step[r.step.length - 1] : "";
    return el("figure", { "data-chart": "phases", "data-rank": String(r.rank),
      "data-points": String(r.step.length), "data-last-step": String(last) },
      [el("figcaption", {}, `r${r.rank} · ms per step`), svg]);
  }

  // One metric over steps across ranks: the median..p90 band and the max line.
  function bandChart(band, steps, fmt, attrs, caption, color, size) {
    const box = { x0: size.x0, y0: 6, w: size.w - size.x0 - 10, h: size.h - 24 };
    const svg = sv("svg", { viewBox: `0 0 ${size.w} ${size.h}`, role: "img" });
    let yMax = 0;
    for (const v of band.max) yMax = Math.max(yMax, v || 0);
    yMax = yMax > 0 ? yMax * 1.05 : 1;
    const lo = steps.length ? steps[0] : 0, hi = steps.length ? steps[steps.length - 1] : 1;
    axes(svg, box, yMax, fmt, steps.length ? [lo, hi] : []);
    const x = xScale(lo, hi, box), y = (v) => box.y0 + box.h - (v / yMax) * box.h;
    const at = (key) => steps.map((s, i) => [s, band[key][i]]).filter((p) => p[1] !== null)
      .map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`);
    const med = at("median"), p90 = at("p90");
    if (med.length) {
      svg.append(sv("path", { d: "M" + p90.concat(med.slice().reverse()).join("L") + "Z", fill: color,
        "fill-opacity": "0.3", "data-band": "p90" }));
    }
    for (const [key, width, dash] of [["median", "1.8", ""], ["max", "1", "3 2"]]) {
      const pts = at(key);
      if (pts.length === 1) pts.push(pts[0]);
      svg.append(sv("polyline", { points: pts.join(" "), fill: "none", stroke: color,
        "stroke-width": width, "stroke-dasharray": dash, "data-band": key }));
    }
    return el("figure", Object.assign({ "data-points": String(steps.length) }, attrs),
      [el("figcaption", {}, caption), svg]);
  }

  function renderBandCharts(doc) {
    const grid = doc.wide.grid, n = doc.wide.num_ranks;
    $("phases-title").textContent = `Step time per phase over steps, across ${n} ranks`;
    const parts = PHASES.concat([["total_ms", "total", "#333333"]]).filter((p) => p[0] in grid.bands);
    if (!grid.steps.length) { fill("phases", el("p", { class: "empty" }, "No steps yet.")); return; }
    fill("phases", parts.map(([key, name, color]) => bandChart(grid.bands[key], grid.steps, fmtMs,
      { "data-chart": "bands", "data-phase": key }, `${name} · ms per step across ${n} ranks: ` +
      "median, p90 (band), max (dashed)", color, { x0: 40, w: 320, h: 134 })));
  }

  function renderPhaseCharts(doc) {
    if (doc.wide) { renderBandCharts(doc); return; }
    $("phases-title").textContent = "Step time per phase over steps, per rank";
    const ranks = doc.series.ranks;
    if (!ranks.length) { fill("phases", el("p", { class: "empty" }, "No steps yet.")); return; }
    const [lo, hi] = stepRange(ranks);
    let yMax = 0;
    for (const r of ranks) for (const v of r.total_ms) yMax = Math.max(yMax, v || 0);
    yMax = yMax > 0 ? yMax : 1;
    fill("phases", ranks.map((r) => phaseChart(r, lo, hi, yMax)));
  }

  // Swimlanes: the typical and the slowest step, a lane per rank (at many ranks the
  // named, slowest, fastest and median ranks, and a density band of all of them).
  const LANE_H = 16, LANE_GAP = 4, LANE_X0 = 110, LANE_W = 900;

  function laneColor(name) {
    const p = PHASES.find((q) => q[1] === name);
    return p ? p[2] : "#999999";
  }

  function drawLanes(svg, s, view) {
    svg.replaceChildren();
    const [lo, hi] = view;
    const x = (t) => LANE_X0 + ((t - lo) / Math.max(1e-9, hi - lo)) * LANE_W;
    const density = s.density ? PHASES.filter((p) => s.density[p[1]]) : [];
    const rows = s.lanes.length + density.length;
    const height = rows * (LANE_H + LANE_GAP) + 24;
    svg.setAttribute("viewBox", `0 0 ${LANE_X0 + LANE_W + 10} ${height}`);
    const defs = sv("defs");
    state.clipIds += 1;
    const clipId = "lanes-clip-" + state.clipIds;
    const cp = sv("clipPath", { id: clipId });
    cp.append(sv("rect", { x: LANE_X0, y: 0, width: LANE_W, height }));
    defs.append(cp);
    svg.append(defs);
    const body = sv("g", { "clip-path": `url(#${clipId})` });
    s.lanes.forEach((lane, i) => {
      const y = i * (LANE_H + LANE_GAP);
      const g = sv("g", { "data-lane": String(lane.rank) });
      svg.append(sv("text", { x: LANE_X0 - 6, y: y + LANE_H - 4, "text-anchor": "end",
        class: "lane" }, "r" + lane.rank));
      const step = sv("rect", { x: x(lane.begin_ms), y, height: LANE_H - 4,
        width: Math.max(0.5, x(lane.begin_ms + lane.total_ms) - x(lane.begin_ms)),
        fill: "#eaeef2", stroke: "#d0d7de", "data-phase": "step" });
      step.append(sv("title", {}, `r${lane.rank} step ${s.step}: ${fmtMs(lane.total_ms)} ms` +
        (Object.keys(lane.not_drawn_ms).length ? "; not drawn: " + Object.entries(
          lane.not_drawn_ms).map(([k, v]) => `${k} ${fmtMs(v)} ms`).join(", ") : "")));
      g.append(step);
      let depth = 0, ends = [];
      for (const [name, b, e] of lane.phases) {
        while (ends.length && ends[ends.length - 1] <= b) ends.pop();
        depth = ends.length;
        ends.push(e);
        const inset = Math.min(depth * 2, 5);
        const t0 = lane.begin_ms + b, t1 = lane.begin_ms + e;
        const r = sv("rect", { x: x(t0), y: y + inset, width: Math.max(0.5, x(t1) - x(t0)),
          height: LANE_H - 4 - 2 * inset, fill: laneColor(name), "data-phase": name,
          "data-ms": (e - b).toFixed(3) });
        r.append(sv("title", {}, `r${lane.rank} ${name}: ${fmtMs(e - b)} ms, ` +
          `from +${fmtMs(b)} ms`));
        g.append(r);
      }
      for (const [a, e] of lane.in_flight || []) {
        const r = sv("rect", { x: x(lane.begin_ms + a), y: y + LANE_H - 3, height: 2,
          width: Math.max(0.5, x(lane.begin_ms + e) - x(lane.begin_ms + a)), fill: "#1f2328",
          "data-phase": "in-flight" });
        r.append(sv("title", {}, `r${lane.rank} collectives in flight: ${fmtMs(e - a)} ms` +
          (lane.in_flight.length > 1 ? ` (of ${lane.in_flight.length} spans)` : "")));
        g.append(r);
      }
      body.append(g);
    });
    density.forEach(([, name, color], j) => {
      const y = (s.lanes.length + j) * (LANE_H + LANE_GAP);
      const counts = s.density[name], n = counts.length, w = s.span_ms / n;
      svg.append(sv("text", { x: LANE_X0 - 6, y: y + LANE_H - 4, "text-anchor": "end" }, name));
      const g = sv("g", { "data-density": name });
      counts.forEach((c, k) => {
        if (!c) return;
        g.append(sv("rect", { x: x(k * w), y, width: Math.max(0.5, x((k + 1) * w) - x(k * w)),
          height: LANE_H - 4, fill: color, "fill-opacity": (0.15 + 0.85 * c / s.num_ranks).toFixed(3) }));
      });
      g.append(sv("title", {}, `${name}: how many of the ${s.num_ranks} ranks were in it`));
      body.append(g);
    });
    svg.append(body);
    const yAxis = rows * (LANE_H + LANE_GAP) + 4;
    svg.append(sv("line", { x1: LANE_X0, y1: yAxis, x2: LANE_X0 + LANE_W, y2: yAxis, stroke: "#d0d7de" }));
    for (const f of [0, 0.25, 0.5, 0.75, 1]) {
      const t = lo + f * (hi - lo);
      svg.append(sv("text", { x: LANE_X0 + f * LANE_W, y: yAxis + 12,
        "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle" }, fmtMs(t) + " ms"));
    }
  }

  function laneChart(s) {
    const svg = sv("svg", { role: "img", "data-chart": "lanes", "data-step": String(s.step) });
    const full = [0, Math.max(s.span_ms, 1e-3)];
    const key = s.label.split(" ")[0];  // "typical" or "slowest": kept across live refreshes
    const kept = state.laneViews[key];
    let view = kept ? [Math.max(0, Math.min(kept[0], full[1])), Math.min(kept[1], full[1])]
      : full.slice(), drag = null;
    if (!(view[1] > view[0])) view = full.slice();
    const redraw = () => {
      state.laneViews[key] = view.slice();
      svg.dataset.view = view.map((v) => v.toFixed(3)).join(",");
      drawLanes(svg, s, view);
    };
    const at = (event) => {
      const box = svg.getBoundingClientRect(), scale = box.width / (LANE_X0 + LANE_W + 10);
      const f = Math.max(0, Math.min(1, ((event.clientX - box.left) / scale - LANE_X0) / LANE_W));
      return view[0] + f * (view[1] - view[0]);
    };
    svg.addEventListener("wheel", (event) => {
      if (!event.deltaY) return;  // a sideways swipe: not a zoom
      event.preventDefault();
      const t = at(event), k = Math.min(2, Math.max(0.5, Math.exp(event.deltaY * 0.002)));
      const lo = t - (t - view[0]) * k, hi = t + (view[1] - t) * k;
      view = [Math.max(full[0], lo), Math.min(full[1], Math.max(hi, lo + 1e-3))];
      redraw();
    }, { passive: false });
    svg.addEventListener("mousedown", (event) => { drag = [event.clientX, view.slice()]; });
    for (const end of ["mouseup", "mouseleave"]) svg.addEventListener(end, () => { drag = null; });
    svg.addEventListener("mousemove", (event) => {
      if (!drag) return;
      const box = svg.getBoundingClientRect(), scale = box.width / (LANE_X0 + LANE_W + 10);
      const dt = -((event.clientX - drag[0]) / scale / LANE_W) * (drag[1][1] - drag[1][0]);
      const width = drag[1][1] - drag[1][0];
      const lo = Math.max(full[0], Math.min(full[1] - width, drag[1][0] + dt));
      view = [lo, lo + width];
      redraw();
    });
    svg.addEventListener("dblclick", () => { view = full.slice(); redraw(); });
    redraw();
    const shown = s.lanes.length < s.num_ranks
      ? ` · ${s.lanes.length} of ${s.num_ranks} ranks drawn (slowest, fastest, median, singled out), ` +
        "the density of all below" : "";
    return el("figure", { "data-chart": "lane-step", "data-label": s.label },
      [el("figcaption", {}, `${s.label}: ${fmtMs(s.span_ms)} ms from the first rank's begin ` +
        `to the last rank's end${shown}`), svg]);
  }

  function renderLanes(doc) {
    const lanes = doc.lanes || [];
    $("lanes").className = "lanes";
    const drawn = JSON.stringify(lanes);  // unchanged on a live refresh: keep a drag going
    if (drawn === state.lanesDrawn) return;
    state.lanesDrawn = drawn;
    const keys = new Set(lanes.map((s) => s.label.split(" ")[0]));
    for (const k of Object.keys(state.laneViews)) if (!keys.has(k)) delete state.laneViews[k];
    if (!lanes.length) {
      fill("lanes", el("p", { class: "empty" }, "No step with its phases placed yet " +
        "(a store written before traceml placed phases has none)."));
      return;
    }
    fill("lanes", lanes.map(laneChart));
  }

  function viridis(t) {
    t = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i;
    const c = VIRIDIS[i].map((a, k) => Math.round(a + (VIRIDIS[i + 1][k] - a) * f));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  function heatGrid(ranks, key) {
    const steps = Array.from(new Set(ranks.flatMap((r) => r.step))).sort((a, b) => a - b);
    const col = new Map(steps.map((s, i) => [s, i]));
    // Colours span the 2nd..98th percentile, so one slow step does not darken the rest.
    const values = ranks.flatMap((r) => r[key]).filter((v) => v !== null).sort((a, b) => a - b);
    if (!values.length) return { steps, col, lo: 0, hi: 1 };
    const at = (q) => values[Math.min(values.length - 1, Math.floor(q * (values.length - 1)))];
    return { steps, col, lo: at(0.02), hi: at(0.98) };
  }

  function heatCells(heat) {
    if (!heat.levels) heat.levels = Uint8Array.from(atob(heat.cells), (c) => c.charCodeAt(0));
    return heat.levels;
  }

  function rowName(pair) { return pair[0] === pair[1] ? "r" + pair[0] : `r${pair[0]}–${pair[1]}`; }

  // Many ranks: the grid the document carries, already cut to rank and step buckets.
  function renderWideHeatmap(doc) {
    const canvas = $("heatmap"), key = $("heat-phase").value, grid = doc.wide.grid;
    const heat = grid.heat[key] || { lo: 0, hi: 0, cells: "" }, cells = heatCells(heat);
    const rows = grid.row_ranks.length, cols = grid.steps.length;
    const cellH = Math.max(2, Math.min(18, Math.floor(512 / Math.max(1, rows))));
    const left = 70, bottom = 34, width = Math.max(300, $("heat-wrap").clientWidth - 12);
    const height = rows * cellH + bottom, ratio = window.devicePixelRatio || 1;
    canvas.width = width * ratio; canvas.height = height * ratio;
    canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const cellW = (width - left) / Math.max(1, cols);
    const colours = Array.from({ length: 254 }, (_, q) => viridis(q / 253)).concat([ABOVE, "#eaeef2"]);
    for (let row = 0; row < rows; row += 1) {
      for (let col = 0; col < cols; col += 1) {
        ctx.fillStyle = colours[cells[row * cols + col]];
        ctx.fillRect(left + col * cellW, row * cellH, Math.ceil(cellW), cellH);
      }
    }
    ctx.font = "10px system-ui, sans-serif"; ctx.fillStyle = "#656d76";
    const every = Math.ceil(14 / cellH);
    for (let row = 0; row < rows; row += every) ctx.fillText(rowName(grid.row_ranks[row]), 4, row * cellH + 10);
    drawHeatScale(ctx, { steps: grid.steps, lo: heat.lo, hi: heat.hi }, left, rows * cellH, width);
    const x = Math.min(width - 60, left + 90 + Math.max(60, Math.min(200, width - left - 260)) + 70);
    ctx.fillStyle = ABOVE; ctx.fillRect(x, rows * cellH + 18, 10, 10);
    ctx.fillStyle = "#656d76"; ctx.fillText("above", x + 14, rows * cellH + 27);
    canvas.dataset.ranks = grid.row_ranks.length ? grid.row_ranks[0][0] + "-" + grid.row_ranks[rows - 1][1] : "";
    canvas.dataset.rows = String(rows);
    canvas.dataset.cols = String(cols);
    state.heat = { wide: true, grid, heat, cells, key, cellW, cellH, left };
  }

  function wideHeatTip(h, row, col) {
    if (row < 0 || col < 0 || row >= h.grid.row_ranks.length || col >= h.grid.steps.length) return "\u00a0";
    const q = h.cells[row * h.grid.steps.length + col], first = h.grid.steps[col];
    const steps = h.grid.bucket_steps > 1 ? `steps ${first}–${first + h.grid.bucket_steps - 1}` : "step " + first;
    const value = q === 255 ? "–" : q === 0 ? "≤" + fmtMs(h.heat.lo) : q === 254 ? ">" + fmtMs(h.heat.hi) :
      "≈" + fmtMs(h.heat.lo + (q / 253) * (h.heat.hi - h.heat.lo));
    return `${rowName(h.grid.row_ranks[row])} · ${steps} · ${h.key.replace("_ms", "")} max ${value} ms`;
  }

  function renderHeatmap(doc) {
    if (doc.wide) { renderWideHeatmap(doc); return; }
    const canvas = $("heatmap"), key = $("heat-phase").value, ranks = doc.series.ranks;
    const grid = heatGrid(ranks, key);
    const cellH = Math.max(3, Math.min(18, Math.floor(360 / Math.max(1, ranks.length))));
    const left = 44, bottom = 34, width = Math.max(300, $("heat-wrap").clientWidth - 12);
    const height = ranks.length * cellH + bottom;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = width * ratio; canvas.height = height * ratio;
    canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const cellW = (width - left) / Math.max(1, grid.steps.length), span = grid.hi - grid.lo || 1;
    ctx.font = "10px system-ui, sans-serif"; ctx.fillStyle = "#656d76";
    ranks.forEach((r, row) => {
      if (cellH >= 9 || row % Math.ceil(9 / cellH) === 0) ctx.fillText("r" + r.rank, 4, row * cellH + cellH - 3);
      r.step.forEach((s, i) => {
        const v = r[key][i];
        ctx.fillStyle = v === null ? "#eaeef2" : viridis((v - grid.lo) / span);
        ctx.fillRect(left + grid.col.get(s) * cellW, row * cellH, Math.ceil(cellW), cellH - (cellH > 5 ? 1 : 0));
      });
    });
    drawHeatScale(ctx, grid, left, ranks.length * cellH, width);
    canvas.dataset.ranks = ranks.map((r) => r.rank).join(",");
    canvas.dataset.cols = String(grid.steps.length);
    state.heat = { grid, ranks, key, cellW, cellH, left };
  }

  function drawHeatScale(ctx, grid, left, top, width) {
    ctx.fillStyle = "#656d76";
    if (grid.steps.length) {
      ctx.fillText("step " + grid.steps[0], left, top + 12);
      const end = "step " + grid.steps[grid.steps.length - 1];
      ctx.fillText(end, width - ctx.measureText(end).width - 2, top + 12);
    }
    const x0 = left + 90, w = Math.max(60, Math.min(200, width - left - 260));
    for (let i = 0; i < w; i += 1) { ctx.fillStyle = viridis(i / w); ctx.fillRect(x0 + i, top + 18, 1, 10); }
    ctx.fillStyle = "#656d76";
    ctx.fillText("≤" + fmtMs(grid.lo) + " ms", x0 - 56, top + 27);
    ctx.fillText("≥" + fmtMs(grid.hi) + " ms", x0 + w + 6, top + 27);
  }

  function heatTip(event) {
    const h = state.heat;
    if (!h) return;
    const rect = $("heatmap").getBoundingClientRect();
    const row = Math.floor((event.clientY - rect.top) / h.cellH);
    const col = Math.floor((event.clientX - rect.left - h.left) / h.cellW);
    if (h.wide) { $("heat-tip").textContent = wideHeatTip(h, row, col); return; }
    const r = h.ranks[row], step = h.grid.steps[col];
    if (!r || step === undefined) { $("heat-tip").textContent = "\u00a0"; return; }
    const i = r.step.indexOf(step);
    const v = i < 0 ? null : r[h.key][i];
    $("heat-tip").textContent = `r${r.rank} · step ${step} · ${h.key.replace("_ms", "")} ${fmtMs(v)} ms`;
  }

  function memoryMetric(ranks) {
    for (const key of ["peak_reserved_bytes", "peak_allocated_bytes", "rss_bytes"]) {
      if (ranks.some((r) => r[key].some((v) => v !== null))) return key;
    }
    return null;
  }

  const MEMORY_NAMES = { peak_reserved_bytes: "device peak reserved", peak_allocated_bytes:
    "device peak allocated", rss_bytes: "host RSS" };

  function renderWideMemory(doc) {
    const grid = doc.wide.grid, key = Object.keys(MEMORY_NAMES).find((k) => k in grid.bands);
    if (key === undefined) { fill("memory", el("p", { class: "empty" }, "No memory measured yet.")); return; }
    $("memory-title").textContent = `Memory over steps: ${MEMORY_NAMES[key]} across ${doc.wide.num_ranks} ranks`;
    fill("memory", bandChart(grid.bands[key], grid.steps, fmtBytes,
      { "data-chart": "memory", "data-metric": key }, "median, p90 (band), max (dashed)",
      RANK_COLORS[0], { x0: 64, w: 960, h: 200 }));
  }

  function renderMemory(doc) {
    if (doc.wide) { renderWideMemory(doc); return; }
    const ranks = doc.series.ranks, key = memoryMetric(ranks);
    const names = MEMORY_NAMES;
    if (key === null) { fill("memory", el("p", { class: "empty" }, "No memory measured yet.")); return; }
    $("memory-title").textContent = "Memory over steps: " + names[key] + " per rank";
    const box = { x0: 64, y0: 8, w: 880, h: 170 };
    const svg = sv("svg", { viewBox: "0 0 960 200", role: "img", "data-chart": "memory",
      "data-metric": key, "data-ranks": ranks.map((r) => r.rank).join(",") });
    let yMax = 0;
    for (const r of ranks) for (const v of r[key]) yMax = Math.max(yMax, v || 0);
    yMax = yMax > 0 ? yMax * 1.05 : 1;
    const [lo, hi] = stepRange(ranks);
    axes(svg, box, yMax, fmtBytes, [lo, hi]);
    const x = xScale(lo, hi, box), y = (v) => box.y0 + box.h - (v / yMax) * box.h;
    ranks.forEach((r, n) => {
      const pts = r.step.map((s, i) => [s, r[key][i]]).filter((p) => p[1] !== null)
        .map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`);
      if (pts.length === 1) pts.push(pts[0]);
      svg.append(sv("polyline", { points: pts.join(" "), fill: "none", "stroke-width": "1.5",
        stroke: RANK_COLORS[n % RANK_COLORS.length], "data-rank": String(r.rank) }));
    });
    const legend = el("div", { class: "legend" }, ranks.slice(0, 32).map((r, n) => el("span", {}, [
      el("span", { class: "swatch", style: "background:" + RANK_COLORS[n % RANK_COLORS.length] }),
      "r" + r.rank])));
    fill("memory", [legend, svg]);
  }

  function gaugeRow(row) {
    return el("div", { class: "gauge-row", "data-gauges": row.name }, [
      el("div", { class: "name" }, row.name)].concat(row.gauges.map((g) => {
      const pct = g.pct === null ? null : Math.max(0, Math.min(100, g.pct));
      const level = pct === null ? "" : pct >= 90 ? "crit" : pct >= 75 ? "warn" : "";
      const bar = pct === null ? el("span", {}, "") :
        el("div", { class: "bar" }, el("span", { class: level, style: `width:${pct}%` }));
      return el("div", { class: "gauge" }, [el("span", {}, g.label), bar, el("span", {}, g.text)]);
    })));
  }

  function fmtRate(v, unit) {
    if (v === null || v === undefined) return "–";
    if (unit === "MFU") return v.toFixed(1) + "%";
    if (unit === "TFLOP/s") return v.toPrecision(3);
    return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString("en-US") : String(+v.toPrecision(4));
  }

  // Many ranks: the ranks' median, p10 and lowest rate (the rank named) instead of a row each.
  function spreadRates(spreads) {
    const cell = (k, u, f) => el("td", {}, k in spreads ? f(spreads[k], u) : "–");
    return [["median", (s, u) => fmtRate(s.median, u)], ["p10", (s, u) => fmtRate(s.p90, u)],
      ["lowest", (s, u) => fmtRate(s.worst_ranks[0].value, u) + " r" + s.worst_ranks[0].rank]]
      .map(([name, f]) => el("tr", { "data-spread": name }, [el("td", {}, "ranks " + name)]
        .concat(RATES.map(([k, u]) => cell(k, u, f)))));
  }

  function renderThroughput(doc) {
    const tp = doc.summary.throughput;
    if (!tp || !(doc.wide ? Object.keys(doc.wide.phases).length : tp.ranks.length)) {
      fill("throughput", el("p", { class: "empty" }, "Waiting for the first steps…"));
      return;
    }
    const job = tp.job;
    const head = el("tr", {}, ["rank"].concat(RATES.map((r) => r[1])).map((h) => el("th", {}, h)));
    const body = doc.wide ? spreadRates(doc.wide.throughput) : tp.ranks.map((r) => el("tr",
      { "data-rank": String(r.rank) },
      [el("td", {}, "r" + r.rank)].concat(RATES.map(([k, u]) => el("td", {}, fmtRate(r[k], u))))));
    const total = el("tr", { class: "worst", "data-job": "true" }, [el("td", {}, "job")]
      .concat(RATES.map(([k, u]) => el("td", {}, fmtRate(job[k], u)))));
    fill("throughput", [
      el("table", {}, [el("thead", {}, head), el("tbody", {}, body.concat([total]))]),
      el("p", { class: "why", "data-source": "peak" }, "Peak: " + job.peak_source),
      el("p", { class: "why", "data-source": "flops" }, "FLOPs: " + job.flops_source)]);
  }

  function renderGauges(doc) {
    const rows = doc.nodes.concat(doc.processes);
    fill("gauges", rows.length ? rows.map(gaugeRow) : el("p", { class: "empty" }, "No samples yet."));
  }

  function renderFindings(doc) {
    const out = [];
    for (const [key, title] of SECTIONS) {
      out.push(el("div", { class: "section-title" }, title));
      if (!doc.summary[key]) continue;  // a summary from before the section existed
      for (const f of doc.summary[key].findings) {
        out.push(el("div", { class: "finding", "data-kind": f.kind }, [
          el("div", {}, [el("strong", {}, f.label + " "), sevBadge(f.severity),
            f.ranks.length ? " " + ranksText(f.ranks) : ""]),
          el("div", { class: "why" }, f.why),
          f.next ? el("div", { class: "next" }, "Next: " + f.next) : ""]));
      }
    }
    fill("findings", out);
  }

  // The operators of each profiler capture (final_summary.json's captures): the suspect
  // against the reference, per step, the same steps on both (traceml/report/text.py).
  function renderCaptures(doc) {
    const captures = doc.summary.captures || [];
    if (!captures.length) {
      fill("captures", el("p", { class: "empty" },
        "None: no live finding asked for one, and no one ran traceml capture."));
      return;
    }
    fill("captures", captures.map((c) => {
      const last = c.first_step + c.steps_asked - 1;
      const steps = c.steps_asked === 1 ? "step " + c.first_step : `steps ${c.first_step}–${last}`;
      const ref = c.reference === null ? null : "r" + c.reference;
      const head = el("div", {}, [el("strong", {}, c.id), " · ",
        c.trigger === "manual" ? "asked with traceml capture" : c.label, " · ", steps,
        " on r" + c.suspect + (ref ? " and " + ref : "")]);
      const cols = ["operator", "r" + c.suspect + " ms"].concat(ref ? [ref + " ms", "difference"] : [])
        .concat(["calls", "shapes"]);
      const rows = c.operators.map((o) => el("tr", { "data-operator": o.name,
        class: o.communication ? "collective" : "" }, [
        el("td", {}, o.name + (o.communication ? " (collective)"
          : o.part !== "compute" ? ` (${o.part})` : "")),
        el("td", {}, fmtMs(o.suspect.ms))].concat(ref ? [
          el("td", {}, o.reference ? fmtMs(o.reference.ms) : "–"),
          el("td", {}, (o.diff_ms >= 0 ? "+" : "−") + fmtMs(Math.abs(o.diff_ms)))] : []).concat([
        el("td", {}, String(o.suspect.calls) + (o.reference ? " / " + o.reference.calls : "")),
        el("td", { class: "shapes" }, o.suspect.shapes + (o.reference &&
          o.reference.shapes !== o.suspect.shapes ? " / " + o.reference.shapes : ""))])));
      const totals = [];
      if (c.compute_diff_ms !== null) {
        let text = `r${c.suspect} against ${ref}, ms per step: the compute operators ` +
          `${c.compute_diff_ms >= 0 ? "+" : ""}${c.compute_diff_ms.toFixed(1)}`;
        const p = c.phase_ms;
        if (c.phase && p.suspect !== null && p.reference !== null) {
          const d = p.suspect - p.reference;
          text += ` (${c.phase} as traceml timed these steps: ${d >= 0 ? "+" : ""}${d.toFixed(1)})`;
        }
        totals.push(el("p", { class: "why" }, text));
      }
      return el("div", { class: "capture", "data-capture": c.id }, [head].concat(totals, [
        c.operators.length ? el("table", {}, [
          el("thead", {}, el("tr", {}, cols.map((h) => el("th", {}, h)))),
          el("tbody", {}, rows)]) : ""],
        c.traces.map((t) => el("p", { class: "why", "data-trace": String(t.rank) },
          `Trace r${t.rank}: ${t.path} (${fmtBytes(t.bytes)}; ui.perfetto.dev or chrome://tracing)`)),
        c.notes.map((n) => el("p", { class: "next" }, "Note: " + n))));
    }));
  }

  function render(doc) {
    state.doc = doc;
    renderHeader(doc);
    renderVerdict(doc);
    usePhaseTable(doc.phase_table);  // before the table: its columns are the phases
    renderTable(doc);
    renderLegend();
    renderPhaseCharts(doc);
    renderLanes(doc);
    renderHeatmap(doc);
    renderMemory(doc);
    renderThroughput(doc);
    renderGauges(doc);
    renderFindings(doc);
    renderCaptures(doc);
    const v = doc.summary.meta.versions;
    fill("footer", `traceml ${v.traceml} · torch ${v.torch} · python ${v.python} · ` +
      `schema ${doc.summary.schema_version} · ${doc.series.bucket_steps} step(s) per point` +
      (doc.wide ? ` · ${doc.wide.num_ranks} ranks: spreads across ranks, ` +
        `${doc.wide.grid.row_ranks.length} heatmap rows (max of each rank bucket)` : ""));
    state.renders += 1;
    if (state.renders === 1) document.body.dataset.firstRenderMs = performance.now().toFixed(0);
    document.body.dataset.renders = String(state.renders);
    document.body.dataset.ended = doc.ended ? "true" : "false";
  }

  function poll(url, intervalMs, failures) {
    fetch(url, { cache: "no-store" })
      .then((resp) => { if (!resp.ok) throw new Error("HTTP " + resp.status); return resp.json(); })
      .then((doc) => {
        render(doc);
        if (!doc.ended) setTimeout(() => poll(url, intervalMs, 0), intervalMs);
      })
      .catch(() => {
        const status = $("status");
        status.className = "status lost";
        if (failures >= 4) { status.textContent = "the dashboard server has stopped"; return; }
        status.textContent = "connection lost · retrying";
        setTimeout(() => poll(url, intervalMs, failures + 1), intervalMs);
      });
  }

  function start() {
    const data = JSON.parse($("traceml-data").textContent);
    $("heat-phase").addEventListener("change", () => { if (state.doc) renderHeatmap(state.doc); });
    $("heatmap").addEventListener("mousemove", heatTip);
    window.addEventListener("resize", () => { if (state.doc) renderHeatmap(state.doc); });
    if (data.poll) poll(data.poll, data.interval_ms, 0);
    else render(data);
  }

  start();
})();
