"""The store on etcd (``commslayer.etcdstore``) against a real etcd server, started here on
loopback ports: c10d's answers for every call, compared with a ``HashStore`` fed the same
calls; waits that end when another client writes; the membership protocol and a real
communicator on it; and a server that is gone is ``StoreUnreachable``, not a hang.
tests/run.sh installs etcd (Debian's etcd-server) where it may; without it these skip."""

import shutil
import signal
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from commslayer.errors import StoreUnreachable
from commslayer.etcdstore import EtcdStore, endpoints_from_url
from commslayer.membership import Membership
from commslayer.processes import free_port
from commslayer.store import bounded

from harness import on_threads

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian's etcd-server)")


@pytest.fixture
def etcd(tmp_path):
    """A one-member etcd cluster on loopback: its client (host, port)."""
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        ["etcd", "--name", "t", "--data-dir", str(tmp_path / "data"),
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = EtcdStore([("127.0.0.1", client)], request_timeout_s=2.0)
    deadline = time.monotonic() + 20
    while True:
        try:
            store.set("up", "1")
            break
        except dist.DistNetworkError:
            assert time.monotonic() < deadline and proc.poll() is None, "etcd did not start"
            time.sleep(0.05)
    yield proc, ("127.0.0.1", client)
    proc.kill()
    proc.wait()


def _calls(store):
    """Every call commslayer makes, in an order that exercises c10d's corner cases."""
    out = []
    store.set("a", "1")
    out.append(store.get("a"))
    out.append(store.check(["a"]))
    out.append(store.check(["a", "nope"]))
    out.append(store.compare_set("c", "x", "y"))  # missing, expected given: left alone, expected answered
    out.append(store.check(["c"]))
    out.append(store.compare_set("c", "", "y"))  # missing, expected empty: written
    out.append(store.compare_set("c", "z", "w"))  # present, mismatch: the value
    out.append(store.compare_set("c", "y", "w"))  # present, match: written
    out.append(store.add("n", 3))
    out.append(store.add("n", -1))
    out.append(store.get("n"))
    store.append("l", "1,")
    store.append("l", "2,")
    out.append(store.get("l"))
    store.multi_set(["p", "q"], ["1", "2"])
    out.append(store.multi_get(["p", "q"]))
    out.append(store.delete_key("n"))
    out.append(store.delete_key("n"))
    out.append(store.check(["n"]))
    return out


def test_every_call_answers_as_a_c10d_store_does(etcd):
    _, endpoint = etcd
    assert _calls(EtcdStore([endpoint], prefix="calls/")) == _calls(dist.HashStore())


def test_a_wait_ends_when_another_client_writes_and_times_out_naming_the_keys(etcd):
    _, endpoint = etcd
    waiter, writer = EtcdStore([endpoint], prefix="w/"), EtcdStore([endpoint], prefix="w/")
    threading.Timer(0.3, lambda: writer.set("k", "v")).start()
    start = time.monotonic()
    assert waiter.get("k") == b"v"  # a get of a key not written yet waits for it
    assert 0.25 < time.monotonic() - start < 2.0
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"wait timeout after 300ms, keys: w/k, w/never"):
        waiter.wait(["k", "never"], timedelta(seconds=0.3))
    assert time.monotonic() - start < 2.0


def test_the_membership_protocol_runs_on_etcd(etcd):
    _, endpoint = etcd
    stores = [bounded(EtcdStore([endpoint], prefix="m/")) for _ in range(3)]
    memberships = [Membership(s, "on-etcd") for s in stores]
    for m in memberships:  # their waits block on etcd (a watch), on a clone of the store
        assert m.waits is not None and m.waits.opened(5.0)
    got = on_threads(*(lambda m=m, me=me: m.agree_after_loss(1, [0, 1, 2, 3], me, lambda: {3}, join_window_s=2.0,
                                                               timeout_s=10.0)
                       for me, m in enumerate(memberships)))
    assert got == [[0, 1, 2]] * 3
    assert on_threads(*(lambda m=m: m.vote(1, 1, 3, True, lambda: None, 10.0) for m in memberships)) == [True] * 3


def _all_reduce_on_etcd(rank, size, _tcp, endpoint):
    import commslayer

    comm = commslayer.new_comm("gloo", name="etcd", store=EtcdStore([tuple(endpoint)], prefix="job/"), rank=rank,
                               size=size, timeout=60)
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t)
    comm.finalize()
    return t.tolist()


@pytest.mark.timeout(120)
def test_a_communicator_runs_on_etcd_and_matches_plain_results(etcd):
    from harness import run_ranks

    _, endpoint = etcd
    assert run_ranks(_all_reduce_on_etcd, 2, list(endpoint), timeout=90) == [[3.0] * 4] * 2


def test_an_etcd_that_is_gone_is_store_unreachable_within_the_deadline(etcd):
    proc, endpoint = etcd
    store = bounded(EtcdStore([endpoint], prefix="gone/", request_timeout_s=1.0), deadline_s=3.0)
    store.set("k", "v")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match=r"etcd://127\.0\.0\.1:\d+"):
        store.set("k", "w")
    assert time.monotonic() - start < 3.5


def test_etcd_addresses_parse_or_say_why_not():
    assert endpoints_from_url("etcd://h1:2379,10.0.0.2:2380") == [("h1", 2379), ("10.0.0.2", 2380)]
    for bad in ("http://h:1", "etcd://h1", "etcd://:2379"):
        with pytest.raises(ValueError):
            endpoints_from_url(bad)
