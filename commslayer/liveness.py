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
``heartbeat_s``.

Set-up goes through the communicator's store: each member listens on its
own advertised address (``commslayer.addresses``: the interface towards the
store, or the one ``GLOO_SOCKET_IFNAME`` or ``COMMSLAYER_LIVENESS_HOST``
names; never every interface) and publishes it with a fresh random key.  A
connection counts only once its hello (sender, receiver) carries the HMAC of
the receiver's key, so a process that cannot read the store cannot join,
pose as a rank or stall the set-up: junk, forged hellos and silent sockets
are logged and dropped (a silent one after ``HELLO_TIMEOUT_S``) while the
real peers connect.  The listener closes once every peer is in.  Set-up
failures are ``PeerLost`` naming the peer.
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
import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Callable, Dict, Set, Tuple

import torch.distributed as dist

from .addresses import advertised_host
from .errors import PeerLost

log = logging.getLogger("commslayer")

_MAGIC = b"CLhb"
_HELLO = struct.Struct("!4sII32s")  # magic, sender's rank, receiver's rank, HMAC-SHA256 of the three
_BEAT = b"."
_BYE = b"B"
HELLO_TIMEOUT_S = 2.0  # a connection that has not said a valid hello by then is dropped

_open: "weakref.WeakSet[Liveness]" = weakref.WeakSet()

LostCallback = Callable[[Set[int], str], None]
LeftCallback = Callable[[Set[int]], None]


def hello(key: bytes, sender: int, receiver: int) -> bytes:
    """The first message on a liveness connection: who dials whom, signed with the
    receiver's key (which only readers of the communicator's store know)."""
    head = _MAGIC + struct.pack("!II", sender, receiver)
    return _HELLO.pack(_MAGIC, sender, receiver, hmac.new(key, head, hashlib.sha256).digest())


def check_hello(key: bytes, receiver: int, data: bytes) -> int:
    """The sender's rank of a valid hello for ``receiver``; ``ValueError`` saying why not."""
    magic, sender, to, mac = _HELLO.unpack(data)
    if magic != _MAGIC:
        raise ValueError("not a liveness hello")
    if not hmac.compare_digest(mac, hello(key, sender, to)[-32:]):
        raise ValueError(f"hello claiming rank {sender} carries a wrong signature")
    if to != receiver:
        raise ValueError(f"hello from rank {sender} is meant for rank {to}")
    return sender


