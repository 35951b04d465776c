"""Liveness: the members of a communicator watch each other over their own TCP
connections, and agree on who is lost (the rules: ``commslayer.detect.watch``).

Why a side channel: Gloo tells a survivor about a dead peer only when that
survivor happens to be talking to it, and a stopped (SIGSTOP) or deadlocked
peer costs everyone the whole op timeout.  So members keep TCP connections
to each other, independent of the backend, and send heartbeats over them:

* a peer whose process dies (SIGKILL, exit, crash) is noticed at once: its
  kernel closes the socket and the reader sees EOF or a reset;
* a peer that stops sending heartbeats for ``peer_timeout_s`` is declared
  lost too: a stopped process, or one whose Python cannot run at all (the
  heartbeat thread needs the GIL, so a deadlock that holds the GIL counts as
  stopped).  A deadlock that leaves the GIL free (a thread stuck on a lock, a
  rank that never calls the next collective) is *not* liveness: the op's
  deadline catches it.

In a small member set every member connects to every other (the full mesh);
in a large one each member connects only to the few it watches and that
watch it, and what one member sees spreads over those connections
(``commslayer.detect.watch``, which also decides when evidence is enough).

One ``Liveness`` serves one member set (a communicator of one generation
and the communicators split from it); one daemon thread runs it, reading all
sockets with a selector, feeding the protocol what arrives and sending what
it says, when it says.

Set-up goes through the communicator's store: each member listens on its
own advertised address (``commslayer.detect.addresses``: the interface towards the
store, or the one ``GLOO_SOCKET_IFNAME`` or ``COMMSLAYER_LIVENESS_HOST``
names; never every interface) and publishes it with a fresh random key; it
dials its higher-ranked neighbours and accepts its lower-ranked ones, so it
reads only its neighbours' keys.  A connection counts only once its hello
(sender, receiver, the topology's checksum) carries the HMAC of the
receiver's key, so a process that cannot read the store cannot join, pose
as a rank or stall the set-up (c10d's TCPStore has no authentication: any
process that reaches it can read it, ``docs/recovery.md`` says what follows): junk,
forged hellos and silent sockets are logged and dropped (a silent one after
``HELLO_TIMEOUT_S``) while the real peers connect.  What others can make it
hold is bounded: the accept backlog, and ``PENDING_MAX`` connections beyond
the awaited peers waiting for their hello (a new one evicts the oldest; a
hello already there is read at accept, so a flood of connections passes the
real peers through); past the first few, drops are counted, not logged one by
one.  A process out of file descriptors gets ``OutOfFiles`` naming its limit.
The listener closes once every neighbour is in.  Set-up failures are ``PeerLost`` naming the peer; a
peer that chose another topology (a setting or a host layout that differs
between ranks, which would leave members unwatched) is a ``ConfigError``.
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
import errno
import hashlib
import hmac
import logging
import resource
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
import weakref
import zlib
from typing import Callable, Dict, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from commslayer.detect.addresses import OUT_OF_FILES, advertised_host
from commslayer.errors import ConfigError, OutOfFiles, PeerLost
from commslayer.detect.watch import BEAT, BROKEN, HUNG_UP, Topology, Watch

log = logging.getLogger("commslayer")

_MAGIC = b"CLhb"
_HELLO = struct.Struct("!4sIII32s")  # magic, sender's rank, receiver's rank, topology digest, HMAC-SHA256 of the four
_OUT_MAX = 1 << 20  # bytes queued for a peer that is not reading, beyond which frames to it are dropped
HELLO_TIMEOUT_S = 2.0  # a connection that has not said a valid hello by then is dropped
HANG_UP_WAIT_S = 0.1  # how long close(goodbye=False) lets the monitor thread hang up before it does so itself
PENDING_MAX = 64  # connections held at set-up before their hello is checked, beyond the peers awaited
_BACKLOG_MAX = 256  # the listener's accept backlog at most
_DROPS_LOGGED = 8  # dropped connections logged one by one at set-up; the rest are counted

_open: "weakref.WeakSet[Liveness]" = weakref.WeakSet()

LostCallback = Callable[[Set[int], str], None]
LeftCallback = Callable[[Set[int]], None]


def hello(key: bytes, sender: int, receiver: int, topology: int) -> bytes:
    """The first message on a liveness connection: who dials whom and the topology
    the sender chose (``Topology.digest``), signed with the receiver's key (which
    only readers of the communicator's store know)."""
    head = _MAGIC + struct.pack("!III", sender, receiver, topology)
    return _HELLO.pack(_MAGIC, sender, receiver, topology, hmac.new(key, head, hashlib.sha256).digest())


