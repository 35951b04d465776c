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
  but its sink had flushed) still counts, and is reported as having no dump;
- a rank that was restarted has one set of files per life: the launcher
  writes a restarted replica group's into ``replica<R>-restart<N>/`` below
  the trace directory (found there too).  The lives of one rank are one
  stream, in restart order, each later life's times moved onto the first
  life's monotonic clock (through the clock anchors), its records marked
  with ``life`` (the restart number) and its op ids moved past the earlier
  lives' (``op_id + life * LIFE_OP_IDS``).

A directory that an earlier run wrote into (the names are fixed: dumps are
replaced, JSON lines appended to) keeps that run's files and lines; the
first are left out by their times (a file last written before the newest
run's first process began tracing), the second by reading a JSON-lines file
from its last ``trace_started`` line, each named in ``problems``.

Bad input (truncated or corrupt JSON, a record without its fields or with a
field of the wrong type or out of range, another schema version, a file that
is not a regular file, a line or dump past its size bound) raises
``TraceFileError`` naming the file and the line (for a dump, which is one
line, the record's index too).  With ``skip_bad`` the bad line, the bad
record of a dump, or the bad file as a whole, is left out and described in
``problems`` instead.  Every record handed on has the types
``RECORD_TYPES`` gives, so the analysis never meets a value it cannot use.
Nothing here unpickles: the Flight Recorder files under ``fr/`` are never
read.

Imports neither torch nor commslayer: traces open on a laptop.
"""

from __future__ import annotations

import mmap
import os
import re
import reprlib
import stat
import time
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from operator import itemgetter
from typing import Any, BinaryIO, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from tracing.records import COMPLETED, DUMP_KIND, RECORD_FIELDS, SCHEMA_VERSION, STATES

try:  # orjson (a dependency of the package) is faster; the viewer also runs without it
    from orjson import loads
except ImportError:  # pragma: no cover - orjson is a dependency of the package
    import json

    def _no_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    loads = partial(json.loads, parse_constant=_no_constant)

# What bad JSON raises: orjson's JSONDecodeError and json's are ValueErrors; the
# standard parser meets a deeply nested value with RecursionError.
_BAD_JSON = (ValueError, RecursionError)
# What makes the fast path of reading a line give up and look closer.
_NOT_FAST = (ValueError, RecursionError, KeyError, TypeError)

_RANK_FILE = re.compile(r"rank(\d+)\.(json|jsonl)$")
_LIFE_DIR = re.compile(r"^replica\d+-restart(\d+)$")  # commslayer.config.trace_dir of a restarted group
LIFE_OP_IDS = 1 << 40  # op ids of life N are moved up by N * this
# A record needs these to be placed and matched; the rest may be null.
REQUIRED = ("op_id", "comm_id", "seq", "op", "state", "enqueue_ns")

MAX_RANKS = 1 << 20           # a rank or communicator size at or above this is taken as corrupt
TIME_LIMIT = 1 << 62          # ns; times at or beyond it are corrupt (aligned sums stay inside int64)
MAX_LINE_BYTES = 1 << 20      # a JSON line (one record or event) longer than this is corrupt
MAX_DUMP_BYTES = 1 << 30      # a larger dump is refused instead of parsed
READ_CHUNK = 16 << 20         # a dump is read and checked this much at a time

_NONE = type(None)
# The type every record field must have (exact types: true is not an integer
# here).  Times must also lie in [0, TIME_LIMIT) and ``state`` be one of
# records.STATES.  The items of ``in_sizes``, ``out_sizes`` and ``stack`` are
# not interpreted here (the viewer shows sizes from ``in_bytes``/``out_bytes``).
RECORD_TYPES: Dict[str, Tuple[type, ...]] = {
    "op_id": (int,), "comm": (str, _NONE), "comm_id": (str,), "generation": (int, _NONE), "seq": (int,),
    "op": (str,), "backend_op": (str, _NONE), "reduce_op": (str, _NONE), "dtype": (str, _NONE),
    "in_sizes": (list, _NONE), "out_sizes": (list, _NONE), "in_bytes": (int, _NONE), "out_bytes": (int, _NONE),
    "root": (int, _NONE), "peer": (int, _NONE), "async_op": (bool, _NONE), "timeout_s": (int, float, _NONE),
    "state": (str,), "error": (str, _NONE), "enqueue_ns": (int,), "start_ns": (int, _NONE),
    "end_ns": (int, _NONE), "duration_ms": (int, float, _NONE), "thread": (str, _NONE),
    "call_site": (str, _NONE), "stack": (list, _NONE),
}
assert tuple(RECORD_TYPES) == RECORD_FIELDS, "RECORD_TYPES must follow records.RECORD_FIELDS"
_STATES = frozenset(STATES)
_record_values = itemgetter(*RECORD_FIELDS)
_STATE, _ENQUEUE, _START, _END = (RECORD_FIELDS.index(k) for k in ("state", "enqueue_ns", "start_ns", "end_ns"))
# Type signatures (field types in RECORD_FIELDS order) that passed the full
# check: a record with one of them needs only its times and state checked.
_good_signatures: Set[Tuple[type, ...]] = set()


class TraceFileError(ValueError):
    """A trace file that cannot be used; ``str()`` names the file and line."""

    def __init__(self, path: str, line: Optional[int], what: str) -> None:
        self.path, self.line, self.what = path, line, what
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {what}")

    def __reduce__(self) -> Tuple[Any, ...]:
        # A parallel reader's error comes back to the parent by pickle.
        return TraceFileError, (self.path, self.line, self.what)


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
    main_stack: Optional[Dict[str, Any]] = None  # the main thread at its last dump but an exit: reason, at, frames
    ring_dropped: int = 0                     # records the dump's ring (or a failed dump write) lost
    jsonl_dropped: int = 0                    # records the JSON-lines sink dropped (its sink_dropped events)
    wall_minus_mono_ns: Optional[int] = None  # from the clock anchor
    jsonl_offset: int = 0                     # where its process's lines begin (earlier ones: an earlier run's)
    jsonl_first_line: int = 1                 # the line number there
    communicators: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    cwd: Optional[str] = None                 # the process's working directory (call sites are shown from it)
    events: List[Dict[str, Any]] = field(default_factory=list)  # recovery events, with wall_ns added
    event_keys: Set[Any] = field(default_factory=set, repr=False)
    life: int = 0                             # the restart number of this life (0: the first process)
    span: Optional[Tuple[int, int]] = None    # of a restarted rank's life: first enqueue, last end (first life's clock)
    lives: List["RankSource"] = field(default_factory=list)     # the later lives of this rank, in order

    @property
    def lost_records(self) -> int:
        """Records of this rank that no file holds: with JSON lines, those its sink
        dropped (the ring's losses are in the JSON lines); else those the ring lost."""
        own = self.jsonl_dropped if self.jsonl_path else self.ring_dropped
        return own + sum(life.lost_records for life in self.lives)

    @property
    def files(self) -> List[str]:
        """The files read for this rank, every life's."""
        return [p for p in (self.jsonl_path, self.dump_path) if p] + [p for life in self.lives for p in life.files]

    @property
    def last_life(self) -> "RankSource":
        """The source of this rank's last life (itself when it was never restarted)."""
        return self.lives[-1] if self.lives else self


# ---------------------------------------------------------------- checking values

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 4, 80, 80, 80
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
               dict: "an object", _NONE: "null"}


def _shown(v: Any) -> str:
    """``v`` for a message, at most 40 characters; values nested deeper than a few
    levels are shown as ``[...]`` (a full repr of one nested ~1000 deep raised
    RecursionError, which ``--skip-bad`` could not skip)."""
    text = _REPR.repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_problem(name: str, v: Any, types: Tuple[type, ...]) -> Optional[str]:
    """Why ``v`` cannot be field ``name`` (None: it can)."""
    if type(v) in types:
        return None
    want = " or ".join("a number" if t is int and float in types else _TYPE_NAMES[t] for t in types if t is not float)
    return f"'{name}' must be {want}, not {_TYPE_NAMES.get(type(v), type(v).__name__)} {_shown(v)}"


def _int_problem(name: str, v: Any, low: int, high: int, *, optional: bool = False) -> Optional[str]:
    """Why ``v`` is not an integer in [low, high) (None: it is, or it is null and may be)."""
    if v is None and optional:
        return None
    if type(v) is not int:
        return _type_problem(name, v, (int, _NONE) if optional else (int,))
    if not low <= v < high:
        return f"'{name}' is {_shown(v)}, outside [{low}, {high})"
    return None


def record_problem(r: Any) -> Optional[str]:
    """Why ``r`` is not a usable trace record (None: it is).  A field the record
    lacks counts as null."""
    if not isinstance(r, dict):
        return "a record must be a JSON object"
    missing = [k for k in REQUIRED if r.get(k) is None]
    if missing:
        return f"record without {', '.join(map(repr, missing))}"
    for name, types in RECORD_TYPES.items():
        why = _type_problem(name, r.get(name), types)
        if why:
            return why
    for name in ("enqueue_ns", "start_ns", "end_ns"):
        why = _int_problem(name, r.get(name), 0, TIME_LIMIT, optional=True)
        if why:
            return why
    if r["state"] not in _STATES:
        return f"'state' is {_shown(r['state'])}, not one of {', '.join(STATES)}"
    return None


_LISTS, _INTS = frozenset((list,)), frozenset((int,))


def shapes_ok(shapes: Any) -> bool:
    """``in_sizes``/``out_sizes`` as the recorder writes them: a list of shapes,
    each a list of integers.  The reader does not look inside them (nothing it
    computes uses them); a tool that writes them back checks them with this,
    as their nesting could be too deep for a JSON encoder."""
    return (type(shapes) is list and _LISTS.issuperset(map(type, shapes))
            and _INTS.issuperset(map(type, chain.from_iterable(shapes))))


def _fast_values(r: Any) -> Optional[Tuple[Any, ...]]:
    """The field values of ``r`` in RECORD_FIELDS order when it is a usual record
    (all fields there, types seen valid before): the hot path of reading.  None:
    look closer."""
    try:
        values = _record_values(r)
    except (KeyError, TypeError):  # a field missing, or not a dict
        return None
    if tuple(map(type, values)) not in _good_signatures:
        return None
    start, end = values[_START], values[_END]
    if (0 <= values[_ENQUEUE] < TIME_LIMIT and (start is None or 0 <= start < TIME_LIMIT)
            and (end is None or 0 <= end < TIME_LIMIT) and values[_STATE] in _STATES):
        return tuple(values)
    return None


def _record(r: Any, path: str, line: int, index: Optional[int] = None) -> Tuple[Any, ...]:
    """The field values of record ``r`` in RECORD_FIELDS order (a missing one:
    None), or ``TraceFileError`` naming what is wrong with it."""
    values = _fast_values(r)
    if values is not None:
        return values
    why = record_problem(r)
    if why is not None:
        raise TraceFileError(path, line, why if index is None else f"record #{index}: {why}")
    values = tuple(map(r.get, RECORD_FIELDS))
    if len(_good_signatures) < 4096:
        _good_signatures.add(tuple(map(type, values)))
    return values


# ---------------------------------------------------------------- files

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str, max_bytes: Optional[int] = None) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (symbolic links are
    followed; what they end at must be a regular file too): a FIFO named
    ``rank0.json`` would block the reader forever and a device such as
    /dev/zero never ends.  The open does not block (``O_NONBLOCK``), the check
    is on the opened file (``fstat``), so a swap between the two cannot fool it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TraceFileError(path, None, exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "a special file")
            raise TraceFileError(path, None, f"not a regular file ({kind})")
        if max_bytes is not None and st.st_size > max_bytes:
            raise TraceFileError(path, None, f"{st.st_size} bytes: larger than the {max_bytes} this reader takes")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


RUN_TRACES = "traces"  # where commslayer-run --run-dir puts the ranks' traces


def find_files(paths: Sequence[str]) -> List[str]:
    """The trace files named by ``paths``: directories give their ``rank<R>.json``
    and ``rank<R>.jsonl`` files, and those of their restarted lives
    (``replica<R>-restart<N>/``), or else those of their ``traces/`` (a run
    directory's); files are taken as they are.  A path that does not exist, or a
    directory without trace files, is an error."""
    out: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = _rank_files(p) or _rank_files(os.path.join(p, RUN_TRACES))
            if not found:
                raise TraceFileError(p, None, f"no trace files here (rank<R>.json or rank<R>.jsonl), nor in "
                                              f"{RUN_TRACES}/")
            out += found
        elif os.path.lexists(p):
            out.append(p)
        else:
            raise TraceFileError(p, None, "no such file or directory")
    return out


def _rank_files(directory: str) -> List[str]:
    """The trace files of ``directory`` and of its restarted lives; none if it is no directory."""
    if not os.path.isdir(directory):
        return []
    dirs = [directory] + sorted((os.path.join(directory, n) for n in os.listdir(directory) if _LIFE_DIR.match(n)
                                 and os.path.isdir(os.path.join(directory, n))), key=life_of)
    return [os.path.join(d, n) for d in dirs for n in sorted(os.listdir(d), key=_rank_file_order)
            if _RANK_FILE.match(n)]


def file_rank(path: str) -> Optional[int]:
    """The rank a trace file's name gives (``rank<R>.json``, ``rank<R>.jsonl``), or None."""
    m = _RANK_FILE.match(os.path.basename(path))
    return int(m.group(1)) if m else None


def _rank_file_order(name: str) -> Tuple[int, str]:
    """Sort key of a directory entry: rank files by rank number, then by name."""
    rank = file_rank(name)
    return (-1 if rank is None else rank, name)


def life_of(path: str) -> int:
    """The restart number of the life that wrote the trace file (or directory) ``path``:
    N for files under ``replica<R>-restart<N>/``, else 0."""
    d = path if os.path.isdir(path) else os.path.dirname(path)
    m = _LIFE_DIR.match(os.path.basename(os.path.normpath(d)) if d else "")
    return int(m.group(1)) if m else 0


def _clock_offset(clock: Any, path: str, line: int) -> int:
    """``wall_ns - mono_ns`` of a clock anchor, checked."""
    if not isinstance(clock, dict):
        raise TraceFileError(path, line, f"'clock' must be an object with wall_ns and mono_ns, not {_shown(clock)}")
    for key in ("wall_ns", "mono_ns"):
        why = _int_problem(f"clock.{key}", clock.get(key), 0, TIME_LIMIT)
        if why:
            raise TraceFileError(path, line, why)
    return int(clock["wall_ns"] - clock["mono_ns"])


def _take_facts(src: RankSource, doc: Dict[str, Any], path: str, line: int) -> None:
    """The process facts of a dump or JSON-lines header, checked, into ``src``."""
    for key, types in (("host", (str, _NONE)), ("job", (str, _NONE)), ("pid", (int, _NONE))):
        why = _type_problem(key, doc.get(key), types)
        if why:
            raise TraceFileError(path, line, why)
    src.host, src.pid, src.job = doc.get("host"), doc.get("pid"), doc.get("job")
    cwd = doc.get("cwd")
    if isinstance(cwd, str):
        src.cwd = cwd


def _count(doc: Dict[str, Any], key: str, path: str, line: int) -> int:
    """A count of lost records (null: 0), checked."""
    why = _int_problem(key, doc.get(key), 0, 1 << 63, optional=True)
    if why:
        raise TraceFileError(path, line, why)
    return doc.get(key) or 0


def _communicator(info: Any, path: str, line: int, what: str) -> Dict[str, Any]:
    """A communicator's description (dump entry or JSON-lines event, in the
    dump's names), checked: the fields the analysis uses."""
    if not isinstance(info, dict):
        raise TraceFileError(path, line, f"{what}: must be a JSON object, not {_shown(info)}")
    why = (_type_problem("name", info.get("name"), (str, _NONE))
           or _type_problem("backend", info.get("backend"), (str, _NONE))
           or _type_problem("state", info.get("state"), (str, _NONE))
           or _int_problem("rank", info.get("rank"), 0, MAX_RANKS, optional=True)
           or _int_problem("size", info.get("size"), 1, MAX_RANKS + 1, optional=True)
           or _int_problem("generation", info.get("generation"), 0, 1 << 63, optional=True))
    ranks = info.get("global_ranks")
    if not why and ranks is not None:
        if type(ranks) is not list:
            why = _type_problem("global_ranks", ranks, (list, _NONE))
        else:
            why = next(filter(None, (_int_problem("global_ranks[]", g, 0, MAX_RANKS) for g in ranks)), None)
    if why:
        raise TraceFileError(path, line, f"{what}: {why}")
    return {k: info.get(k) for k in ("name", "backend", "rank", "size", "global_ranks", "generation", "state")}


def _jsonl_header(path: str, offset: int = 0, line: int = 1) -> Dict[str, Any]:
    """The line at byte ``offset`` (line number ``line``) of a JSONL file: the first
    line of the process read (the sink writes ``trace_started`` first)."""
    with open_regular(path) as f:
        f.seek(offset)
        first = f.readline(MAX_LINE_BYTES + 1)
    if not first.strip():
        raise TraceFileError(path, line, "empty file: no trace_started line")
    if len(first) > MAX_LINE_BYTES:
        raise TraceFileError(path, line, f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        head = loads(first)
    except _BAD_JSON as exc:
        raise TraceFileError(path, line, f"not JSON ({exc})") from None
    if not isinstance(head, dict) or type(head.get("rank")) is not int:
        raise TraceFileError(path, line, "not a commslayer JSON-lines trace (no rank)")
    if head.get("event") == "trace_started" and head.get("schema") != SCHEMA_VERSION:
        raise TraceFileError(path, line, f"trace schema {_shown(head.get('schema'))}; this reader knows "
                                         f"{SCHEMA_VERSION}")
    why = _int_problem("rank", head["rank"], 0, MAX_RANKS)
    if why:
        raise TraceFileError(path, line, why)
    return head


# How the sink writes the first line of a process (an earlier one's may come before it:
# the file is appended to).  Inside a JSON string the quotes would be escaped.
_PROCESS_START = b'"event":"trace_started"'


def _last_process(path: str) -> Tuple[int, int, int]:
    """Where the last process's lines of the JSON-lines file ``path`` begin: the
    byte offset, the line number, and how many processes wrote lines before it
    (a run before this one, writing into the same directory: the sink appends)."""
    starts: List[int] = []
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0, 1, 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            at = m.find(_PROCESS_START)
            while at >= 0:
                starts.append(m.rfind(b"\n", 0, at) + 1)
                at = m.find(_PROCESS_START, at + len(_PROCESS_START))
            if len(starts) < 2:
                return 0, 1, 0
            offset = starts[-1]
            newlines = sum(m[i:min(i + READ_CHUNK, offset)].count(b"\n") for i in range(0, offset, READ_CHUNK))
    return offset, newlines + 1, len(starts) - 1


# The clock anchor near the start of a dump or a JSON-lines file's first line: when
# the process that wrote it began tracing (its recorder was made).
_STARTED = re.compile(rb'"clock"\s*:\s*\{[^{}]{0,200}?"wall_ns"\s*:\s*(\d{1,19})')
_HEAD_BYTES = 1 << 16


def _window(path: str, offset: int = 0) -> Optional[Tuple[int, int]]:
    """When the process that wrote ``path`` (from ``offset``) began tracing and when
    the file was last written, wall clock ns; None where the file does not say or
    cannot be read (the rest of the reader says why), or says something impossible."""
    try:
        with open_regular(path) as f:
            f.seek(offset)
            m = _STARTED.search(f.read(_HEAD_BYTES))
            written = os.fstat(f.fileno()).st_mtime_ns
    except (TraceFileError, OSError):
        return None
    if m is None or int(m.group(1)) > written:  # a process starts before it writes
        return None
    return int(m.group(1)), written


RUN_GAP_NS = 1_000_000_000  # a run is told from the next by more than this (clocks of hosts differ a little)


def _earlier_runs(windows: Dict[str, Tuple[int, int]]) -> List[Tuple[List[str], int, int]]:
    """The files that earlier runs left, each run's (files, last written, the next
    run's first start): every process of one run traces while the others do (they
    meet in collectives from the start), so a file last written well before
    (``RUN_GAP_NS``) the newest run's first process began is another run's, left
    in a directory used again."""
    runs: List[List[Any]] = []  # [first start, last written, files], by start
    for path, (start, end) in sorted(windows.items(), key=lambda kv: kv[1]):
        if runs and start <= runs[-1][1] + RUN_GAP_NS:
            runs[-1][1] = max(runs[-1][1], end)
            runs[-1][2].append(path)
        else:
            runs.append([start, end, [path]])
    return [(files, end, runs[i + 1][0]) for i, (_, end, files) in enumerate(runs[:-1])]


def _utc(ns: int) -> str:
    """A wall-clock time in ns, as the warnings give it."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ns / 1e9))


def _json_text(f: BinaryIO, path: str) -> bytearray:
    """A dump's bytes, read in chunks and refused at the first chunk that cannot be a
    dump's JSON (a NUL byte, which JSON text never holds; a first character other than
    ``{``): a 1 GiB file of zeros was read whole (2.1 GB of memory) before ``loads``
    refused it."""
    data, first = bytearray(), b""
    while chunk := f.read(READ_CHUNK):
        nul = chunk.find(b"\0")
        if nul >= 0:
            raise TraceFileError(path, None, f"not a commslayer trace dump (a NUL byte at offset {len(data) + nul})")
        first = first or chunk.lstrip()[:1]
        if first not in (b"", b"{"):
            raise TraceFileError(path, 1, f"not a commslayer trace dump (it starts with {first.decode('latin-1')!r}, "
                                          "not '{')")
        data += chunk
        if len(data) > MAX_DUMP_BYTES:
            raise TraceFileError(path, None, f"larger than the {MAX_DUMP_BYTES} bytes this reader takes")
    return data


def read_dump(path: str) -> Dict[str, Any]:
    """One dump file, parsed and checked as a whole (``TraceFileError`` says
    what is wrong with it); its fields and records are checked as they are used."""
    with open_regular(path, MAX_DUMP_BYTES) as f:
        data = _json_text(f, path)
    try:
        doc = loads(data)
    except _BAD_JSON as exc:
        line = getattr(exc, "lineno", None)
        raise TraceFileError(path, line, f"truncated or corrupt JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != DUMP_KIND:
        raise TraceFileError(path, 1, "not a commslayer trace dump")
    if doc.get("schema") != SCHEMA_VERSION:
        raise TraceFileError(path, 1, f"trace schema {_shown(doc.get('schema'))}; this reader knows {SCHEMA_VERSION}")
    if not isinstance(doc.get("records"), list) or type(doc.get("rank")) is not int:
        raise TraceFileError(path, 1, "dump without a rank or a records list")
    why = _int_problem("rank", doc["rank"], 0, MAX_RANKS)
    if why:
        raise TraceFileError(path, 1, why)
    return doc


# ---------------------------------------------------------------- reading

def discover(paths: Sequence[str], *, skip_bad: bool = False,
             problems: Optional[List[str]] = None) -> Dict[int, RankSource]:
    """Group the files under ``paths`` by rank (headers only; records are read
    later).  No usable file at all is an error, also with ``skip_bad``."""
    sources: Dict[Tuple[int, int], RankSource] = {}  # (rank, life) -> source
    skipped: List[str] = []
    notes: List[str] = []
    files = find_files(paths)
    starts: Dict[str, Tuple[int, int, int]] = {}  # a JSON-lines file's last process: offset, line, earlier ones
    windows: Dict[str, Tuple[int, int]] = {}
    for path in files:
        if path.endswith(".jsonl"):
            try:
                starts[path] = _last_process(path)
            except (TraceFileError, OSError, ValueError):
                starts[path] = (0, 1, 0)  # read as it is below, which says what is wrong
        window = _window(path, starts.get(path, (0,))[0])
        if window is not None:
            windows[path] = window
    named = {os.path.abspath(p) for p in paths if not os.path.isdir(p)}
    left_out: Set[str] = set()
    for run_files, written, next_start in _earlier_runs(windows):
        scanned = [p for p in run_files if os.path.abspath(p) not in named]
        left_out.update(scanned)
        if scanned:
            notes.append(f"left out {', '.join(scanned)}: an earlier run's, last written {_utc(written)}, before "
                         f"the next run's first process began tracing at {_utc(next_start)} (use a trace "
                         f"directory per run)")
    for path, (_, line, earlier) in starts.items():
        if earlier and path not in left_out:
            notes.append(f"{path}: left out lines 1-{line - 1}, written by {earlier} process(es) before this "
                         f"one (the file is appended to: an earlier run, or a restart, wrote into this directory)")
    for path in files:
        if path in left_out:
            continue
        life = life_of(path)
        try:
            if path.endswith(".jsonl"):
                offset, line, _ = starts[path]
                head = _jsonl_header(path, offset, line)
                src = sources.get((head["rank"], life)) or RankSource(head["rank"], life=life)
                if src.jsonl_path:
                    raise TraceFileError(path, None, f"a second JSON-lines file for rank {src.rank} "
                                                     f"(first: {src.jsonl_path})")
                wall_minus_mono = None if head.get("clock") is None else _clock_offset(head["clock"], path, line)
                _take_facts(src, head, path, line)
                if src.wall_minus_mono_ns is None:
                    src.wall_minus_mono_ns = wall_minus_mono
                src.jsonl_path, src.jsonl_offset, src.jsonl_first_line = path, offset, line
            else:
                m = _RANK_FILE.search(os.path.basename(path))
                if m:
                    open_regular(path, MAX_DUMP_BYTES).close()  # read later: say now if it cannot be
                    rank = int(m.group(1))
                else:
                    rank = read_dump(path)["rank"]
                why = _int_problem("rank", rank, 0, MAX_RANKS)
                if why:
                    raise TraceFileError(path, None, f"file name: {why}")
                src = sources.get((rank, life)) or RankSource(rank, life=life)
                if src.dump_path:
                    raise TraceFileError(path, None, f"a second dump for rank {rank} (first: {src.dump_path})")
                src.dump_path = path
            sources[(src.rank, life)] = src
        except TraceFileError as exc:
            if not skip_bad:
                raise
            skipped.append(f"skipped {exc}")
    if problems is not None:
        problems += notes + skipped
    if not sources:
        raise TraceFileError(", ".join(paths), None, f"no usable trace file ({skipped[0]}"
                                                     f"{f' and {len(skipped) - 1} more' if len(skipped) > 1 else ''})")
    ranks: Dict[int, RankSource] = {}
    for (rank, _), src in sorted(sources.items()):
        if rank in ranks:
            ranks[rank].lives.append(src)
        else:
            ranks[rank] = src
    return ranks


def _note_skipped(problems: List[str], exc: TraceFileError, bad: int) -> None:
    if bad <= 5:
        problems.append(f"skipped {exc}")


MAX_STACK_FRAMES = 64  # a dump's writer keeps 32


def _main_stack(stack: Any, path: str) -> Optional[Dict[str, Any]]:
    """A dump's ``main_stack`` (None where it has none), checked: ``reason`` and ``at``
    strings (``at`` may be null), ``frames`` a list of at most ``MAX_STACK_FRAMES`` strings."""
    if stack is None:
        return None
    if not isinstance(stack, dict):
        raise TraceFileError(path, 1, str(_type_problem("main_stack", stack, (dict, _NONE))))
    frames = stack.get("frames")
    why = _type_problem("main_stack.reason", stack.get("reason"), (str,)) or \
        _type_problem("main_stack.at", stack.get("at"), (str, _NONE))
    if not isinstance(frames, list):
        why = why or _type_problem("main_stack.frames", frames, (list,))
    elif len(frames) > MAX_STACK_FRAMES:
        why = why or f"'main_stack.frames' holds {len(frames)} frames, more than {MAX_STACK_FRAMES}"
    else:
        why = why or next(filter(None, (_type_problem("main_stack.frames[]", f, (str,)) for f in frames)), None)
    if why:
        raise TraceFileError(path, 1, why)
    return {k: stack[k] for k in ("reason", "at", "frames")}


Row = Tuple[Tuple[Any, ...], Dict[str, Any]]  # a record's field values in RECORD_FIELDS order, and the record


def load_dump(src: RankSource, skip_bad: bool, problems: List[str]) -> Dict[int, Row]:
    """Read the rank's dump (facts into ``src``); its records by op_id.  With
    ``skip_bad`` a bad record is left out; a bad dump as a whole always raises."""
    path = src.dump_path
    assert path is not None  # a source read for its dump has one
    doc = read_dump(path)
    if doc["rank"] != src.rank:
        raise TraceFileError(path, 1, f"dump of rank {doc['rank']} in a file named for rank {src.rank}")
    if doc.get("clock") is None:
        raise TraceFileError(path, 1, "dump without its clock anchor")
    offset = _clock_offset(doc["clock"], path, 1)
    why = _type_problem("reason", doc.get("reason"), (str, _NONE))
    if why:
        raise TraceFileError(path, 1, why)
    dropped = _count(doc, "dropped_records", path, 1)
    comms = doc.get("communicators") or {}
    if not isinstance(comms, dict):
        raise TraceFileError(path, 1, f"'communicators' must be an object, not {_shown(comms)}")
    infos = {uid: _communicator(info, path, 1, f"communicator {_shown(uid)}") for uid, info in comms.items()}
    _take_facts(src, doc, path, 1)
    src.wall_minus_mono_ns, src.reason, src.ring_dropped = offset, doc.get("reason"), dropped
    src.main_stack = _main_stack(doc.get("main_stack"), path)
    src.communicators.update(infos)
    events = doc.get("events") or []
    if not isinstance(events, list):
        raise TraceFileError(path, 1, f"'events' must be a list, not {_shown(events)}")
    for ev in events:
        _take_event(src, ev, path, 1)
    out: Dict[int, Row] = {}
    bad = 0
    for i, r in enumerate(doc["records"]):
        try:
            values = _record(r, path, 1, i)
        except TraceFileError as exc:
            if not skip_bad:
                raise
            bad += 1
            _note_skipped(problems, exc, bad)
            continue
        out[values[0]] = (values, r)
    if bad > 5:
        problems.append(f"skipped {bad - 5} more bad records of {path}")
    return out


def _jsonl_rows(src: RankSource, skip_bad: bool, problems: List[str]) -> Iterator[Row]:
    path = src.jsonl_path
    assert path is not None  # a source read for its JSON lines has them
    bad = 0
    with open_regular(path) as f:
        f.seek(src.jsonl_offset)
        read = partial(f.readline, MAX_LINE_BYTES + 1)
        lineno = src.jsonl_first_line - 1
        for line in iter(read, b""):
            lineno += 1
            try:  # the common case first, in one try: a whole collective record
                ev = loads(line)
                if ev["event"] == "collective":
                    values = _fast_values(ev)
                    if values is not None:
                        yield values, ev
                        continue
            except _NOT_FAST:
                pass
            try:
                if len(line) > MAX_LINE_BYTES:
                    while line and not line.endswith(b"\n"):  # the rest of the long line
                        line = read()
                    raise TraceFileError(path, lineno, f"line longer than {MAX_LINE_BYTES} bytes")
                if not line.endswith(b"\n") and _cut_short(line):
                    problems.append(f"{path}:{lineno}: the last line is cut short (its process was killed while "
                                    "writing it, or is writing it now): left out")
                    continue
                row = _other_line(src, path, lineno, line)
            except TraceFileError as exc:
                if not skip_bad:
                    raise
                bad += 1
                _note_skipped(problems, exc, bad)
                continue
            if row is not None:
                yield row
    if bad > 5:
        problems.append(f"skipped {bad - 5} more bad lines of {path}")


def _cut_short(line: bytes) -> bool:
    """Whether ``line``, the file's last (no newline ends it), is JSON cut off part-way:
    the sink writes whole lines, so that is a write that did not finish."""
    try:
        loads(line)
    except _BAD_JSON:
        return True
    return False


def tail_ends(path: str, n: int, start: int = 0) -> List[int]:
    """The ends (the file's clock) of completed records among the last lines of the
    JSON-lines file ``path`` (those from byte ``start``: its last process's): at least
    ``n`` when it holds as many, read from its end (lines that are not valid records
    are passed over; a line past the size bound stops the search).  The ``n``-th
    latest of them is a lower bound of the ``n``-th latest end of the whole file,
    found without reading it."""
    ends: List[int] = []
    with open_regular(path) as f:
        pos = f.seek(0, os.SEEK_END)
        chunk, carry = 1 << 20, b""
        while pos > start and len(ends) < n and len(carry) <= MAX_LINE_BYTES:
            step = min(chunk, pos - start)
            pos -= step
            f.seek(pos)
            lines = (f.read(step) + carry).split(b"\n")
            carry = lines.pop(0) if pos > start else b""  # the first line may go on before this chunk
            for line in lines:
                try:
                    r = loads(line)
                    if r["event"] == "collective" and r["state"] == COMPLETED:
                        values = _record(r, path, 0)
                        if values[_END] is not None:
                            ends.append(values[_END])
                except (TraceFileError, *_NOT_FAST):
                    pass
            chunk *= 2
    return ends


def _other_line(src: RankSource, path: str, lineno: int, line: bytes) -> Optional[Row]:
    """A JSONL line the fast path did not take: a record (checked in full, returned),
    an event to note (None), or an error."""
    return check_event(src, parse_line(path, lineno, line), path, lineno)


def parse_line(path: str, lineno: int, line: bytes) -> Any:
    """One JSON line, parsed, or ``TraceFileError``."""
    try:
        return loads(line)
    except _BAD_JSON as exc:
        raise TraceFileError(path, lineno, f"truncated or corrupt JSON line ({exc})") from None


# The events a communicator writes when it fails (tracing.record.sinks).
FAILURE_EVENTS = ("collective_timeout", "peer_lost", "communicator_error")


def check_event(src: RankSource, ev: Any, path: str, lineno: int) -> Optional[Row]:
    """A parsed JSONL event, checked: a record (returned with its values), an event
    noted into ``src`` (None), or ``TraceFileError`` naming what is wrong."""
    kind = ev.get("event") if isinstance(ev, dict) else None
    if kind == "collective":
        return _record(ev, path, lineno), ev
    if kind in ("communicator_created", "communicator_split"):
        uid = ev.get("comm_id")
        if type(uid) is not str:
            raise TraceFileError(path, lineno, f"{kind}: {_type_problem('comm_id', uid, (str,))}")
        info = _communicator({"name": ev.get("comm"), "backend": ev.get("backend"), "rank": ev.get("comm_rank"),
                              "size": ev.get("size"), "global_ranks": ev.get("global_ranks"),
                              "generation": ev.get("generation"), "state": "ok"}, path, lineno, kind)
        src.communicators.setdefault(uid, info)
    elif kind == "recovery":
        _take_event(src, ev, path, lineno)
    elif kind == "sink_dropped":
        src.jsonl_dropped += _count(ev, "dropped", path, lineno)
    elif kind in FAILURE_EVENTS:
        why = next(filter(None, (_type_problem(k, ev.get(k), (str, _NONE)) for k in ("comm", "error"))), None)
        if why:
            raise TraceFileError(path, lineno, f"{kind}: {why}")
    elif kind == "trace_started":
        if ev.get("schema") != SCHEMA_VERSION:
            raise TraceFileError(path, lineno,
                                 f"trace schema {_shown(ev.get('schema'))}; this reader knows {SCHEMA_VERSION}")
        if ev.get("clock") is not None:
            _clock_offset(ev["clock"], path, lineno)
    elif kind is None:
        raise TraceFileError(path, lineno, "not a trace event (no 'event' field)")
    return None


# The fields of recovery events (records.EVENT_KINDS) the viewer uses, and their types.
_EVENT_INTS = ("step", "generation", "bytes", "source", "source_replica", "seq")
_EVENT_TYPES: Dict[str, Tuple[type, ...]] = {
    "comm": (str, _NONE), "comm_id": (str, _NONE), "error": (str, _NONE), "why": (str, _NONE), "op": (str, _NONE),
    "seconds": (int, float, _NONE), "lost": (list, _NONE), "members": (list, _NONE), "before": (list, _NONE),
    "replicas": (list, _NONE), "lost_replicas": (list, _NONE),
}


def _take_event(src: RankSource, ev: Any, path: str, line: int) -> None:
    """A recovery event, checked, into ``src.events`` (once: a dump and JSON lines both hold it)."""
    if not isinstance(ev, dict):
        raise TraceFileError(path, line, f"an event must be an object, not {_shown(ev)}")
    why = _type_problem("event kind", ev.get("kind"), (str,)) \
        or _int_problem("event mono_ns", ev.get("mono_ns"), 0, TIME_LIMIT) \
        or next(filter(None, (_int_problem(f"event {k}", ev.get(k), -1, 1 << 62, optional=True)
                              for k in _EVENT_INTS)), None) \
        or next(filter(None, (_type_problem(f"event {k}", ev.get(k), types)
                              for k, types in _EVENT_TYPES.items())), None)
    for k in ("lost", "members", "before", "replicas", "lost_replicas"):
        if not why and isinstance(ev.get(k), list):
            why = next(filter(None, (_int_problem(f"event {k}[]", m, 0, MAX_RANKS) for m in ev[k])), None)
    if why:
        raise TraceFileError(path, line, why)
    key = (ev["kind"], ev["mono_ns"])
    if key not in src.event_keys:
        src.event_keys.add(key)
        src.events.append({k: v for k, v in ev.items() if k not in ("event", "level", "ts", "job", "host", "pid")})


def rank_records(src: RankSource, *, skip_bad: bool = False,
                 problems: Optional[List[str]] = None) -> Iterator[Dict[str, Any]]:
    """Every record of one rank, each once: the JSONL's, then what only the dump has.

    Fills ``src``'s facts (clock, communicators, dump reason) as it reads;
    raises ``TraceFileError`` on bad input unless ``skip_bad``.  Every record
    it yields passed ``record_problem``: its users can trust its types.
    """
    for _, r in rank_rows(src, skip_bad=skip_bad, problems=problems):
        yield r


def rank_rows(src: RankSource, *, skip_bad: bool = False, problems: Optional[List[str]] = None) -> Iterator[Row]:
    """``rank_records`` with each record's field values in RECORD_FIELDS order
    (what checking it fetched anyway: the analysis' hot loop unpacks them).
    The later lives follow the first, moved onto its clock (see the module doc)."""
    problems = [] if problems is None else problems
    if not src.lives and not src.life:
        yield from _life_rows(src, skip_bad, problems)
        return
    for life in [src, *src.lives]:
        rows = _life_rows(life, skip_bad, problems)
        first = next(rows, None)
        if src.wall_minus_mono_ns is None:  # the first life left nothing usable: this one sets the axis
            src.wall_minus_mono_ns = life.wall_minus_mono_ns
        shift = (life.wall_minus_mono_ns or 0) - (src.wall_minus_mono_ns or 0)
        ids = life.life * LIFE_OP_IDS
        lo, hi = TIME_LIMIT, -1
        if first is not None:
            for values, r in chain((first,), rows):
                v = list(values)
                if shift:
                    v[_ENQUEUE] += shift
                    if v[_START] is not None:
                        v[_START] += shift
                    if v[_END] is not None:
                        v[_END] += shift
                    r.update(enqueue_ns=v[_ENQUEUE], start_ns=v[_START], end_ns=v[_END])
                    for k in ("wait_ns", "wait_end_ns"):
                        if type(r.get(k)) is int:
                            r[k] += shift
                if ids:
                    v[0] += ids
                    if not v[3]:
                        v[2] = life_uid(v[2], life.life)
                    r.update(op_id=v[0], comm_id=v[2], life=life.life)
                lo, hi = min(lo, v[_ENQUEUE]), max(hi, v[_END] or v[_ENQUEUE])
                yield tuple(v), r
        life.span = (lo, hi) if hi >= 0 else None


def life_uid(uid: str, life: int) -> str:
    """The id under which a restarted life's generation-0 communicator ``uid`` is shown:
    the new processes built it anew (its sequence numbers start again), so it is
    another communicator than the one of the same id in the life before."""
    return f"{uid}@life{life}" if life else uid


def life_communicators(src: RankSource) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Every communicator of every life of rank ``src``, under the ids its records carry."""
    for life in [src, *src.lives]:
        for uid, info in life.communicators.items():
            yield (uid if info.get("generation") else life_uid(uid, life.life)), info


def _life_rows(src: RankSource, skip_bad: bool, problems: List[str]) -> Iterator[Row]:
    """The rows of one life of a rank (its dump and JSON lines)."""
    from_dump: Dict[int, Row] = {}
    if src.dump_path:
        try:
            from_dump = load_dump(src, skip_bad, problems)
        except TraceFileError as exc:
            if not skip_bad:
                raise
            problems.append(f"skipped {exc}")
            src.dump_path = None
    if src.wall_minus_mono_ns is None and src.jsonl_path:
        problems.append(f"rank {src.rank}: no clock anchor in {src.jsonl_path}; its times are taken as wall time")
        src.wall_minus_mono_ns = 0
    if src.jsonl_path:
        for row in _jsonl_rows(src, skip_bad, problems):
            if from_dump:
                from_dump.pop(row[0][0], None)  # by op_id, the first field
            yield row
    for op_id in sorted(from_dump):
        yield from_dump[op_id]
    if src.wall_minus_mono_ns is not None:
        for ev in src.events:
            ev["wall_ns"] = ev["mono_ns"] + src.wall_minus_mono_ns


def iter_records(paths: Sequence[str], *, skip_bad: bool = False,
                 problems: Optional[List[str]] = None) -> Iterator[Dict[str, Any]]:
    """All records of a job, rank by rank, each with ``rank`` (global) added."""
    for rank, src in sorted(discover(paths, skip_bad=skip_bad, problems=problems).items()):
        for r in rank_records(src, skip_bad=skip_bad, problems=problems):
            r["rank"] = rank
            yield r
