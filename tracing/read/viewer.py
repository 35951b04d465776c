"""The self-contained HTML view of a job's traces: one file, no network.

On top, the diagnosis in plain words (``analysis.diagnose``); then a canvas
timeline, one row per rank x communicator lane on the common time axis, with
zoom (wheel, buttons), pan (drag) and hover details of each op; then the
summary tables (bandwidth, stragglers, clock offsets) and the overlap table.

Every string that comes from a trace is escaped: in the HTML parts with
``html.escape``, and the timeline's data travels as JSON in a
``<script type="application/json">`` block (``<``, ``>`` and ``&`` written as
``\\u003c`` etc., so no trace text can close the block) that the script reads
with ``JSON.parse`` and shows only through ``textContent`` and the canvas.
A Content-Security-Policy of ``default-src 'none'`` keeps the page from
loading anything.

Scale: at most ``MAX_OPS`` ops are drawn one by one.  Beyond that each rank
keeps its latest ops (where a hang is) and every op that did not complete;
its older ops are aggregated per lane into ``BINS`` time bins, drawn as
shaded blocks whose darkness is the fraction of the bin the lane was busy,
with the op count in the hover text.
"""

from __future__ import annotations

import html
import json
import os
import re
from bisect import bisect_left
from itertools import chain
from typing import Any, Dict, List, Optional, Tuple

from tracing.messages import human_bytes, short_error
from tracing.read.story import recovered_text
from tracing.read.analysis import JobScan, OverlapStats, diagnose, straggler_line, summary
from tracing.read.layout import RankLayout, life_ends

MAX_OPS = 60_000
BINS = 600
STEP_ROWS = 200  # steps shown in the per-step overlap table (the latest)
_STATE_CODE = {"completed": 0, "started": 1, "scheduled": 1, "timed_out": 2, "failed": 2, "aborted": 3}


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def _detail(r: Dict[str, Any], rank: int, in_flight: bool, site: Optional[str]) -> str:
    size = r.get("in_bytes") if r.get("in_bytes") is not None else r.get("out_bytes")
    lines = [f"rank {rank}: {r['op']} #{r['seq']} of '{r.get('comm')}' ({r['comm_id']})",
             f"state {r['state']}" + (" (no end recorded)" if in_flight else "")
             + ("" if r.get("duration_ms") is None else f", {r['duration_ms']:.3f} ms"),
             f"{r.get('dtype')}, in {size} B, out {r.get('out_bytes')} B"
             + ("" if r.get("reduce_op") is None else f", {r['reduce_op']}")
             + ("" if r.get("root") is None else f", root {r['root']}")
             + ("" if r.get("peer") is None else f", peer {r['peer']}"),
             f"{'async' if r.get('async_op') else 'sync'}, timeout {r.get('timeout_s')} s, thread {r.get('thread')}",
             f"at {site}" + ("" if site == r.get("call_site") else f" ({r.get('call_site')})")]
    if r.get("life"):
        lines.append(f"life {r['life'] + 1} of this rank (restart {r['life']})")
    if r.get("error"):
        lines.append(f"error: {short_error(r['error'])}")
        lines.append(f"full error text: {r['error']}")
    return "\n".join(lines)


