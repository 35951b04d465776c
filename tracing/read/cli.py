"""``commslayer-trace``: the command line of the collective trace viewer.

Each subcommand reads one job's traces (directories or files), hands them to
``tracing.read.analysis`` and prints a table, or JSON with ``--json``.  Exit
status: 0 fine, 1 ``diagnose`` found a problem, 2 unusable input or usage:
every failure is one line on stderr, never a traceback.  Trace text reaches
the terminal with its control characters escaped (a name cannot move the
cursor, recolour or retitle the terminal, or fake a line of the report).
Imports neither torch nor commslayer, so it starts fast and runs anywhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

from tracing.read import analysis
from tracing.read.perfetto import export_perfetto
from tracing.read.story import recovered_text
from tracing.read.traceio import TraceFileError, iter_records
from tracing.read.viewer import MAX_OPS, write_html


# C0 and C1 controls (newline and tab too: one printed line is one line of the
# report), DEL, and the Unicode bidirectional and line-separator controls.
_CONTROLS = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
             for c in (*range(0x20), *range(0x7f, 0xa0), 0x200e, 0x200f, *range(0x202a, 0x202f),
                       *range(0x2066, 0x206a), 0x2028, 0x2029)}


def say(line: str = "", file: Optional[TextIO] = None) -> None:
    """Print one line of the report, its control characters escaped (``\\x1b``)."""
    print(line.translate(_CONTROLS), file=file or sys.stdout)


def _warn(problems: List[str]) -> None:
    for p in problems:
        say(f"commslayer-trace: warning: {p}", sys.stderr)


def cmd_overlap(args: argparse.Namespace) -> int:
    """Print per-rank reduce-scatter/all-gather overlap."""
    problems: List[str] = []
    records = iter_records(args.paths, skip_bad=args.skip_bad, problems=problems)
    stats = list((analysis.overlap_by_step(records) if args.by_step else analysis.overlap_by_rank(records)).values())
    _warn(problems)
    if args.json:
        print(json.dumps({"ranks": [s.to_dict() for s in stats], "problems": problems}, indent=1))
        return 0
    step = f"{'step':>6} " if args.by_step else ""
    say(f"{'rank':>4} {step}{'RS ops':>7} {'AG ops':>7} {'RS s':>10} {'AG s':>10} {'hidden RS s':>12} "
        f"{'hidden %':>9} {'comm s':>10} {'exposed s':>10}")
    for s in stats:
        step = f"{s.step:>6} " if args.by_step else ""
        say(f"{s.rank:>4} {step}{s.rs_count:>7} {s.ag_count:>7} {s.rs_s:>10.4f} {s.ag_s:>10.4f} "
            f"{s.hidden_rs_s:>12.4f} {100 * s.hidden_fraction:>8.1f}% {s.comm_s:>10.4f} {s.exposed_comm_s:>10.4f}")
    if not stats:
        say("no records" + (" with a step (only a resilient job's records have one)" if args.by_step else ""))
    return 0


def _num(v: Optional[float], fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def print_summary(s: Dict[str, Any]) -> None:
    """The summary as tables for a terminal."""
    say(f"ranks: {', '.join(map(str, s['ranks'])) or 'none'}")
    say()
    say(f"{'communicator':<22} {'op':<22} {'size':<18} {'n':>3} {'count':>7} {'total ms':>10} {'mean ms':>9} "
        f"{'p50 ms':>9} {'p99 ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for g in s["groups"]:
        say(f"{g['comm'][:22]:<22} {g['op'][:22]:<22} {g['bucket']:<18} {g['ranks']:>3} {g['count']:>7} "
            f"{g['total_ms']:>10.3f} {g['mean_ms']:>9.3f} {g['p50_ms']:>9.3f} {g['p99_ms']:>9.3f} "
            f"{_num(g['algbw_gbps'], '.4f'):>11} {_num(g['busbw_gbps'], '.4f'):>11}")
    say()
    say("straggler time: how long each rank waited for the last member to arrive")
    say(f"{'rank':>4} {'collectives':>11} {'waited s':>10} {'last to arrive':>15}")
    for r in s["stragglers"]:
        say(f"{r['rank']:>4} {r['collectives']:>11} {r['wait_s']:>10.4f} {r['last_arrivals']:>15}")
    say(f"straggler: {analysis.straggler_line(s['straggler'])}")
    say()
    say("clock offsets against the reference rank (subtracted from the rank's times; true value within bounds)")
    say(f"{'rank':>4} {'ref':>4} {'offset us':>11} {'low us':>11} {'high us':>11} {'+/- us':>10} {'from ops':>8}")
    for c in s["clock"]:
        note = "" if c["consistent"] else "  bounds cross: clocks drift?"
        say(f"{c['rank']:>4} {c['reference']:>4} {c['offset_us']:>11.1f} {_num(c['low_us'], '.1f'):>11} "
            f"{_num(c['high_us'], '.1f'):>11} {_num(c['uncertainty_us'], '.1f'):>10} {c['collectives']:>8}{note}")
    if s["recovery"]["lines"]:
        say()
        for line in s["recovery"]["lines"]:
            say(line)
    print_recovery(s["recovery"])


def _report(args: argparse.Namespace, compute: Callable[[analysis.JobScan], Dict[str, Any]],
            show: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """Scan the input, compute, print as JSON or through ``show``; the result."""
    scan = analysis.JobScan(args.paths, skip_bad=args.skip_bad, jobs=args.jobs)
    result = compute(scan)
    _warn(scan.problems)
    if args.json:
        print(json.dumps(result, indent=1))  # ASCII: control characters come out as \\u escapes
    else:
        show(result)
    return result


def cmd_summary(args: argparse.Namespace) -> int:
    """Print the bandwidth/latency tables, stragglers and clock offsets."""
    _report(args, analysis.summary, print_summary)
    return 0


def print_diagnosis(d: Dict[str, Any]) -> None:
    """The diagnosis in plain words for a terminal."""
    say(d["headline"])
    for f in d["findings"]:
        say(f"  {f['severity']}: {f['text']}")
    print_recovery(d.get("recovery") or {})
    say()
    say("where each rank stands:")
    for r in d["ranks"]:
        files = "no files" if not r["files"] else ("dump" if r.get("dump") else "JSON lines only, no dump")
        lives = f", {r['lives']} lives" if r.get("lives", 1) > 1 else ""
        why = f", {r['reason']}" if r.get("reason") else ""
        say(f"  rank {r['rank']}: {r['stands']} [{files}{lives}{why}]")
        main = r.get("main_thread")
        if main:
            say(f"    its main thread was at {main['at'] or '?'} when it dumped on {main['reason']}")
    for c in d["communicators"]:
        say()
        say(f"communicator '{c['name']}' ({c['uid']}), ranks {', '.join(map(str, c['members']))}:")
        for row in c["rows"]:
            where = "" if not row.get("from") else f" ({row['from']})"
            if row["last_entered"] is None and row.get("from"):
                none = "no trace" if not row["present"] else "no record of its own"
                say(f"  rank {row['rank']}: {none}; {row['from']}")
            elif not row["present"]:
                say(f"  rank {row['rank']}: no trace")
            else:
                say(f"  rank {row['rank']}: last entered {row['last_entered'] or '-'}, "
                    f"last completed {row['last_completed'] or '-'}, at {row['call_site'] or '?'}{where}")


def print_recovery(story: Dict[str, Any]) -> None:
    """The recovery table: per loss, each survivor's detection, the decision, the
    resume; per admission, each heal."""
    if not story.get("losses") and not story.get("admissions"):
        return
    say()
    say("recovery:")
    for loss in story["losses"]:
        step = "" if loss["step"] is None else f" at step {loss['step']}"
        say(f"  lost {', '.join(map(str, loss['lost']))}{step} (generation {loss['generation']} of "
            f"'{loss['lineage']}')")
        for det in loss["detections"]:
            say(f"    rank {det['rank']} saw it +{det['latency_s']:.3f} s after the {loss['detection_base']}"
                f" on '{det['comm']}': {det['how']}")
        if loss["decision_s"] is not None:
            say(f"    decision: generation {loss['decision_generation']}, members {loss['members_before']} -> "
                f"{loss['members_after']}, {loss['decision_s']:.3f} s after the first detection")
        if loss["resume_s"] is not None:
            took = recovered_text(loss)
            took = took and f"; {took}"
            say(f"    resume: first op of generation {loss['decision_generation']} "
                f"{loss['resume_s']:.3f} s after the first detection{took}")
        else:
            say("    no new generation ran an op: the job did not recover from it")
    for adm in story["admissions"]:
        step = "" if adm["step"] is None else f" at step {adm['step']}"
        if adm.get("continued_at") is not None and adm["continued_at"] != adm["step"]:
            step += f" (continuing at step {adm['continued_at']})"
        took = "" if adm["seconds"] is None else f" ({adm['seconds']:.3f} s on the survivors)"
        say(f"  admitted {', '.join(map(str, adm['joined']))}{step}: generation {adm['generation']}, members "
            f"{adm['members_before']} -> {adm['members_after']}{took}")
        for h in adm["heals"]:
            life = "" if not h["restarted"] else " (restarted)" if h.get("spare") is None else \
                f" (warm spare {h['spare']})"
            group = "" if h.get("source_replica") is None else f" (replica group {h['source_replica']})"
            size = "" if h["bytes"] is None else f": {h['bytes']} B"
            took = "" if h["seconds"] is None else f" in {h['seconds']:.3f} s"
            at = "" if h["step"] is None else f", continuing at step {h['step']}"
            say(f"    rank {h['rank']}{life} healed from rank {h['source']}{group}{size}{took}{at}")
    for f in story["fenced"]:
        say(f"  rank {f['rank']} fenced out of '{f['comm']}'")


def cmd_diagnose(args: argparse.Namespace) -> int:
    """Print the diagnosis; exit 1 when something is wrong."""
    return 0 if _report(args, analysis.diagnose, print_diagnosis)["ok"] else 1


def cmd_export(args: argparse.Namespace) -> int:
    """Write the Chrome trace-event JSON."""
    scan = analysis.JobScan(args.paths, skip_bad=args.skip_bad, jobs=args.jobs)
    counts = export_perfetto(scan, args.perfetto)
    _warn(scan.problems)
    say(f"wrote {args.perfetto}: {counts['ranks']} ranks, {counts['slices']} ops, {counts['flows']} flows, "
        f"{counts['markers']} recovery markers "
        "(open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    """Write the self-contained HTML view."""
    scan = analysis.JobScan(args.paths, skip_bad=args.skip_bad, jobs=args.jobs, detail=args.max_ops)
    write_html(scan, args.output, args.title or f"commslayer trace: {', '.join(args.paths)}")
    _warn(scan.problems)
    say(f"wrote {args.output}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    """Follow a running job's trace directory in the terminal until Ctrl-C."""
    from tracing.read.watch import run

    return run(args.dir, interval_s=args.interval, last=args.last, once=args.once, say=say)


