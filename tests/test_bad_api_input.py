"""Hostile inputs to the API and the configuration (issue 16, items 2 and 9-12):
backend hints, closed or replaced communicators, long names, every
``COMMSLAYER_*`` variable, timeouts given as numbers and reduce ops that are
not ``ReduceOp``s.  Each gets a named ``CommError`` at once: never a hang, a
raw exception from C++ or the socket layer, or a silent wrong answer.

One rank wherever one rank shows it; two for what involves several members
(a stale ``shrink`` next to a live generation).  Checks that build nothing
run in the pytest process; a test that builds a communicator runs its rank
in a forked process (``_alone``), as every other test file does: Gloo's
threads and the watchdog must not be alive in the pytest process when a
later test forks its ranks (a forked child then crashed collecting the
inherited Gloo groups, measured).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import commslayer
from commslayer import CommAborted, ConfigError, InvalidArgument, ReduceOp, config
from commslayer.comm import backends
from commslayer.comm.validation import MAX_NAME_CHARS
from tests.harness import run_ranks

ROOT = Path(__file__).resolve().parent.parent
AT_ONCE_S = 1.0  # generous: each of these is refused before anything is sent or built


def _comm(name: str, store=None, **kwargs) -> commslayer.Communicator:
    return commslayer.new_comm("gloo", name=name, store=store if store is not None else dist.HashStore(),
                               rank=0, size=1, **{"timeout": 10, **kwargs})


def _alone(body) -> None:
    """Run ``body(store)`` as the only rank of a forked process, over the harness's TCPStore."""
    run_ranks(lambda rank, size, store: body(store), 1, timeout=60)


def _refused(call, cls=InvalidArgument) -> str:
    """The message of the ``cls`` that ``call()`` raises, after checking it raised at once.
    (No ``pytest.raises``: its failure cannot be pickled back from a forked rank.)"""
    start = time.monotonic()
    try:
        call()
    except cls as err:
        took = time.monotonic() - start
        assert took < AT_ONCE_S, f"{type(err).__name__} took {took:.2f}s: {err}"
        return str(err)
    raise AssertionError(f"no {cls.__name__} raised")


# ------------------------------------------------------------- 2. backend hints
@pytest.mark.parametrize("hint,value,allowed", [
    ("threads", "0", "an integer from 1 to 256"),  # hung every op until its deadline
    ("threads", "abc", "an integer from 1 to 256"),  # raw ValueError from int()
    ("threads", "-3", "an integer from 1 to 256"),  # raw ValueError from C++ (vector::_M_default_append)
    ("threads", 0, "an integer from 1 to 256"),
    ("threads", 100000, "an integer from 1 to 256"),
    ("threads", 2.5, "an integer from 1 to 256"),
    ("threads", True, "an integer from 1 to 256"),
    ("interface", "no-such-if0", "network interface of this host"),
    ("interface", "", "network interface of this host"),
    ("interface", "lo,", "network interface of this host"),
    ("reduce_scatter", "halving", "'auto', 'ring' or 'native'"),
    ("reduce_scatter", 1, "'auto', 'ring' or 'native'"),
    ("thread", "2", "it takes: interface, reduce_scatter, threads"),  # a typo is not dropped silently
    ("high_priority_stream", "1", "it takes: interface, reduce_scatter, threads"),  # NCCL's, not Gloo's
])
def test_a_bad_backend_hint_is_refused_before_the_group_is_built(hint, value, allowed):
    store = dist.HashStore()
    msg = _refused(lambda: _comm("hinted", store, timeout=3, **{hint: value}))
    assert f"{hint}={value!r}" in msg and allowed in msg and "op new_comm" in msg, msg
    assert store.num_keys() == 0, "nothing is built for a refused call"


def _good_hints(store):
    comm = _comm("hints", store, threads="1", interface="lo")
    t = torch.ones(3)
    comm.all_reduce(t)
    assert comm._hints == {"threads": "1", "interface": "lo"}
    assert torch.equal(t, torch.ones(3))
    msg = _refused(lambda: comm.split([0], "sub", threads="0"))
    assert "threads='0'" in msg and "op split" in msg, msg
    sub = comm.split([0], "sub2", threads=2)  # an int is taken as its string
    sub.all_reduce(t)
    assert sub._hints == {"threads": "2", "interface": "lo"}


@pytest.mark.timeout(90)
def test_good_hints_work_and_split_checks_its_own():
    _alone(_good_hints)


