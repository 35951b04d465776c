"""Where a communicator's store comes from when the caller gives none, how its
waits stay interruptible, and how every call on it stays bounded in time.

Under torchrun the store is the agent's (``TORCHELASTIC_USE_AGENT_STORE``), so
it outlives any one worker; standalone, rank 0 hosts it.  One connection is
shared by every communicator of the process; each communicator works under
its own prefix.

**Every store call has a deadline** (``COMMSLAYER_STORE_TIMEOUT_S``, default
10 s): ``bounded`` wraps a store so that a call that gets no answer within it
raises ``StoreUnreachable`` naming the store's address and the call.  Why it
takes a thread: a TCPStore client blocks for ever in a call to a server that
is stopped (SIGSTOP) or cut off without a reset, whatever its own timeout
(measured, torch 2.13: ``check`` still blocked after 70 s with a 2 s client
timeout, ``get`` of a key that exists too), and nothing can interrupt a
thread blocked inside C++.  So the calls on one connection (the store at the
bottom of the ``PrefixStore`` chain) are made by one worker thread of their
own, and the caller waits for the answer with a bound.  One thread per
connection, not per call: a TCPStore client makes its calls one at a time on
one socket, so a second thread would only queue behind a stuck call.  Once a
call overruns, that connection is in an unknown state (a late answer would be
read as the answer to the next request), so it is marked broken and every
later call on it, from any communicator of the process, fails at once with
``StoreUnreachable`` naming the first failure.  A connection that the server
closed (its process died, or it refused a request: a key longer than 8192
bytes makes torch's server drop the connection) is broken the same way: a
store failure is ``StoreUnreachable``, never a peer's loss.

The deadline bounds one request, not a wait for another rank: ``get`` of a
key that does not exist yet and ``wait`` block until a peer writes it, which
may legitimately take long.  The wrapper turns them into polls of ``check``
(each one bounded) followed by the read; a key that never comes ends with
torch's ``DistStoreError`` after the store's own timeout, as before.  A
``get`` therefore costs a ``check`` more than on the bare store, plus the
hand-over to the worker thread (measured in docs/recovery.md).  Waits that
many ranks make at once (every survivor waiting for one decision, every
member for a vote's outcome) cost a poll every few milliseconds each; they
block on the server instead, one request each, on a second connection
(``WaitConnection``), bounded by their own timeout plus the deadline.

The wrapper is a ``torch.distributed.Store``, so everything built on it uses
it too: ``PrefixStore``s, and the C++ rendezvous of the Gloo and NCCL groups.
A C++ reference does not keep the Python object alive, so whoever builds
``PrefixStore``s over a wrapper keeps the wrapper itself (a communicator's
``Lineage`` does).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist

from commslayer import config
from commslayer.endpoints import host_port, is_etcd
from commslayer.errors import StoreUnreachable, first_line

log = logging.getLogger("commslayer")

POLL_S = 0.005  # the longest pause between polls of a store wait
FIRST_POLL_S = 0.0002  # waits that usually end within a millisecond start polling this fast
_SLICE_S = 0.5  # a caller waits for the worker in slices: time this process spends stopped does not count
_KEY_SHOWN = 120  # longest key shown whole in a message
WAIT_SLICE_S = 1.0  # a blocking wait asks the server again after this long: at most one request per slice
_INTERRUPTED = object()  # what a call answers when the caller stopped waiting for it
_lock = threading.Lock()
_env_store: Optional[Tuple[dist.Store, int, int]] = None
_connections: "weakref.WeakValueDictionary[int, _Connection]" = weakref.WeakValueDictionary()


def _forget_connections() -> None:
    """In a forked child: the parent's workers did not come along (a fork copies one
    thread), so none of its connections may be used from here."""
    global _lock
    _lock = threading.Lock()
    _connections.clear()


os.register_at_fork(after_in_child=_forget_connections)


def env_rank_size() -> Tuple[int, int]:
    """``RANK`` and ``WORLD_SIZE`` from the environment (torchrun sets both)."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as missing:
        raise ValueError(
            f"{missing.args[0]} is not set: run under torchrun or pass rank= and size= to new_comm"
        ) from None