class Liveness:
    """The heartbeat mesh of one member set. On its thread, ``on_lost(ranks, why)``
    runs when peers die or stop, ``on_left(ranks)`` when peers close it on purpose.

    Set-up failures raise ``PeerLost`` naming the peer that could not be reached."""

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
        try:
            self._connect(store, connect_timeout_s)
        except BaseException:
            for s in list(self._socks.values()) + [self._wake_r, self._wake_w]:
                s.close()
            raise
        _open.add(self)
        self._thread = threading.Thread(target=self._run, name=f"commslayer-liveness-{label}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- set-up
    def _connect(self, store: dist.Store, timeout_s: float) -> None:
        """Listen on this host's advertised address, publish it with a fresh key, dial the
        higher ranks, and accept the lower ones (only hellos signed with the key count)."""
        host = advertised_host(store)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            try:
                listener.bind((host, 0))
            except OSError as exc:  # an address the user named for a NAT, not one of this host's
                log.warning("commslayer %s: cannot listen on %s (%s); listening on every interface",
                            self._label, host, exc.strerror or exc)
                listener.bind(("0.0.0.0", 0))
            listener.listen(max(self.size, 16))
            key = secrets.token_bytes(32)
            deadline = time.monotonic() + timeout_s
            store.set(f"liveness/{self.rank}", f"{host}:{listener.getsockname()[1]}:{key.hex()}")
            for peer in range(self.rank + 1, self.size):
                self._dial(peer, store.get(f"liveness/{peer}").decode(), deadline)
            self._accept(listener, key, deadline)
        finally:
            listener.close()

    def _setup_failed(self, ranks: Set[int], why: str) -> PeerLost:
        return PeerLost(f"liveness set-up: {why}", comm=self._label, op="new_comm", ranks=ranks)

    def _dial(self, peer: int, published: str, deadline: float) -> None:
        try:
            h, p, key = published.rsplit(":", 2)
            addr, key_bytes = (h, int(p)), bytes.fromhex(key)
        except ValueError:
            raise self._setup_failed({peer}, f"rank {peer} published no valid liveness address "
                                             f"({published[:80]!r})") from None
        try:
            s = socket.create_connection(addr, timeout=max(0.05, deadline - time.monotonic()))
        except OSError as exc:
            raise self._setup_failed({peer}, f"cannot reach rank {peer}'s liveness listener at {h}:{p} "
                                             f"({exc.strerror or exc})") from None
        try:
            s.sendall(hello(key_bytes, self.rank, peer))
        except OSError as exc:
            s.close()
            raise self._setup_failed({peer}, f"rank {peer}'s liveness listener at {h}:{p} hung up "
                                             f"({exc.strerror or exc})") from None
        self._adopt(peer, s)

    def _accept(self, listener: socket.socket, key: bytes, deadline: float) -> None:
        """Accept until every lower rank has said a valid hello. Anything else that
        connects (junk, a forged hello, a silent socket) is logged and dropped without
        holding up the others."""
        wanted = set(range(self.rank))
        pending: Dict[socket.socket, Tuple[bytes, float, str]] = {}  # bytes read, since, where from
        listener.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        try:
            while wanted:
                now = time.monotonic()
                if now >= deadline:
                    raise self._setup_failed(wanted, f"rank(s) {sorted(wanted)} did not connect to this rank's "
                                                     "liveness listener in time")
                for s, (_, since, who) in list(pending.items()):
                    if now - since > HELLO_TIMEOUT_S:
                        self._reject(sel, pending, s, who, f"no hello within {HELLO_TIMEOUT_S:g}s")
                for sel_key, _ in sel.select(timeout=min(0.1, deadline - now)):
                    if sel_key.fileobj is listener:
                        self._take(listener, sel, pending)
                    else:
                        peer = self._read_hello(sel_key.fileobj, key, wanted, sel, pending)
                        if peer is not None:
                            wanted.discard(peer)
        finally:
            for s in pending:
                s.close()
            sel.close()

    @staticmethod
    def _take(listener: socket.socket, sel: selectors.BaseSelector, pending: Dict) -> None:
        try:
            s, where = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, None)
        pending[s] = (b"", time.monotonic(), "%s:%s" % where[:2])

    def _read_hello(self, s: socket.socket, key: bytes, wanted: Set[int], sel: selectors.BaseSelector,
                    pending: Dict) -> "int | None":
        """Read what ``s`` sent; adopt it once it is a whole, valid hello (its rank)."""
        got, since, who = pending[s]
        try:
            chunk = s.recv(_HELLO.size - len(got))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            chunk, why = b"", f"connection error ({exc.strerror or exc})"
        else:
            why = "closed before a whole hello"
        if not chunk:
            self._reject(sel, pending, s, who, why)
            return None
        got += chunk
        if len(got) < _HELLO.size:
            pending[s] = (got, since, who)
            return None
        try:
            peer = check_hello(key, self.rank, got)
            if peer not in wanted:
                raise ValueError(f"rank {peer} is not one this rank waits for (connected already, or not lower)")
        except ValueError as exc:
            self._reject(sel, pending, s, who, str(exc))
            return None
        sel.unregister(s)
        del pending[s]
        self._adopt(peer, s)
        return peer

    def _reject(self, sel: selectors.BaseSelector, pending: Dict, s: socket.socket, who: str, why: str) -> None:
        log.warning("commslayer %s: dropped a liveness connection from %s: %s", self._label, who, why)
        sel.unregister(s)
        del pending[s]
        s.close()

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