def _command(sub: Any, name: str, fn: Callable[[argparse.Namespace], int], brief: str, description: str,
             *, json_out: bool = False, parallel: bool = True) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=brief, description=description)
    p.add_argument("paths", nargs="+", metavar="DIR",
                   help="a trace directory (rank<R>.json / rank<R>.jsonl), or trace files")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out corrupt or unreadable files and lines (and say so) instead of stopping")
    if parallel:
        p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), metavar="N",
                       help="processes reading ranks in parallel when the input is large (default: the usable CPUs)")
    if json_out:
        p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=fn)
    return p


def _seconds(text: str) -> float:
    """``watch --interval``: a finite number of seconds >= 0 (time.sleep refuses the rest)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: a finite number of seconds >= 0")
    return value


def _at_least_1(text: str) -> int:
    """``watch --last``: 1 or more (0 or less took every collective seen, unsaid)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: 1 or more")
    return value


def parser() -> argparse.ArgumentParser:
    """The argument parser, one subcommand per question."""
    top = argparse.ArgumentParser(prog="commslayer-trace",
                                  description="Merge, check and show the collective traces of one job.")
    sub = top.add_subparsers(dest="command", required=True)
    _command(sub, "summary", cmd_summary, "latency and bandwidth per communicator, op and size; stragglers; clocks",
             "Per communicator x op x message-size bucket (powers of two): count, total, mean, p50 and p99 "
             "latency, algorithm and bus bandwidth (nccl-tests formulas); per rank, time spent waiting for the "
             "last arrival; the estimated clock offsets with their bounds.", json_out=True)
    _command(sub, "diagnose", cmd_diagnose, "who is stuck where and why; exit status 1 when something is wrong",
             "For each communicator: the last op every rank entered and completed, ranks that never entered the "
             "op the others wait or failed in, mismatched op/dtype/size/reduce op/root at one sequence number, "
             "ranks without files, the likely culprits and where each rank stands. Exit 0: nothing wrong; "
             "1: a problem; 2: unusable input.", json_out=True)
    p = _command(sub, "export", cmd_export, "Chrome trace-event JSON for Perfetto UI / chrome://tracing",
                 "One process per rank, one thread per communicator lane, one slice per op, flows linking each "
                 "collective across ranks; clocks aligned.")
    p.add_argument("--perfetto", required=True, metavar="OUT.json", help="the file to write")
    p = _command(sub, "view", cmd_view, "one self-contained HTML file: diagnosis, timeline, tables",
                 "The diagnosis on top, a zoomable timeline per rank and communicator lane with hover details, "
                 "the summary and overlap tables; no network needed.")
    p.add_argument("-o", "--output", required=True, metavar="OUT.html", help="the file to write")
    p.add_argument("--title", help="page title (default: the input paths)")
    p.add_argument("--max-ops", type=int, default=MAX_OPS,
                   help=f"ops drawn one by one (default {MAX_OPS}); older ones are aggregated into time bins")
    p = _command(sub, "overlap", cmd_overlap,
                 "per rank (or step): reduce-scatter time hidden under all-gather, exposed comm time",
                 "Per rank: union of reduce-scatter and all-gather busy time, the part of RS time during which an "
                 "AG was in flight, and the time the issuing thread was blocked on communication: in synchronous "
                 "calls and in Work.wait of async ones (see docs/viewer.md).", json_out=True, parallel=False)
    p.add_argument("--by-step", action="store_true",
                   help="one row per rank and step (a resilient job's records carry their step)")
    p = sub.add_parser("watch", help="follow a running job: each rank's current op, stragglers, generations, failures",
                       description="Follows the JSON lines (COMMSLAYER_TRACE_JSONL=1) and dumps of a running job "
                                   "and redraws every second: each rank's current op and its age, the slowest rank "
                                   "of the last collectives, each resizable communicator's generation and members, "
                                   "the first failure and the latest recovery events. Ctrl-C quits.")
    p.add_argument("dir", metavar="DIR", help="the job's trace directory (COMMSLAYER_TRACE_DIR)")
    p.add_argument("--interval", type=_seconds, default=1.0, metavar="S", help="seconds between redraws (default 1)")
    p.add_argument("--last", type=_at_least_1, default=20, metavar="N",
                   help="collectives the slowest rank is found over (default 20)")
    p.add_argument("--once", action="store_true", help="draw once and exit (no screen clearing)")
    p.set_defaults(fn=cmd_watch, skip_bad=True)
    return top