def env_store(timeout: timedelta) -> Tuple[dist.Store, int, int]:
    """The process-wide store from ``MASTER_ADDR``/``MASTER_PORT``: (store, rank, size).

    Reuses the default process group's store when one exists.
    """
    global _env_store
    with _lock:
        if _env_store is None:
            if dist.is_initialized():
                from torch.distributed.distributed_c10d import _get_default_store

                _env_store = (_get_default_store(), dist.get_rank(), dist.get_world_size())
            else:
                store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
                store.set_timeout(timeout)
                _env_store = (store, rank, size)
        return _env_store


def connect(address: str, timeout: timedelta) -> dist.Store:
    """A client of the job's store at ``address`` (``COMMSLAYER_JOB_STORE``, ``--store``):
    ``host:port``, a TCPStore server (the launcher's), or ``etcd://h1:2379,h2:2379/job``,
    the keys under ``job/`` of an etcd cluster (``commslayer.agree.etcdstore``).  ``ValueError``
    for anything else; what the store raises when it cannot be reached."""
    from commslayer.agree.etcdstore import EtcdStore

    if is_etcd(address):
        # its own retries (on the next member) end before the deadline that ``bounded`` keeps
        return EtcdStore.at(address, timeout, request_timeout_s=0.8 * config.store_timeout_s())
    host, port = host_port(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, use_libuv=True)


def wait_for_keys(store: dist.Store, keys: Sequence[str], interrupted: Callable[[], Optional[Exception]],
                  timeout_s: float, slow_after_s: float = float("inf"), slow_pause_s: float = POLL_S) -> bool:
    """Wait until every key of ``keys`` exists (True), or ``timeout_s`` passes (False).

    Polls rather than blocking in ``store.wait``, so that a wait on a member that
    died ends as soon as the communicator knows: ``interrupted()`` is asked
    between polls and what it returns (an error) is raised.  The pauses are
    ``next_pause``'s."""
    keys = list(keys)
    start = time.monotonic()
    pause = FIRST_POLL_S
    while not store.check(keys):
        err = interrupted()
        if err is not None:
            raise err
        waited = time.monotonic() - start
        if waited >= timeout_s:
            return False
        time.sleep(pause)
        pause = next_pause(pause, waited, slow_after_s, slow_pause_s)
    return True


def next_pause(pause: float, waited_s: float, slow_after_s: float = float("inf"), slow_pause_s: float = POLL_S) -> float:
    """The pause after ``pause`` in a poll that has waited ``waited_s``: the first is
    ``FIRST_POLL_S``, each one doubles, up to ``POLL_S``, and after ``slow_after_s``
    on up to ``slow_pause_s`` (a long wait costs the store fewer requests)."""
    return min(pause * 2, slow_pause_s if waited_s >= slow_after_s else POLL_S)


def bounded(store: dist.Store, prefix: str = "", comm: Optional[str] = None,
            deadline_s: Optional[float] = None) -> "BoundedStore":
    """``store`` (under ``prefix``, if given) with every call bounded by ``deadline_s``
    (default ``COMMSLAYER_STORE_TIMEOUT_S``; see the module doc); its errors name the
    communicator ``comm``.  Keep the returned object for as long as anything built
    on it is used."""
    deadline_s = config.store_timeout_s() if deadline_s is None else deadline_s
    if isinstance(store, BoundedStore):  # one hand-over, not two
        target = dist.PrefixStore(prefix, store._target) if prefix else store._target
        shown = "/".join(p for p in (store._prefix, prefix) if p)  # as nested PrefixStores join them
        return BoundedStore(target, store._connection, deadline_s, shown, comm)
    bottom = store
    while isinstance(bottom, dist.PrefixStore):
        bottom = bottom.underlying_store
    with _lock:
        connection = _connections.get(id(bottom))
        if connection is None:
            connection = _connections[id(bottom)] = _Connection(bottom)
    return BoundedStore(dist.PrefixStore(prefix, store) if prefix else store, connection, deadline_s, prefix, comm)


