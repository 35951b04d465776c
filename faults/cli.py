"""``commslayer-faults``: list the scenarios, run one or all of them against a job.

Exit status: 0 every scenario run passed, 1 one failed, 2 usage errors.
Scenarios that cannot run here (root needed) are reported as skipped, with
the reason, and do not fail the run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .harness import Options, Skipped, markdown, repeated, run, write_reports
from .scenarios import BY_NAME, SCENARIOS


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="commslayer-faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the scenarios, by family")
    r = sub.add_parser("run", help="run scenarios against the job; write report.json and report.md",
                       usage="commslayer-faults run [SCENARIO ...] [--all] [options] [-- JOB_ARGS ...]")
    r.add_argument("scenarios", nargs="*", metavar="SCENARIO")
    r.add_argument("--all", action="store_true", help="every scenario")
    r.add_argument("--fast", action="store_true", help="with --all: the fast set (the one the test suite runs)")
    r.add_argument("--ranks", type=int, default=4, help="ranks in the job (default 4; per-rank scenarios: 3 or more)")
    r.add_argument("--per-replica", type=int, default=2,
                   help="ranks per replica group (default 2; network scenarios use 1, a host per rank; "
                        "per-rank scenarios have no replica groups)")
    r.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    r.add_argument("--rank", type=int, help="the rank the faults hit (default: the last; for the mismatch "
                                            "scenarios not the first of its replica group)")
    r.add_argument("--step", type=int, default=Options.step,
                   help=f"the step of a step fault or an external one (default {Options.step})")
    r.add_argument("--op", help="the collective a collective fault fires at (all_reduce, broadcast, ...; "
                                "default: the scenario's)")
    r.add_argument("--nth", type=int, help="the call of that collective it fires at (default: about the fault "
                                           "step's)")
    r.add_argument("--job", default=Options.job, help="the training script (default launch/train.py)")
    r.add_argument("--out", default="runs/faults", help="reports and run directories go here")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds one scenario may run")
    r.add_argument("--no-reference", action="store_true",
                   help="per-rank scenarios: skip the fault-free run their final state is compared with")
    r.add_argument("--repeat", type=int, default=1, help="run each scenario this many times (out/run<i>/...); "
                                                         "the summary gives medians and ranges")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.job_args = argv[cut + 1:]  # after --: extra arguments for the job
    if a.command == "list":
        for s in SCENARIOS:
            tags = [t for t, on in (("fast", s.fast), ("root", s.needs_root), (f"expect {s.expect}", True)) if on]
            print(f"{s.name:<24} {s.family:<15} {', '.join(tags):<26} {s.summary}")
        return 0
    known = {s.name for s in SCENARIOS}
    names = [s.name for s in SCENARIOS if not a.fast or s.fast] if a.all else a.scenarios
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        p.error(f"unknown scenario(s) {unknown}; `commslayer-faults list` shows them" if unknown
                else "name a scenario, or --all")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # each run replaces <out>/<scenario>: the first report would point at the second run's files
        p.error(f"scenario(s) {twice} named more than once; --repeat N runs each N times")
    if a.repeat < 1:
        p.error(f"--repeat {a.repeat}: must be 1 or more")
    options = Options(ranks=a.ranks, per_replica=a.per_replica, steps=a.steps, rank=a.rank, step=a.step, nth=a.nth, op=a.op,
                      job=os.path.abspath(a.job), job_args=a.job_args, timeout_s=a.timeout,
                      reference=not a.no_reference)
    if not os.path.isfile(options.job):  # else the launcher says so in job.log, and the run fails a minute later
        p.error(f"--job {a.job}: no such file")
    try:  # every scenario named, before the first one runs
        faults = [f for n in names for f in options.faults(BY_NAME[n], options.layout(BY_NAME[n]))]
    except ValueError as exc:
        p.error(str(exc))
    if (a.op is not None or a.nth is not None) and not any(f.op and f.action != "delay" for f in faults):
        p.error(f"--op and --nth move a fault at a collective; {', '.join(names)} has none (--step moves a step fault)")
    os.makedirs(a.out, exist_ok=True)
    reports = []
    for i in range(a.repeat):
        out = a.out if a.repeat == 1 else os.path.join(a.out, f"run{i + 1}")
        for name in names:
            reports.append(_run_one(name, out, options))
    if len(reports) > 1:
        write_reports(reports, a.out, "summary")
        if a.repeat > 1:
            with open(os.path.join(a.out, "summary.md"), "a") as f:
                f.write(f"\n## Over {a.repeat} runs: median (range)\n\n" + repeated(reports))
        print(f"commslayer-faults: summary in {os.path.join(a.out, 'summary.md')}")
    print(markdown(reports).split("\n\n")[0])
    if a.repeat > 1:
        print(repeated(reports))
    return 0 if all(r["passed"] for r in reports) else 1


def _run_one(name: str, out: str, options: Options) -> dict:
    """Run one scenario and print its verdict; a scenario that cannot run here is skipped."""
    print(f"commslayer-faults: running {name} ...", flush=True)
    try:
        report = run(name, out, options)
    except Skipped as exc:
        print(f"commslayer-faults: SKIPPED {exc}", flush=True)
        return {"scenario": name, "skipped": str(exc), "passed": True}
    print(f"commslayer-faults: {name}: {'PASS' if report['passed'] else 'FAIL'} ({report['wall_s']:.1f}s); "
          f"report in {report['run_dir']}/report.md", flush=True)
    for c in report["checks"]:
        if c["ok"] is False:
            print(f"    FAILED {c['name']}: {c['detail']}", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(main())
