// The status page: polls this daemon's /status and /history every 2 s and draws them, the loss curves as
// inline SVG. Text that comes from other peers' records is only ever set with textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const HISTORY_POINTS = 500;
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = { width: 800, height: 300, left: 58, right: 14, top: 12, bottom: 32 };

const byId = (id) => document.getElementById(id);
const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
const fmt = (v, digits) => (isNumber(v) ? v.toFixed(digits) : "-");
const shortId = (id) => (typeof id === "string" && id.length > 16 ? `${id.slice(0, 6)}...${id.slice(-6)}` : String(id));

function codecText(t, last) {
  // the scheme (top-k with its density and value width), the last round's bytes sent and its coding error
  const scheme = t.codec_scheme === "topk"
    ? `top-k ${fmt(100 * t.codec_density, 2)}% at ${t.codec_value_bits} bits` : (t.codec_scheme || "-");
  const sent = isNumber(last.bytes_sent) ? `, last round ${fmtBytes(last.bytes_sent)} sent` : "";
  return `${scheme}${sent}, error ${fmt(last.codec_error, 4)}`;
}

function fmtBytes(n) {
  if (!isNumber(n)) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (!isNumber(s)) return "-";
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function node(tag, text, attrs) {
  const element = document.createElement(tag);
  if (text !== undefined) element.textContent = String(text);
  for (const [key, value] of Object.entries(attrs || {})) element.setAttribute(key, value);
  return element;
}

function svg(tag, attrs, text) {
  const element = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) element.setAttribute(key, String(value));
  if (text !== undefined) element.textContent = String(text);
  return element;
}

function row(cells, className) {
  const tr = node("tr");
  if (className) tr.className = className;
  for (const cell of cells) tr.append(cell instanceof Node ? cell : node("td", cell));
  return tr;
}

function renderFacts(status) {
  const t = status.training;
  const last = (t && t.last_round) || {};
  const facts = [
    ["peer id", status.peer_id],
    ["state", status.state],
    ["uptime", fmtSeconds(status.uptime)],
    ["version", status.software_version],
    ["addresses", (status.maddrs || []).join("\n") || "-"],
    ...reachabilityFacts(status.reachability),
  ];
  if (t) {
    const diloco = t.mode === "diloco";
    facts.push(
      ["mode", diloco ? `diloco${t.outer_pending ? " (outer round in flight)" : ""}` : t.mode],
      [diloco ? "phase" : "step", diloco ? `${t.step} (inner step ${t.inner_steps})` : t.step],
      ["device", `${t.device} (${t.precision})`],
      ["compute", isNumber(t.utilisation) ? `${fmt(100 * t.utilisation, 1)}% of wall time` : "-"],
      ["loss", fmt(t.loss, 4)],
      ["validation loss", isNumber(t.validation_loss) ? `${fmt(t.validation_loss, 4)} (step ${t.validation_step})` : "-"],
      ["samples/s", `${fmt(t.samples_per_second, 1)} here, ${fmt(t.swarm_samples_per_second, 1)} swarm`],
      ["trainers", t.peers_training],
      ["rounds", `${t.rounds_ok} averaged, ${t.rounds_solo} solo`],
      ["traffic", `${fmtBytes(t.bytes_sent)} sent, ${fmtBytes(t.bytes_received)} received`],
      ["codec", codecText(t, last)],
    );
    const foreign = Object.keys(t.foreign_peers || {});
    if (foreign.length) facts.push(["other models", foreign.map(shortId).join(", ")]);
  } else {
    facts.push(["training", "off on this peer"]);
  }
  const dl = byId("peer-facts");
  dl.replaceChildren(...facts.flatMap(([k, v]) => [node("dt", k), node("dd", v === undefined ? "-" : v)]));
}

function reachabilityFacts(reach) {
  if (!reach) return [];
  const how = {
    relayed: `through relay ${(reach.relays || []).map(shortId).join(", ")}`,
    unreachable: "NOT reachable: behind NAT, no relay holds a slot yet",
  }[reach.state] || `${reach.state}, at its own addresses`;
  const conns = reach.connections || {};
  const service = reach.relay_service || {};
  let relaying = "off";
  if (service.enabled) {
    relaying = service.active
      ? `${service.reservations_open} slots held, ${service.circuits_open} circuits open, ${fmtBytes(service.bytes_relayed)} relayed`
      : "on, idle until this peer is known to be reachable";
  }
  return [
    ["reachable", `${how} (${conns.direct || 0} direct, ${conns.relayed || 0} relayed connections)`],
    ["relaying for others", relaying],
  ];
}

function via(connection) {
  const text = String(connection || "-");
  return text.startsWith("relay ") ? `relay ${shortId(text.slice(6))}` : text;
}

