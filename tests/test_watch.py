"""The watch protocol (``commslayer.detect.watch``) on the simulator (``commslayer.detect.watchsim``):
the topology's guarantees, detection of kills and stops at a few hundred members,
and what must not happen (a healthy member declared lost by one cut-off or stopped
watcher, a frame misread). Real processes run the same code in test_recovery.py,
test_peer_loss.py and test_watch_processes.py."""

import logging
import struct
from collections import Counter

import pytest

from commslayer.detect.watch import BEAT, BROKEN, HUNG_UP, SILENT, Topology, Watch
from commslayer.detect.watchsim import Simulation


def test_every_member_has_k_distinct_watchers_and_at_most_2k_connections():
    top = Topology.choose(200, k=3, mesh_max=16, seed=7)
    assert not top.full_mesh and top.degree == 3
    edges = Counter()
    for r in range(200):
        assert len(top.watchers(r)) == 3 and len(top.watches(r)) == 3
        assert r not in top.neighbours(r) and len(top.neighbours(r)) == 6
        for p in top.watches(r):
            assert r in top.watchers(p)
            edges[frozenset((r, p))] += 1
    assert max(edges.values()) == 1  # the cycles share no edge: k independent watchers
    again = Topology.choose(200, k=3, mesh_max=16, seed=7)
    assert [again.watchers(r) for r in range(200)] == [top.watchers(r) for r in range(200)]
    other = Topology.choose(200, k=3, mesh_max=16, seed=8)
    assert [other.watchers(r) for r in range(200)] != [top.watchers(r) for r in range(200)]


def test_watchers_sit_on_other_hosts_where_hosts_are_known():
    hosts = [f"node{r // 8}" for r in range(48)]  # 6 hosts of 8 ranks, as torchrun lays them out
    top = Topology.choose(48, k=3, mesh_max=16, seed=1, hosts=hosts)
    for r in range(48):
        assert all(hosts[w] != hosts[r] for w in top.watchers(r)), r


def test_the_full_mesh_up_to_its_threshold():
    assert Topology.choose(16, k=3, mesh_max=16, seed=0).full_mesh
    assert not Topology.choose(17, k=3, mesh_max=16, seed=0).full_mesh
    assert Topology.choose(6, k=3, mesh_max=2, seed=0).full_mesh  # 3 disjoint cycles need 7 members
    mesh = Topology(5)
    assert mesh.watchers(2) == mesh.watches(2) == (0, 1, 3, 4)


def _declared_by_all(sim, target, size, failed):
    by = sim.declared.get(target, {})
    return sorted(set(range(size)) - set(failed) - set(by))


def test_a_killed_member_is_known_to_every_member_within_a_few_hops():
    sim = Simulation(300, k=3, seed=3)
    sim.run(1.0)
    sim.kill(42, at=1.0)
    sim.run(2.0)
    assert _declared_by_all(sim, 42, 300, [42]) == []
    (detection,) = sim.detections()
    assert detection.quantile(1.0) < 0.2, detection.quantile(1.0)  # 0.2 ms per hop, a handful of hops
    assert sim.false_positives() == [] and set(sim.declared) == {42}
    assert all(w.lost[42].startswith("its process exited") for m, w in enumerate(sim.members) if m != 42)


def test_a_stopped_member_is_known_to_every_member_after_the_peer_timeout():
    sim = Simulation(300, k=3, peer_timeout_s=3.0, seed=4)
    sim.run(1.0)
    sim.stop(17, at=1.0)
    sim.run(5.0)
    (detection,) = sim.detections()
    assert detection.missing == 0
    assert 3.0 - 0.25 <= detection.quantile(0.0) and detection.quantile(1.0) < 3.0 + 0.5, detection.delays[:5]
    assert sim.false_positives() == [] and set(sim.declared) == {17}


def test_one_cut_off_watcher_cannot_get_a_healthy_member_declared():
    """The link between a member and one of its watchers dies: that watcher reports the
    member silent, the member's other watchers refute it, and nobody declares it lost.
    The same member cut off from every watcher is declared by everyone."""
    sim = Simulation(100, k=3, peer_timeout_s=1.0, seed=5)
    target = 10
    watcher = sim.topology.watchers(target)[0]
    sim.run(0.5)
    sim.cut(watcher, target, at=0.5)
    sim.run(8.0)
    assert target in sim.members[watcher]._reported  # it did report the silence
    assert sim.declared == {}

    sim = Simulation(100, k=3, peer_timeout_s=1.0, seed=5)
    sim.run(0.5)
    for n in sim.topology.neighbours(target):
        sim.cut(n, target, at=0.5)
    sim.run(8.0)
    assert _declared_by_all(sim, target, 100, [target]) == []


def test_a_watcher_stopped_for_longer_than_the_peer_timeout_declares_nobody_when_it_resumes():
    sim = Simulation(100, k=3, peer_timeout_s=1.0, seed=6)
    sim.run(0.5)
    sim.stop(20, at=0.5, for_s=3.0)
    sim.run(8.0)
    assert set(sim.declared) == {20}  # the others rightly took it as lost while it was stopped
    assert not any(20 in by for by in sim.declared.values())
    assert sim.false_positives() == []


