"""The store on etcd (``commslayer.agree.etcdstore``) against a real etcd server, started here on
loopback ports: c10d's answers for every call, compared with a ``HashStore`` fed the same
calls; waits that end when another client writes; the membership protocol and a real
communicator on it; and a server that is gone is ``StoreUnreachable``, not a hang.
tests/run.sh installs etcd (Debian's etcd-server) where it may; without it these skip."""

import http.server
import shutil
import json
import threading
import time
import tracemalloc
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from commslayer.errors import StoreUnreachable
from commslayer.endpoints import parse_url
from commslayer.agree.etcdstore import RECEIPTS, EtcdStore
from commslayer.agree.membership import Membership
from commslayer.agree.store import bounded
from faults.etcd import EtcdCluster, available

from harness import on_threads

pytestmark = pytest.mark.skipif(not available(), reason="etcd is not installed (Debian's etcd-server)")


@pytest.fixture
def etcd(tmp_path):
    """A one-member etcd cluster on loopback: (the cluster, its client (host, port))."""
    cluster = EtcdCluster(tmp_path, size=1)
    yield cluster, cluster.endpoints[0]
    cluster.close()


@pytest.fixture
def cluster(tmp_path):
    """A three-member etcd cluster on loopback."""
    cluster = EtcdCluster(tmp_path, size=3)
    yield cluster
    cluster.close()


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
    assert _calls(EtcdStore([endpoint], job="calls")) == _calls(dist.HashStore())


def test_a_wait_ends_when_another_client_writes_and_times_out_naming_the_keys(etcd):
    _, endpoint = etcd
    waiter, writer = EtcdStore([endpoint], job="w"), EtcdStore([endpoint], job="w")
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
    stores = [bounded(EtcdStore([endpoint], job="m")) for _ in range(3)]
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

    comm = commslayer.new_comm("gloo", name="etcd", store=EtcdStore([tuple(endpoint)], job="job"), rank=rank,
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
    cluster, endpoint = etcd
    store = bounded(EtcdStore([endpoint], job="gone", request_timeout_s=1.0), deadline_s=3.0)
    store.set("k", "v")
    cluster.kill(0)
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match=r"etcd://127\.0\.0\.1:\d+/gone"):
        store.set("k", "w")
    assert time.monotonic() - start < 3.5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_adds_and_appends_are_exactly_once_while_the_leader_is_lost(cluster, fault):
    """Four clients add and append while the leader is SIGKILLed (or SIGSTOPped, when the
    requests in flight to it get no answer at all): every one of them counted once."""
    stores = [EtcdStore(cluster.endpoints, job="once") for _ in range(4)]
    leader = cluster.leader()
    for s in stores:
        s._good = leader  # every client starts on the leader: the loss hits requests in flight
    rounds, slowest = 60, []

    def client(i, s):
        for n in range(rounds):
            start = time.monotonic()
            s.add("count", 1)
            s.append("log", f"{i}.{n},")
            slowest.append(time.monotonic() - start)
    threading.Timer(0.3, lambda: getattr(cluster, fault)(leader)).start()
    results = on_threads(*(lambda i=i, s=s: client(i, s) for i, s in enumerate(stores)), timeout_s=60)
    assert results == [None] * 4, results
    assert int(stores[0].get("count")) == 4 * rounds
    log = stores[0].get("log").decode().split(",")[:-1]
    assert sorted(log) == sorted(f"{i}.{n}" for i in range(4) for n in range(rounds))
    assert cluster.leader() != leader and max(slowest) < 8.0, max(slowest)  # served again, by a new leader
    if fault == "stop":
        cluster.resume(leader)


@pytest.mark.timeout(120)
def test_a_lost_quorum_is_store_unreachable_within_the_deadline_and_a_restored_one_serves(cluster):
    store = bounded(EtcdStore(cluster.endpoints, job="q", request_timeout_s=4.0), deadline_s=6.0)
    store.set("k", "v")
    leader = cluster.leader()
    others = [i for i in range(3) if i != leader]
    cluster.kill(others[0])
    cluster.kill(leader)  # one member of three left: no quorum
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match=r"etcd://.*/q.*did not serve"):
        store.set("k", "w")
    assert 3.5 < time.monotonic() - start < 6.5
    restored = bounded(EtcdStore(cluster.endpoints, job="q", request_timeout_s=8.0), deadline_s=10.0)
    threading.Timer(1.0, lambda: cluster.start(leader)).start()  # back before the deadline
    start = time.monotonic()
    restored.set("k", "x")
    assert restored.get("k") == b"x" and time.monotonic() - start < 8.0