function renderStall(status) {
  // A swarm whose rounds all fail still trains, each peer alone: nothing else on the page would show it.
  const a = (status.training && status.training.averaging) || {};
  const alert = byId("averaging-stalled");
  alert.hidden = !a.stalled;
  alert.textContent = a.stalled
    ? `Averaging has stopped: ${a.failed_streak} rounds in ${fmtSeconds(a.failing_for)} ended without averaging ` +
      `although ${a.others_in_view} other trainer(s) are in view, so this peer trains alone. ` +
      `Last failure: ${a.last_error}`
    : "";
}

function renderPeers(status) {
  const t = status.training;
  const self = row([
    node("td", `${shortId(status.peer_id)} (this peer)`, { title: status.peer_id }),
    status.state, (status.roles || []).join(","), t ? fmt(t.samples_per_second, 1) : "-",
    status.software_version, "-", "-", "-", (status.maddrs || ["-"])[0],
  ], "self");
  const peers = [...(status.peers || [])].sort((a, b) => String(a.peer_id).localeCompare(String(b.peer_id)));
  const rows = peers.map((p) => {
    const caps = p.capabilities || {};
    return row([
      node("td", shortId(p.peer_id), { title: String(p.peer_id) }),
      p.state, (p.roles || []).join(","), fmt(caps.throughput, 1), p.software_version,
      (caps.experts || []).length, fmtSeconds(p.age), via(p.connection), (p.maddrs || ["-"])[0],
    ], "peer");
  });
  byId("peers-table").tBodies[0].replaceChildren(self, ...rows);
  byId("peer-count").textContent = `(${peers.length} other peer${peers.length === 1 ? "" : "s"})`;
  const error = byId("dht-error");
  error.hidden = !status.dht_error;
  error.textContent = status.dht_error ? `Could not read the swarm's records: ${status.dht_error}` : "";
}

function finitePoints(series) {
  return (series || []).filter((p) => Array.isArray(p) && isNumber(p[1]) && isNumber(p[2]));
}

// Axis ticks a reader can read values off: 1, 2 or 5 times a power of ten, labelled exactly (no 4.46 or
// .0000452). Each tick is { at, label } with `at` in axis units (log10 of the value on a log axis).
function tickLabel(mantissa, exponent) {
  if (exponent < -3 || exponent > 4) return `${mantissa}e${exponent}`;
  return (mantissa * 10 ** exponent).toFixed(Math.max(0, -exponent));
}

// A log axis from 10^y0 to 10^y1: its powers of ten (every other one, or sparser, over many decades), and 2x
// and 5x between them when fewer than three powers of ten fall inside.
function logTicks(y0, y1) {
  const inside = (at) => at >= y0 - 1e-9 && at <= y1 + 1e-9;
  const every = Math.max(1, Math.ceil((Math.floor(y1) - Math.ceil(y0) + 1) / 6));
  const ticks = [];
  for (let k = Math.ceil(y0 / every) * every; k <= y1 + 1e-9; k += every) {
    ticks.push({ at: k, label: tickLabel(1, k) });
  }
  if (ticks.length < 3) {
    for (let k = Math.floor(y0); k <= Math.ceil(y1); k += 1) {
      for (const m of [2, 5]) {
        const at = k + Math.log10(m);
        if (inside(at)) ticks.push({ at, label: tickLabel(m, k) });
      }
    }
    ticks.sort((a, b) => a.at - b.at);
  }
  return ticks;
}

// A linear axis from y0 to y1: steps of 1, 2 or 5 times a power of ten, the one nearest (geometrically) to
// a fifth of the range.
function linearTicks(y0, y1) {
  const raw = (y1 - y0) / 5;
  let exponent = Math.floor(Math.log10(raw));
  const ratio = raw / 10 ** exponent;
  let mantissa = ratio >= Math.sqrt(50) ? 10 : ratio >= Math.sqrt(10) ? 5 : ratio >= Math.sqrt(2) ? 2 : 1;
  if (mantissa === 10) { mantissa = 1; exponent += 1; }
  const step = mantissa * 10 ** exponent;
  const ticks = [];
  for (let i = Math.ceil(y0 / step - 1e-9); i * step <= y1 + step * 1e-9; i += 1) {
    ticks.push({ at: i * step, label: (i * step).toFixed(Math.max(0, -exponent)) });
  }
  return ticks;
}

function yTicks(y0, y1, log) {
  return log ? logTicks(y0, y1) : linearTicks(y0, y1);
}