def test_two_members_one_lost_is_declared_at_once_and_a_lone_survivor_waits_for_its_grace():
    sim = Simulation(2, seed=1)
    sim.run(0.5)
    sim.kill(1, at=0.5)
    sim.run(0.6)
    assert sim.detections()[0].quantile(1.0) < 0.01

    sim = Simulation(3, peer_timeout_s=1.0, seed=1)
    sim.run(0.5)
    sim.stop(1, at=0.5)
    sim.stop(2, at=0.5)
    sim.run(3.0)
    delays = [d.quantile(0.0) for d in sim.detections()]
    # silence after 1 s, then one report with no second observer left to agree: half the peer timeout
    assert all(1.0 - 0.25 < d < 1.0 + 0.5 + 0.1 for d in delays), delays


def test_a_goodbye_reaches_every_member_and_is_not_a_loss():
    sim = Simulation(200, k=3, seed=2)
    sim.run(0.5)
    sim.leave(9, at=0.5)
    sim.run(1.5)
    assert sorted(sim.departed[9]) == [m for m in range(200) if m != 9]
    assert sim.declared == {}


def test_no_false_positive_under_50ms_jitter():
    sim = Simulation(300, k=3, jitter_s=0.05, peer_timeout_s=3.0, seed=9)
    sim.run(30.0)
    assert sim.declared == {}
    median, most = sim.beats_per_member_s(30.0)
    assert median <= 3 * 4 and most <= 3 * 4 + 0.1  # k heartbeats per period, whatever the size


def test_a_loss_costs_each_member_a_constant_number_of_frames():
    sim = Simulation(400, k=3, seed=11)
    sim.run(1.0)
    before = [w.sent - b for w, b in zip(sim.members, sim.beats)]
    sim.kill(5, at=1.0)
    sim.run(2.0)
    extra = [w.sent - b - x for w, b, x in zip(sim.members, sim.beats, before)]
    assert max(extra) <= 2 * 3 * 2 * 3  # each of <= 2k reports forwarded once to <= 2k neighbours


def _mesh_member(size=3, me=0, now=0.0):
    return Watch(me, Topology(size), heartbeat_s=0.25, peer_timeout_s=3.0, now=now)


def test_frames_split_anywhere_are_read_whole():
    watch = _mesh_member()
    report = struct.pack("!cIIIBI", b"R", 2, 1, 1, HUNG_UP, 0)  # rank 1 saw rank 2 hang up
    for i in range(len(report)):
        watch.received(1, report[i:i + 1], now=0.1)
    watch.received(1, BEAT + BEAT, now=0.2)
    assert watch.take()[1] == {}  # rank 1's word alone: this member's own link to rank 2 says nothing yet
    watch.hung_up(2, now=0.21, how=BROKEN)  # its own evidence, a second observer: rank 1's report was read whole
    assert watch.take()[1] == {2: "its connection broke"}


def test_one_members_word_that_a_peer_hung_up_is_refuted_at_the_peers_next_beat():
    watch = _mesh_member()
    watch.received(1, struct.pack("!cIIIBI", b"R", 2, 1, 1, HUNG_UP, 0), now=0.1)
    watch.received(2, BEAT, now=0.2)  # rank 2 is alive: this member refutes rank 1's report
    out, lost, _ = watch.take()
    assert lost == {} and (1, struct.pack("!cIIII", b"A", 2, 0, 1, 1)) in out
    watch.tick(now=3.0)  # long past confirm_s: the refuted report never stood
    assert watch.take()[1] == {} and not watch.lost


def test_in_the_full_mesh_a_member_speaks_only_for_itself(caplog):
    watch = _mesh_member(size=4)
    with caplog.at_level(logging.WARNING, logger="commslayer"):
        watch.received(1, struct.pack("!cIIIBI", b"R", 2, 3, 1, SILENT, 900), now=0.1)  # in rank 3's name
        watch.received(1, struct.pack("!cIIIBI", b"R", 2, 0, 7, SILENT, 900), now=0.1)  # in this rank's own
        watch.received(1, struct.pack("!cI", b"L", 2), now=0.1)  # "rank 2 left", said by rank 1
    assert watch.refused == 3 and caplog.text.count("in another member's name") == 1
    watch.received(3, struct.pack("!cIIIBI", b"R", 2, 3, 1, SILENT, 900), now=0.2)  # rank 3 itself: taken
    watch.tick(now=0.2 + 1.6)  # one report, unrefuted for confirm_s
    assert list(watch.take()[1]) == [2] and watch.left == set()


def test_a_report_flood_keeps_the_tables_bounded():
    watch = _mesh_member(size=4)
    flood = b"".join(struct.pack("!cIIIBI", b"R", t, 1, serial, SILENT, 100)
                     for serial in range(1, 100_001) for t in (2, 3))
    watch.received(1, flood, now=0.1)
    refute = b"".join(struct.pack("!cIIII", b"A", 2, 1, 3, serial) for serial in range(1, 50_001))
    watch.received(1, refute, now=0.1)
    tables = (watch._latest, watch._refuted, watch._early, watch._reports, watch._vouch)
    assert sum(len(t) for t in tables) <= 4 * 3 * len(tables), [len(t) for t in tables]