class OutputError(Exception):
    """An output path that cannot be written (checked before reading any trace)."""


def check_output(path: str) -> None:
    """Fail now, not after reading the traces, when ``path`` cannot be a file we write."""
    if os.path.isdir(path):
        raise OutputError(f"cannot write {path}: it is a directory")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise OutputError(f"cannot write {path}: no such directory {parent}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``commslayer-trace`` console script."""
    args = parser().parse_args(argv)
    # Reading builds millions of short-lived dicts and no cycles: the cyclic GC
    # only re-scans them (measured: it doubled the time to parse a large dump).
    collecting = gc.isenabled()
    gc.disable()
    try:
        for out in (getattr(args, "perfetto", None), getattr(args, "output", None)):
            if out is not None:
                check_output(out)
        return args.fn(args)
    except BrokenPipeError:  # `| head`: the reader left
        sys.stdout = open(os.devnull, "w")
        return 0
    except TraceFileError as exc:
        say(f"commslayer-trace: error: {exc}", sys.stderr)
        if not args.skip_bad and os.path.lexists(exc.path) and not os.path.isdir(exc.path):
            say("commslayer-trace: --skip-bad leaves such files or lines out", sys.stderr)
        return 2
    except (OutputError, OSError) as exc:
        say(f"commslayer-trace: error: {exc}", sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug of ours: still one line, never a traceback
        say(f"commslayer-trace: internal error: {type(exc).__name__}: {exc} "
            "(a bug in commslayer-trace: please report it with the input that caused it)", sys.stderr)
        return 2
    finally:
        if collecting:
            gc.enable()


if __name__ == "__main__":
    sys.exit(main())
