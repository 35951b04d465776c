"""Liveness: every member of a communicator watches every other over its own TCP mesh.

Why a side channel: Gloo tells a survivor about a dead peer only when that
survivor happens to be talking to it, and a stopped (SIGSTOP) or deadlocked
peer costs everyone the whole op timeout.  So each member keeps one TCP
connection to every other member, independent of the backend:

* a peer whose process dies (SIGKILL, exit, crash) is noticed at once: its
  kernel closes the socket and the reader sees EOF or a reset;
* a peer that stops sending heartbeats for ``peer_timeout_s`` is declared
  lost too: a stopped process, or one whose Python cannot run at all (the
  heartbeat thread needs the GIL, so a deadlock that holds the GIL counts as
  stopped).  A deadlock that leaves the GIL free (a thread stuck on a lock, a
  rank that never calls the next collective) is *not* liveness: the op's
  deadline catches it.

One ``Liveness`` serves one member set (a communicator of one generation
and the communicators split from it); one daemon thread runs it, reading all
sockets with a selector and sending a one-byte heartbeat every
``heartbeat_s``.  Addresses are exchanged through the communicator's store.
``close()`` (``finalize``, and every monitor at normal interpreter exit)
says goodbye first, so a member that leaves on purpose is not reported as
lost; the communicator still fails an op that needs a member that left.  A
process ending on an uncaught exception hangs up without a goodbye (an
``excepthook``), so its peers take it as lost at once instead of waiting
``peer_timeout_s`` for an op it will never finish.  ``sys.exit(1)`` cannot be
told apart from a normal exit: it says goodbye.
"""

from __future__ import annotations

import atexit
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Callable, Dict, Set

import torch.distributed as dist

log = logging.getLogger("commslayer")

_HELLO = struct.Struct("!4sI")  # magic, sender's rank
_MAGIC = b"CLhb"
_BEAT = b"."
_BYE = b"B"

_open: "weakref.WeakSet[Liveness]" = weakref.WeakSet()

LostCallback = Callable[[Set[int], str], None]
LeftCallback = Callable[[Set[int]], None]


