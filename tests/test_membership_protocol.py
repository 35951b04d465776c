"""The membership protocol (commslayer.agree.membership) in process: threads as members over one
store, milliseconds a test, for its corner cases: a c10d ``HashStore`` (waits poll) and a
TCPStore as a job's store is wrapped (waits block on the server). The same protocol with
real processes, sockets and kills is tested in test_recovery.py and test_resilience.py."""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from commslayer.errors import CollectiveTimeout, CommAborted, CommError, PeerLost
from commslayer.agree.membership import JOINERS_POLL_S, Membership
from commslayer.agree.store import bounded
from launch.bench.bench_agreement import CountingStore

from harness import on_threads


def _tcp_store(counter=None):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return bounded(server if counter is None else CountingStore(server, counter)), server


def _ready(m):
    """``m`` once its connection for blocking waits is open."""
    assert m.waits.opened(5.0), "the connection for waits did not open"
    return m


@pytest.fixture(params=["polled", "blocking"])
def m(request):
    if request.param == "polled":
        return Membership(dist.HashStore(), "proto")
    store, server = _tcp_store()
    request.addfinalizer(lambda: server)  # the server lives as long as the test
    return _ready(Membership(store, "proto"))


def _shrink(m, me, suspects=(), members=(0, 1, 2, 3), window_s=2.0, min_size=1):
    return lambda: m.agree_after_loss(1, list(members), me, lambda: set(suspects), join_window_s=window_s,
                                      timeout_s=5.0, min_size=min_size)


# ------------------------------------------------------------------ shrinking
def test_survivors_agree_without_waiting_out_the_window_once_every_unsuspected_member_joined(m):
    start = time.monotonic()
    got = on_threads(_shrink(m, 0, suspects={3}), _shrink(m, 1), _shrink(m, 2))
    assert got == [[0, 1, 2]] * 3
    assert time.monotonic() - start < 1.0  # the 2 s join window was not needed
    assert m.decided(1) == [0, 1, 2] and m.current() == 1


def test_a_survivor_slow_to_notice_the_loss_still_gets_in(m):
    got = on_threads(_shrink(m, 0, suspects={3}), _shrink(m, 1, suspects={3}), _shrink(m, 2), stagger_s=0.05)
    assert got == [[0, 1, 2]] * 3


def test_a_survivor_waiting_for_the_decision_costs_the_store_one_wait_not_a_poll_every_few_ms():
    counts = {"proposer": [0], "waiter": [0]}
    proposer_store, server = _tcp_store(counts["proposer"])
    waiter_store, _ = _tcp_store(counts["waiter"])  # its own server, unused: the counts stay apart
    waiter_store = bounded(CountingStore(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                       timeout=timedelta(seconds=10)), counts["waiter"]))
    proposer, waiter = Membership(proposer_store, "proto"), _ready(Membership(waiter_store, "proto"))
    # Member 2 never joins: the proposer (0) waits out its 0.4 s join window, member 1 waits for it.
    got = on_threads(lambda: proposer.agree_after_loss(1, [0, 1, 2], 0, set, join_window_s=0.4, timeout_s=5.0),
                     lambda: waiter.agree_after_loss(1, [0, 1, 2], 1, set, join_window_s=0.4, timeout_s=5.0))
    assert got == [[0, 1]] * 2
    # join (with what it suspects), one wait, one read of the decision; polling would have cost about 28
    assert counts["waiter"][0] == 3, counts


def test_survivors_waiting_on_a_proposer_that_is_lost_take_over_at_once(m):
    lost_at = time.monotonic() + 0.2  # the proposer (0) never joins; the monitors name it 0.2 s in

    def suspects():
        return {0} if time.monotonic() >= lost_at else set()

    shrink = [lambda me=me: m.agree_after_loss(1, [0, 1, 2], me, suspects, join_window_s=2.0, timeout_s=5.0)
              for me in (1, 2)]
    assert on_threads(*shrink) == [[1, 2]] * 2
    assert time.monotonic() - lost_at < 1.0  # not after twice the join window (4 s)


def test_a_member_that_never_joins_is_left_out_after_the_join_window(m):
    start = time.monotonic()
    got = on_threads(_shrink(m, 0, window_s=0.1), _shrink(m, 1, window_s=0.1))
    assert got == [[0, 1]] * 2 and time.monotonic() - start >= 0.1


def test_a_member_the_others_suspected_is_fenced_out_when_it_arrives(m):
    assert on_threads(_shrink(m, 0, suspects={2}, members=(0, 1, 2)),
                    _shrink(m, 1, suspects={2}, members=(0, 1, 2))) == [[0, 1]] * 2
    late = on_threads(_shrink(m, 2, members=(0, 1, 2)))[0]
    assert isinstance(late, CommAborted) and "fenced out of generation 1" in str(late), late
    assert m.decided(1) == [0, 1]  # the late member's join did not change the decision