def test_nccl_hints_are_checked_too():
    nccl = backends.SPECS["nccl"]
    assert nccl.check_hints({"high_priority_stream": True}) == {"high_priority_stream": "1"}
    with pytest.raises(ValueError, match=r"high_priority_stream='yes' is not allowed: '1' or '0'"):
        nccl.check_hints({"high_priority_stream": "yes"})
    with pytest.raises(ValueError, match="unknown hint threads='2' for the nccl backend; it takes: "
                                         "high_priority_stream"):
        nccl.check_hints({"threads": "2"})


# --------------------------------------------- 9. closed or replaced communicators
def _membership_calls(comm):
    return {"shrink": comm.shrink, "reconfigure": lambda: comm.reconfigure(list(comm.members)),
            "split": lambda: comm.split([0], "late")}


def _closed(store):
    for close, state in (("finalize", "finalized"), ("abort", "aborted")):
        comm = _comm(f"closed-{close}", store)
        getattr(comm, close)()
        keys = store.num_keys()
        for op, call in _membership_calls(comm).items():
            msg = _refused(call, CommAborted)
            assert f"communicator was {state}" in msg and f"op {op}" in msg, msg
        assert store.num_keys() == keys, "a refused call must not touch the store"


@pytest.mark.timeout(90)
def test_a_closed_communicator_cannot_change_membership():
    _alone(_closed)


def _replaced(store):
    old = _comm("replaced", store)
    new = old.shrink()
    keys = store.num_keys()
    for op, call in _membership_calls(old).items():
        msg = _refused(call, CommAborted)
        assert "communicator was replaced by generation 1 (members [0])" in msg and f"op {op}" in msg, msg
    assert store.num_keys() == keys
    t = torch.ones(2)
    new.all_reduce(t)
    assert new.state == "ok" and new.generation == 1


@pytest.mark.timeout(90)
def test_a_replaced_communicator_cannot_change_membership():
    _alone(_replaced)


def _stale_shrink(rank, size, store):
    """Both members shrink without a loss (generation 1), then call shrink, reconfigure and
    split on generation 0; then finalize generation 1 and do it again."""
    comm = commslayer.new_comm("gloo", name="stale", store=store, rank=rank, size=size, timeout=30)
    comm.all_reduce(torch.ones(4))
    new = comm.shrink()
    report = {"generation": new.generation, "members": new.members}

    def refusals(target, tag):
        keys = store.num_keys()
        for op, call in _membership_calls(target).items():
            start = time.monotonic()
            try:
                call()
                outcome = "no error"
            except CommAborted as err:
                outcome = f"CommAborted: {err}"
            except Exception as err:  # what it raised before: ConnectionRefusedError, TimeoutError
                outcome = f"{type(err).__name__}: {err}"
            report[f"{tag} {op}"] = (outcome, time.monotonic() - start)
        report[f"{tag} store keys added"] = store.num_keys() - keys

    new.barrier()  # both ranks are past the shrink
    refusals(comm, "replaced")
    t = torch.ones(4)
    start = time.monotonic()
    new.all_reduce(t)  # the live generation is not delayed by the stale calls
    report["live all_reduce s"] = time.monotonic() - start
    report["live result"] = t.tolist()
    new.barrier()
    new.finalize()
    refusals(new, "finalized")
    return report


@pytest.mark.timeout(120)
def test_stale_shrink_is_refused_at_once_on_every_rank_and_the_live_generation_goes_on():
    for rank, r in enumerate(run_ranks(_stale_shrink, 2, timeout=60)):
        assert r["generation"] == 1 and r["members"] == [0, 1], r
        for tag, state in (("replaced", "replaced by generation 1 (members [0, 1])"), ("finalized", "finalized")):
            for op in ("shrink", "reconfigure", "split"):
                outcome, took = r[f"{tag} {op}"]
                assert outcome.startswith(f"CommAborted: communicator was {state}"), (rank, tag, op, outcome)
                assert took < AT_ONCE_S, (rank, tag, op, took)
            assert r[f"{tag} store keys added"] == 0, (rank, tag)
        assert r["live result"] == [2.0] * 4
        assert r["live all_reduce s"] < AT_ONCE_S, r["live all_reduce s"]