def test_a_frame_this_version_does_not_know_is_dropped_with_a_warning(caplog):
    watch = _mesh_member()
    with caplog.at_level(logging.WARNING, logger="commslayer"):
        watch.received(1, b"Zjunk" + BEAT, now=0.1)
    assert "does not know" in caplog.text
    watch.received(1, struct.pack("!cIIIBI", b"R", 2, 9, 1, SILENT, 100), now=0.2)  # 9 is not rank 2's neighbour
    watch.received(1, struct.pack("!cIIIBI", b"R", 7, 1, 1, HUNG_UP, 0), now=0.2)  # no rank 7
    assert watch.take()[1] == {}


@pytest.mark.parametrize("size", [1000])
def test_the_simulator_holds_a_thousand_members(size):
    sim = Simulation(size, k=3, jitter_s=0.01, seed=12)
    sim.run(1.0)
    sim.kill(3, at=1.0)
    sim.stop(4, at=1.0)
    sim.run(4.6)
    kill, stop = sim.detections()
    assert kill.missing == stop.missing == 0
    assert kill.quantile(0.5) < 0.5 and stop.quantile(0.99) < 3.0 + 0.5
    assert sim.false_positives() == []


def test_a_member_reported_silent_and_then_killed_is_declared_at_the_hang_up():
    """A ring of 4 (one watcher each): member 2's watcher (1) reports its silence, and with
    the link to its other neighbour (3) cut nobody seconds it, so the grace would take half
    the peer timeout; the hang-up when it dies ends the wait at once for the watcher, which
    saw it. The others have only the watcher's word, one observer's: they wait out the grace
    that began with its first report, and not a new one from the hang-up."""
    sim = Simulation(4, k=1, mesh_max=1, peer_timeout_s=2.0, seed=3)
    assert sim.topology.watchers(2) == (1,) and set(sim.topology.neighbours(2)) == {1, 3}
    sim.run(0.5)
    sim.stop(2, at=0.5)
    sim.cut(2, 3, at=0.5)
    sim.run(2.6)  # silent for 2 s by now: reported, not yet confirmed (the grace ends near 3.5 s)
    assert sim.declared == {}
    sim.kill(2, at=2.6)
    sim.run(2.7)
    assert sorted(sim.declared.get(2, {})) == [1]
    sim.run(3.6)
    assert sorted(sim.declared.get(2, {})) == [0, 1, 3]


_LAYOUT_VARS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "COMMSLAYER_NODE_SIZES",
                "SLURM_TASKS_PER_NODE", "SLURM_DISTRIBUTION", "SLURM_PROCID", "SLURM_NODEID")


def _layout(monkeypatch, **env):
    for name in _LAYOUT_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_torchrun_layout_gives_each_member_its_node(monkeypatch):
    from commslayer.detect.addresses import rank_hosts

    _layout(monkeypatch)
    assert rank_hosts([0, 1]) is None  # not started by torchrun
    _layout(monkeypatch, RANK="5", GROUP_RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", WORLD_SIZE="16")
    assert rank_hosts([0, 3, 4, 15]) == [0, 0, 1, 3]
    assert rank_hosts([0, 16]) is None  # not global ranks of this job
    monkeypatch.setenv("GROUP_RANK", "0")  # rank 5 is not in node 0's block: not that layout
    assert rank_hosts([0, 1]) is None


def test_slurm_and_explicit_layouts_give_each_member_its_node(monkeypatch):
    from commslayer.detect.addresses import rank_hosts
    from commslayer.errors import ConfigError

    _layout(monkeypatch, SLURM_TASKS_PER_NODE="2(x3),1", SLURM_PROCID="4", SLURM_NODEID="2")
    assert rank_hosts([0, 1, 2, 5, 6]) == [0, 0, 1, 2, 3]
    assert rank_hosts([7]) is None  # 7 tasks in all
    monkeypatch.setenv("SLURM_NODEID", "1")  # this task is not where the layout puts it
    assert rank_hosts([0]) is None
    _layout(monkeypatch, SLURM_TASKS_PER_NODE="2(x3),1", SLURM_PROCID="4", SLURM_NODEID="2",
            SLURM_DISTRIBUTION="cyclic")
    assert rank_hosts([0]) is None  # not in blocks: no layout
    # the explicit layout wins over torchrun's (commslayer-run sets it after a resharding)
    _layout(monkeypatch, COMMSLAYER_NODE_SIZES="2,1,3", RANK="1", GROUP_RANK="1", LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1", WORLD_SIZE="6")
    assert rank_hosts([0, 1, 2, 3, 5]) == [0, 0, 1, 2, 2]
    for bad in ("2,,1", "0,2", "x"):
        monkeypatch.setenv("COMMSLAYER_NODE_SIZES", bad)
        with pytest.raises(ConfigError, match="COMMSLAYER_NODE_SIZES"):
            rank_hosts([0])