def _advertised_host() -> str:
    """The address peers should dial: ``COMMSLAYER_LIVENESS_HOST``, else the
    address torchrun's store uses, else loopback."""
    host = os.environ.get("COMMSLAYER_LIVENESS_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        return socket.gethostbyname(host) if host != "localhost" else "127.0.0.1"
    except OSError:
        return "127.0.0.1"


class Liveness:
    """The heartbeat mesh of one member set. On its thread, ``on_lost(ranks, why)``
    runs when peers die or stop, ``on_left(ranks)`` when peers close it on purpose."""

    def __init__(self, store: dist.Store, rank: int, size: int, *, heartbeat_s: float, peer_timeout_s: float,
                 connect_timeout_s: float, on_lost: LostCallback, on_left: LeftCallback, label: str) -> None:
        self.rank = rank
        self.size = size
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self._on_lost = on_lost
        self._on_left = on_left
        self._label = label
        self._socks: Dict[int, socket.socket] = {}
        self._last_seen: Dict[int, float] = {}
        self._lost: Set[int] = set()
        self._left: Set[int] = set()
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the thread through it
        self._connect(store, connect_timeout_s)
        _open.add(self)
        self._thread = threading.Thread(target=self._run, name=f"commslayer-liveness-{label}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- set-up
    def _connect(self, store: dist.Store, timeout_s: float) -> None:
        """Listen, publish the address, connect to higher ranks, accept lower ones."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host = _advertised_host()
        listener.bind(("0.0.0.0", 0))
        listener.listen(self.size)
        listener.settimeout(timeout_s)
        store.set(f"liveness/{self.rank}", f"{host}:{listener.getsockname()[1]}")
        try:
            for peer in range(self.rank + 1, self.size):
                addr = store.get(f"liveness/{peer}").decode()
                h, p = addr.rsplit(":", 1)
                s = socket.create_connection((h, int(p)), timeout=timeout_s)
                s.sendall(_HELLO.pack(_MAGIC, self.rank))
                self._adopt(peer, s)
            for _ in range(self.rank):
                s, _ = listener.accept()
                s.settimeout(timeout_s)
                magic, peer = _HELLO.unpack(self._read_exact(s, _HELLO.size))
                if magic != _MAGIC or not 0 <= peer < self.rank or peer in self._socks:
                    s.close()
                    raise ConnectionError(f"unexpected liveness hello from {s.getpeername()}")
                self._adopt(peer, s)
        finally:
            listener.close()

    @staticmethod
    def _read_exact(s: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("liveness peer closed during hello")
            buf += chunk
        return buf

    def _adopt(self, peer: int, s: socket.socket) -> None:
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks[peer] = s
        self._last_seen[peer] = time.monotonic()

    # ------------------------------------------------------------ running
    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        for peer, s in self._socks.items():
            sel.register(s, selectors.EVENT_READ, peer)
        next_beat = 0.0
        tick = min(self.heartbeat_s, self.peer_timeout_s / 4)
        while not self._closing:
            now = time.monotonic()
            if now >= next_beat:
                self._send_all(_BEAT)
                next_beat = now + self.heartbeat_s
            dead: Dict[int, str] = {}
            left: Set[int] = set()
            for key, _ in sel.select(timeout=min(tick, max(0.0, next_beat - now))):
                peer = key.data
                if peer is None:
                    continue  # woken by close()
                try:
                    data = key.fileobj.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    data, why = b"", f"connection error ({exc.strerror or exc})"
                else:
                    why = "its process exited (connection closed)"
                if _BYE in data and peer not in self._left:
                    self._left.add(peer)
                    left.add(peer)
                if not data:
                    sel.unregister(key.fileobj)
                    if peer not in self._left:
                        dead[peer] = why
                    continue
                self._last_seen[peer] = time.monotonic()
            started, now = now, time.monotonic()
            if now - started > tick + self.peer_timeout_s / 2:
                # This process was stopped itself (or starved): the silence is ours, not the peers'.
                for peer in self._last_seen:
                    self._last_seen[peer] = now
            for peer, seen in self._last_seen.items():
                if peer not in dead and peer not in self._left and now - seen > self.peer_timeout_s:
                    dead[peer] = f"no heartbeat for {now - seen:.2f}s (stopped or hung)"
            self._declare(dead)
            if left:
                self._callback(self._on_left, left)
        sel.close()

    def _send_all(self, msg: bytes) -> None:
        # Lost peers get the goodbye too: a stopped one reads it when it resumes, and so learns
        # that it was left behind.
        for peer, s in list(self._socks.items()):
            if peer in self._left or (msg is _BEAT and peer in self._lost):
                continue
            try:
                s.send(msg)
            except (BlockingIOError, InterruptedError):
                pass  # a full buffer means the peer is not reading: its silence will tell
            except OSError:
                pass  # the reader sees the same failure

    def _declare(self, dead: Dict[int, str]) -> None:
        if self._closing:
            return
        new = {p: why for p, why in dead.items() if p not in self._lost}  # only this thread writes _lost
        self._lost.update(new)
        if not new:
            return
        for p in new:
            self._last_seen.pop(p, None)
        why = "; ".join(f"rank {p}: {w}" for p, w in sorted(new.items()))
        log.warning("commslayer %s: lost %s", self._label, why)
        self._callback(self._on_lost, set(new), why)

    def _callback(self, fn: Callable[..., None], *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("commslayer %s: handling a peer's change failed", self._label)

    def close(self, goodbye: bool = True) -> None:
        """Say goodbye to every peer and stop (idempotent). ``goodbye=False`` hangs up
        without it: the peers take this process as lost at once."""
        if self._closing:
            return
        self._closing = True  # first: a peer seen to go from now on is no news (it ended too, or we do)
        if goodbye:
            self._send_all(_BYE)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.heartbeat_s + 1.0)
        for s in self._socks.values():
            _drain(s)
        for s in list(self._socks.values()) + [self._wake_r, self._wake_w]:
            try:
                s.close()
            except OSError:
                pass


def _drain(s: socket.socket) -> None:
    """Read what a peer sent and nobody read: closing a socket with unread data resets the
    connection, and a reset can overtake the goodbye still on its way (on a slow link)."""
    try:
        s.setblocking(False)
        while s.recv(4096):
            pass
    except OSError:
        pass


def close_all(goodbye: bool = True) -> None:
    """Say goodbye on every monitor of this process (runs at interpreter exit; a
    process that ends with ``os._exit`` should call it first). A process leaving
    because of a failure passes ``goodbye=False``, so that its peers stop waiting
    for it now rather than once it is gone."""
    for liveness in list(_open):
        liveness.close(goodbye)


def _hang_up_on_uncaught_exception(previous: Callable[..., None]) -> Callable[..., None]:
    def hook(exc_type, exc, tb) -> None:
        close_all(goodbye=False)  # dying, not leaving: the peers must not wait for this rank's part
        previous(exc_type, exc, tb)

    return hook


atexit.register(close_all)
sys.excepthook = _hang_up_on_uncaught_exception(sys.excepthook)