# ----------------------------------------------------------------- 10. name cap
def _long_names(store):
    msg = _refused(lambda: _comm("n" * 20000, store))
    assert f"at most {MAX_NAME_CHARS} characters" in msg and "20000 characters" in msg, msg
    assert len(msg) < 1000, "the error does not repeat the whole name"
    _refused(lambda: commslayer.join("gloo", name="j" * (MAX_NAME_CHARS + 1), member=0, store=store))
    comm = _comm("x" * MAX_NAME_CHARS, store)  # at the cap: fine
    msg = _refused(lambda: comm.split([0], "s" * (MAX_NAME_CHARS + 1)))
    assert f"at most {MAX_NAME_CHARS} characters" in msg and "op split" in msg, msg
    t = torch.ones(2)
    _comm("after", store).all_reduce(t)  # the process's store connection still works
    assert t.tolist() == [1.0, 1.0]


@pytest.mark.timeout(90)
def test_a_name_longer_than_the_cap_is_refused_and_the_shared_store_survives():
    _alone(_long_names)  # over a TCPStore: the connection that a long key used to kill


# ------------------------------------------------------------ 11. configuration
@pytest.mark.parametrize("env,fragments", [
    ({"COMMSLAYER_PEER_TIMEOUT_S": "0.1"},
     ["COMMSLAYER_PEER_TIMEOUT_S='0.1'", "COMMSLAYER_HEARTBEAT_S (unset, default 0.25)", "more than 2 x"]),
    ({"COMMSLAYER_HEARTBEAT_S": "10"},
     ["COMMSLAYER_PEER_TIMEOUT_S (unset, default 3)", "COMMSLAYER_HEARTBEAT_S='10'", "(> 20 s)"]),
    ({"COMMSLAYER_HEARTBEAT_S": "0.5", "COMMSLAYER_PEER_TIMEOUT_S": "1"}, ["more than 2 x"]),
    ({"COMMSLAYER_HEARTBEAT_S": "-1"}, ["COMMSLAYER_HEARTBEAT_S='-1'", "from 0.01 s up to 10 years", "or 0 (off)"]),
    ({"COMMSLAYER_HEARTBEAT_S": "1e-9"}, ["COMMSLAYER_HEARTBEAT_S='1e-9'", "from 0.01 s up to 10 years, or 0 (off)"]),
    ({"COMMSLAYER_HEARTBEAT_S": "0.009"}, ["COMMSLAYER_HEARTBEAT_S='0.009'", "from 0.01 s up to 10 years"]),
    ({"COMMSLAYER_HEARTBEAT_S": "nan"}, ["COMMSLAYER_HEARTBEAT_S='nan'"]),
    ({"COMMSLAYER_PEER_TIMEOUT_S": "0"}, ["COMMSLAYER_PEER_TIMEOUT_S='0'", "positive number of seconds"]),
    ({"COMMSLAYER_TIMEOUT_S": "abc"}, ["COMMSLAYER_TIMEOUT_S='abc'", "positive number of seconds"]),
    ({"COMMSLAYER_TIMEOUT_S": "1e300"}, ["COMMSLAYER_TIMEOUT_S='1e300'", "below 10 years"]),
    ({"COMMSLAYER_TIMEOUT_S": "inf"}, ["COMMSLAYER_TIMEOUT_S='inf'"]),
    ({"COMMSLAYER_JOB_RANK": "abc"}, ["COMMSLAYER_JOB_RANK='abc'", "an integer >= 0"]),
    ({"COMMSLAYER_JOB_RANK": "-7"}, ["COMMSLAYER_JOB_RANK='-7'", "an integer >= 0"]),
    ({"COMMSLAYER_TRACE_BUFFER": "abc"}, ["COMMSLAYER_TRACE_BUFFER='abc'", "an integer from 1 to 10000000"]),
    ({"COMMSLAYER_TRACE_BUFFER": "0"}, ["COMMSLAYER_TRACE_BUFFER='0'"]),
    ({"COMMSLAYER_TRACE_BUFFER": "10000000000"}, ["COMMSLAYER_TRACE_BUFFER='10000000000'"]),
    ({"COMMSLAYER_TRACE_SINK_QUEUE": "-5"}, ["COMMSLAYER_TRACE_SINK_QUEUE='-5'", "an integer >= 1"]),
    ({"COMMSLAYER_CHECK": "ture"}, ["COMMSLAYER_CHECK='ture'", "1, true, yes or on"]),
    ({"COMMSLAYER_ROUTE_C10D": "2"}, ["COMMSLAYER_ROUTE_C10D='2'"]),
    ({"COMMSLAYER_TRACE_JSONL": "y"}, ["COMMSLAYER_TRACE_JSONL='y'"]),
    ({"COMMSLAYER_TRACE_OTEL": "enable"}, ["COMMSLAYER_TRACE_OTEL='enable'"]),
    ({"COMMSLAYER_TRACE_STACK": "11"}, ["COMMSLAYER_TRACE_STACK='11'"]),
    ({"COMMSLAYER_ISOLATE_WRITES": "maybe"}, ["COMMSLAYER_ISOLATE_WRITES='maybe'"]),
    ({"COMMSLAYER_REDUCE_SCATTER": "halving"}, ["COMMSLAYER_REDUCE_SCATTER='halving'", "auto, ring or native"]),
    ({"COMMSLAYER_RING_MIN_BYTES": "-1"}, ["COMMSLAYER_RING_MIN_BYTES='-1'", "an integer >= 0"]),
    ({"COMMSLAYER_LIVENESS_HOST": "no-such-host.invalid"},
     ["COMMSLAYER_LIVENESS_HOST='no-such-host.invalid'", "resolves"]),
    ({"COMMSLAYER_TRACE_DIR": __file__}, ["COMMSLAYER_TRACE_DIR=", "a directory"]),
    ({"COMMSLAYER_FAULTS_LOG": str(ROOT)}, ["COMMSLAYER_FAULTS_LOG=", "not a directory"]),
    ({"COMMSLAYER_TRACE_MODE": "0777"}, ["COMMSLAYER_TRACE_MODE='0777'", "owner read and write", "0600, 0640"]),
    # a spare's id left in an environment outside commslayer-run would hold back tracing and faults
    ({"COMMSLAYER_SPARE": "0"}, ["COMMSLAYER_SPARE='0'", "only by commslayer-run --spares, for a process of its "
                                 "job"]),
    ({"COMMSLAYER_SPARE": "x", "COMMSLAYER_RESTART_UNIT": "rank"}, ["COMMSLAYER_SPARE='x'"]),
])
def test_every_bad_variable_is_named_with_its_value_and_what_is_allowed(monkeypatch, env, fragments):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as info:
        config.validate()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert isinstance(info.value, ValueError) and isinstance(info.value, commslayer.CommError)


