"""The liveness mesh against a hostile neighbour on the same host.

An attacker that can reach a member's liveness listener but cannot read the
communicator's store (it learns the port, not the key) connects while member
1 waits for member 0's hello and sends junk, a hello that claims to be rank
0 with a forged signature, a truncated hello, and a connection that stays
silent; after the set-up it tries again.  The mesh must come up on time with
the real member 0, keep both members alive (heartbeats flow, nobody is
declared lost), and log each dropped connection; the listener is closed
once the mesh is up.  A communicator built beside the attack works too."""

from __future__ import annotations

import logging
import os
import socket
import struct
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks



def _member_or_attacker(rank, size, store):
    import commslayer
    from commslayer.detect.liveness import Liveness

    if rank == 2:  # the attacker: knows the address, not the key
        published = dist.PrefixStore("mesh", store)  # where member 1 publishes its listener (and its key)
        published.wait(["liveness/1"])
        host, port, _key = published.get("liveness/1").decode().rsplit(":", 2)
        addr = (host, int(port))
        junk = socket.create_connection(addr)
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
        forged = socket.create_connection(addr)
        forged.sendall(b"CLhb" + struct.pack("!III", 0, 1, 0) + os.urandom(32))
        short = socket.create_connection(addr)
        short.sendall(b"CLhb\x00")
        short.close()
        silent = socket.create_connection(addr)
        store.set("attacked", "1")
        store.wait(["mesh-up"])
        try:
            socket.create_connection(addr, timeout=2).close()
            after = "accepted"
        except OSError as exc:
            after = type(exc).__name__
        for s in (silent, junk, forged):
            s.close()
        store.set("attacked-after", "1")
        return after

    dropped, lost = [], []

    class Keep(logging.Handler):
        def emit(self, record):
            dropped.append(record.getMessage())

    logging.getLogger("commslayer").addHandler(Keep(level=logging.WARNING))
    if rank == 0:
        store.wait(["attacked"])  # member 1 is listening with the attacker's sockets on it
    start = time.monotonic()
    mesh = Liveness(dist.PrefixStore("mesh", store), rank, 2, heartbeat_s=0.1, peer_timeout_s=1.0,
                    connect_timeout_s=60, on_lost=lambda ranks, why: lost.append(why), on_left=lambda ranks: None,
                    label="mesh")
    setup_s = time.monotonic() - start
    if rank == 1:
        store.set("mesh-up", "1")
    store.wait(["attacked-after"])
    time.sleep(1.5)  # more than the peer timeout: heartbeats must have flowed
    comm = commslayer.new_comm("gloo", name="sec", store=store, rank=rank, size=2, timeout=60)
    t = torch.full((8,), float(rank + 1))
    comm.all_reduce(t)
    comm.finalize()
    mesh.close()
    return setup_s, lost, t.tolist(), [m for m in dropped if "dropped a liveness connection" in m]


@pytest.mark.timeout(90)
def test_attackers_are_dropped_and_the_mesh_comes_up():
    (setup0, lost0, t0, dropped0), (setup1, lost1, t1, dropped1), after_setup = \
        run_ranks(_member_or_attacker, 3, timeout=60)
    assert lost0 == lost1 == []
    assert t0 == t1 == [3.0] * 8
    assert setup1 < 10, setup1  # the silent socket did not hold member 1 for the 60 s timeout
    assert after_setup == "ConnectionRefusedError"  # the listener closed once the mesh was up
    reasons = " | ".join(dropped1)
    assert "not a liveness hello" in reasons
    assert "wrong signature" in reasons
    assert "closed before a whole hello" in reasons
    assert dropped0 == []


