"""``commslayer-trace watch DIR``: a running job's traces, live in the terminal.

Follows the JSON lines every rank appends (``rank<R>.jsonl``, and those of
restarted lives in ``replica<R>-restart<N>/``), reading only what was added
since the last look (whole lines; a line still being written waits for the
next look), and the dumps a rank writes on a failure or SIGUSR1 (for the ops
it has in flight: the JSON lines hold finished ops only).  Every second it
redraws: each rank's current op (in flight per its latest dump, else the last
one that ended) and its age, the slowest rank of the last N collectives (the
one that arrived last most often, and how long the others waited for it),
the live generation and membership of each resizable communicator, the
first failure as soon as a rank reports it, and the latest recovery events.

Imports neither torch nor commslayer: it runs anywhere the trace directory
is visible (a shared file system), while the job runs.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple

from tracing.messages import IN_FLIGHT, loss_cause, op_name, short_error
from tracing.read.story import lineage
from tracing.read.traceio import (FAILURE_EVENTS, MAX_LINE_BYTES, RankSource, TraceFileError, check_event, file_rank,
                                   find_files, life_of, load_dump, parse_line)

SUMMARY = "summary.json"  # commslayer.runs.SUMMARY: the launcher writes it into the run directory at the job's end
READ_BYTES = 8 << 20  # per file and look: a job far ahead is caught up over several looks
KEEP_COLLECTIVES = 4096  # the latest collectives whose arrivals are kept
MAX_MEMBERS_SHOWN = 4096
MAX_PROBLEMS = 5  # bad lines or files named per file; the rest are counted
_CLEAR = "\x1b[H\x1b[2J"


def _clock(wall_ns: float) -> str:
    return datetime.fromtimestamp(wall_ns / 1e9, timezone.utc).strftime("%H:%M:%S.%f")[:-3]


class _Follower:
    """One JSON-lines file, read as it grows."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.lineno = 0
        self.rank: Optional[int] = None
        self.life = life_of(path)
        self.offset_ns = 0  # wall - monotonic of the writing process (its trace_started line)
        self.checked = RankSource(-1)  # where check_event notes communicators and events (watch keeps its own)

    def new_lines(self, skip: Callable[[TraceFileError], None]) -> List[Dict[str, Any]]:
        """The events appended since the last call, each checked as the other commands
        check it; a bad line (or one longer than the bound) goes to ``skip``."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(READ_BYTES)
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        if len(self.rest) > MAX_LINE_BYTES:  # counted as a line of its own, skipped
            lines.append(self.rest)
            self.rest = b""
        out = []
        for line in lines:
            self.lineno += 1
            try:
                if len(line) > MAX_LINE_BYTES:
                    raise TraceFileError(self.path, self.lineno, f"line longer than {MAX_LINE_BYTES} bytes")
                ev = parse_line(self.path, self.lineno, line)
                check_event(self.checked, ev, self.path, self.lineno)
            except TraceFileError as exc:
                skip(exc)
                continue
            out.append(ev)
        return out


class Watch:
    """What ``watch`` knows of the job so far; ``poll()`` reads, ``frame()`` draws."""

    def __init__(self, directory: str, *, last: int = 20) -> None:
        self.directory = directory
        self.last = last
        self.files: Dict[str, _Follower] = {}
        self.dumps: Dict[str, float] = {}                      # path -> mtime read
        self.latest: Dict[int, Tuple[int, Dict[str, Any]]] = {}  # rank -> (life, last finished record)
        self.in_flight: Dict[int, Tuple[float, List[Dict[str, Any]]]] = {}  # rank -> (dump mtime, open records)
        self.arrivals: "OrderedDict[Tuple[str, Any, Any], Dict[int, int]]" = OrderedDict()  # by (comm, gen, seq)
        self.generations: Dict[str, Tuple[int, List[int], int]] = {}  # "'name' (lineage)" -> (generation, members, wall)
        self.first_failure: Optional[Tuple[int, str]] = None   # (wall ns, text): the earliest reported
        self.events: List[Tuple[int, str]] = []
        self.job: Optional[str] = None
        self.problems: List[str] = []  # bad lines and files skipped, as the other commands word them
        self._bad: Dict[str, int] = {}  # path -> bad lines or dumps of it seen

    # ---------------------------------------------------------------- reading
    def poll(self) -> None:
        """Read what the job wrote since the last call."""
        try:
            paths = find_files([self.directory])
        except TraceFileError:
            return  # nothing written yet
        for path in sorted(paths, key=lambda p: not p.endswith(".jsonl")):  # JSON lines first: they have it all
            if path.endswith(".jsonl"):
                f = self.files.get(path) or self.files.setdefault(path, _Follower(path))
                for ev in f.new_lines(self._skip):
                    self._take(f, ev)
            else:
                self._take_dump(path)

    def _skip(self, exc: TraceFileError) -> None:
        """Note a bad line or file: the first few of each file by name, the rest counted."""
        bad = self._bad[exc.path] = self._bad.get(exc.path, 0) + 1
        if bad <= MAX_PROBLEMS:
            self.problems.append(f"skipped {exc}")

    def warnings(self) -> List[str]:
        """What was skipped, worded as the other commands' ``--skip-bad`` warnings."""
        more = [f"skipped {n - MAX_PROBLEMS} more bad lines of {path}"
                for path, n in sorted(self._bad.items()) if n > MAX_PROBLEMS]
        return self.problems + more

    def _take(self, f: _Follower, ev: Dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "trace_started":
            f.rank = ev.get("rank") if type(ev.get("rank")) is int else None
            clock = ev.get("clock")  # checked (traceio.check_event)
            if clock is not None:
                f.offset_ns = clock["wall_ns"] - clock["mono_ns"]
            if isinstance(ev.get("job"), str):
                self.job = self.job or ev["job"]
            return
        rank = f.rank if f.rank is not None else ev.get("rank")
        if type(rank) is not int:
            return
        if kind == "collective":
            self._take_record(f, rank, ev)
        elif kind in ("communicator_created", "communicator_split") and "/" not in str(ev.get("comm_id")):
            members, size = ev.get("global_ranks"), ev.get("size")
            if members is None and type(size) is int and size <= MAX_MEMBERS_SHOWN:
                members = list(range(size))  # a new communicator's members are 0..size-1
            self._membership(ev.get("comm"), ev.get("generation"), members, f, ev)
        elif kind == "recovery":
            if ev.get("kind") == "generation":
                self._membership(ev.get("comm"), ev.get("generation"), ev.get("members"), f, ev)
            what = ", ".join(f"{k} {ev[k]:.3f}" if isinstance(ev[k], float) else f"{k} {ev[k]}"
                             for k in ("generation", "lost", "members", "step", "bytes", "seconds", "source")
                             if ev.get(k) is not None)
            self._event(f, ev, f"rank {rank} {ev.get('kind')}: {what}")
            if ev.get("kind") in ("peer_lost", "fenced"):
                self._fail(f, ev, f"rank {rank}: {ev.get('kind')} {ev.get('lost') or ''} in '{ev.get('comm')}': "
                                  f"{loss_cause(ev.get('error') or ev.get('why'))}")
        elif kind in FAILURE_EVENTS:
            why = loss_cause(ev.get("error")) if kind == "peer_lost" else short_error(ev.get("error"))
            self._fail(f, ev, f"rank {rank}: {kind} in '{ev.get('comm')}': {why}")

    def _take_record(self, f: _Follower, rank: int, r: Dict[str, Any]) -> None:
        old = self.latest.get(rank)
        if old is None or old[0] <= f.life:
            self.latest[rank] = (f.life, dict(r, wall_end_ns=(r.get("end_ns") or r.get("enqueue_ns") or 0) + f.offset_ns))
        if r.get("state") not in (None, "completed"):
            self._fail(f, r, f"rank {rank}: {r.get('op')} #{r.get('seq')} of '{r.get('comm')}' {r.get('state')}: "
                             f"{short_error(r.get('error'))}")
        if r.get("op") in ("send", "recv") or type(r.get("enqueue_ns")) is not int:
            return
        key = (str(r.get("comm_id")), r.get("generation") or 0, r.get("seq"))
        arrivals = self.arrivals.setdefault(key, {})
        arrivals[rank] = r["enqueue_ns"] + f.offset_ns
        while len(self.arrivals) > KEEP_COLLECTIVES:
            self.arrivals.popitem(last=False)

    def _take_dump(self, path: str) -> None:
        src = RankSource(file_rank(path) or 0, dump_path=path)  # find_files gives rank<R>.json names only
        try:
            mtime = os.stat(path).st_mtime
            if self.dumps.get(path) == mtime:
                return
            self.dumps[path] = mtime  # a bad dump is named once, not at every look
            rows = load_dump(src, True, self.problems)
        except OSError:
            return
        except TraceFileError as exc:
            self._skip(exc)
            return
        f = _Follower(path)
        f.rank, f.offset_ns = src.rank, src.wall_minus_mono_ns or 0
        records = [r for _, r in rows.values()]
        open_ops = [dict(r, wall_start_ns=(r.get("start_ns") or r.get("enqueue_ns") or 0) + f.offset_ns)
                    for r in records if r.get("state") in ("started", "scheduled")]
        self.in_flight[f.rank] = (mtime, open_ops)
        if not any(g.rank == f.rank and g.life == f.life for g in self.files.values()):
            # No JSON lines of this life (not asked for, or not yet flushed): the dump tells what it holds.
            for r in records:
                if r.get("state") not in ("started", "scheduled"):
                    self._take_record(f, f.rank, r)
            for ev in src.events:
                self._take(f, {**ev, "event": "recovery"})

    def _membership(self, name: Any, generation: Any, members: Any, f: _Follower, ev: Dict[str, Any]) -> None:
        if type(generation) is not int or not isinstance(members, list):
            return
        key = f"'{name}' ({lineage(str(ev.get('comm_id')))})"
        known = self.generations.get(key)
        if known is None or generation >= known[0]:
            self.generations[key] = (generation, members, (ev.get("mono_ns") or 0) + f.offset_ns)

    def _event(self, f: _Follower, ev: Dict[str, Any], text: str) -> None:
        wall = (ev.get("mono_ns") or 0) + f.offset_ns
        self.events.append((wall, f"{_clock(wall)} {text}"))
        self.events = sorted(self.events)[-5:]

    def _fail(self, f: _Follower, ev: Dict[str, Any], text: str) -> None:
        wall = (ev.get("mono_ns") or ev.get("end_ns") or 0) + f.offset_ns
        if self.first_failure is None or wall < self.first_failure[0]:
            self.first_failure = (wall, f"{_clock(wall)} {text}")

    # ---------------------------------------------------------------- drawing
    def slowest(self) -> Optional[Tuple[int, int, int, float]]:
        """Over the last N collectives with two or more ranks: (rank that arrived last
        most often, how often, of how many, seconds the others waited for it)."""
        keys = sorted((k for k, a in self.arrivals.items() if len(a) > 1),
                      key=lambda k: max(self.arrivals[k].values()))[-self.last:]
        if not keys:
            return None
        count: Dict[int, int] = {}
        waited: Dict[int, int] = {}
        for k in keys:
            a = self.arrivals[k]
            late = max(a, key=lambda rank: a[rank])
            count[late] = count.get(late, 0) + 1
            waited[late] = waited.get(late, 0) + sum(a[late] - t for t in a.values())
        top = max(count, key=lambda r: (count[r], waited[r]))
        return top, count[top], len(keys), waited[top] / 1e9

    def _ended(self) -> Optional[int]:
        """When the launcher wrote the run's summary (the job's end), in wall ns, if it is newer
        than every trace file here (a reused run directory keeps an earlier run's until the end)."""
        here = self.directory.rstrip(os.sep)
        run_dirs = [here] + ([os.path.dirname(here)] if os.path.basename(here) == "traces" else [])
        for path in (os.path.join(d, SUMMARY) for d in run_dirs):
            try:
                written = os.stat(path).st_mtime_ns
                if all(os.stat(p).st_mtime_ns <= written for p in [*self.files, *self.dumps]):
                    return written
            except OSError:
                continue
        return None

    def frame(self, now_ns: Optional[int] = None) -> List[str]:
        """The screen, as lines."""
        now = time.time_ns() if now_ns is None else now_ns
        lines = [f"commslayer-trace watch {self.directory}  ({_clock(now)} UTC; Ctrl-C quits)",
                 f"job: {self.job or '?'}   files: {len(self.files)} JSON lines, {len(self.dumps)} dumps"]
        if not self.files and not self.dumps:
            lines.append("waiting for trace files (rank<R>.jsonl: set COMMSLAYER_TRACE_JSONL=1 in the job)")
            return lines
        for name, (gen, members, since) in sorted(self.generations.items()):
            lines.append(f"{name}: generation {gen}, members {', '.join(map(str, members))} "
                         f"(since {_clock(since)})")
        lines.append(f"first failure: {self.first_failure[1] if self.first_failure else 'none so far'}")
        ended = self._ended()
        if ended is not None:
            lines.append(f"the job ended at {_clock(ended)} UTC (its launcher wrote {SUMMARY}): nothing more will come")
        if self.problems:
            lines.append(f"skipped bad input: {sum(self._bad.values())} lines or files, the first: "
                         f"{self.problems[0][len('skipped '):]}")
        lines.append("")
        lines.append(f"{'rank':>4} {'life':>4}  {'current op':<44} {'state':<10} {'age s':>8}")
        for rank in sorted(set(self.latest) | set(self.in_flight)):
            life, r = self.latest.get(rank, (0, None))
            mtime, open_ops = self.in_flight.get(rank, (0.0, []))
            if open_ops and (r is None or mtime * 1e9 >= r["wall_end_ns"]):
                o = open_ops[0]
                op, state, age = op_name(o.get("op"), o.get("seq"), o.get("comm")), IN_FLIGHT, \
                    (now - o["wall_start_ns"]) / 1e9
            elif r is not None:
                op, state, age = op_name(r.get("op"), r.get("seq"), r.get("comm")), f"{r.get('state')}", \
                    (now - r["wall_end_ns"]) / 1e9
            else:
                continue
            lines.append(f"{rank:>4} {life + 1:>4}  {op[:44]:<44} {state:<10} {age:>8.1f}")
        s = self.slowest()
        lines.append("")
        lines.append("slowest of the last collectives: " + (
            "-" if s is None else f"rank {s[0]}, last to arrive in {s[1]} of {s[2]} "
                                  f"(the others waited {s[3]:.3f} s for it)"))
        if self.events:
            lines.append("recovery events:")
            lines += [f"  {text}" for _, text in self.events]
        return lines


def run(directory: str, *, interval_s: float = 1.0, last: int = 20, once: bool = False,
        out: Optional[TextIO] = None, say: Any = None) -> int:
    """The ``watch`` loop: poll and redraw every ``interval_s`` until Ctrl-C (or once)."""
    out = out or sys.stdout
    if not os.path.isdir(directory):
        raise TraceFileError(directory, None, "not a directory" if os.path.lexists(directory) else
                             "no such directory (a job's trace directory exists once its first rank starts)")
    w = Watch(directory, last=last)
    try:
        while True:
            w.poll()
            # The screen goes out in one write, the clear with it: a clear written on its own
            # (an unbuffered stdout, PYTHONUNBUFFERED) left the terminal blank until the frame was built.
            screen = io.StringIO()
            for line in w.frame():
                say(line, screen)
            out.write(("" if once else _CLEAR) + screen.getvalue())
            out.flush()
            if once:
                for problem in w.warnings():
                    say(f"commslayer-trace: warning: {problem}", sys.stderr)
                return 0
            time.sleep(interval_s)
    except KeyboardInterrupt:
        say("watch stopped", out)
        return 0