def test_validate_reports_every_bad_variable_in_one_message(monkeypatch):
    monkeypatch.setenv("COMMSLAYER_JOB_RANK", "-7")
    monkeypatch.setenv("COMMSLAYER_TRACE_BUFFER", "abc")
    monkeypatch.setenv("COMMSLAYER_HEARTBEAT_S", "x")
    with pytest.raises(ConfigError, match=r"^3 bad COMMSLAYER_\* variables: ") as info:
        config.validate()
    for name in ("COMMSLAYER_JOB_RANK='-7'", "COMMSLAYER_TRACE_BUFFER='abc'", "COMMSLAYER_HEARTBEAT_S='x'"):
        assert name in str(info.value)


@pytest.mark.parametrize("sink", ["COMMSLAYER_TRACE_JSONL", "COMMSLAYER_TRACE_OTEL"])
def test_a_sink_without_a_trace_directory_is_warned_of(monkeypatch, sink):
    monkeypatch.delenv("COMMSLAYER_TRACE_DIR", raising=False)
    monkeypatch.setenv(sink, "1")
    with pytest.warns(UserWarning, match=f"{sink} is on, but COMMSLAYER_TRACE_DIR is not set"):
        config.validate()
    monkeypatch.setenv("COMMSLAYER_TRACE_DIR", str(ROOT))  # a directory: nothing to warn of
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.validate()


@pytest.mark.parametrize("zero", ["0", "0.0", "0.00", "0e0", " 0 "])
def test_every_spelling_of_zero_turns_the_heartbeat_off(monkeypatch, zero):
    monkeypatch.setenv("COMMSLAYER_HEARTBEAT_S", zero)
    monkeypatch.setenv("COMMSLAYER_PEER_TIMEOUT_S", "0.1")  # no heartbeat: no constraint on it
    config.validate()
    assert config.liveness_timing() == (0.0, 0.1)