class _Connection:
    """The worker thread that makes every call on one store connection, and whether
    that connection is still usable (``broken``: why not)."""

    def __init__(self, bottom: dist.Store) -> None:
        self.bottom = bottom  # keeps its id, the registry's key, from being reused
        # A TCPStore's network error is its server closing the connection; another store's (an
        # EtcdStore's: no member served the call in time) says itself what failed.
        self.tcp = isinstance(bottom, dist.TCPStore)
        if self.tcp:
            self.address = f"{bottom.host}:{bottom.port}"
        else:  # an EtcdStore names its cluster
            self.address = getattr(bottom, "address", None) or f"a {type(bottom).__name__}"
        self.broken: Optional[str] = None
        calls: "queue.SimpleQueue" = queue.SimpleQueue()
        self.calls = calls
        threading.Thread(target=_serve, args=(calls,), name=f"commslayer-store-{self.address}", daemon=True).start()
        weakref.finalize(self, calls.put, None)  # the thread ends with the last user of the connection


def _serve(calls: "queue.SimpleQueue") -> None:
    while True:
        call = calls.get()
        if call is None:
            return
        fn, args, answer, done = call
        try:
            answer.append((True, fn(*args)))
        except BaseException as exc:  # the caller raises it
            answer.append((False, exc))
        done.release()
        del call, fn, args, answer, done  # hold nothing between calls: the last user of the connection may go