class TopologyMismatch(ValueError):
    """A validly signed hello from a member that chose another watch topology."""


def check_hello(key: bytes, receiver: int, data: bytes, topology: int) -> int:
    """The sender's rank of a valid hello for ``receiver``; ``ValueError`` saying why not."""
    magic, sender, to, theirs, mac = _HELLO.unpack(data)
    if magic != _MAGIC:
        raise ValueError("not a liveness hello")
    if not hmac.compare_digest(mac, hello(key, sender, to, theirs)[-32:]):
        raise ValueError(f"hello claiming rank {sender} carries a wrong signature")
    if to != receiver:
        raise ValueError(f"hello from rank {sender} is meant for rank {to}")
    if theirs != topology:
        raise TopologyMismatch(f"rank {sender} chose another watch topology than rank {receiver} "
                               f"(checksum {theirs:08x}, not {topology:08x}): COMMSLAYER_WATCH_PEERS, "
                               "COMMSLAYER_FULL_MESH_MAX or the host layout (COMMSLAYER_NODE_SIZES, torchrun's "
                               "or Slurm's variables) differ between ranks")
    return sender


class Liveness:
    """The liveness monitor of one member set. On its thread, ``on_lost(ranks, why)``
    runs when peers die or stop, ``on_left(ranks)`` when peers close it on purpose.

    ``watch_peers`` and ``mesh_max`` choose the topology (``Topology.choose``);
    ``hosts`` (a label per rank), where known, puts watchers on other hosts.
    Set-up failures raise ``PeerLost`` naming the peer that could not be reached."""

    def __init__(self, store: dist.Store, rank: int, size: int, *, heartbeat_s: float, peer_timeout_s: float,
                 connect_timeout_s: float, on_lost: LostCallback, on_left: LeftCallback, label: str,
                 watch_peers: int = 3, mesh_max: int = 16, hosts: Optional[Sequence[object]] = None,
                 before_goodbye: Callable[[], None] = lambda: None) -> None:
        self.rank = rank
        self.size = size
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.topology = Topology.choose(size, k=watch_peers, mesh_max=mesh_max, seed=zlib.crc32(label.encode()),
                                        hosts=hosts)
        self._digest = self.topology.digest
        self._on_lost = on_lost
        self._on_left = on_left
        self._before_goodbye = before_goodbye
        self._label = label
        self._socks: Dict[int, socket.socket] = {}
        self._out: Dict[int, bytearray] = {}
        self._closing = False
        self._goodbye = True
        self.connections_dropped = 0  # connections to the listener dropped at set-up
        try:
            self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the thread through it
            try:
                self._connect(store, connect_timeout_s)
            except BaseException:
                for s in list(self._socks.values()) + [self._wake_r, self._wake_w]:
                    s.close()
                raise
        except OSError as exc:
            if exc.errno not in OUT_OF_FILES:
                raise
            raise self._out_of_files(exc) from None
        self._watch = Watch(rank, self.topology, heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                            now=time.monotonic())
        _open.add(self)
        self._thread = threading.Thread(target=self._run, name=f"commslayer-liveness-{label}", daemon=True)
        self._thread.start()

    @property
    def frames_sent(self) -> int:
        """Frames this member sent so far (heartbeats, reports, forwarding), one per peer."""
        return self._watch.sent

    # ------------------------------------------------------------- set-up
    def _connect(self, store: dist.Store, timeout_s: float) -> None:
        """Listen on this host's advertised address, publish it with a fresh key, dial the
        higher-ranked neighbours, and accept the lower ones (only hellos signed with the
        key count)."""
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
            neighbours = self.topology.neighbours(self.rank)
            listener.listen(min(len(neighbours) + 16, _BACKLOG_MAX))
            key = secrets.token_bytes(32)
            deadline = time.monotonic() + timeout_s
            store.set(f"liveness/{self.rank}", f"{host}:{listener.getsockname()[1]}:{key.hex()}")
            for peer in sorted(p for p in neighbours if p > self.rank):
                self._dial(peer, store.get(f"liveness/{peer}").decode(), deadline)
            self._accept(listener, key, {p for p in neighbours if p < self.rank}, deadline)
        finally:
            listener.close()

    def _setup_failed(self, ranks: Set[int], why: str) -> PeerLost:
        return PeerLost(f"liveness set-up: {why}", comm=self._label, op="new_comm", ranks=ranks)

    def _out_of_files(self, exc: OSError) -> OutOfFiles:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return OutOfFiles(f"liveness set-up: cannot open a socket ({exc.strerror or exc}): this process may hold "
                          f"{soft} file descriptors (RLIMIT_NOFILE; raise it with ulimit -n, or open fewer "
                          "communicators)" + (", and the host's table is full" if exc.errno == errno.ENFILE else ""),
                          comm=self._label, op="new_comm")

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
            if exc.errno in OUT_OF_FILES:
                raise
            raise self._setup_failed({peer}, f"cannot reach rank {peer}'s liveness listener at {h}:{p} "
                                             f"({exc.strerror or exc})") from None
        try:
            s.sendall(hello(key_bytes, self.rank, peer, self._digest))
        except OSError as exc:
            s.close()
            raise self._setup_failed({peer}, f"rank {peer}'s liveness listener at {h}:{p} hung up "
                                             f"({exc.strerror or exc})") from None
        self._adopt(peer, s)

    def _accept(self, listener: socket.socket, key: bytes, wanted: Set[int], deadline: float) -> None:
        """Accept until every rank in ``wanted`` has said a valid hello. Anything else
        that connects (junk, a forged hello, a silent socket) is logged and dropped
        without holding up the others; at most ``PENDING_MAX`` of them at once."""
        pending: Dict[socket.socket, Tuple[bytes, float, str]] = {}  # bytes read, since, where from (oldest first)
        cap = PENDING_MAX + len(wanted)
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
                    s = self._take(listener, sel, pending, cap) if sel_key.fileobj is listener else sel_key.fileobj
                    peer = None if s is None else self._read_hello(s, key, wanted, sel, pending)
                    if peer is not None:
                        wanted.discard(peer)
        finally:
            for s in pending:
                s.close()
            sel.close()
            if self.connections_dropped > _DROPS_LOGGED:
                log.warning("commslayer %s: dropped %d liveness connections in all during set-up (the first %d "
                            "are logged)", self._label, self.connections_dropped, _DROPS_LOGGED)

    def _take(self, listener: socket.socket, sel: selectors.BaseSelector, pending: Dict,
              cap: int) -> Optional[socket.socket]:
        """Accept one connection, first making room for it by dropping the oldest pending one;
        out of file descriptors, drop the oldest to make room, or raise ``OutOfFiles``."""
        if len(pending) >= cap:
            self._evict_oldest(sel, pending, f"{cap} connections waited for a hello already")
        try:
            s, where = listener.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            if exc.errno not in OUT_OF_FILES:  # one that was reset before it was accepted
                return None
            if not pending:
                raise self._out_of_files(exc) from None
            self._evict_oldest(sel, pending, "this process ran out of file descriptors")
            return None
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, None)
        pending[s] = (b"", time.monotonic(), "%s:%s" % where[:2])
        return s

    def _evict_oldest(self, sel: selectors.BaseSelector, pending: Dict, why: str) -> None:
        oldest = next(iter(pending))
        self._reject(sel, pending, oldest, pending[oldest][2], f"{why}: the oldest is dropped")

    def _read_hello(self, s: socket.socket, key: bytes, wanted: Set[int], sel: selectors.BaseSelector,
                    pending: Dict) -> "int | None":
        """Read what ``s`` sent; adopt it once it is a whole, valid hello (its rank)."""
        if s not in pending:
            return None  # dropped since the selector returned it (making room for a newer one)
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
            peer = check_hello(key, self.rank, got, self._digest)
            if peer not in wanted:
                raise ValueError(f"rank {peer} is not one this rank waits for (connected already, or not a "
                                 "lower-ranked neighbour)")
        except TopologyMismatch as exc:  # a peer in good faith, set up differently: no liveness is possible
            raise ConfigError(f"liveness set-up: {exc}", comm=self._label, op="new_comm") from None
        except ValueError as exc:
            self._reject(sel, pending, s, who, str(exc))
            return None
        sel.unregister(s)
        del pending[s]
        self._adopt(peer, s)
        return peer

    def _reject(self, sel: selectors.BaseSelector, pending: Dict, s: socket.socket, who: str, why: str) -> None:
        self.connections_dropped += 1
        if self.connections_dropped <= _DROPS_LOGGED:
            log.warning("commslayer %s: dropped a liveness connection from %s: %s", self._label, who, why)
        sel.unregister(s)
        del pending[s]
        s.close()

    def _adopt(self, peer: int, s: socket.socket) -> None:
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks[peer] = s
        self._out[peer] = bytearray()

    # ------------------------------------------------------------ running
    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # a bug here must not pass for silence: say so, loudly, and hang up
            log.exception("commslayer %s: the liveness monitor failed; peers will take this rank as lost",
                          self._label)
            self._goodbye = False
            self._hang_up()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        for peer, s in self._socks.items():
            sel.register(s, selectors.EVENT_READ, peer)
        watch = self._watch
        while not self._closing:
            for key, _ in sel.select(timeout=max(0.0, watch.due() - time.monotonic())):
                peer = key.data
                if peer is None:
                    continue  # woken by close()
                try:
                    data = key.fileobj.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    log.info("commslayer %s: connection error from rank %d (%s)", self._label, peer,
                             exc.strerror or exc)
                    sel.unregister(key.fileobj)
                    watch.hung_up(peer, time.monotonic(), BROKEN)
                    continue
                if not data:
                    sel.unregister(key.fileobj)
                    watch.hung_up(peer, time.monotonic(), HUNG_UP)
                else:
                    watch.received(peer, data, time.monotonic())
            watch.tick(time.monotonic())
            self._act()
        sel.close()
        if self._goodbye:
            watch.goodbye()
            self._act()
        self._hang_up()

    def _act(self) -> None:
        """Send what the protocol queued, and tell the owner who was lost or left."""
        out, lost, left = self._watch.take()
        for peer, frame in out:
            buf = self._out.get(peer)
            if buf is None or (frame is BEAT and buf) or len(buf) > _OUT_MAX:
                continue  # a peer not reading gets no more heartbeats: its silence will tell
            buf += frame
        for peer, buf in self._out.items():
            if buf:
                try:
                    del buf[:self._socks[peer].send(buf)]
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    buf.clear()  # the reader sees the same failure
        if self._closing:
            return  # a peer seen to go from now on is no news (it ended too, or we do)
        if lost:
            why = "; ".join(f"rank {p}: {w}" for p, w in sorted(lost.items()))
            log.warning("commslayer %s: lost %s", self._label, why)
            self._callback(self._on_lost, set(lost), why)
        if left:
            self._callback(self._on_left, left)

    def _callback(self, fn: Callable[..., None], *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("commslayer %s: handling a peer's change failed", self._label)

    def _hang_up(self) -> None:
        for s in self._socks.values():
            _drain(s)
        for s in list(self._socks.values()) + [self._wake_r, self._wake_w]:
            try:
                s.close()
            except OSError:
                pass

    def close(self, goodbye: bool = True) -> None:
        """Say goodbye to every peer and stop (idempotent); ``before_goodbye`` runs first.
        ``goodbye=False`` hangs up without it: the peers take this process as lost at once."""
        if self._closing:
            return
        if goodbye:  # the peers take what this member knew as settled once it said goodbye
            self._before_goodbye()
        self._goodbye = goodbye
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is threading.current_thread():
            return  # the thread says goodbye and hangs up once the callback that closed it returns
        # The goodbye frames need the thread; a hang-up does not: its thread may be busy in a
        # callback (a store call, seconds), and a process ending on SIGTERM has little time.
        self._thread.join(timeout=2 * self.heartbeat_s + 1.0 if goodbye else HANG_UP_WAIT_S)
        if self._thread.is_alive():
            self._hang_up()


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