def test_good_values_pass(monkeypatch):
    for k, v in {"COMMSLAYER_HEARTBEAT_S": "0.01", "COMMSLAYER_PEER_TIMEOUT_S": "1.5", "COMMSLAYER_JOB_RANK": "0",
                 "COMMSLAYER_CHECK": "Yes", "COMMSLAYER_TRACE_JSONL": "off", "COMMSLAYER_TRACE_BUFFER": "100000",
                 "COMMSLAYER_LIVENESS_HOST": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    config.validate()
    assert config.check_mode() and not config.trace_jsonl() and config.job_rank() == 0


def test_liveness_host_accessor(monkeypatch):
    monkeypatch.delenv("COMMSLAYER_LIVENESS_HOST", raising=False)
    assert config.liveness_host() is None
    monkeypatch.setenv("COMMSLAYER_LIVENESS_HOST", "localhost")
    assert config.liveness_host() == "localhost"
    monkeypatch.setenv("COMMSLAYER_LIVENESS_HOST", "x" * 300)  # not even a valid DNS name
    with pytest.raises(ConfigError, match="COMMSLAYER_LIVENESS_HOST='xxx"):
        config.liveness_host()


def test_new_comm_and_init_process_group_fail_at_start_up(monkeypatch):
    monkeypatch.setenv("COMMSLAYER_PEER_TIMEOUT_S", "0.1")
    store = dist.HashStore()
    with pytest.raises(ConfigError, match="COMMSLAYER_PEER_TIMEOUT_S='0.1'"):
        _comm("configured", store)
    assert store.num_keys() == 0
    with pytest.raises(ConfigError, match="COMMSLAYER_PEER_TIMEOUT_S='0.1'"):
        dist.init_process_group("commslayer", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_tracing_autoload_fails_import_torch_with_the_variable_named(tmp_path):
    env = {**os.environ, "COMMSLAYER_TRACE_DIR": str(tmp_path), "COMMSLAYER_TRACE_BUFFER": "abc"}
    proc = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "ConfigError: COMMSLAYER_TRACE_BUFFER='abc' is not allowed" in proc.stderr, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == [], "nothing was traced"


def test_the_configuration_page_documents_every_variable_config_reads():
    read = set(re.findall(r"COMMSLAYER_[A-Z0-9_]+", (ROOT / "commslayer" / "config.py").read_text()))
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = page.split("## `COMMSLAYER_*` variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(COMMSLAYER_[A-Z0-9_]+)`", table, re.M))
    assert read == documented, (read - documented, documented - read)


# ------------------------------------------------------ 12. timeouts and reduce ops
def _waits(store):
    comm = _comm("waits", store)
    for timeout in (5, 2.5, timedelta(seconds=5)):
        assert comm.all_reduce(torch.ones(2), async_op=True).wait(timeout) is True
    for bad in (-1, 0, math.nan, math.inf, True, "5", timedelta(seconds=-1)):
        work = comm.all_reduce(torch.ones(2), async_op=True)
        msg = _refused(lambda: work.wait(bad))
        assert "timeout must be" in msg and "op all_reduce" in msg, msg
        assert work.wait() is True  # the refused wait did not time the op out
    assert comm.state == "ok"


@pytest.mark.timeout(90)
def test_work_wait_takes_seconds_as_a_number():
    _alone(_waits)


def _timeouts(store):
    comm = _comm("timeouts", store, timeout=7)
    assert comm.get_timeout() == timedelta(seconds=7)
    t = torch.ones(2)
    comm.all_reduce(t, timeout=3)
    comm.barrier(timeout=0.5)
    for bad in (-1, math.nan, True, "3"):
        _refused(lambda: comm.all_reduce(t, timeout=bad))
        _refused(lambda: comm.broadcast(t, 0, timeout=bad))
        _refused(lambda: _comm("bad-timeout", store, timeout=bad))
    assert comm.state == "ok"


@pytest.mark.timeout(90)
def test_every_timeout_argument_takes_seconds_and_refuses_the_rest():
    _alone(_timeouts)


def _reduce_ops(store):
    comm = _comm("ops", store)
    t = torch.tensor([6, 3])
    for op in (5, 0, True, "SUM", None, 1.0):
        msg = _refused(lambda: comm.all_reduce(t, op))
        assert "op must be a commslayer.ReduceOp" in msg and f"got {op!r}" in msg, msg
        _refused(lambda: comm.reduce_scatter_single(torch.empty(2, dtype=torch.int64), t, op))
        assert t.tolist() == [6, 3]
    # what the API documents, and what the c10d adapter passes (its option structs' reduceOp)
    for op in (ReduceOp.MAX, dist.ReduceOp.MAX, dist.ReduceOp.RedOpType.MAX, dist.ReduceOp(dist.ReduceOp.MAX)):
        comm.all_reduce(t, op)
        assert t.tolist() == [6, 3]
    assert comm.state == "ok"


@pytest.mark.timeout(90)
def test_a_reduce_op_that_is_not_a_reduce_op_is_refused_and_reduce_ops_are_accepted():
    _alone(_reduce_ops)