def _keys(keys: Any) -> str:
    """Keys for a message: long ones cut short (a 20,000-character key stays readable)."""
    def one(key: str) -> str:
        return repr(key) if len(key) <= _KEY_SHOWN else repr(key[:_KEY_SHOWN // 2]) + f"...({len(key)} characters)"

    return "[" + ", ".join(one(k) for k in keys) + "]" if isinstance(keys, list) else one(str(keys))


def _never() -> None:
    return None


class BoundedStore(dist.Store):
    """A store whose every call answers within ``deadline_s`` or raises
    ``StoreUnreachable`` (build it with ``bounded``; the module doc says how)."""

    def __init__(self, target: dist.Store, connection: _Connection, deadline_s: float, prefix: str,
                 comm: Optional[str]) -> None:
        super().__init__()
        self._target = target
        self._connection = connection
        self._prefix = prefix
        self._comm = comm
        self.deadline_s = deadline_s
        self._soon: Optional[threading.Lock] = None  # released once the last set_soon was answered
        self.set_timeout(target.timeout)

    @property
    def address(self) -> str:
        """Where the store is (host:port, or an etcd:// address), for messages."""
        return self._connection.address

    @property
    def underlying_store(self) -> dist.Store:
        """The store this one bounds (what ``commslayer.detect.addresses`` follows to find the host)."""
        return self._target

    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        self._check_usable(op, args)
        return self._finish(op, args, *self._submit(fn, args), self.deadline_s)

    def _submit(self, fn: Callable[..., Any], args: tuple) -> Tuple[List[Tuple[bool, Any]], threading.Lock, float]:
        """Hand ``fn(*args)`` to the connection's worker: (where the answer goes, released
        when it is there, when it was handed over)."""
        answer: List[Tuple[bool, Any]] = []
        done = threading.Lock()
        done.acquire()
        self._connection.calls.put((fn, args, answer, done))
        return answer, done, time.monotonic()

    def _finish(self, op: str, args: tuple, answer: List[Tuple[bool, Any]], done: threading.Lock, start: float,
                deadline_s: float, interrupted: Callable[[], bool] = lambda: False, step_s: float = _SLICE_S) -> Any:
        """The answer to a call handed over at ``start``: waited for until ``deadline_s``,
        asking ``interrupted()`` every ``step_s`` (``_INTERRUPTED`` when it says so)."""
        conn = self._connection
        waited = 0.0
        while not done.acquire(timeout=min(step_s, deadline_s - waited)):
            waited += step_s
            if conn.broken is not None:  # queued behind a call that failed
                raise self._unusable(op, args)
            if interrupted():
                return _INTERRUPTED
            if waited >= deadline_s:
                raise self._overrun(op, args, time.monotonic() - start, deadline_s)
        ok, value = answer[0]
        if ok:
            return value
        if isinstance(value, dist.DistNetworkError):
            call = self._describe(op, args)
            if conn.tcp:
                conn.broken = conn.broken or f"it closed the connection during {call} ({first_line(value)})"
                message = (f"the store at {conn.address} closed the connection ({first_line(value)}): the process "
                           "holding it is gone, or it refused the request")
            else:
                conn.broken = conn.broken or f"{call} failed ({first_line(value)})"
                message = first_line(value)
            raise StoreUnreachable(message, comm=self._comm, op=call, elapsed_s=time.monotonic() - start) from None
        raise value

    def _check_usable(self, op: str, args: tuple) -> None:
        if self._connection.broken is not None:
            raise self._unusable(op, args)

    def _unusable(self, op: str, args: tuple) -> StoreUnreachable:
        conn = self._connection
        return StoreUnreachable(f"the store at {conn.address} is not used any more: {conn.broken}", comm=self._comm,
                                op=self._describe(op, args))

    def _overrun(self, op: str, args: tuple, elapsed_s: float, deadline_s: float) -> StoreUnreachable:
        conn = self._connection
        call = self._describe(op, args)
        conn.broken = conn.broken or f"{call} got no answer within {deadline_s:g}s"
        return StoreUnreachable(f"the store at {conn.address} did not answer within {deadline_s:g}s: the process "
                               "holding it is stopped, hung or cut off (COMMSLAYER_STORE_TIMEOUT_S)",
                               comm=self._comm, op=call, timeout_s=deadline_s, elapsed_s=elapsed_s)

    def _describe(self, op: str, args: tuple) -> str:
        return f"store.{op}({_keys(self._full(args[0]))})"

    def _full(self, keys: Any) -> Any:
        """A key (or keys) as the server sees it (``PrefixStore`` joins with a ``/``)."""
        if not self._prefix:
            return keys
        return [f"{self._prefix}/{k}" for k in keys] if isinstance(keys, list) else f"{self._prefix}/{keys}"

    # ------------------------------------------------------------ requests
    def set(self, key: str, value) -> None:
        self._call("set", self._target.set, key, value)

    def check(self, keys: List[str]) -> bool:
        return self._call("check", self._target.check, list(keys))

    def set_soon(self, key: str, value: str) -> bool:
        """Hand a ``set`` to the connection's worker and return at once, for a thread that must
        never wait on the store (the watchdog's): False, and nothing handed, when the
        connection is broken or this store's previous ``set_soon`` got no answer yet (so
        nothing piles up behind a stuck call). What the set raises is dropped."""
        pending = self._soon
        if self._connection.broken is not None or pending is not None and not pending.acquire(blocking=False):
            return False
        self._soon = self._submit(self._target.set, (key, value))[1]
        return True

    def add(self, key: str, value: int) -> int:
        return self._call("add", self._target.add, key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", self._target.compare_set, key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", self._target.delete_key, key)

    deleteKey = delete_key  # the name c10d's C++ side calls it by

    def append(self, key: str, value) -> None:
        self._call("append", self._target.append, key, value)

    def multi_set(self, keys: List[str], values) -> None:
        self._call("multi_set", self._target.multi_set, list(keys), list(values))

    def has_extended_api(self) -> bool:
        return self._target.has_extended_api()

    # --------------------------------------------- waits for another rank
    def get(self, key: str) -> bytes:
        value = self.get_if_set(key)
        if value is None:
            self.wait([key])
            value = self._call("get", self._target.get, key)
        return value

    def multi_get(self, keys: List[str]) -> List[bytes]:
        keys = list(keys)
        values = self._call("multi_get", self._multi_get_if_set, keys)
        if values is None:
            self.wait(keys)
            values = self._call("multi_get", self._target.multi_get, keys)
        return values

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None or timeout.total_seconds() <= 0:  # c10d's "no timeout given"
            timeout = self.timeout
        if not wait_for_keys(self, keys, _never, timeout.total_seconds()):
            raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: "
                                      f"{_keys(self._full(list(keys)))}")

    def get_written(self, key: str) -> bytes:
        """The value of ``key``, known to exist: one request (``get`` checks first)."""
        return self._call("get", self._target.get, key)

    def get_if_set(self, key: str) -> Optional[bytes]:
        """The value of ``key``, or None if nobody wrote it (never waits for it)."""
        return self._call("get", self._get_if_set, key)

    def _get_if_set(self, key: str) -> Optional[bytes]:
        return self._target.get(key) if self._target.check([key]) else None

    def _multi_get_if_set(self, keys: List[str]) -> Optional[List[bytes]]:
        return self._target.multi_get(keys) if self._target.check(keys) else None


class WaitConnection:
    """Waits that block on the server, on a connection of their own: one request,
    answered when the key is written (TCPStore's ``wait``), where a poll costs the
    store a request every few milliseconds.  For the waits that many ranks make
    at once (every survivor of a loss waiting for one decision).

    Why a connection of its own: a blocking call holds its connection (see the
    module doc), and nothing else of the process may queue behind it.  It is
    opened in the background, since a recovery must never wait for it to open
    (opening one took up to 5 s here when the resolver was slow); until it is
    open, for a store that cannot open a second connection, and while a wait
    the caller gave up on still holds it, ``wait`` answers None: the caller polls.
    Keys are those of ``PrefixStore(prefix, store)``."""

    def __init__(self, store: BoundedStore, prefix: str = "") -> None:
        self._open: Optional[BoundedStore] = None
        self._free = threading.Lock()  # held while a wait uses the connection
        self._lock = threading.Lock()  # hands the connection over between a caller who gave up and the worker
        self._pid = os.getpid()
        threading.Thread(target=self._connect, args=(store, prefix), name="commslayer-store-waits",
                         daemon=True).start()

    def _connect(self, store: BoundedStore, prefix: str) -> None:
        try:
            target = store.underlying_store.clone()
        except Exception as exc:  # a store that cannot open a second connection: its waits poll
            log.debug("commslayer: waits on a %s poll (%s)", type(store.underlying_store).__name__, first_line(exc))
            return
        bottom = target
        while isinstance(bottom, dist.PrefixStore):
            bottom = bottom.underlying_store
        self._open = BoundedStore(dist.PrefixStore(prefix, target) if prefix else target, _Connection(bottom),
                                  store.deadline_s, "/".join(p for p in (store._prefix, prefix) if p), store._comm)

    def opened(self, timeout_s: float) -> bool:
        """Whether the connection is open, waiting up to ``timeout_s`` for it."""
        deadline = time.monotonic() + timeout_s
        while self._open is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self._open is not None

    def wait(self, key: str, timeout_s: float, look_again: Callable[[], bool]) -> Optional[bool]:
        """Whether ``key`` was written within ``timeout_s``, False as soon as
        ``look_again()`` is true (asked every ``POLL_S``, here, at no cost to the
        store); None when this connection cannot wait now (the class doc says when)."""
        store = self._open
        if store is None or os.getpid() != self._pid or not self._free.acquire(blocking=False):
            return None
        call = _SliceCall()
        try:
            start = time.monotonic()
            while True:
                left = timeout_s - (time.monotonic() - start)
                if left < 0.001:  # c10d counts milliseconds, and a zero timeout is its "the default"
                    return False
                slice_s = min(WAIT_SLICE_S, left)
                store._check_usable("wait", ([key],))
                call.running = True
                handed = store._submit(self._wait_once, (store._target, key, slice_s, call))
                got = store._finish("wait", ([key],), *handed, slice_s + store.deadline_s, look_again, POLL_S)
                if got is _INTERRUPTED:
                    with self._lock:
                        call.abandoned = call.running  # then the worker frees the connection when it is done
                    return False
                if got:
                    return True
                if look_again():
                    return False
        finally:
            with self._lock:
                if not call.abandoned:
                    self._free.release()

    def _wait_once(self, target: dist.Store, key: str, slice_s: float, call: "_SliceCall") -> bool:
        """One slice of a wait, on the worker thread."""
        try:
            target.wait([key], timedelta(seconds=slice_s))
            return True
        except dist.DistStoreError:  # the slice ended
            return False
        finally:
            with self._lock:
                call.running = False
                if call.abandoned:
                    self._free.release()


class _SliceCall:
    """A wait's call in progress: ``running`` on the worker, ``abandoned`` by its caller."""
    running = False
    abandoned = False
