"""Every ``COMMSLAYER_*`` environment variable, read and checked in one place.

docs/configuration.md documents this table; keep the two in step.

A value that is not allowed raises ``ConfigError`` naming the variable, the
value and what is allowed, never a bare ``ValueError`` and never a silent
fallback to the default.  ``validate()`` checks every variable at once and
reports all bad ones in one message; it runs at start-up (``new_comm``,
``join``, a commslayer ``torch.distributed`` group, the tracing autoload),
so a typo fails the job before it builds anything rather than when a trace
is dumped or a peer is judged.  A variable that is allowed but does nothing
in the environment it is in gets a warning there.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, overload

from commslayer import startup
from commslayer.endpoints import host_port, is_etcd, parse_url
from commslayer.errors import ConfigError

MAX_TIMEOUT_S = 10 * 365 * 86400.0  # c10d keeps timeouts in int64 milliseconds
MAX_TRACE_BUFFER = 10_000_000  # the ring is allocated whole at start-up (8 bytes a slot)
# Beats faster than this cost a rank CPU and its peers' connections for nothing (1e-9 s: 1.48 s of
# CPU and 160,000 frames in 5 s on an idle rank, issue 41); a peer timeout is more than 2 beats anyway.
MIN_HEARTBEAT_S = 0.01
try:  # a relative path in the environment is taken from here, where the process started
    _START_DIR: Optional[str] = os.getcwd()  # (a script may change directory later: Hydra's runs do)
except OSError:  # the directory is gone: such a path stays relative
    _START_DIR = None
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def _bad(name: str, raw: str, allowed: str) -> ConfigError:
    return ConfigError(f"{name}={raw!r} is not allowed: {allowed}")


def _seconds(name: str, default: float, *, zero_is_off: bool = False, minimum: float = 0.0) -> float:
    """A number of seconds from the environment, or ``default`` when unset or empty.
    With ``zero_is_off``, zero in any spelling (``0``, ``0.0``, ``0e0``) is 0.0.
    A ``minimum`` above 0 is the smallest value allowed (zero aside)."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    lowest = f"from {minimum:g} s up to" if minimum > 0 else "a positive number of seconds below"
    allowed = f"{lowest} 10 years" + (", or 0 (off)" if zero_is_off else "")
    try:
        value = float(raw)
    except ValueError:
        raise _bad(name, raw, allowed) from None
    if zero_is_off and value == 0:
        return 0.0
    if not (0 < value < MAX_TIMEOUT_S and value >= minimum):  # also rejects nan and inf
        raise _bad(name, raw, allowed)
    return value


def _shown(name: str, value: float) -> str:
    """``NAME='raw'`` as given, or that it is unset and what it defaults to."""
    raw = os.environ.get(name, "")
    return f"{name}={raw!r}" if raw.strip() else f"{name} (unset, default {value:g})"


@overload
def _integer(name: str, default: int, minimum: int, maximum: Optional[int] = None) -> int: ...


@overload
def _integer(name: str, default: None, minimum: int, maximum: Optional[int] = None) -> Optional[int]: ...


def _integer(name: str, default: Optional[int], minimum: int, maximum: Optional[int] = None) -> Optional[int]:
    """An integer in [minimum, maximum] from the environment, or ``default`` when unset or empty."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    allowed = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, raw, allowed) from None
    if value < minimum or (maximum is not None and value > maximum):
        raise _bad(name, raw, allowed)
    return value


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise _bad(name, raw, "1, true, yes or on (on); 0, false, no, off or empty (off); in any case")


def _path(name: str, directory: bool) -> str:
    """A path from the environment (empty: unset), relative ones taken from where the
    process started; an existing one must be of the right kind."""
    raw = os.environ.get(name, "")
    path = os.path.join(_START_DIR, raw) if raw and _START_DIR is not None else raw
    if path and os.path.exists(path) and os.path.isdir(path) != directory:
        raise _bad(name, raw, "a directory" if directory else "a file path, not a directory")
    return path


def default_timeout() -> timedelta:
    """``COMMSLAYER_TIMEOUT_S``: deadline of an op that names none (default 300 s)."""
    return timedelta(seconds=_seconds("COMMSLAYER_TIMEOUT_S", 300.0))


def group_timeout(given: timedelta) -> timedelta:
    """The op deadline of a group built through ``torch.distributed`` with c10d's timeout
    ``given``: ``COMMSLAYER_TIMEOUT_S`` when it is set, which replaces it, else ``given``."""
    return default_timeout() if os.environ.get("COMMSLAYER_TIMEOUT_S", "").strip() else given


def check_mode() -> bool:
    """``COMMSLAYER_CHECK=1``: compare every op's fingerprint across ranks first."""
    return _flag("COMMSLAYER_CHECK")


