"""The shrink agreement (``commslayer.agree.agreement``) on the simulator (``commslayer.detect.watchsim``
with a ``StoreModel``): hundreds of survivors, each starting it when its watch declares
the loss, against one simulated store. The same code runs on real stores in
test_membership_protocol.py and, with real processes, test_recovery.py."""

import pytest

from commslayer.detect.watchsim import Simulation, StoreModel


def _agree(size, faults, blocking=True, seed=2):
    sim = Simulation(size, seed=seed, jitter_s=0.02, store=StoreModel(blocking_waits=blocking))
    for member, kind, at in faults:
        getattr(sim, kind)(member, at=at)
    sim.run(12.0)
    return sim, sim.agreement


@pytest.mark.parametrize("blocking", [True, False])
def test_every_survivor_of_a_kill_has_the_same_decision_and_waits_cheaply(blocking):
    sim, a = _agree(300, [(17, "kill", 1.0)], blocking)
    survivors = [m for m in range(300) if m != 17]
    assert a.decision == survivors and sorted(a.returned) == survivors and not a.failed
    assert all(a.returned[m] >= a.decided_at for m in survivors)
    assert a.decided_at - 1.0 < 0.5  # the proposer waited for every survivor, not out the join window
    waiters = sorted(a.requests[m] for m in survivors if m != 0)  # 0 proposes
    if blocking:  # join (with what it suspects), one wait, one read of the decision
        assert waiters[len(waiters) // 2] == 3 and waiters[-1] <= 4, waiters[-5:]
    else:
        assert waiters[len(waiters) // 2] > 3


@pytest.mark.parametrize("blocking", [True, False])
def test_survivors_take_over_when_the_proposer_dies_during_the_agreement(blocking):
    # member 0 proposes; it dies 30 ms after the first loss, while the others wait for it
    sim, a = _agree(300, [(40, "kill", 1.0), (0, "kill", 1.03)], blocking)
    survivors = [m for m in range(300) if m not in (0, 40)]
    assert a.decision == survivors and sorted(a.returned) == survivors and not a.failed
    assert a.decided_at - 1.0 < 1.0  # not twice the join window (6 s): member 1 took over at once


def test_a_stopped_member_is_decided_out_after_its_peer_timeout():
    sim, a = _agree(200, [(9, "stop", 1.0)])
    assert a.decision == [m for m in range(200) if m != 9]
    assert 1.0 + 2.0 < a.decided_at < 1.0 + 3.5