def test_etcd_addresses_parse_or_say_why_not():
    assert parse_url("etcd://h1:2379,10.0.0.2:2380") == ([("h1", 2379), ("10.0.0.2", 2380)], "")
    assert parse_url("etcd://h1:2379/run7/") == ([("h1", 2379)], "run7")
    for bad in ("http://h:1", "etcd://h1", "etcd://:2379", "etcd://h:99999/x", "etcd://h:1/a b"):
        with pytest.raises(ValueError):
            parse_url(bad)


def test_a_clone_made_through_a_prefix_store_keeps_working(etcd):
    """c10d's PrefixStore.clone clones the store under it from C++ (the waits' second
    connection does so): the clone must outlive the Python call that made it."""
    import gc

    _, endpoint = etcd
    store = EtcdStore([endpoint], job="c")  # kept, as every store that commslayer wraps is
    clone = dist.PrefixStore("p", store).clone()
    gc.collect()
    clone.set("k", "v")
    assert clone.get("k") == b"v" and clone.check(["k"])


def test_a_claim_is_exclusive_and_goes_with_its_holder(etcd):
    """The launcher that starts a job holds it this way: a second claim is refused while the
    holder lives, and the key goes within its time to live once the holder is SIGKILLed."""
    import subprocess
    import sys

    _, (host, port) = etcd
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom commslayer.agree.etcdstore import EtcdStore\n"
         f"claim = EtcdStore([({host!r}, {port})], 'cl').claim('job', 'first', 2.0)\n"
         "print('held' if claim else 'refused', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        store = EtcdStore([(host, port)], job="cl")
        time.sleep(3.0)  # longer than the time to live: the holder's renewals keep it
        assert store.claim("job", "second", 2.0) is None and store.get("job") == b"first"
    finally:
        holder.kill()
        holder.wait()
    start = time.monotonic()
    while (mine := store.claim("job", "second", 2.0)) is None:
        assert time.monotonic() - start < 5.0, "the dead holder's claim did not expire"
        time.sleep(0.1)
    assert store.get("job") == b"second"
    mine.release()
    assert not store.check(["job"])


def _count_under(endpoint, prefix: bytes) -> int:
    """How many keys of the cluster begin with ``prefix``, read raw (no job's view)."""
    import base64
    import http.client
    import json

    conn = http.client.HTTPConnection(*endpoint, timeout=5)
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    conn.request("POST", "/v3/kv/range", json.dumps({"key": base64.b64encode(prefix).decode(), "count_only": True,
                                                      "range_end": base64.b64encode(end).decode()}))
    return int(json.loads(conn.getresponse().read()).get("count", 0))


def test_jobs_whose_names_nest_or_mimic_internal_keys_stay_apart(etcd, monkeypatch):
    """Job ``team`` started on a cluster where job ``team/exp`` runs leaves its keys alone, and
    ``team/exp`` stays held by its launcher; a job named like the receipts' keys deletes none."""
    from commslayer.run import launch
    from commslayer.run.supervisor import Failed

    monkeypatch.setattr(launch, "CLAIM_TTL_S", 2.0)  # a refusal within 3 s
    _, endpoint = etcd
    exp = EtcdStore([endpoint], job="team/exp")
    held = launch._start_on_etcd(exp)
    exp.set("rank/0/lost/0", "x")
    exp.add("counter", 1)  # writes a receipt
    receipts = _count_under(endpoint, RECEIPTS)
    assert receipts >= 1
    claims = [launch._start_on_etcd(EtcdStore([endpoint], job=job))
              for job in ("team", "commslayer/receipts", "commslayer", "", "../receipts", "team%2Fexp")]
    assert exp.check(["rank/0/lost/0", "counter", launch.STARTED]) and exp.get("counter") == b"1"
    assert _count_under(endpoint, RECEIPTS) == receipts
    with pytest.raises(Failed, match=r"the job at etcd://127\.0\.0\.1:\d+/team/exp is running"):
        launch._start_on_etcd(EtcdStore([endpoint], job="team/exp"))
    for claim in (held, *claims):
        claim.release()


