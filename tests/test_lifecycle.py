"""The lifecycle's state machine (commslayer.comm.lifecycle), its races on real threads, and the
same races on real communicators (forked ranks).

In-process tests drive a ``Lifecycle`` directly: its membership protocol runs on a
c10d ``HashStore`` and its owner is a small stand-in that counts what the lifecycle
asks of it (no backend, no liveness thread, so no communicator in the pytest process).
"""

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import commslayer
from commslayer.errors import CommAborted, CommError, PeerLost
from commslayer.comm.lifecycle import OPEN, TRANSITIONS, Lifecycle, Lineage, State
from commslayer.agree.membership import Membership

from harness import on_threads, run_ranks

ROUNDS = 200  # races repeated: each round is well under a millisecond


class Owner:
    """What a lifecycle asks of its communicator: let go of the backend, stop the waiter."""

    def __init__(self) -> None:
        self._seq = 7
        self.released = 0
        self.waiters_stopped = 0

    def _release(self) -> None:
        self.released += 1

    def _stop_waiter(self) -> None:
        self.waiters_stopped += 1


def _life(owner: Owner, *, size: int = 2, rank: int = 0, store=None, peer_timeout_s: float = 0.05,
          parent=None) -> Lifecycle:
    store = dist.HashStore() if store is None else store
    lineage = Lineage(store, "t.0", Membership(store, "t"), heartbeat_s=0.0, peer_timeout_s=peer_timeout_s,
                      isolate=False)
    return Lifecycle(owner, name="t", rank=rank, size=size, lineage=lineage, generation=0,
                     members=list(range(size)), parent=parent)


# ------------------------------------------------------------------ the table
def test_closed_states_are_final_and_open_ones_are_active_and_broken():
    assert OPEN == {State.ACTIVE, State.BROKEN}
    for state in State:
        if state not in OPEN and state is not State.SHRINKING:
            assert TRANSITIONS[state] == frozenset(), state
    assert TRANSITIONS[State.SHRINKING] == {State.REPLACED, State.FENCED, State.ABORTED}
    assert State.ACTIVE not in set().union(*TRANSITIONS.values())  # nothing goes back to ACTIVE


def test_an_illegal_move_raises_comm_aborted_naming_the_state():
    owner = Owner()
    life = _life(owner)
    assert life.close(State.FINALIZED) and life.state is State.FINALIZED
    with pytest.raises(CommAborted, match=r"communicator was finalized \[communicator 't'; op shrink\]"):
        life.retire(State.SHRINKING, "being shrunk after a loss", op="shrink")
    assert not life.retire(State.REPLACED, "replaced by generation 1")  # an internal retire: skipped
    assert life.state is State.FINALIZED and life.reason == "finalized" and owner.released == 0
    assert not life.close(State.ABORTED)  # abort after finalize: nothing happens


def test_states_render_as_the_text_traces_and_errors_show():
    owner = Owner()
    life = _life(owner)
    assert life.describe() == "ok" and life.clean
    life.fail(PeerLost("gone", comm="t", op="all_reduce", seq=3, ranks=[1]))
    assert life.state is State.BROKEN and life.describe() == "broken: PeerLost: gone" and not life.clean
    life.retire(State.REPLACED, "replaced by generation 1 (members [0])")
    assert life.describe() == "replaced by generation 1 (members [0])" and owner.released == 1
    err = life.interruption("all_reduce", 4)
    assert isinstance(err, PeerLost) and "interrupted: gone" in str(err)  # the first failure's class stays


# ---------------------------------------------------------------------- races
def test_a_failure_reported_from_many_threads_at_once_runs_the_error_hook_once():
    for _ in range(ROUNDS):
        life = _life(Owner())
        seen = []
        life.error_hooks.add(seen.append)
        errors = [CommError(f"failure {i}", comm="t") for i in range(4)]
        won = on_threads(*(lambda e=e: life.fail(e) for e in errors))
        assert won.count(True) == 1, won
        assert seen == [life.failure] and life.failure is errors[won.index(True)]
        assert life.state is State.BROKEN


def test_abort_racing_the_start_of_a_shrink_ends_in_one_state_or_the_other():
    for _ in range(ROUNDS):
        owner = Owner()
        life = _life(owner)
        aborts = []
        life.abort_hooks.add(lambda: aborts.append(1))
        aborted, shrank = on_threads(lambda: life.close(State.ABORTED),
                                    lambda: life.retire(State.SHRINKING, "being shrunk after a loss",
                                                        stop_watching=False, op="shrink"))
        if aborted:  # abort first: the shrink is refused, naming the state
            assert isinstance(shrank, CommAborted) and "communicator was aborted" in str(shrank), shrank
            assert life.state is State.ABORTED and owner.released == 0
        else:  # shrink first: the abort finds it closed and does nothing
            assert shrank is True and life.state is State.SHRINKING and owner.released == 1
        assert aborts == [1]  # the abort hooks ran once either way


def test_abort_while_a_shrink_agrees_does_not_undo_the_shrink():
    owner = Owner()
    life = _life(owner, peer_timeout_s=0.3)  # member 1 is not suspected: the agreement waits for it
    built = []

    def build(generation, members):
        built.append((generation, members))
        return f"generation {generation}"

    results = {}
    shrinking = threading.Thread(target=lambda: results.update(shrink=life.shrink(5.0, 1, build)))
    shrinking.start()
    deadline = time.monotonic() + 5
    while life.state is not State.SHRINKING and time.monotonic() < deadline:
        time.sleep(0.001)
    assert life.state is State.SHRINKING
    assert life.close(State.ABORTED) is False  # closed to ops already: abort has nothing to do
    shrinking.join(10)
    assert results["shrink"] == "generation 1" and built == [(1, [0])]
    assert life.state is State.REPLACED and life.reason == "replaced by generation 1 (members [0])"
    assert owner.released == 1