function renderChart(history) {
  const chart = byId("loss-chart");
  const loss = finitePoints(history && history.loss);
  const validation = finitePoints(history && history.validation_loss);
  chart.replaceChildren();
  chart.dataset.points = String(loss.length);
  chart.dataset.validationPoints = String(validation.length);
  const { width, height, left, right, top, bottom } = CHART;
  if (!loss.length && !validation.length) {
    chart.append(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" },
      history ? "No loss recorded yet" : "This peer does not train"));
    byId("chart-scale").textContent = "";
    return;
  }
  const all = loss.concat(validation);
  let [x0, x1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const lo = Math.min(...all.map((p) => p[2]));
  const hi = Math.max(...all.map((p) => p[2]));
  // A loss that falls by orders of magnitude (e.g. the synthetic task) is only readable on a log scale.
  const log = lo > 0 && hi / lo > 20;
  const f = log ? Math.log10 : (v) => v;
  let [y0, y1] = [f(lo), f(hi)];
  const pad = (y1 - y0) * 0.05 || 0.5;
  [y0, y1] = [y0 - pad, y1 + pad];
  const sx = (s) => left + ((s - x0) / (x1 - x0)) * (width - left - right);
  const sy = (v) => height - bottom - ((f(v) - y0) / (y1 - y0)) * (height - top - bottom);

  for (const tick of yTicks(y0, y1, log)) {
    const y = height - bottom - ((tick.at - y0) / (y1 - y0)) * (height - top - bottom);
    chart.append(svg("line", { x1: left, x2: width - right, y1: y, y2: y, class: "grid" }));
    chart.append(svg("text", { x: left - 6, y: y + 4, "text-anchor": "end", class: "tick y-tick" }, tick.label));
  }
  for (let i = 0; i <= 4; i += 1) {
    const step = Math.round(x0 + ((x1 - x0) * i) / 4);
    chart.append(svg("text", { x: sx(step), y: height - bottom + 16, "text-anchor": "middle", class: "tick" }, step));
  }
  chart.append(svg("text", { x: width - right, y: height - 2, "text-anchor": "end", class: "tick" }, "step"));
  const line = (points, cls) => svg("polyline", {
    class: cls, points: points.map((p) => `${sx(p[1]).toFixed(1)},${sy(p[2]).toFixed(1)}`).join(" "),
  });
  if (loss.length) chart.append(line(loss, "loss"));
  if (validation.length) {
    chart.append(line(validation, "validation"));
    for (const p of validation) chart.append(svg("circle", { cx: sx(p[1]), cy: sy(p[2]), r: 3, class: "validation" }));
  }
  byId("chart-scale").textContent = log ? "(log scale)" : "";
}

function renderRounds(history) {
  const rounds = [...((history && history.rounds) || [])].reverse();
  byId("rounds-table").tBodies[0].replaceChildren(...rounds.map((r) => {
    const excluded = Object.keys(r.excluded || {});
    return row([
      isNumber(r.time) ? new Date(r.time * 1000).toLocaleTimeString() : "-", r.step, r.group_size,
      `${fmt(r.duration, 2)} s`, fmtBytes(r.bytes_sent), fmtBytes(r.bytes_received), fmt(r.codec_error, 4),
      node("td", excluded.length ? excluded.map(shortId).join(", ") : "none", { title: excluded.join("\n") }),
    ]);
  }));
  byId("rounds-table").hidden = !rounds.length;
  byId("no-rounds").hidden = rounds.length > 0;
}

function renderExperts(status) {
  const rows = [];
  for (const p of status.peers || []) {
    for (const uid of (p.capabilities && p.capabilities.experts) || []) {
      rows.push(row([uid, node("td", shortId(p.peer_id), { title: String(p.peer_id) }), p.state]));
    }
  }
  byId("experts-table").tBodies[0].replaceChildren(...rows);
  byId("experts-table").hidden = !rows.length;
  byId("no-experts").hidden = rows.length > 0;
}

function setConnection(ok, text) {
  const badge = byId("connection");
  badge.className = `badge ${ok ? "ok" : "bad"}`;
  badge.textContent = text;
}

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function refresh() {
  try {
    const [status, history] = await Promise.all([getJson("/status"), getJson(`/history?points=${HISTORY_POINTS}`)]);
    byId("run-name").textContent = status.run_name || "";
    document.title = `peerd ${status.run_name || ""} - ${shortId(status.peer_id)}`;
    renderFacts(status);
    renderStall(status);
    renderPeers(status);
    renderChart(history.training);
    renderRounds(history.training);
    renderExperts(status);
    setConnection(true, `live, updated ${new Date().toLocaleTimeString()}`);
    // Lets tests (and anyone scripting the page) wait for a render instead of guessing a delay.
    document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
    document.dispatchEvent(new CustomEvent("peerd:rendered"));
  } catch (error) {
    setConnection(false, `daemon not answering (${error.message})`);
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

refresh();