def test_too_few_survivors_for_min_size_decide_nothing(m):
    got = on_threads(_shrink(m, 0, suspects={1, 2, 3}, min_size=2))[0]
    assert isinstance(got, CommError) and "only 1 member(s) [0] survived; min_size is 2" in str(got), got
    assert m.decided(1) is None


# ------------------------------------------------------------------ reconfigure and admission
def test_concurrent_reconfigures_adopt_the_first_list(m):
    got = on_threads(lambda: m.agree_on(1, [0, 1], 0, [0, 1]), lambda: m.agree_on(1, [1, 0], 1, [0, 1]))
    assert got[0] == got[1] and got[0] in ([0, 1], [1, 0])


def test_a_joiner_is_pending_until_admitted_and_then_not_again(m):
    joined = {}
    before = m.announce(2)
    joiner = threading.Thread(target=lambda: joined.update(got=m.wait_for_admission(2, before, 5.0)))
    joiner.start()
    assert m.joiners([0, 1]) == [2]
    assert m.joiners([0, 1], fresh=False) == [2]  # the first call reads at once
    assert on_threads(lambda: m.agree_on(1, [0, 1, 2], 0, [0, 1]),
                      lambda: m.agree_on(1, [0, 1, 2], 1, [0, 1])) == [[0, 1, 2]] * 2
    joiner.join(5)
    assert joined["got"] == (1, [0, 1, 2])
    assert m.joiners([0, 1, 2]) == []
    m.announce(2)  # killed again after joining: it must announce again, and is pending again
    assert m.joiners([0, 1]) == [2]


def test_the_background_read_sees_an_announcement_within_a_few_periods(m):
    assert m.joiners([0, 1], fresh=False) == []  # starts the background read
    m.announce(3)
    start = time.monotonic()
    while m.joiners([0, 1], fresh=False) != [3]:
        assert time.monotonic() - start < 10 * JOINERS_POLL_S, "the background read did not see the joiner"
        time.sleep(0.01)


def test_a_joiner_skips_decisions_that_do_not_name_it(m):
    before = m.announce(5)
    m.agree_on(1, [0, 1], 0, [0, 1, 2])
    m.agree_on(2, [0, 1, 5], 0, [0, 1])
    assert m.wait_for_admission(5, before, 1.0) == (2, [0, 1, 5])


# ------------------------------------------------------------------ rounds whose tally failed
def _unsure(m, call, me, members=(0, 1, 2), gone=(), timeout_s=5.0):
    return lambda: m.unsure(0, call, me, list(members), lambda: set(gone), lambda: None, timeout_s)


def test_members_unsure_of_a_round_commit_once_a_member_that_committed_confirms_it(m):
    def confirm_later():  # member 2's tally ended (every member voted yes); it confirms once it sees the loss
        time.sleep(0.2)
        return m.settle(0, 1, "commit")

    assert on_threads(_unsure(m, 1, 0), _unsure(m, 1, 1), confirm_later) == [True] * 3


def test_when_every_member_is_unsure_or_gone_nobody_committed_and_the_round_aborts(m):
    assert on_threads(_unsure(m, 1, 0, gone={2}), _unsure(m, 1, 1, gone={2})) == [False, False]
    assert m.settle(0, 1, "commit") is False  # a member that committed and was counted gone is fenced


def test_an_unsure_member_times_out_when_another_neither_settles_nor_is_lost(m):
    got = on_threads(_unsure(m, 1, 0, members=(0, 1), timeout_s=0.1))[0]
    assert isinstance(got, CollectiveTimeout) and "should_commit" in str(got) and "members [1]" in str(got), got


# ------------------------------------------------------------------ votes counted in the store
def _vote(m, call, ok, interrupted=lambda: None, size=3, timeout_s=5.0):
    return lambda: m.vote(0, call, size, ok, interrupted, timeout_s)


def test_every_yes_commits_everywhere_and_one_no_aborts_everywhere(m):
    assert on_threads(*(_vote(m, 1, True) for _ in range(3))) == [True] * 3
    assert on_threads(_vote(m, 2, True), _vote(m, 2, False), _vote(m, 2, True)) == [False] * 3


def test_a_member_lost_before_voting_aborts_the_step_for_those_waiting(m):
    lost = PeerLost("peer lost", comm="proto", ranks=[2])
    assert on_threads(_vote(m, 1, True, lambda: lost), _vote(m, 1, True, lambda: lost)) == [False] * 2


def test_a_yes_that_arrives_after_the_commit_cannot_turn_it(m):
    assert on_threads(*(_vote(m, 1, True, size=2) for _ in range(2))) == [True] * 2
    assert _vote(m, 1, False, size=2)() is True  # a late "no" (say, a member fenced later) reads the outcome


def test_a_vote_nobody_completes_times_out(m):
    got = on_threads(_vote(m, 1, True, timeout_s=0.05))[0]
    assert isinstance(got, CollectiveTimeout) and "should_commit" in str(got), got