@pytest.mark.timeout(60)
def test_a_member_that_chose_another_topology_is_a_config_error_not_an_unwatched_member():
    """Rank 0 watches everyone (the full mesh); ranks 1 and 2 were told to watch one
    peer each (a ring): set up that way, some member would be watched by nobody."""
    from commslayer.errors import ConfigError
    from commslayer.detect.liveness import Liveness
    from tests.harness import on_threads

    store = dist.HashStore()

    def member(rank):
        ring = {} if rank == 0 else {"watch_peers": 1, "mesh_max": 1}
        return Liveness(dist.PrefixStore("mix", store), rank, 3, heartbeat_s=0.1, peer_timeout_s=1.0,
                        connect_timeout_s=5, on_lost=lambda ranks, why: None, on_left=lambda ranks: None,
                        label="mix", **ring)

    got = on_threads(*(lambda r=r: member(r) for r in range(3)))
    mismatch = [g for g in got if isinstance(g, ConfigError)]
    assert mismatch and "chose another watch topology" in str(mismatch[0]), got
    assert "COMMSLAYER_WATCH_PEERS" in str(mismatch[0])
    for g in got:
        if isinstance(g, Liveness):
            g.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _flooded(rank, size, store):
    """Rank 2 floods rank 1's listener with silent connections (more than rank 1's 256
    file descriptors: the usual 1024, scaled to what this host's loopback accepts in a few
    seconds) while rank 0 connects; rank 1 samples how many it holds."""
    import resource
    import threading
    from commslayer.detect.liveness import Liveness

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if rank == 2:
        flood = 700
        published = dist.PrefixStore("flood", store)
        published.wait(["liveness/1"])
        host, port, _key = published.get("liveness/1").decode().rsplit(":", 2)
        held = []
        for i in range(flood):
            try:
                held.append(socket.create_connection((host, int(port)), timeout=1))
            except OSError:
                pass
            if len(held) == 300:  # more than rank 1 may hold
                store.set("flooding", "1")
            if i % 50 == 0 and store.check(["mesh-up"]):
                break
        store.wait(["mesh-up"])
        for s in held:
            s.close()
        return flood, len(held)

    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logging.getLogger("commslayer").addHandler(Keep(level=logging.WARNING))
    peak, done = [_fds()], threading.Event()
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

        def sample():
            while not done.is_set():
                peak.append(_fds())
                time.sleep(0.002)

        threading.Thread(target=sample, daemon=True).start()
    else:
        store.wait(["flooding"])
    start = time.monotonic()
    mesh = Liveness(dist.PrefixStore("flood", store), rank, 2, heartbeat_s=0.1, peer_timeout_s=1.0,
                    connect_timeout_s=60, on_lost=lambda ranks, why: None, on_left=lambda ranks: None, label="flood")
    setup_s = time.monotonic() - start
    done.set()
    if rank == 1:
        store.set("mesh-up", "1")
    mesh.close()
    return setup_s, max(peak) - peak[0], mesh.connections_dropped, logged


@pytest.mark.timeout(120)
def test_a_connection_flood_at_set_up_is_bounded_and_counted():
    from commslayer.detect.liveness import PENDING_MAX

    (_, _, dropped0, _), (setup1, extra_fds, dropped1, logged1), (flood, held) = run_ranks(_flooded, 3, timeout=100)
    assert held >= 300, (flood, held)  # more than rank 1 could ever hold at once (256 files), the flood's signal
    assert setup1 < 30, setup1
    # what it did not drop: the connections waiting at the end, and those left in the backlog
    assert dropped0 == 0 and dropped1 >= held - PENDING_MAX - 1 - 18, (dropped1, held)
    assert extra_fds <= PENDING_MAX + 8, extra_fds  # listener, selector, the peer, the sampler's listdir
    one_by_one = [m for m in logged1 if "dropped a liveness connection" in m]
    assert 1 <= len(one_by_one) <= 8 and any(f"dropped {dropped1} liveness connections in all" in m for m in logged1)


def _starved(rank, size, store):
    """Rank 1 builds a liveness member with k file descriptors left, for k = 0..7, while
    rank 0 (no member: it never says a valid hello) keeps connecting junk to it."""
    import resource
    from commslayer.detect.liveness import Liveness

    if rank == 0:
        for k in range(8):
            published = dist.PrefixStore(f"starved{k}", store)
            while not store.check([f"done{k}"]):
                if published.check(["liveness/1"]):
                    host, port, _ = published.get("liveness/1").decode().rsplit(":", 2)
                    try:
                        socket.create_connection((host, int(port)), timeout=1).sendall(b"junk" * 11)
                    except OSError:
                        pass
                time.sleep(0.01)
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    outcomes = []
    for k in range(8):
        fillers = []
        try:
            while True:
                fillers.append(open("/dev/null"))
        except OSError:
            pass
        for f in fillers[len(fillers) - k:] if k else []:
            f.close()
        try:
            Liveness(dist.PrefixStore(f"starved{k}", store), 1, 2, heartbeat_s=0.1, peer_timeout_s=1.0,
                     connect_timeout_s=3, on_lost=lambda ranks, why: None, on_left=lambda ranks: None,
                     label="starved").close()
            outcomes.append(("built", ""))
        except Exception as exc:  # what a user would see
            outcomes.append((type(exc).__name__, str(exc)))
        for f in fillers:
            f.close()
        store.set(f"done{k}", "1")
    return outcomes


