"""Reading one job's traces: find the files, check them, stream their records.

A job leaves, per rank, a dump (``rank<R>.json``: the last ring of records,
in-flight ops included) and optionally structlog JSON lines
(``rank<R>.jsonl``: every op as it ended, all of them, however many).  This
module turns any mix of those into one stream of record dicts per rank, so
that the analysis never holds more than one rank's parsed file at a time:

- a JSONL file is parsed line by line;
- when a rank has both, its JSONL records come first and the dump adds what
  the JSONL lacks (ops still in flight when the dump was written), matched
  by ``op_id``;
- a rank with only a JSONL file (a SIGSTOPped or SIGKILLed rank never dumps,
  but its sink had flushed) still counts, and is reported as having no dump.

Bad input (truncated or corrupt JSON, a record without its fields, another
schema version) raises ``TraceFileError`` naming the file and the line (for a
dump, which is one line, the record's index too).  With ``skip_bad`` the bad
line, or the bad dump as a whole, is left out and described in
``problems`` instead.  Nothing here unpickles: the Flight Recorder files
under ``fr/`` are never read.

Imports neither torch nor commslayer: traces open on a laptop.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

from .records import DUMP_KIND, SCHEMA_VERSION

try:  # orjson (a dependency of the package) is faster; the viewer also runs without it
    from orjson import JSONDecodeError, loads
except ImportError:  # pragma: no cover - orjson is a dependency of the package
    from json import JSONDecodeError, loads  # type: ignore[assignment]

_RANK_FILE = re.compile(r"rank(\d+)\.(json|jsonl)$")
# A record needs these to be placed and matched; the rest may be null.
REQUIRED = ("op_id", "comm_id", "seq", "op", "state", "enqueue_ns")


class TraceFileError(ValueError):
    """A trace file that cannot be used; ``str()`` names the file and line."""

    def __init__(self, path: str, line: Optional[int], what: str) -> None:
        self.path, self.line, self.what = path, line, what
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {what}")


@dataclass
class RankSource:
    """What one rank left: its files and the facts its dump or JSONL header gives."""

    rank: int
    dump_path: Optional[str] = None
    jsonl_path: Optional[str] = None
    host: Optional[str] = None
    pid: Optional[int] = None
    job: Optional[str] = None
    reason: Optional[str] = None              # why the dump was written
    ring_dropped: int = 0                     # records the dump's ring (or a failed dump write) lost
    jsonl_dropped: int = 0                    # records the JSON-lines sink dropped (its sink_dropped events)
    wall_minus_mono_ns: Optional[int] = None  # from the clock anchor
    communicators: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    @property
    def lost_records(self) -> int:
        """Records of this rank that no file holds: with JSON lines, those its sink
        dropped (the ring's losses are in the JSON lines); else those the ring lost."""
        return self.jsonl_dropped if self.jsonl_path else self.ring_dropped

    @property
    def files(self) -> List[str]:
        """The files read for this rank."""
        return [p for p in (self.jsonl_path, self.dump_path) if p]


def find_files(paths: Sequence[str]) -> List[str]:
    """The trace files named by ``paths``: directories give their ``rank<R>.json``
    and ``rank<R>.jsonl`` files; files are taken as they are."""
    out: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted((os.path.join(p, n) for n in os.listdir(p) if _RANK_FILE.match(n)),
                          key=lambda q: (int(_RANK_FILE.search(q).group(1)), q))
        elif os.path.exists(p):
            out.append(p)
        else:
            raise TraceFileError(p, None, "no such file or directory")
    return out


def _jsonl_header(path: str) -> Dict[str, Any]:
    """The first line of a JSONL file (the sink writes ``trace_started`` first)."""
    with open(path, "rb") as f:
        first = f.readline()
    if not first.strip():
        raise TraceFileError(path, 1, "empty file: no trace_started line")
    try:
        head = loads(first)
    except JSONDecodeError as exc:
        raise TraceFileError(path, 1, f"not JSON ({exc})") from None
    if not isinstance(head, dict) or not isinstance(head.get("rank"), int):
        raise TraceFileError(path, 1, "not a commslayer JSON-lines trace (no rank)")
    if head.get("event") == "trace_started" and head.get("schema") != SCHEMA_VERSION:
        raise TraceFileError(path, 1, f"trace schema {head.get('schema')}; this reader knows {SCHEMA_VERSION}")
    return head


def read_dump(path: str) -> Dict[str, Any]:
    """One dump file, parsed and checked (``TraceFileError`` says what is wrong with it)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        doc = loads(data)
    except JSONDecodeError as exc:
        line = getattr(exc, "lineno", None)
        raise TraceFileError(path, line, f"truncated or corrupt JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != DUMP_KIND:
        raise TraceFileError(path, 1, "not a commslayer trace dump")
    if doc.get("schema") != SCHEMA_VERSION:
        raise TraceFileError(path, 1, f"trace schema {doc.get('schema')}; this reader knows {SCHEMA_VERSION}")
    if not isinstance(doc.get("records"), list) or not isinstance(doc.get("rank"), int):
        raise TraceFileError(path, 1, "dump without a rank or a records list")
    return doc


def _check_record(r: Any, path: str, line: int, index: Optional[int] = None) -> None:
    try:
        if None not in (r["op_id"], r["comm_id"], r["seq"], r["op"], r["state"], r["enqueue_ns"]):
            return
    except (KeyError, TypeError):
        pass
    where = "" if index is None else f"record #{index}: "
    if not isinstance(r, dict):
        raise TraceFileError(path, line, f"{where}a record must be a JSON object")
    missing = [k for k in REQUIRED if r.get(k) is None]
    raise TraceFileError(path, line, f"{where}record without {', '.join(map(repr, missing))}")


def discover(paths: Sequence[str], *, skip_bad: bool = False,
             problems: Optional[List[str]] = None) -> Dict[int, RankSource]:
    """Group the files under ``paths`` by rank (headers only; records are read later)."""
    sources: Dict[int, RankSource] = {}
    for path in find_files(paths):
        try:
            if path.endswith(".jsonl"):
                head = _jsonl_header(path)
                src = sources.setdefault(head["rank"], RankSource(head["rank"]))
                if src.jsonl_path:
                    raise TraceFileError(path, None, f"a second JSON-lines file for rank {src.rank} "
                                                     f"(first: {src.jsonl_path})")
                src.jsonl_path = path
                src.host, src.pid, src.job = head.get("host"), head.get("pid"), head.get("job")
                clock = head.get("clock")
                if isinstance(clock, dict) and src.wall_minus_mono_ns is None:
                    src.wall_minus_mono_ns = clock["wall_ns"] - clock["mono_ns"]
            else:
                m = _RANK_FILE.search(os.path.basename(path))
                rank = int(m.group(1)) if m else read_dump(path)["rank"]
                src = sources.setdefault(rank, RankSource(rank))
                if src.dump_path:
                    raise TraceFileError(path, None, f"a second dump for rank {rank} (first: {src.dump_path})")
                src.dump_path = path
        except (TraceFileError, OSError) as exc:
            if not skip_bad:
                raise exc if isinstance(exc, TraceFileError) else TraceFileError(path, None, str(exc))
            if problems is not None:
                problems.append(f"skipped {exc}")
    return sources


def _load_dump_into(src: RankSource) -> Dict[int, Dict[str, Any]]:
    """Read the rank's dump (facts into ``src``); its records by op_id."""
    path = src.dump_path
    doc = read_dump(path)
    if doc["rank"] != src.rank:
        raise TraceFileError(path, 1, f"dump of rank {doc['rank']} in a file named for rank {src.rank}")
    clock = doc.get("clock") or {}
    if "wall_ns" not in clock or "mono_ns" not in clock:
        raise TraceFileError(path, 1, "dump without its clock anchor")
    src.wall_minus_mono_ns = clock["wall_ns"] - clock["mono_ns"]
    src.host, src.pid, src.job = doc.get("host"), doc.get("pid"), doc.get("job")
    src.reason = doc.get("reason")
    src.ring_dropped = int(doc.get("dropped_records") or 0)
    for uid, info in (doc.get("communicators") or {}).items():
        src.communicators[uid] = dict(info)
    out: Dict[int, Dict[str, Any]] = {}
    for i, r in enumerate(doc["records"]):
        _check_record(r, path, 1, i)
        out[r["op_id"]] = r
    return out


def _jsonl_records(src: RankSource, skip_bad: bool, problems: List[str]) -> Iterator[Dict[str, Any]]:
    path = src.jsonl_path
    bad = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:  # the common case first, in one try: a whole collective record
                ev = loads(line)
                if ev["event"] == "collective" and \
                        None not in (ev["op_id"], ev["comm_id"], ev["seq"], ev["op"], ev["state"], ev["enqueue_ns"]):
                    yield ev
                    continue
            except (JSONDecodeError, KeyError, TypeError):
                pass
            try:
                _other_line(src, path, lineno, line)
            except TraceFileError as exc:
                if not skip_bad:
                    raise
                bad += 1
                if bad <= 5:
                    problems.append(f"skipped {exc}")
    if bad > 5:
        problems.append(f"skipped {bad - 5} more bad lines of {path}")


def _other_line(src: RankSource, path: str, lineno: int, line: bytes) -> None:
    """A JSONL line that is not a whole collective record: an event to note, or an error."""
    try:
        ev = loads(line)
    except JSONDecodeError as exc:
        raise TraceFileError(path, lineno, f"truncated or corrupt JSON line ({exc})") from None
    kind = ev.get("event") if isinstance(ev, dict) else None
    if kind == "collective":
        _check_record(ev, path, lineno)
    elif kind in ("communicator_created", "communicator_split"):
        src.communicators.setdefault(ev["comm_id"], {
            "name": ev.get("comm"), "backend": ev.get("backend"), "rank": ev.get("comm_rank"),
            "size": ev.get("size"), "global_ranks": ev.get("global_ranks"),
            "generation": ev.get("generation"), "state": "ok"})
    elif kind == "sink_dropped":
        src.jsonl_dropped += int(ev.get("dropped") or 0)
    elif kind == "trace_started" and ev.get("schema") != SCHEMA_VERSION:
        raise TraceFileError(path, lineno, f"trace schema {ev.get('schema')}; this reader knows {SCHEMA_VERSION}")
    elif kind is None:
        raise TraceFileError(path, lineno, "not a trace event (no 'event' field)")


def rank_records(src: RankSource, *, skip_bad: bool = False,
                 problems: Optional[List[str]] = None) -> Iterator[Dict[str, Any]]:
    """Every record of one rank, each once: the JSONL's, then what only the dump has.

    Fills ``src``'s facts (clock, communicators, dump reason) as it reads;
    raises ``TraceFileError`` on bad input unless ``skip_bad``.
    """
    problems = [] if problems is None else problems
    from_dump: Dict[int, Dict[str, Any]] = {}
    if src.dump_path:
        try:
            from_dump = _load_dump_into(src)
        except TraceFileError as exc:
            if not skip_bad:
                raise
            problems.append(f"skipped {exc}")
            src.dump_path = None
    if src.wall_minus_mono_ns is None and src.jsonl_path:
        problems.append(f"rank {src.rank}: no clock anchor in {src.jsonl_path}; its times are taken as wall time")
        src.wall_minus_mono_ns = 0
    if src.jsonl_path:
        for r in _jsonl_records(src, skip_bad, problems):
            if from_dump:
                from_dump.pop(r["op_id"], None)
            yield r
    for op_id in sorted(from_dump):
        yield from_dump[op_id]


def iter_records(paths: Sequence[str], *, skip_bad: bool = False,
                 problems: Optional[List[str]] = None) -> Iterator[Dict[str, Any]]:
    """All records of a job, rank by rank, each with ``rank`` (global) added."""
    for rank, src in sorted(discover(paths, skip_bad=skip_bad, problems=problems).items()):
        for r in rank_records(src, skip_bad=skip_bad, problems=problems):
            r["rank"] = rank
            yield r