# ------------------------------------------------------------- hostile endpoints
HEADER = {"cluster_id": "1", "member_id": "2", "revision": "5", "raft_term": "1"}


class _Fake(http.server.BaseHTTPRequestHandler):
    """Answers every request with what its server's ``answer(request) -> (status, body)`` says;
    a body that is a callable writes the answer itself."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        status, body = self.server.answer(request)
        if callable(body):
            return body(self)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake():
    """A fake etcd endpoint served by a thread here: set ``fake.answer``; ``fake.endpoint``."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    server.daemon_threads = True
    server.handle_error = lambda request, address: None  # a client that left mid-answer: expected here
    server.endpoint = ("127.0.0.1", server.server_address[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _read_key(request):
    """The key the first read of a transaction (or a range) asks for."""
    return request["success"][0]["request_range"]["key"] if "success" in request else request.get("key")


def _answer(**fields):
    return lambda request: (200, json.dumps({"header": HEADER, **fields}).encode())


def _kv(**fields):
    """A transaction answer whose one read found the key asked for, with ``fields``."""
    return lambda request: (200, json.dumps({"header": HEADER, "succeeded": True, "responses": [
        {"response_range": {"kvs": [{"key": _read_key(request), **fields}]}}]}).encode())


HOSTILE = {
    "not JSON": lambda request: (200, b"<html>hello</html>"),
    "a list": lambda request: (200, b"[1]"),
    "nested 100000 deep": lambda request: (200, b"[" * 100000 + b"]" * 100000),
    "only a revision": lambda request: (200, b'{"header":{"revision":"1"}}'),
    "no header": lambda request: (200, b'{"succeeded":true,"responses":[]}'),
    "a revision that is no number": _answer(header={**HEADER, "revision": "abc"}),
    "no responses": _answer(succeeded=True),
    "succeeded a string": _answer(succeeded="yes", responses=[{"response_range": {}}]),
    "a put's response to a read": _answer(succeeded=True, responses=[{"response_put": {}}]),
    "kvs a string": _answer(succeeded=True, responses=[{"response_range": {"kvs": "x"}}]),
    "another key": _answer(succeeded=True, responses=[{"response_range": {"kvs": [
        {"key": "b3RoZXI=", "value": "", "mod_revision": "3"}]}}]),
    "bad base64": _kv(value="!!not base64", mod_revision="3"),
    "a value that is a number": _kv(value=7, mod_revision="3"),
    "no mod_revision": _kv(value="eA=="),
    "an error as a list": lambda request: (500, b"[1]"),
}


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_a_wrong_shaped_answer_is_the_endpoint_not_serving(fake, shape):
    """Every wrong shape: no KeyError, no AssertionError, no key found or waited for that was
    never written; after the deadline, DistNetworkError naming the endpoint and what was wrong."""
    fake.answer = HOSTILE[shape]
    store = EtcdStore([fake.endpoint], job="j", request_timeout_s=0.2)
    where = rf"127\.0\.0\.1:{fake.endpoint[1]}: (a wrong-shaped answer|an answer that is not JSON|HTTP 500)"
    for call in (lambda: store.check(["k"]), lambda: store.wait(["k"], timedelta(seconds=0.5)),
                 lambda: store.get("k"), lambda: store.multi_get(["k"]), lambda: store.add("n", 1)):
        with pytest.raises(dist.DistNetworkError, match=where):
            call()


def test_a_wrong_shaped_answer_sends_the_request_to_the_next_member(fake, etcd):
    """The issue's ``{"header":{"revision":"1"}}``, from the first of two endpoints: every
    call is served by the real member, with its true answers."""
    _, endpoint = etcd
    fake.answer = HOSTILE["only a revision"]
    store = EtcdStore([fake.endpoint, endpoint], job="next", request_timeout_s=3.0)
    assert not store.check(["missing"])
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.wait(["missing"], timedelta(seconds=0.3))
    store._good = 0  # back to the fake first
    store.set("k", "v")
    assert store.get("k") == b"v" and store.add("n", 2) == 2 and store.check(["k", "n"])


def _endless(handler):
    """An answer with no Content-Length that never ends (1 MiB at a time until the client goes)."""
    handler.send_response(200)
    handler.send_header("Connection", "close")
    handler.end_headers()
    chunk = b"x" * (1 << 20)
    try:
        for _ in range(400):
            handler.wfile.write(chunk)
    except OSError:
        pass


def _huge_length(handler):
    """An answer that says it holds 400 MB (and sends 1 MiB of it)."""
    handler.send_response(200)
    handler.send_header("Content-Length", str(400 << 20))
    handler.end_headers()
    try:
        handler.wfile.write(b"x" * (1 << 20))
    except OSError:
        pass


@pytest.mark.parametrize("body", [_endless, _huge_length], ids=["endless", "huge-content-length"])
def test_an_answer_over_the_cap_is_refused_having_read_at_most_the_cap(fake, monkeypatch, body):
    from commslayer.agree import etcdstore

    monkeypatch.setattr(etcdstore, "MAX_REPLY_BYTES", 4 << 20)  # the real cap is 64 MiB: the same code, smaller
    fake.answer = lambda request: (200, body)
    store = EtcdStore([fake.endpoint], job="big", request_timeout_s=1.0)
    tracemalloc.start()
    try:
        with pytest.raises(dist.DistNetworkError, match=r"an answer of (over )?\d+ bytes"):
            store.check(["k"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # the cap and one chunk, not 400 MB


# ------------------------------------------------------------- auth
def _gateway(endpoint, path, body, token=None):
    """One request to etcd's JSON gateway, as an operator's tool would make it: (status, answer)."""
    import http.client

    conn = http.client.HTTPConnection(*endpoint, timeout=5)
    conn.request("POST", path, json.dumps(body), {"Authorization": token} if token else {})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


@pytest.fixture
def secured(etcd):
    """The one-member cluster with etcd's auth enabled: user root, password ``s3cret-pw``."""
    _, endpoint = etcd
    for path, body in (("/v3/auth/user/add", {"name": "root", "password": "s3cret-pw"}),
                       ("/v3/auth/role/add", {"name": "root"}),
                       ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                       ("/v3/auth/enable", {})):
        status, answer = _gateway(endpoint, path, body)
        assert status == 200, (path, answer)
    return endpoint


def test_with_auth_enabled_only_the_jobs_own_store_writes_its_keys(secured, monkeypatch):
    """The issue's forgery (``job/failed``) from a client without the password is refused, and
    its message never shows the password; the job's store, given the user by environment,
    writes and reads, and authenticates again when etcd no longer takes its token."""
    endpoint = secured
    url = f"etcd://127.0.0.1:{endpoint[1]}/secure"
    monkeypatch.setenv("COMMSLAYER_ETCD_USER", "root")
    monkeypatch.setenv("COMMSLAYER_ETCD_PASSWORD", "s3cret-pw")
    job = EtcdStore.at(url, request_timeout_s=3.0)
    job.set("rank/0/ok", "1")
    for forger, why in ((EtcdStore([endpoint], job="secure", request_timeout_s=0.5), "user name is empty"),
                        (EtcdStore([endpoint], job="secure", request_timeout_s=0.5, auth=("root", "guess")),
                         "authenticating as 'root'")):
        with pytest.raises(dist.DistNetworkError, match=why) as refused:
            forger.set("job/failed", "forged")
        assert "s3cret" not in str(refused.value) and "guess" not in str(refused.value)
    assert not job.check(["job/failed"]) and job.get("rank/0/ok") == b"1"
    job._token = "bogus.token"  # as if it had expired
    threading.Timer(0.5, lambda: EtcdStore.at(url).set("late", "1")).start()
    assert job.get("late") == b"1"  # a watch refused for its token: authenticated again, it sees the write
    job._token = "bogus.token"
    with pytest.raises(dist.DistNetworkError, match="watch was cancelled: .*invalid auth token"):
        job._watch("never", 1, 1.0)
    assert job._token is None  # the next request authenticates again
    job._token = "bogus.token"
    job.set("job/failed", "real")
    assert job.get("job/failed") == b"real" and job.add("n", 1) == 1
    claim = job.claim("launcher", "me", 3.0)  # leases too
    assert claim is not None and job.check(["launcher"])
    claim.release()


def test_etcd_credentials_and_tls_files_are_checked_and_never_in_an_address(monkeypatch):
    from commslayer import config
    from commslayer.errors import ConfigError

    monkeypatch.setenv("COMMSLAYER_ETCD_PASSWORD", "s3cret-pw")
    with pytest.raises(ConfigError, match="COMMSLAYER_ETCD_PASSWORD is set .* without COMMSLAYER_ETCD_USER") as bad:
        config.etcd_auth()
    assert "s3cret" not in str(bad.value)
    monkeypatch.delenv("COMMSLAYER_ETCD_PASSWORD")
    monkeypatch.setenv("COMMSLAYER_ETCD_USER", "root")
    with pytest.raises(ConfigError, match="COMMSLAYER_ETCD_USER='root' .* COMMSLAYER_ETCD_PASSWORD"):
        config.etcd_auth()
    monkeypatch.setenv("COMMSLAYER_ETCD_CERT", "/etc/hostname")
    with pytest.raises(ConfigError, match="COMMSLAYER_ETCD_CERT or COMMSLAYER_ETCD_KEY is set without COMMSLAYER_ETCD_CA"):
        config.etcd_tls()
    monkeypatch.setenv("COMMSLAYER_ETCD_CA", "/nonexistent/ca.pem")
    with pytest.raises(ConfigError, match="COMMSLAYER_ETCD_CERT='/etc/hostname' is not allowed: set with the other"):
        config.etcd_tls()
    monkeypatch.delenv("COMMSLAYER_ETCD_CERT")
    with pytest.raises(ConfigError, match="COMMSLAYER_ETCD_CA='/nonexistent/ca.pem' is not allowed: an existing"):
        config.etcd_tls()
    with pytest.raises(ValueError, match="set COMMSLAYER_ETCD_USER and COMMSLAYER_ETCD_PASSWORD") as bad:
        parse_url("etcd://root:s3cret-pw@h1:2379/job")
    assert "s3cret" not in str(bad.value)


# ------------------------------------------------------------- TLS
def _certificates(where):
    """A certificate authority, a server certificate for 127.0.0.1 (a client one too: etcd's
    JSON gateway shows it to etcd itself) and a client one, made with openssl in ``where``:
    their paths by name (``ca``, ``server``, ``client``: pem, key)."""
    import subprocess

    def run(*args):
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=commslayer-test-ca")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (where / f"{name}.ext").write_text(ext + "\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
            f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {n: (str(where / f"{n}.pem"), str(where / f"{n}.key")) for n in ("ca", "server", "client")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_over_tls_with_a_client_certificate_only_a_holder_of_one_is_served(tmp_path, monkeypatch):
    """etcd serving HTTPS and asking for client certificates: the job's store, given the CA
    and its certificate by environment, is served (a watch included); one without a
    certificate, or speaking plain HTTP, is not."""
    import subprocess

    from commslayer.agree.etcdstore import tls_context
    from commslayer.run.processes import free_port

    files = _certificates(tmp_path)
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    member = subprocess.Popen(
        ["etcd", "--data-dir", str(tmp_path / "data"), "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
         f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}",
         "--cert-file", files["server"][0], "--key-file", files["server"][1], "--client-cert-auth",
         "--trusted-ca-file", files["ca"][0]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        monkeypatch.setenv("COMMSLAYER_ETCD_CA", files["ca"][0])
        monkeypatch.setenv("COMMSLAYER_ETCD_CERT", files["client"][0])
        monkeypatch.setenv("COMMSLAYER_ETCD_KEY", files["client"][1])
        job = EtcdStore.at(f"etcd://127.0.0.1:{port}/tls", request_timeout_s=20.0)  # etcd starting
        job.set("k", "v")
        threading.Timer(0.3, lambda: EtcdStore.at(f"etcd://127.0.0.1:{port}/tls").set("late", "1")).start()
        assert job.get("k") == b"v" and job.get("late") == b"1"
        for stranger in (EtcdStore([("127.0.0.1", port)], job="tls", request_timeout_s=0.5),
                         EtcdStore([("127.0.0.1", port)], job="tls", request_timeout_s=0.5,
                                   tls=tls_context(files["ca"][0]))):
            with pytest.raises(dist.DistNetworkError, match=rf"127\.0\.0\.1:{port}: "):
                stranger.set("job/failed", "forged")
        assert not job.check(["job/failed"])
    finally:
        member.kill()
        member.wait()