@pytest.mark.timeout(120)
def test_a_member_out_of_file_descriptors_gets_out_of_files_naming_the_limit():
    _, outcomes = run_ranks(_starved, 2, timeout=100)
    kinds = [kind for kind, _ in outcomes]
    assert set(kinds) <= {"OutOfFiles", "PeerLost"}, outcomes  # never a raw OSError
    assert kinds[0] == "OutOfFiles" and "RLIMIT_NOFILE" in outcomes[0][1] and "256" in outcomes[0][1]
    assert kinds[-1] == "PeerLost", outcomes  # enough descriptors: the junk was dropped, rank 0 never came
    assert all("RLIMIT_NOFILE" in msg for kind, msg in outcomes if kind == "OutOfFiles")


def _liar(rank, size, store):
    """A full mesh of 3: rank 2 is a member (it read the store and says valid heartbeats,
    by hand) that lies: rank 1 hung up, in its own name and in rank 0's; then floods
    reports of made-up serials; then hangs up for real, which must still be seen at once."""
    import resource
    from commslayer.detect.liveness import Liveness
    from commslayer.detect.watch import HUNG_UP, SILENT

    if rank == 2:
        return _lie(dist.PrefixStore("liar", store), store, struct.Struct("!cIIIBI"), HUNG_UP, SILENT)
    lost = []
    mesh = Liveness(dist.PrefixStore("liar", store), rank, 3, heartbeat_s=0.1, peer_timeout_s=1.0,
                    connect_timeout_s=60, on_lost=lambda ranks, why: lost.append((time.monotonic(), ranks, why)),
                    on_left=lambda ranks: None, label="liar")
    store.wait(["lied"])
    lied_lost = list(lost)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    store.wait(["flooded"])
    time.sleep(1.0)  # the frames read and handled
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    watch = mesh._watch
    tables = sum(len(t) for t in (watch._latest, watch._refuted, watch._early, watch._reports, watch._vouch))
    store.set(f"measured{rank}", "1")
    store.wait(["hung-up"])
    time.sleep(1.0)
    hung_up_at = float(store.get("hung-up").decode()) + time.monotonic() - time.time()
    mesh.close()
    return lied_lost, watch.refused, grown_kib, tables, [at - hung_up_at for at, ranks, _ in lost if 2 in ranks]


def _lie(published, store, report, hung_up, silent):
    """Rank 2's part: accept ranks 0 and 1 (they dial the higher rank), beat, lie, flood."""
    listener = socket.create_server(("127.0.0.1", 0))
    published.set("liveness/2", f"127.0.0.1:{listener.getsockname()[1]}:{os.urandom(32).hex()}")
    socks = {}
    for _ in range(2):
        s, _ = listener.accept()
        socks[struct.unpack("!I", s.recv(44)[4:8])[0]] = s  # its hello: the sender's rank
    listener.close()

    def send(data):
        for s in socks.values():
            s.sendall(data)

    def beat_for(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            send(b".")
            time.sleep(0.05)

    beat_for(0.5)
    send(report.pack(b"R", 1, 2, 1, hung_up, 0) + report.pack(b"R", 1, 0, 1, hung_up, 0))  # "rank 1 hung up"
    beat_for(2.0)  # past the grace (0.5 s)
    store.set("lied", "1")
    send(b"".join(report.pack(b"R", i & 1, 2, 2 + i, silent, 100) + b"." for i in range(200_000)))
    store.set("flooded", "1")
    while not store.check(["measured0", "measured1"]):
        beat_for(0.1)
    store.set("hung-up", repr(time.time()))
    for s in socks.values():
        s.close()  # no goodbye: a crash, as they see it
    return None


@pytest.mark.timeout(120)
def test_one_lying_member_gets_no_healthy_rank_declared_and_a_report_flood_stays_bounded():
    results = run_ranks(_liar, 3, timeout=100)
    for rank, (lied_lost, refused, grown_kib, tables, seen_after) in enumerate(results[:2]):
        assert lied_lost == [], (rank, lied_lost)  # nobody took rank 1 (nor anyone) for lost
        assert refused >= 1, rank  # the report in rank 0's name: refused in the full mesh
        assert grown_kib < 20_000, (rank, grown_kib)  # 200,000 reports: once a set of every frame seen
        assert tables <= 3 * 3, (rank, tables)
        # the real hang-up is still seen, before the peer timeout (1 s): at once, or (1 run in 4 here,
        # 0.502 s, cause not found) once the grace of an unconfirmed report (0.5 s) ran out
        assert len(seen_after) == 1 and seen_after[0] < 0.9, (rank, seen_after)