def nan_check() -> bool:
    """``COMMSLAYER_NAN_CHECK=1``: every communicator refuses to send a NaN
    (``commslayer.comm.nan_check``); off by default."""
    return _flag("COMMSLAYER_NAN_CHECK")


def native() -> bool:
    """``COMMSLAYER_NATIVE``: on (the default, empty or unset), a synchronous
    collective's direct path runs in native code where it is built
    (``commslayer.comm.native``); 0 or off: in Python."""
    return not os.environ.get("COMMSLAYER_NATIVE", "").strip() or _flag("COMMSLAYER_NATIVE")


def route_c10d() -> bool:
    """``COMMSLAYER_ROUTE_C10D=1``: run ``init_process_group("gloo"|"nccl")`` and
    every later group through commslayer, without code changes."""
    return _flag("COMMSLAYER_ROUTE_C10D")


def job_id() -> str:
    """``COMMSLAYER_JOB_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``, else ``"local"``."""
    return os.environ.get("COMMSLAYER_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"


def trace_dir() -> str:
    """``COMMSLAYER_TRACE_DIR``: where trace dumps go; setting it turns tracing on
    for every communicator of the process (empty: tracing off). A restarted replica
    group (under ``commslayer-run``) writes into ``replica<R>-restart<N>/`` below it,
    so its files do not replace those of the life before; a replacement rank in
    per-rank mode (one replica group) into ``replica0-restart<N>/``."""
    base = _path("COMMSLAYER_TRACE_DIR", directory=True)
    replica, restart = replica_id(), restart_count()
    if replica is None and restart_unit() == "rank":
        replica = 0
    if base and replica is not None and restart:
        return os.path.join(base, f"replica{replica}-restart{restart}")
    return base


def run_dir() -> Optional[str]:
    """``COMMSLAYER_RUN_DIR``: set by ``commslayer-run --run-dir`` for its workers; where a
    resilient job's ranks write their results (``commslayer.runs``). None when unset."""
    return _path("COMMSLAYER_RUN_DIR", directory=True) or None


def scratch_dir() -> Optional[str]:
    """``COMMSLAYER_SCRATCH_DIR``: set by ``commslayer-run`` in per-rank mode: a directory in
    host memory (``/dev/shm``) that it removes whatever way it ends, where a ``PeerJob``
    leaves the whole state while it starts again resharded. None when unset."""
    return _path("COMMSLAYER_SCRATCH_DIR", directory=True) or None


def job_rank() -> Optional[int]:
    """``COMMSLAYER_JOB_RANK``: this process's rank in a job made of several torchruns
    (one per replica group, ``commslayer-run``), each of which numbers its ranks
    from 0. It names trace files, and c10d groups map their ranks into it
    (a torchrun's ranks are taken to be one contiguous block of the job's)."""
    rank = _integer("COMMSLAYER_JOB_RANK", None, 0)
    replica = replica_id()
    if rank is None and replica is not None and os.environ.get("RANK"):  # replica groups of WORLD_SIZE ranks
        return replica * int(os.environ.get("WORLD_SIZE") or 1) + int(os.environ["RANK"])
    return rank  # None also in a torchrun agent: no rank of its own


def replica_id() -> Optional[int]:
    """``COMMSLAYER_REPLICA``: the replica group this process belongs to, set by the
    launcher (``commslayer-run``) for each of its torchruns; unset under plain torchrun."""
    return _integer("COMMSLAYER_REPLICA", None, 0)


def restart_count() -> int:
    """torchrun's ``TORCHELASTIC_RESTART_COUNT``: which life of its replica group this is."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def trace_mode() -> int:
    """``COMMSLAYER_TRACE_MODE``: permission bits, in octal, of the trace files a job
    creates (default 0600: only the job's user reads them; 0640 lets its group read
    a shared trace directory). Directories it creates get search where read is
    allowed (0700, 0750). Group and others may read at most: a trace file they
    could write could be made to lie. The umask still applies."""
    raw = os.environ.get("COMMSLAYER_TRACE_MODE", "")
    if not raw.strip():
        return 0o600
    try:
        mode = int(raw.strip(), 8)
    except ValueError:
        mode = -1
    if mode < 0 or mode & ~0o644 or mode & 0o600 != 0o600:
        raise _bad("COMMSLAYER_TRACE_MODE", raw, "an octal file mode with owner read and write and at most read "
                   "for group and others: 0600, 0640, 0604 or 0644")
    return mode


def trace_buffer() -> int:
    """``COMMSLAYER_TRACE_BUFFER``: records kept in the flight recorder's ring (default 4096)."""
    return _integer("COMMSLAYER_TRACE_BUFFER", 4096, 1, MAX_TRACE_BUFFER)


def trace_stack() -> bool:
    """``COMMSLAYER_TRACE_STACK=1``: keep the full Python stack in every record (slow)."""
    return _flag("COMMSLAYER_TRACE_STACK")


def trace_jsonl() -> bool:
    """``COMMSLAYER_TRACE_JSONL=1``: also write structlog JSON lines, one per op."""
    return _flag("COMMSLAYER_TRACE_JSONL")


def trace_otel() -> bool:
    """``COMMSLAYER_TRACE_OTEL=1``: also emit OpenTelemetry spans and metrics."""
    return _flag("COMMSLAYER_TRACE_OTEL")


def trace_sink_queue() -> int:
    """``COMMSLAYER_TRACE_SINK_QUEUE``: records a trace sink (JSON lines, OpenTelemetry)
    holds before its background thread writes them; beyond it, records are dropped
    and counted rather than slowing the op down (default 65536)."""
    return _integer("COMMSLAYER_TRACE_SINK_QUEUE", 65536, 1)


def heartbeat_s() -> float:
    """``COMMSLAYER_HEARTBEAT_S``: how often each member tells its peers it is alive
    (default 0.25 s, at least ``MIN_HEARTBEAT_S``; ``0`` turns liveness off: a lost
    peer is then only seen by the op that talks to it, or at the op's deadline)."""
    return _seconds("COMMSLAYER_HEARTBEAT_S", 0.25, zero_is_off=True, minimum=MIN_HEARTBEAT_S)


def peer_timeout_s() -> float:
    """``COMMSLAYER_PEER_TIMEOUT_S``: silence after which a peer counts as stopped
    (default 3 s). A peer whose process ends is named at once, whatever this is."""
    return _seconds("COMMSLAYER_PEER_TIMEOUT_S", 3.0)


def watch_peers() -> int:
    """``COMMSLAYER_WATCH_PEERS``: how many peers each member watches once a member
    set is larger than ``COMMSLAYER_FULL_MESH_MAX`` (default 3): each member then
    has this many watchers and at most twice this many liveness connections."""
    return _integer("COMMSLAYER_WATCH_PEERS", 3, 1, 64)


def full_mesh_max() -> int:
    """``COMMSLAYER_FULL_MESH_MAX``: the largest member set in which every member
    watches every other (default 16); larger sets use the watch topology of
    ``COMMSLAYER_WATCH_PEERS`` (see docs/recovery.md)."""
    return _integer("COMMSLAYER_FULL_MESH_MAX", 16, 1)


def job_store() -> Optional[str]:
    """``COMMSLAYER_JOB_STORE``: the job's store, which ``commslayer-run`` gives its ranks:
    ``host:port`` of its TCPStore, or ``etcd://h1:2379,h2:2379/job`` (keys under ``job/``
    of an etcd cluster); None when unset (plain torchrun: torchrun's store)."""
    raw = os.environ.get("COMMSLAYER_JOB_STORE", "")
    if not raw.strip():
        return None
    try:
        parse_url(raw.strip()) if is_etcd(raw.strip()) else host_port(raw)
    except ValueError as exc:
        raise _bad("COMMSLAYER_JOB_STORE", raw, f"host:port or etcd://host:port,.../job ({exc})") from None
    return raw.strip()


def etcd_auth() -> Optional[Tuple[str, str]]:
    """``COMMSLAYER_ETCD_USER`` and ``COMMSLAYER_ETCD_PASSWORD``: the user a job's store on
    etcd authenticates as (etcd's auth enabled), both or neither; None when neither is
    set. The password is never shown, in an error or anywhere else."""
    user = os.environ.get("COMMSLAYER_ETCD_USER", "")
    password = os.environ.get("COMMSLAYER_ETCD_PASSWORD", "")
    if not user and not password:
        return None
    if not password:
        raise _bad("COMMSLAYER_ETCD_USER", user, "set with COMMSLAYER_ETCD_PASSWORD, which is unset or empty")
    if not user:
        raise ConfigError("COMMSLAYER_ETCD_PASSWORD is set (its value not shown) without COMMSLAYER_ETCD_USER")
    return user, password


def etcd_tls() -> Optional[Tuple[str, Optional[str], Optional[str]]]:
    """``COMMSLAYER_ETCD_CA``, ``COMMSLAYER_ETCD_CERT``, ``COMMSLAYER_ETCD_KEY``: a job's store
    on etcd speaks TLS to its members, trusting the certificate authority in the CA file,
    and shows the client certificate (CERT, KEY: both or neither) where given; None when
    none is set."""
    names = ("COMMSLAYER_ETCD_CA", "COMMSLAYER_ETCD_CERT", "COMMSLAYER_ETCD_KEY")
    ca, cert, key = (os.environ.get(name, "").strip() for name in names)
    if not (ca or cert or key):
        return None
    if not ca:
        raise ConfigError("COMMSLAYER_ETCD_CERT or COMMSLAYER_ETCD_KEY is set without COMMSLAYER_ETCD_CA (the "
                          "certificate authority that signed the etcd members' certificates)")
    if bool(cert) != bool(key):
        name, raw = (names[1], cert) if cert else (names[2], key)
        raise _bad(name, raw, "set with the other of COMMSLAYER_ETCD_CERT and COMMSLAYER_ETCD_KEY")
    for name, path in zip(names, (ca, cert, key)):
        if path and not os.path.isfile(path):
            raise _bad(name, path, "an existing file (PEM)")
    return ca, cert or None, key or None


def node_sizes() -> Optional[List[int]]:
    """``COMMSLAYER_NODE_SIZES``: how many ranks each node holds, in rank order, for
    a launcher that lays ranks out in blocks per node but is neither torchrun nor
    Slurm (``8,8,8,7``: ranks 0-7 on the first node, 24-30 on the last); every rank
    must be given the same value.  Unset: the layout comes from torchrun's or
    Slurm's variables, where they give one (``commslayer.detect.addresses.rank_hosts``)."""
    raw = os.environ.get("COMMSLAYER_NODE_SIZES", "")
    if not raw.strip():
        return None
    try:
        sizes = [int(x) for x in raw.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise _bad("COMMSLAYER_NODE_SIZES", raw, "positive integers separated by commas, one per node")
    return sizes


def liveness_timing() -> Tuple[float, float]:
    """(heartbeat, peer timeout) in seconds, checked together: with liveness on, the
    peer timeout must exceed two heartbeat periods, or a healthy peer whose beat is
    merely late (a busy host, one lost packet) is declared lost."""
    heartbeat, peer_timeout = heartbeat_s(), peer_timeout_s()
    if heartbeat > 0 and not peer_timeout > 2 * heartbeat:
        raise ConfigError(
            f"{_shown('COMMSLAYER_PEER_TIMEOUT_S', peer_timeout)} is not allowed with "
            f"{_shown('COMMSLAYER_HEARTBEAT_S', heartbeat)}: the peer timeout must be more than 2 x the "
            f"heartbeat period (> {2 * heartbeat:g} s), or healthy peers are declared lost")
    return heartbeat, peer_timeout


def liveness_host() -> Optional[str]:
    """``COMMSLAYER_LIVENESS_HOST``: the host name or address this rank's peers dial for
    its liveness connections, as given (None when unset). A value that does not
    resolve is an error: falling back to another address would have peers dial
    the wrong host."""
    raw = os.environ.get("COMMSLAYER_LIVENESS_HOST", "")
    host = raw.strip()
    if not host:
        return None
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as exc:
        raise _bad("COMMSLAYER_LIVENESS_HOST", raw,
                   f"a host name or address that resolves on this host ({exc})") from None
    return host


def store_timeout_s() -> float:
    """``COMMSLAYER_STORE_TIMEOUT_S``: how long one store request may go unanswered
    before the store counts as unreachable (default 10 s; commslayer.agree.store)."""
    return _seconds("COMMSLAYER_STORE_TIMEOUT_S", 10.0)


def isolate_writes() -> bool:
    """``COMMSLAYER_ISOLATE_WRITES=1``: ops write into staging buffers that are
    copied to the caller's tensors only when the op succeeds, so an op that
    raised can never write into them later (costs a copy of every output)."""
    return _flag("COMMSLAYER_ISOLATE_WRITES")


REDUCE_SCATTER_ALGORITHMS = ("auto", "ring", "native")
# measured (docs/bench/reduce-scatter.md): the ring won from 64 KiB up on a capped link and at 4 ranks
# on one host; at 2 ranks on one host, issued async as FSDP2 issues it, it lost below 512 KiB
RING_MIN_BYTES = 65536
RING_MIN_BYTES_2_RANKS_ONE_HOST = 524288


def reduce_scatter_algorithm() -> str:
    """``COMMSLAYER_REDUCE_SCATTER``: how a Gloo communicator reduce-scatters a sum:
    ``auto`` (the ring from ``ring_min_bytes`` of input up, Gloo's own below),
    ``ring`` or ``native`` always (commslayer.comm.ring). Every rank must agree."""
    raw = os.environ.get("COMMSLAYER_REDUCE_SCATTER", "")
    value = raw.strip().lower() or "auto"
    if value not in REDUCE_SCATTER_ALGORITHMS:
        raise _bad("COMMSLAYER_REDUCE_SCATTER", raw, "auto, ring or native (any case), or empty (auto)")
    return value


def ring_min_bytes(size: int, one_host: bool) -> int:
    """``COMMSLAYER_RING_MIN_BYTES``: the input size from which ``auto`` takes the ring on a
    communicator of ``size`` ranks, all on one host or not; unset, 512 KiB for 2 ranks on
    one host (where the bytes it saves are memory copies), else 64 KiB."""
    default = RING_MIN_BYTES_2_RANKS_ONE_HOST if size == 2 and one_host else RING_MIN_BYTES
    return _integer("COMMSLAYER_RING_MIN_BYTES", default, 0)


def average_after_backward() -> bool:
    """``COMMSLAYER_AVERAGE_AFTER_BACKWARD=1``: a resilient job averages every gradient
    across replica groups after backward, in buckets, instead of beginning during
    backward where FSDP2 or DDP hooks allow (the default of ``resilience.init``'s
    ``overlap``; for comparing the two without editing the script)."""
    return _flag("COMMSLAYER_AVERAGE_AFTER_BACKWARD")


def restart_unit() -> str:
    """``COMMSLAYER_RESTART_UNIT``: ``rank`` when ``commslayer-run`` supervises every rank on
    its own (no ``--replicas``: one rank's death ends no other, and a replacement takes
    its place); empty otherwise (replica groups, or plain torchrun)."""
    raw = os.environ.get("COMMSLAYER_RESTART_UNIT", "")
    if raw.strip() not in ("", "rank"):
        raise _bad("COMMSLAYER_RESTART_UNIT", raw, "rank, or empty")
    return raw.strip()


def node() -> int:
    """``COMMSLAYER_NODE``: the host (node rank) of this rank, set by ``commslayer-run``;
    the copies of a rank's state go to ranks on other hosts. Default 0."""
    return _integer("COMMSLAYER_NODE", 0, 0)


def spare() -> Optional[int]:
    """``COMMSLAYER_SPARE``: set by ``commslayer-run --spares`` for a warm spare, the spare's
    id on its host: the process waits in ``resilience.init`` until its launcher gives it a
    lost rank's identity (commslayer.train.spare). None when unset (a rank). Set outside
    a job of ``commslayer-run`` (``startup.is_spare``) it is refused (a value left in an
    environment would otherwise hold back the recorder and the faults, which wait for a
    spare to get its rank)."""
    value = _integer("COMMSLAYER_SPARE", None, 0)
    if value is not None and not startup.is_spare():
        raise _bad("COMMSLAYER_SPARE", os.environ["COMMSLAYER_SPARE"],
                   "set only by commslayer-run --spares, for a process of its job (per-rank mode's "
                   "COMMSLAYER_RESTART_UNIT=rank, or a replica-mode job's variables); unset it")
    return value


def redundancy() -> int:
    """``COMMSLAYER_REDUNDANCY``: how many other ranks keep a copy of each rank's state in
    a job whose restart unit is a rank (default 1: any single loss, and any losses
    that take no rank together with every holder of its state, are survived)."""
    return _integer("COMMSLAYER_REDUNDANCY", 1, 1)


def refresh_every() -> int:
    """``COMMSLAYER_REFRESH_EVERY``: refresh the copies every K steps (default 1: a loss
    costs no step; K > 1: less traffic, and a loss redoes up to K steps)."""
    return _integer("COMMSLAYER_REFRESH_EVERY", 1, 1)


def reshard() -> bool:
    """``COMMSLAYER_RESHARD``: in a job whose restart unit is a rank, go on with the
    survivors, resharded, when a lost rank gets no replacement (default on; off:
    the job ends with ``ReplacementMissing``)."""
    return os.environ.get("COMMSLAYER_RESHARD", "").strip() == "" or _flag("COMMSLAYER_RESHARD")


def resharded() -> Optional[Dict[str, Any]]:
    """``COMMSLAYER_RESHARDED``: set by a ``PeerJob`` for the script it starts again after
    resharding onto the survivors (JSON: the epoch, the launcher's ranks of the new
    layout in order, the whole state's file, the loss it follows); None when unset."""
    raw = os.environ.get("COMMSLAYER_RESHARDED", "")
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
        if not (isinstance(value, dict) and isinstance(value.get("epoch"), int) and value["epoch"] > 0
                and isinstance(value.get("ranks"), list) and all(isinstance(r, int) for r in value["ranks"])
                and isinstance(value.get("from"), str)):
            raise ValueError
    except ValueError:
        raise _bad("COMMSLAYER_RESHARDED", raw, "what a resharding job sets: JSON with epoch, ranks and from") \
            from None
    return value


def faults() -> str:
    """``COMMSLAYER_FAULTS``: the fault harness's faults, as JSON (faults.inject
    parses and checks them when it loads)."""
    return os.environ.get("COMMSLAYER_FAULTS", "")


def faults_log() -> str:
    """``COMMSLAYER_FAULTS_LOG``: where a process logs the faults it fires and the
    first failure of each of its communicators (empty: nowhere)."""
    return _path("COMMSLAYER_FAULTS_LOG", directory=False)


# What validate() reads: every accessor that can refuse a value.
_CHECKED: Tuple[Callable[[], object], ...] = (
    default_timeout, check_mode, nan_check, native, route_c10d, trace_dir, job_rank, trace_buffer, trace_stack,
    trace_jsonl, trace_otel, trace_sink_queue, heartbeat_s, peer_timeout_s, liveness_timing, liveness_host, watch_peers,
    full_mesh_max, isolate_writes, faults_log, trace_mode, replica_id, run_dir, store_timeout_s,
    average_after_backward, restart_unit, node, spare, redundancy, refresh_every, reshard, resharded,
    reduce_scatter_algorithm, lambda: ring_min_bytes(2, True), node_sizes, job_store, etcd_auth, etcd_tls,
)
_valid: Set[Tuple[Tuple[str, str], ...]] = set()  # environments found valid (resolving a host costs)


def validate() -> None:
    """Check every ``COMMSLAYER_*`` variable; raise one ``ConfigError`` naming every
    bad one (variable, value, what is allowed). Cheap after the first call for the
    same environment."""
    snapshot = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("COMMSLAYER_")))
    if snapshot in _valid:
        return
    problems = []
    for accessor in _CHECKED:
        try:
            accessor()
        except ConfigError as err:
            if err.what not in problems:  # liveness_timing repeats a bad heartbeat or peer timeout
                problems.append(err.what)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} bad COMMSLAYER_* variables: " + "; ".join(problems))
    if not trace_dir():
        for name in ("COMMSLAYER_TRACE_JSONL", "COMMSLAYER_TRACE_OTEL"):
            if _flag(name):
                warnings.warn(f"{name} is on, but COMMSLAYER_TRACE_DIR is not set: tracing starts only with a "
                              "trace directory (or a program's own tracing.record.recorder.install(trace_dir)), "
                              "so this sink writes nothing", stacklevel=2)
    _valid.add(snapshot)
