"""``commslayer-trace``: the command line of the collective trace viewer.

Each subcommand reads one job's traces (directories or files), hands them to
``tracing.analysis`` and prints a table, or JSON with ``--json``.  Exit
status: 0 fine, 1 ``diagnose`` found a problem, 2 unusable input or usage.
Imports neither torch nor commslayer, so it starts fast and runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

from . import analysis
from .traceio import TraceFileError, iter_records


def _add_input(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="DIR",
                   help="a trace directory (rank<R>.json / rank<R>.jsonl), or trace files")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out corrupt or unreadable files and lines (and say so) instead of stopping")


def _warn(problems: List[str]) -> None:
    for p in problems:
        print(f"commslayer-trace: warning: {p}", file=sys.stderr)


def cmd_overlap(args: argparse.Namespace) -> int:
    """Print per-rank reduce-scatter/all-gather overlap."""
    problems: List[str] = []
    stats = analysis.overlap_by_rank(iter_records(args.paths, skip_bad=args.skip_bad, problems=problems))
    _warn(problems)
    if args.json:
        print(json.dumps({"ranks": [s.to_dict() for s in stats.values()], "problems": problems}, indent=1))
        return 0
    print(f"{'rank':>4} {'RS ops':>7} {'AG ops':>7} {'RS s':>10} {'AG s':>10} {'hidden RS s':>12} "
          f"{'hidden %':>9} {'comm s':>10} {'exposed s':>10}")
    for s in stats.values():
        print(f"{s.rank:>4} {s.rs_count:>7} {s.ag_count:>7} {s.rs_s:>10.4f} {s.ag_s:>10.4f} "
              f"{s.hidden_rs_s:>12.4f} {100 * s.hidden_fraction:>8.1f}% {s.comm_s:>10.4f} {s.exposed_comm_s:>10.4f}")
    if not stats:
        print("no records")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser, one subcommand per question."""
    top = argparse.ArgumentParser(prog="commslayer-trace",
                                  description="Merge, check and show the collective traces of one job.")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("overlap", help="per rank: reduce-scatter time hidden under all-gather, exposed comm time",
                       description="Per rank: union of reduce-scatter and all-gather busy time, the part of "
                                   "RS time during which an AG was in flight, and the time the issuing thread "
                                   "was blocked in synchronous calls (see docs/viewer.md).")
    _add_input(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_overlap)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``commslayer-trace`` console script."""
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except TraceFileError as exc:
        print(f"commslayer-trace: error: {exc}", file=sys.stderr)
        print("commslayer-trace: --skip-bad leaves such files or lines out", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