def test_a_shrink_that_fails_leaves_the_communicator_aborted_with_the_reason():
    life = _life(Owner(), peer_timeout_s=0.01)
    with pytest.raises(CommError, match="only 1 member"):
        life.shrink(5.0, 2, lambda g, m: pytest.fail("nothing may be built"))
    assert life.state is State.ABORTED
    assert life.describe().startswith("closed by a shrink that failed (CommError: only 1 member(s) [0] survived")


def test_a_loss_named_twice_at_once_is_one_failure_and_reaches_the_split():
    for _ in range(50):
        owner = Owner()
        parent = _life(owner, size=3)
        child = _life(Owner(), size=2, parent=parent)
        parent.adopt(child, [1, 2])
        seen = []
        parent.error_hooks.add(seen.append)
        on_threads(lambda: parent.peers_lost({2}, "socket closed"), lambda: parent.peers_lost({2}, "no heartbeat"))
        assert len(seen) == 1 and seen[0].ranks == (2,) and seen[0].seq == 7
        assert parent.lost_ranks == {2} and child.lost_ranks == {1} and child.state is State.BROKEN


def test_retiring_a_parent_retires_its_splits_with_a_reason_that_names_it():
    owner, child_owner = Owner(), Owner()
    parent = _life(owner, size=2)
    child = _life(child_owner, size=1, parent=parent)
    parent.adopt(child, [0])
    parent.retire(State.SHRINKING, "being shrunk after a loss", stop_watching=False, op="shrink")
    parent.retire(State.REPLACED, "replaced by generation 1 (members [0])")
    assert child.state is State.REPLACED and child_owner.released == 1 and owner.released == 1
    assert child.reason == ("split from 't' generation 0, which was replaced by generation 1 (members [0]); "
                            "split the new generation again")


def test_a_peer_that_left_becomes_a_loss_only_when_an_op_needs_it():
    life = _life(Owner(), size=3)
    life.peers_left({2})
    assert life.state is State.ACTIVE and not life.clean
    life.ensure_usable("send", 1, peer=1)  # a point-to-point op with another peer is fine
    with pytest.raises(PeerLost, match=r"rank 2 \(member 2\): it left the communicator"):
        life.ensure_usable("all_reduce", 1)
    assert life.state is State.BROKEN and life.lost_ranks == {2}


def test_a_rank_the_others_went_on_without_is_fenced_and_a_loss_then_changes_nothing():
    store = dist.HashStore()
    owner = Owner()
    life = _life(owner, size=3, rank=2, store=store)
    assert not life.check_fenced()  # no decision yet
    life.lineage.membership.agree_on(1, [0, 1], 0, [0, 1, 2])
    seen = []
    life.error_hooks.add(seen.append)
    assert life.check_fenced()  # what its monitor asks when the others leave or vanish
    life.peers_lost({0}, "no heartbeat")  # a loss reported later does not break a fenced rank
    assert life.state is State.FENCED and owner.released == 1 and seen == [] and life.lost_ranks == {0}
    assert life.reason == "fenced out of generation 1: the others went on with members [0, 1]"


# ------------------------------------------------- the same races, real communicators
def _finalize_while_waiting(rank, size, store):
    comm = commslayer.new_comm("gloo", name="fin", store=store, rank=rank, size=size, timeout=30)
    comm.all_reduce(torch.ones(2))
    if rank == 1:  # never joins rank 0's next op; leaves once rank 0 is done
        store.wait(["done"], timedelta(seconds=30))
        comm.finalize()
        return None
    result = {}

    def op():
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(2))
            result["outcome"] = "completed"
        except CommError as err:
            result["outcome"] = f"{type(err).__name__}: {err.what}"
        result["took"] = time.monotonic() - start

    waiting = threading.Thread(target=op)
    waiting.start()
    time.sleep(0.3)
    finalized = time.monotonic()
    comm.finalize()
    waiting.join(20)
    result["after finalize"] = time.monotonic() - finalized
    result["state"] = comm.state
    store.set("done", "1")
    return result


@pytest.mark.timeout(90)
def test_finalize_while_an_op_waits_ends_the_op_with_comm_aborted():
    r = run_ranks(_finalize_while_waiting, 2, timeout=60)[0]
    assert r["outcome"] == "CommAborted: communicator was finalized", r
    assert r["after finalize"] < 2.0 and r["state"] == "finalized", r


def _error_hook_once(rank, size, store):
    comm = commslayer.new_comm("gloo", name="hook", store=store, rank=rank, size=size, timeout=30)
    comm.all_reduce(torch.ones(2))
    if rank == 1:
        time.sleep(0.2)  # rank 0 is waiting in its all_reduce by now
        os._exit(0)  # dies without a goodbye: the op and the liveness thread both report it
    calls = []
    comm.register_error_hook(lambda err: calls.append(type(err).__name__))
    outcomes = []
    for _ in range(2):  # the second op is refused by the first failure: no second hook call
        try:
            comm.all_reduce(torch.ones(2))
        except CommError as err:
            outcomes.append(type(err).__name__)
    return {"hook calls": calls, "op outcomes": outcomes, "state": comm.state}


@pytest.mark.timeout(90)
def test_a_loss_seen_by_the_waiting_op_and_the_monitor_runs_the_error_hook_once():
    r = run_ranks(_error_hook_once, 2, timeout=60, allow_errors=True)[0]
    assert r["hook calls"] == ["PeerLost"], r
    assert r["op outcomes"] == ["PeerLost", "PeerLost"] and r["state"].startswith("broken: PeerLost"), r