class _Timeline:
    """Collects the timeline's plain values rank by rank (times in us from the first op)."""

    def __init__(self, scan: JobScan, culprits: List[int], bins: int) -> None:
        self.scan = scan
        self.t0, self.t_end = scan.span()
        self.span_us = (self.t_end - self.t0) / 1e3
        self.culprits = set(culprits)
        self.bins = bins
        self.lanes: List[Dict[str, Any]] = []
        self.ops: List[List[Any]] = []
        self.details: List[str] = []
        self.agg: List[List[Any]] = []
        self.aggregated = 0

    def add(self, rank: int, lay: RankLayout) -> None:
        """Lay out one rank: its latest ops (``JobScan.detail_budget``) and every unfinished
        one in detail, the older ones binned."""
        src, off = self.scan.sources[rank], self.scan.offsets[rank].offset_ns
        base = self.t0 + off  # the anchor axis minus this, in ns from the first op
        first = len(self.lanes)
        for lane in lay.lanes:
            self.lanes.append({"rank": rank, "culprit": rank in self.culprits,
                               "label": f"rank {rank} {lane.name}" + (f" #{lane.number + 1}" if lane.number else "")})
        ends: Dict[int, int] = {}  # draw index -> end, of the ops the page may detail
        for i, (k, j) in lay.at.items():
            ends[i] = lay.lanes[k].end(j)
        if lay.open_life:  # drawn to the end of the trace, or of its life when the rank was restarted after it
            last = life_ends(src, src.wall_minus_mono_ns or 0, self.t_end + off)
            for i, life in lay.open_life.items():
                k, j = lay.at[i]
                ends[i] = max(lay.lanes[k].start[j], last.get(life, self.t_end + off))
        budget = self.scan.detail_budget or lay.count
        top = sorted(chain(lay.latest, (ends[i] for i in lay.open_life)))
        cut = top[-budget] if lay.count > budget else None
        width = 1 if cut is None else max(1, (cut - base) // self.bins + 1)
        records, site = lay.records, self.scan.site
        detailed = sorted(i for i in records if cut is None or ends[i] >= cut or i in lay.incomplete)
        for i in detailed:
            r, (k, j) = records[i], lay.at[i]
            start = lay.lanes[k].start[j]
            self.ops.append([first + k, (start - base) / 1e3, (ends[i] - start) / 1e3,
                             _STATE_CODE.get(r["state"], 1), len(self.details), r["op"]])
            self.details.append(_detail(r, rank, i in lay.open_life, site(r.get("call_site"), rank)))
        if len(detailed) == lay.count:
            return
        self.aggregated += lay.count - len(detailed)
        skipped: Dict[int, List[int]] = {}  # lane -> positions of its detailed ops, ascending
        for i in detailed:
            skipped.setdefault(lay.at[i][0], []).append(lay.at[i][1])
        cells = []  # (draw index of its first op, lane, bin, ops, busy ns), per time bin of a lane
        for k, lane in enumerate(lay.lanes):
            starts, busy, skip = lane.start, lane.busy, sorted(skipped.get(k, ()))
            lo = 0
            while lo < len(starts):
                b = (starts[lo] - base) // width
                hi = bisect_left(starts, base + (b + 1) * width, lo)
                qa, qb = bisect_left(skip, lo), bisect_left(skip, hi)
                if hi - lo > qb - qa:
                    first_op = lo
                    for q in skip[qa:qb]:
                        if q != first_op:
                            break
                        first_op += 1
                    cells.append((lane.draw[first_op], first + k, b, hi - lo - (qb - qa),
                                  busy[hi] - busy[lo] - sum(busy[q + 1] - busy[q] for q in skip[qa:qb])))
                lo = hi
        for _, k, b, n, took in sorted(cells):
            self.agg.append([k, b * width / 1e3, width / 1e3, n, took / 1e3])

    def data(self, story: Dict[str, Any]) -> Dict[str, Any]:
        """What the page's script reads: the ops, and the recovery story's markers (across
        every row), generation bands, and the gaps between a restarted rank's lives."""
        us = lambda t: (t - self.t0) / 1e3  # noqa: E731
        gaps = []
        for rank, lives in self.scan.lives.items():
            rows = [i for i, lane in enumerate(self.lanes) if lane["rank"] == rank]
            for (_, _, end), (life, start, _) in zip(lives, lives[1:]):
                if rows and start > end:
                    gaps.append([rows[0], rows[-1], us(end), us(start), f"rank {rank} restarted: life {life + 1}"])
        return {"span_us": self.span_us, "lanes": self.lanes, "ops": self.ops, "details": self.details,
                "bins": self.agg, "aggregated": self.aggregated,
                "markers": [[us(m["t_ns"]), m["kind"], m["label"]] for m in story["markers"]],
                "bands": [[us(b["start_ns"]), us(b["end_ns"]), b["generation"]] for b in story["generations"]],
                "gaps": gaps}


def _cell(c: Any) -> str:
    """A table cell; a (text, full) pair shows ``text`` with ``full`` on hover."""
    if isinstance(c, tuple):
        text, full = c
        return f"<td title='{_e(full)}'>{_e(text)}</td>" if full and full != text else f"<td>{_e(text)}</td>"
    return f"<td>{_e(c)}</td>"


def _table(head: List[str], rows: List[List[Any]], ident: str = "") -> str:
    out = [f"<table{f' id={ident!r}' if ident else ''}><tr>", *(f"<th>{_e(h)}</th>" for h in head), "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(_cell(c) for c in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _main_thread(main: Optional[Dict[str, Any]]) -> Tuple[str, Optional[str]]:
    """A rank's main thread at its last dump but an exit: where, with the frames as the cell's title."""
    if not main:
        return "-", None
    return f"{main['at'] or '?'} (on {main['reason']})", "\n".join(main["frames"])


def _below(path: str, inputs: List[str]) -> str:
    """``path`` relative to the input directory it was found in (as given when it is not below one)."""
    for d in inputs:
        if os.path.isdir(d) and os.path.abspath(path).startswith(os.path.abspath(d) + os.sep):
            return os.path.relpath(path, d)
    return path


def _recovery_rows(story: Dict[str, Any], t0: int) -> List[List[Any]]:
    """The recovery table: loss, each survivor's detection, decision, resume; admissions and heals; fencing."""
    at = lambda t: f"{(t - t0) / 1e9:.3f}"  # noqa: E731
    rows: List[List[Any]] = []
    for loss in story["losses"]:
        step = "-" if loss["step"] is None else loss["step"]
        rows.append(["loss", at(loss["t_ns"]), step, ", ".join(map(str, loss["lost"])),
                     f"generation {loss['generation']} of '{loss['lineage']}'"])
        for d in loss["detections"]:
            rows.append(["detection", at(d["t_ns"]), step, d["rank"],
                         (f"+{d['latency_s']:.3f} s after the {loss['detection_base']}: {d['how']}", d["error"])])
        if loss["decision_s"] is not None:
            rows.append(["decision", at(loss["t_ns"] + int(loss["decision_s"] * 1e9)), step,
                         ", ".join(map(str, loss["members_after"] or [])),
                         f"generation {loss['decision_generation']}: members {loss['members_before']} -> "
                         f"{loss['members_after']}, {loss['decision_s']:.3f} s after the first detection"])
        if loss["resume_s"] is not None:
            took = recovered_text(loss)
            took = took and f"; {took}"
            rows.append(["resume", at(loss["t_ns"] + int(loss["resume_s"] * 1e9)), step, "",
                         f"first op of generation {loss['decision_generation']}, {loss['resume_s']:.3f} s after "
                         f"the first detection{took}"])
        else:
            rows.append(["no resume", "-", step, "", "no later generation ran an op"])
    for adm in story["admissions"]:
        step = "-" if adm["step"] is None else adm["step"]
        rows.append(["admission", at(adm["t_ns"]), step, ", ".join(map(str, adm["joined"])),
                     f"generation {adm['generation']}: members {adm['members_before']} -> {adm['members_after']}"
                     + ("" if adm["seconds"] is None else f", {adm['seconds']:.3f} s on the survivors")])
        for h in adm["heals"]:  # at the step it continued at (its heal's), which the survivors went back to
            rows.append(["heal", at(h["t_ns"]), step if h["step"] is None else h["step"], h["rank"],
                         f"{'restarted; ' if h['restarted'] else ''}{human_bytes(h['bytes'] or 0)} from rank "
                         f"{h['source']}"
                         + ("" if h.get("source_replica") is None else f" of replica group {h['source_replica']}")
                         + ("" if h["seconds"] is None else f" in {h['seconds']:.3f} s")])
    for f in story["fenced"]:
        rows.append(["fenced", at(f["t_ns"]), "-", f["rank"], (short_error(f["why"]), f["why"])])
    return rows


def _f(v: Optional[float], fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def render(scan: JobScan, title: str) -> str:
    """The whole page of a job read with ``JobScan(..., detail=MAX_OPS)`` (or another number
    of ops to draw one by one)."""
    if scan.detail_budget is None:
        raise ValueError("the view needs a JobScan read with detail (the ops drawn one by one)")
    d = diagnose(scan)
    s = summary(scan)
    tl = _Timeline(scan, d["culprits"], BINS)
    for rank in sorted(scan.sources):
        tl.add(rank, scan.layouts[rank])
    ov = [scan.overlap[rank] for rank in sorted(scan.overlap)]
    by_step: Dict[int, List[OverlapStats]] = {}
    for (_, step), st in sorted(scan.step_overlap.items()):
        by_step.setdefault(step, []).append(st)
    story = d["recovery"]
    data = tl.data(story)
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e") \
        .replace("&", "\\u0026")
    status = "ok" if d["ok"] else "bad"
    findings = "".join(f"<li class='{_e(f['severity'])}'><b>{_e(f['severity'])}</b>: {_e(f['text'])}</li>"
                       for f in d["findings"])
    stands = _table(["rank", "where it stands", "call site", "lives", "files", "how it ended (its dumps)",
                     "its main thread when dumped"],
                    [[r["rank"], r["stands"], (r["call_site"] or "-", r.get("call_site_full")), r.get("lives", 0),
                      (", ".join(_below(f, scan.paths) for f in r["files"]) or "none", ", ".join(r["files"])),
                      (r.get("reason") or "-", r.get("reason_full")), _main_thread(r.get("main_thread"))]
                     for r in d["ranks"]])
    recovery = "" if not story["losses"] and not story["admissions"] else (
        "<h3>recovery</h3>" + _table(["event", "at s", "step", "ranks", "what"],
                                     _recovery_rows(story, tl.t0), "recovery"))
    comm_tables = "".join(
        f"<h3>communicator {_e(c['name'])} ({_e(c['uid'])})</h3>"
        + _table(["rank", "last entered", "last completed", "call site"],
                 [[row["rank"], row["last_entered"] or ("no trace" if not row["present"] else "-"),
                   row["last_completed"] or "-", row["call_site"] or "-"] for row in c["rows"]])
        for c in d["communicators"])
    groups = _table(["communicator", "op", "size", "ranks", "count", "total ms", "mean ms", "p50 ms", "p99 ms",
                     "algbw GB/s", "busbw GB/s"],
                    [[g["comm"], g["op"], g["bucket"], g["ranks"], g["count"], _f(g["total_ms"]), _f(g["mean_ms"]),
                      _f(g["p50_ms"]), _f(g["p99_ms"]), _f(g["algbw_gbps"], ".4f"), _f(g["busbw_gbps"], ".4f")]
                     for g in s["groups"]])
    strag = _table(["rank", "collectives", "waited s", "last to arrive"],
                   [[r["rank"], r["collectives"], _f(r["wait_s"], ".4f"), r["last_arrivals"]] for r in s["stragglers"]])
    clock = _table(["rank", "reference", "offset us", "low us", "high us", "+/- us", "from ops"],
                   [[c["rank"], c["reference"], _f(c["offset_us"], ".1f"), _f(c["low_us"], ".1f"),
                     _f(c["high_us"], ".1f"), _f(c["uncertainty_us"], ".1f"), c["collectives"]] for c in s["clock"]])
    overlap = _table(["rank", "RS ops", "AG ops", "RS s", "AG s", "hidden RS s", "hidden %", "comm s", "exposed s"],
                     [[o.rank, o.rs_count, o.ag_count, _f(o.rs_s, ".4f"), _f(o.ag_s, ".4f"), _f(o.hidden_rs_s, ".4f"),
                       _f(100 * o.hidden_fraction, ".1f"), _f(o.comm_s, ".4f"), _f(o.exposed_comm_s, ".4f")]
                      for o in ov])
    shown = sorted(by_step)[-STEP_ROWS:]
    steps = "" if not by_step else (
        f"<h3>per step (the last {len(shown)} of {len(by_step)} steps; means over the ranks)</h3>" + _table(
            ["step", "ranks", "comm s", "exposed s", "most exposed", "hidden RS %"],
            [[step, len(sts), _f(sum(x.comm_s for x in sts) / len(sts), ".4f"),
              _f(sum(x.exposed_comm_s for x in sts) / len(sts), ".4f"),
              "rank %d: %.4f s" % max(((x.rank, x.exposed_comm_s) for x in sts), key=lambda t: t[1]),
              _f(100 * sum(x.hidden_rs_s for x in sts) / max(1e-12, sum(x.rs_s for x in sts)), ".1f")
              if any(x.rs_s for x in sts) else "-"]
             for step, sts in ((k, by_step[k]) for k in shown)]))
    problems = "".join(f"<li>{_e(p)}</li>" for p in d["problems"])
    note = (f"{data['aggregated']} older ops are aggregated into shaded time bins (darker: busier); "
            f"{len(data['ops'])} ops are drawn one by one." if data["aggregated"] else
            f"{len(data['ops'])} ops.")
    return fill(_PAGE, {
        "TITLE": _e(title), "STATUS": status, "HEADLINE": _e(d["headline"]), "FINDINGS": findings,
        "RECOVERY": recovery,
        "PROBLEMS": f"<h3>input problems</h3><ul>{problems}</ul>" if problems else "", "STANDS": stands,
        "COMMS": comm_tables, "NOTE": _e(note), "GROUPS": groups, "STRAG": strag,
        "STRAGGLER": _e(straggler_line(s["straggler"])), "CLOCK": clock, "OVERLAP": overlap + steps, "SCRIPT": _SCRIPT,
        "DATA": payload})


_PLACEHOLDER = re.compile(r"%([A-Z]+)%")


def fill(template: str, values: Dict[str, str]) -> str:
    """``template`` with each ``%NAME%`` replaced by ``values[NAME]``, in one pass
    over the template: a value that holds ``%DATA%`` (a trace string can) is
    never substituted again, so the page grows with its input, not its square."""
    parts = _PLACEHOLDER.split(template)
    parts[1::2] = [values[name] for name in parts[1::2]]
    return "".join(parts)


def write_html(scan: JobScan, path: str, title: str) -> None:
    """Write the page (``render``) to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(scan, title))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<link rel="icon" href="data:,">
<title>%TITLE%</title>
<style>
body{font:13px/1.4 system-ui,sans-serif;margin:12px;color:#222}
h1{font-size:18px;margin:0 0 8px} h2{font-size:15px;margin:18px 0 6px} h3{font-size:13px;margin:10px 0 4px}
#diagnosis{padding:8px 12px;border-radius:6px;border:1px solid #ccc}
#diagnosis.bad{background:#fdecea;border-color:#e0a09a} #diagnosis.ok{background:#eaf6ea;border-color:#9ac79a}
#headline{font-size:15px;font-weight:600} li.error b{color:#b00} li.warning b{color:#a60} li.info b{color:#555}
table{border-collapse:collapse;margin:4px 0} td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}
th{background:#f3f3f3} #tl{border:1px solid #ccc;display:block;cursor:grab;width:100%}
#tip{position:fixed;display:none;background:#222;color:#fff;padding:6px 8px;border-radius:4px;
 white-space:pre;font:12px monospace;pointer-events:none;max-width:720px;overflow:hidden;z-index:9}
#controls button{margin-right:4px} .legend span{display:inline-block;width:10px;height:10px;margin:0 3px 0 10px}
</style></head>
<body>
<h1>%TITLE%</h1>
<div id="diagnosis" class="%STATUS%"><div id="headline">%HEADLINE%</div>%RECOVERY%<ul>%FINDINGS%</ul>%PROBLEMS%
<h3>where each rank stands</h3>%STANDS%</div>
<h2>timeline</h2>
<div id="controls"><button id="zin">zoom in</button><button id="zout">zoom out</button><button id="reset">reset</button>
 wheel: zoom at the pointer, drag: pan, double-click: reset. <span id="range"></span>
 <span class="legend"><span style="background:#4a7fc1"></span>completed<span style="background:#e08a1e"></span>in
 flight<span style="background:#c62828"></span>timed out / failed<span style="background:#888"></span>aborted</span></div>
<p>%NOTE%</p>
<canvas id="tl"></canvas><div id="tip"></div><ul id="markers"></ul>
<h2>communicators</h2>%COMMS%
<h2>summary</h2>%GROUPS%
<h3>straggler time (waiting for the last arrival)</h3><p>straggler: %STRAGGLER%</p>%STRAG%
<h3>clock offsets (subtracted from each rank's times; the true offset lies within the bounds)</h3>%CLOCK%
<h2>reduce-scatter / all-gather overlap</h2>%OVERLAP%
<div id="errors"></div>
<script type="application/json" id="data">%DATA%</script>
<script>%SCRIPT%</script>
</body></html>
"""

_SCRIPT = r"""
"use strict";
window.addEventListener("error", function (e) {
  document.getElementById("errors").textContent += "script error: " + e.message + "\n";
});
(function () {
  const data = JSON.parse(document.getElementById("data").textContent);
  const canvas = document.getElementById("tl"), tip = document.getElementById("tip");
  const ctx = canvas.getContext("2d");
  const ROW = 18, LABEL = 190, AXIS = 22;
  const COLORS = ["#4a7fc1", "#e08a1e", "#c62828", "#888"];
  const MARKS = {loss: "#d00", decision: "#a0a", resume: "#080", admit: "#06c", fenced: "#000"};
  const lanes = data.lanes, nl = lanes.length;
  const byLane = lanes.map(function () { return []; });
  data.ops.forEach(function (o) { byLane[o[0]].push(o); });
  byLane.forEach(function (l) { l.sort(function (a, b) { return a[1] - b[1]; }); });
  const binsByLane = lanes.map(function () { return []; });
  data.bins.forEach(function (b) { binsByLane[b[0]].push(b); });
  const full = Math.max(data.span_us, 1);
  let v0 = 0, v1 = full, dragX = null, dragV0 = 0;

  function size() {
    const w = canvas.clientWidth || 1000, h = AXIS + Math.max(1, nl) * ROW + 4;
    const dpr = window.devicePixelRatio || 1;
    canvas.width = w * dpr; canvas.height = h * dpr; canvas.style.height = h + "px";
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return w;
  }
  let W = size();
  function x(t) { return LABEL + (t - v0) / (v1 - v0) * (W - LABEL); }
  function t(px) { return v0 + (px - LABEL) / (W - LABEL) * (v1 - v0); }
  function fmt(us) {
    const a = Math.abs(us);
    return a >= 1e6 ? (us / 1e6).toFixed(3) + " s" : a >= 1e3 ? (us / 1e3).toFixed(3) + " ms" : us.toFixed(1) + " us";
  }
  function draw() {
    ctx.clearRect(0, 0, W, canvas.height);
    ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
    const step = Math.pow(10, Math.floor(Math.log10((v1 - v0) / 5 || 1)));
    ctx.fillStyle = "#666"; ctx.strokeStyle = "#eee";
    for (let s = Math.ceil(v0 / step) * step; s <= v1; s += step) {
      const px = x(s);
      ctx.beginPath(); ctx.moveTo(px, AXIS - 4); ctx.lineTo(px, canvas.height); ctx.stroke();
      ctx.fillText(fmt(s), px + 2, 8);
    }
    (data.bands || []).forEach(function (b, i) {
      const a = Math.max(LABEL, x(b[0])), e = Math.min(W, x(b[1]));
      if (e <= a) return;
      ctx.fillStyle = i % 2 ? "rgba(120,170,120,0.10)" : "rgba(120,120,200,0.08)";
      ctx.fillRect(a, AXIS, e - a, canvas.height - AXIS);
      ctx.fillStyle = "#474"; ctx.fillText("generation " + b[2], a + 3, AXIS - 6);
    });
    for (let i = 0; i < nl; i++) {
      const y = AXIS + i * ROW;
      if (i > 0 && lanes[i].rank !== lanes[i - 1].rank) {
        ctx.strokeStyle = "#999"; ctx.beginPath(); ctx.moveTo(0, y); ctx.lineTo(W, y); ctx.stroke();
      }
      ctx.fillStyle = lanes[i].culprit ? "#fdecea" : "#fafafa"; ctx.fillRect(0, y, LABEL - 4, ROW - 1);
      ctx.fillStyle = lanes[i].culprit ? "#b00" : "#222";
      ctx.fillText(lanes[i].label.slice(0, 30), 4, y + ROW / 2);
      binsByLane[i].forEach(function (b) {
        if (b[1] + b[2] < v0 || b[1] > v1) return;
        ctx.fillStyle = "rgba(74,127,193," + Math.min(1, 0.15 + b[4] / b[2]).toFixed(3) + ")";
        ctx.fillRect(x(b[1]), y + 3, Math.max(1, x(b[1] + b[2]) - x(b[1])), ROW - 7);
      });
      const ops = byLane[i];
      for (let k = 0; k < ops.length; k++) {
        const o = ops[k];
        if (o[1] > v1) break;
        if (o[1] + o[2] < v0) continue;
        const a = Math.max(LABEL, x(o[1])), b = Math.min(W, x(o[1] + o[2]));
        ctx.fillStyle = COLORS[o[3]];
        ctx.fillRect(a, y + 2, Math.max(1, b - a), ROW - 5);
        if (b - a > 40) { ctx.fillStyle = "#fff"; ctx.fillText(o[5], a + 3, y + ROW / 2); }
      }
    }
    (data.gaps || []).forEach(function (g) {
      const a = Math.max(LABEL, x(g[2])), e = Math.min(W, x(g[3]));
      if (e <= a) return;
      const y0 = AXIS + g[0] * ROW, h = (g[1] - g[0] + 1) * ROW;
      ctx.fillStyle = "rgba(0,0,0,0.12)"; ctx.fillRect(a, y0, e - a, h);
      ctx.strokeStyle = "#777"; ctx.setLineDash([4, 3]); ctx.strokeRect(a, y0 + 1, e - a, h - 2); ctx.setLineDash([]);
      ctx.fillStyle = "#444"; ctx.fillText("restart", a + 3, y0 + ROW / 2);
    });
    (data.markers || []).forEach(function (m) {
      const px = x(m[0]);
      if (px < LABEL || px > W) return;
      ctx.strokeStyle = MARKS[m[1]] || "#000"; ctx.lineWidth = 2;
      ctx.beginPath(); ctx.moveTo(px, AXIS - 10); ctx.lineTo(px, canvas.height); ctx.stroke(); ctx.lineWidth = 1;
    });
    document.getElementById("range").textContent = "showing " + fmt(v0) + " to " + fmt(v1);
  }
  function zoom(f, at) {
    const c = at === undefined ? (v0 + v1) / 2 : at;
    const nv0 = c - (c - v0) * f, nv1 = c + (v1 - c) * f;
    if (nv1 - nv0 < 0.01) return;
    v0 = Math.max(-full * 0.05, nv0); v1 = Math.min(full * 1.05, nv1); draw();
  }
  function hit(ev) {
    const r = canvas.getBoundingClientRect(), px = ev.clientX - r.left, py = ev.clientY - r.top;
    const lane = Math.floor((py - AXIS) / ROW);
    if (lane < 0 || lane >= nl || px < LABEL) return null;
    const at = t(px), slack = 2 * (v1 - v0) / (W - LABEL), ops = byLane[lane];
    let lo = 0, hi = ops.length - 1, best = -1;
    while (lo <= hi) { const m = (lo + hi) >> 1; if (ops[m][1] <= at + slack) { best = m; lo = m + 1; } else hi = m - 1; }
    if (best >= 0 && ops[best][1] + ops[best][2] >= at - slack) return data.details[ops[best][4]];
    const bin = binsByLane[lane].find(function (b) { return b[1] <= at && at <= b[1] + b[2]; });
    return bin ? lanes[lane].label + ": " + bin[3] + " ops aggregated, busy " + fmt(bin[4]) + " of " + fmt(bin[2]) : null;
  }
  canvas.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    const r = canvas.getBoundingClientRect();
    zoom(ev.deltaY < 0 ? 0.8 : 1.25, t(ev.clientX - r.left));
  }, {passive: false});
  canvas.addEventListener("mousedown", function (ev) { dragX = ev.clientX; dragV0 = v0; canvas.style.cursor = "grabbing"; });
  window.addEventListener("mouseup", function () { dragX = null; canvas.style.cursor = "grab"; });
  canvas.addEventListener("mousemove", function (ev) {
    if (dragX !== null) {
      const d = (ev.clientX - dragX) / (W - LABEL) * (v1 - v0), w = v1 - v0;
      v0 = dragV0 - d; v1 = v0 + w; draw(); tip.style.display = "none"; return;
    }
    const text = hit(ev);
    if (text) {
      tip.textContent = text; tip.style.display = "block";
      tip.style.left = Math.min(ev.clientX + 12, window.innerWidth - 400) + "px"; tip.style.top = (ev.clientY + 12) + "px";
    } else tip.style.display = "none";
  });
  canvas.addEventListener("mouseleave", function () { tip.style.display = "none"; });
  canvas.addEventListener("dblclick", function () { v0 = 0; v1 = full; draw(); });
  document.getElementById("zin").onclick = function () { zoom(0.5); };
  document.getElementById("zout").onclick = function () { zoom(2); };
  document.getElementById("reset").onclick = function () { v0 = 0; v1 = full; draw(); };
  window.addEventListener("resize", function () { W = size(); draw(); });
  draw();
  const list = document.getElementById("markers");
  (data.markers || []).forEach(function (m) {
    const li = document.createElement("li");
    li.className = "marker " + m[1];
    li.style.color = MARKS[m[1]] || "#000";
    li.textContent = fmt(m[0]) + ": " + m[2];
    list.appendChild(li);
  });
  document.body.dataset.markers = String((data.markers || []).length);
  document.body.dataset.rendered = String(data.ops.length);
  console.log("commslayer-trace view rendered " + data.ops.length + " ops");
})();
"""
