"""A ``torch.distributed.Store`` on an etcd cluster, so that the job's store
outlives any one host (a TCPStore dies with the process that holds it).

Why etcd's JSON gateway and the standard library: etcd 3.4 serves its v3 API
as JSON over HTTP (``/v3/kv/...``, ``/v3/watch``), so each store call is one
HTTP request made with ``http.client``, with a socket timeout, and no gRPC
stack comes into the job.  Which etcd primitive does what:

* ``set``, ``get``, ``check``, ``delete_key``, ``multi_get``, ``multi_set``,
  ``num_keys``: puts, ranges and delete-ranges (several in one transaction);
* ``compare_set``: one transaction comparing the value (or that the key does
  not exist), with c10d's answers: a key that does not exist and an
  ``expected`` that is not empty is left alone and ``expected`` answered;
* ``add`` and ``append``: a read, then a transaction that writes only if the
  key's modification revision is still the one read, repeated on a race;
  exactly once, even when an answer is lost: the transaction also writes a
  receipt (its own key, outside every job's, under a lease that ends it after
  ``RECEIPT_TTL_S``) and applies only where that receipt does not exist, so
  the same transaction is simply sent again, and either applies or answers
  with the receipt;
* ``wait`` (and ``get`` of a key not written yet): a watch from the revision
  at which the key was seen missing, so the server answers when it is
  written; one request, no polling;
* ``claim``: a key under a lease that a thread renews, gone soon after its
  holder (the launcher that started a job holds the job this way).

A job's keys live under ``JOBS`` + its name, percent-encoded (``job_prefix``): a
name holds no ``/`` there, so no job's keys are a part of another's (``team`` and
``team/exp``), and the receipts, outside ``JOBS``, are part of none.  Losing a member, the leader included, is
survived: each request goes to the member that served last, which gets
``ATTEMPT_S`` to answer (a member that is stopped, or that waits for a new
leader, answers nothing), then to the next, round after round, for up to
``request_timeout_s``.  A member that refuses the connection is left at once.
When no member serves within that time (no quorum: the members answer with
errors, or nothing), the call raises ``DistNetworkError``, which
``commslayer.agree.store.bounded`` turns into ``StoreUnreachable``.

On a cluster with etcd's auth enabled the store authenticates as ``auth`` (user,
password; ``COMMSLAYER_ETCD_USER`` and ``COMMSLAYER_ETCD_PASSWORD`` for ``at``),
sends the token etcd gives in every request's ``Authorization`` header, and
authenticates again when etcd refuses it (an expired token): a process without
the password can then neither read nor write the job's keys.  The password is
never part of an address, a message or a log line.  With ``tls`` (an
``ssl.SSLContext``; ``COMMSLAYER_ETCD_CA``, ``COMMSLAYER_ETCD_CERT`` and
``COMMSLAYER_ETCD_KEY`` for ``at``: ``tls_context``) it speaks HTTPS, showing a
client certificate where the context holds one.

An answer is taken only as etcd gives it: a JSON object with the header every
etcd answer has, each field of the type and form the request calls for (a
transaction's answers one per operation, each read's key the one asked for,
values valid base64), and a body of at most ``MAX_REPLY_BYTES``.  Anything
else is that endpoint not serving, as a silent one: the request goes to the
next, and ``DistNetworkError`` names the endpoint and what was wrong with its
answer; never a wrong answer taken for a right one (a key that ``check``
finds, a ``wait`` that ends, where none was written).
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import ssl
import threading
import time
import urllib.parse
import uuid
from datetime import timedelta
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

import torch.distributed as dist

from commslayer import config
from commslayer.errors import ConfigError
from commslayer.endpoints import SCHEME, parse_url

DEFAULT_TIMEOUT = timedelta(seconds=300)  # c10d's default store timeout: how long get and wait wait for a key
REQUEST_TIMEOUT_S = 8.0  # one call, tried on every endpoint in turn until one serves it (below the store deadline)
ATTEMPT_S = 1.0  # one request to one endpoint: a member that is stopped, or waits for a leader, is left after this
RELEASE_S = 2.0  # how long revoking a claim's lease may take (Claim.release)
RECEIPT_TTL_S = 60  # how long the receipt of an add or append outlives it (its retries end well before)
NAMESPACE = b"commslayer/"  # every key commslayer writes on a cluster begins so
JOBS = NAMESPACE + b"jobs/"  # each job's keys: here, under its encoded name (job_prefix)
RECEIPTS = NAMESPACE + b"receipts/"  # where receipts live: outside JOBS, so no job's keys count or delete them
# The most of an answer read before it is refused.  etcd takes requests of at most 1.5 MiB
# (--max-request-bytes; its docs advise at most 10 MiB), so one key's value is at most that, and a
# read of a few keys in one transaction, in base64 (4/3) and JSON, a few times that; 64 MiB leaves
# room for a cluster configured for larger values, and bounds what a member (or something posing as
# one) can make a rank hold: the 400 MB value was read whole.
MAX_REPLY_BYTES = 64 << 20
CHUNK_BYTES = 1 << 20  # an answer is read this much at a time, its deadline checked between reads
INVALID_TOKEN = "invalid auth token"  # how etcd says that a token expired or is unknown
_DIGITS = 20  # the longest int64 (or uint64) etcd writes: a longer "number" is not one

T = TypeVar("T")


class _NotServed(Exception):
    """One endpoint did not serve a request (refused, reset, silent, an error answer, or
    one of the wrong shape or size)."""


def job_prefix(job: str) -> bytes:
    """Where the keys of ``job`` live: under ``JOBS``, the name percent-encoded so that it
    holds no ``/``, ended by one; so no job's prefix begins another's (``team/`` and
    ``team%2Fexp/``) and none is the receipts'.  The job without a name is ``JOBS//``."""
    return JOBS + urllib.parse.quote(job, safe="").encode() + b"/"


def tls_context(ca: str, cert: Optional[str] = None, key: Optional[str] = None) -> ssl.SSLContext:
    """A TLS context that trusts the certificate authority in ``ca`` (PEM) and shows the
    client certificate ``cert`` with its ``key`` if given; ``ConfigError`` naming the
    files where they do not load."""
    try:
        context = ssl.create_default_context(cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(f"cannot load the etcd TLS files (COMMSLAYER_ETCD_CA={ca!r}, COMMSLAYER_ETCD_CERT={cert!r}, "
                          f"COMMSLAYER_ETCD_KEY={key!r}): {exc}") from None
    return context


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _absent(key: str) -> Dict[str, Any]:
    """A transaction's condition that the key (base64, as sent) does not exist."""
    return {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def _read(key: str) -> Dict[str, Any]:
    """A transaction's read of the key (base64, as sent)."""
    return {"request_range": {"key": key}}


def _write(key: str, value: bytes, lease: str = "") -> Dict[str, Any]:
    """A transaction's write of the key (base64, as sent), under ``lease`` if given."""
    put = {"key": key, "value": _b64(value)}
    return {"request_put": {**put, "lease": lease} if lease else put}


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # c10d hands over lists of ints for std::vector<uint8_t>


# ----------------------------------------------------------------- answers
class Kv(NamedTuple):
    """A key as etcd answered it: its value, the revision that last wrote it, its lease
    (``"0"`` for none)."""

    value: bytes
    mod_revision: int
    lease: str


class Txn(NamedTuple):
    """A transaction's answer: whether its comparisons held, what each operation of the
    branch that ran read (its key's ``Kv``, None for a missing key or an operation
    that is not a read), how many keys its deletes deleted, the store's revision."""

    succeeded: bool
    kvs: List[Optional[Kv]]
    deleted: int
    revision: int


def _object(data: Any, what: str) -> Dict[str, Any]:
    if not isinstance(data, dict):
        raise _NotServed(f"a wrong-shaped answer: {what} is not a JSON object")
    return data


def _number(data: Dict[str, Any], name: str, default: Optional[int] = None) -> int:
    """``data[name]``, an integer as etcd writes one (a decimal string; ``default`` where
    etcd leaves a zero out)."""
    value = data.get(name)
    if value is None and default is not None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str) or not 0 < len(value) <= _DIGITS or not value.lstrip("-").isdigit():
        raise _NotServed(f"a wrong-shaped answer: {name!r} is {str(value)[:40]!r}, not a number")
    return int(value)


def _revision(data: Dict[str, Any]) -> int:
    """The store's revision in the header every etcd answer has (naming its cluster and
    member too: ``{"header": {"revision": "1"}}`` is not etcd's)."""
    header = _object(data.get("header"), "the header")
    _number(header, "cluster_id")
    _number(header, "member_id")
    return _number(header, "revision")


def _decoded(text: Any, name: str) -> bytes:
    if not isinstance(text, str):
        raise _NotServed(f"a wrong-shaped answer: {name!r} is not a string")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise _NotServed(f"a wrong-shaped answer: {name!r} is not base64") from None


def _one(answer: Dict[str, Any], key: str) -> Optional[Kv]:
    """The ``Kv`` of ``key`` (base64, as sent) in a range's answer; None if it does not exist."""
    kvs = answer.get("kvs", [])
    if not isinstance(kvs, list) or len(kvs) > 1:
        raise _NotServed("a wrong-shaped answer: 'kvs' is not a list of at most the one key read")
    if not kvs:
        return None
    kv = _object(kvs[0], "a kv")
    if kv.get("key") != key:
        raise _NotServed("a wrong-shaped answer: a kv of another key than the one read")
    return Kv(_decoded(kv.get("value", ""), "value"), _number(kv, "mod_revision"), str(_number(kv, "lease", 0)))


def _ranged(key: str) -> Callable[[Dict[str, Any]], Tuple[Optional[Kv], int]]:
    """The parser of a range's answer for ``key`` (base64): (its ``Kv`` or None, the revision)."""
    def parse(data: Dict[str, Any]) -> Tuple[Optional[Kv], int]:
        revision = _revision(data)
        return _one(data, key), revision
    return parse


def _counted(name: str) -> Callable[[Dict[str, Any]], int]:
    """The parser of an answer that counts keys in ``name`` (``deleted``, ``count``)."""
    def parse(data: Dict[str, Any]) -> int:
        _revision(data)
        return _number(data, name, 0)
    return parse


def _lease_id(data: Dict[str, Any]) -> str:
    """A granted lease's ID (as etcd writes it)."""
    _revision(data)
    lease = _number(data, "ID")
    if lease <= 0:
        raise _NotServed(f"a wrong-shaped answer: lease ID {lease}")
    return str(lease)


def _token(data: Dict[str, Any]) -> str:
    """The token in an authentication's answer."""
    _revision(data)
    token = data.get("token")
    if not isinstance(token, str) or not token.isprintable() or not 0 < len(token) <= 4096:
        raise _NotServed("a wrong-shaped answer: no token")
    return token


def _kept_alive(data: Dict[str, Any]) -> int:
    """A lease's seconds left in a keep-alive's answer (0: it expired)."""
    result = _object(data.get("result"), "'result'")
    _revision(result)
    return _number(result, "TTL", 0)


def _transacted(success: List[Dict[str, Any]], failure: List[Dict[str, Any]]) -> Callable[[Dict[str, Any]], Txn]:
    """The parser of the answer to a transaction of these operations: one answer per
    operation of the branch that ran, each of its kind."""
    def parse(data: Dict[str, Any]) -> Txn:
        revision = _revision(data)
        succeeded = data.get("succeeded", False)
        if not isinstance(succeeded, bool):
            raise _NotServed("a wrong-shaped answer: 'succeeded' is not a boolean")
        ops = success if succeeded else failure
        responses = data.get("responses", [])
        if not isinstance(responses, list) or len(responses) != len(ops):
            raise _NotServed(f"a wrong-shaped answer: not {len(ops)} responses, one per operation")
        kvs: List[Optional[Kv]] = []
        deleted = 0
        for op, response in zip(ops, responses):
            (kind, request), = op.items()
            answer = _object(_object(response, "a response").get(kind.replace("request_", "response_")),
                             f"the response to a {kind}")
            kvs.append(_one(answer, request["key"]) if kind == "request_range" else None)
            deleted += _number(answer, "deleted", 0) if kind == "request_delete_range" else 0
        return Txn(succeeded, kvs, deleted, revision)
    return parse


def _body(response: http.client.HTTPResponse, deadline: float) -> bytes:
    """An answer's body, read ``CHUNK_BYTES`` at a time until ``deadline``; ``_NotServed``
    for one over ``MAX_REPLY_BYTES``, refused having read at most that much (at once, if
    its Content-Length says so)."""
    if response.length is not None and response.length > MAX_REPLY_BYTES:
        raise _NotServed(f"an answer of {response.length} bytes, over the cap of {MAX_REPLY_BYTES}")
    chunks: List[bytes] = []
    size = 0
    while chunk := response.read(min(CHUNK_BYTES, MAX_REPLY_BYTES + 1 - size)):
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise _NotServed(f"an answer of over {MAX_REPLY_BYTES} bytes, the cap")
        if time.monotonic() > deadline and response.length != 0:  # (0: the whole answer is read)
            raise _NotServed("an answer still arriving at its deadline")
        chunks.append(chunk)
    return b"".join(chunks)


def _parsed(raw: bytes) -> Dict[str, Any]:
    """An answer's body as the JSON object it must be."""
    try:
        return _object(json.loads(raw or b"{}"), "the answer")
    except (ValueError, RecursionError) as exc:
        raise _NotServed(f"an answer that is not JSON ({type(exc).__name__})") from None


class EtcdStore(dist.Store):
    """The keys of ``job`` on the etcd cluster at ``endpoints`` ((host, port) pairs), as
    a c10d store, authenticated as ``auth`` (user, password) if given, over TLS with
    ``tls`` if given; ``EtcdStore.at(url)`` for an ``etcd://`` address."""

    def __init__(self, endpoints: Sequence[Tuple[str, int]], job: str = "",
                 timeout: timedelta = DEFAULT_TIMEOUT, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 auth: Optional[Tuple[str, str]] = None, tls: Optional[ssl.SSLContext] = None) -> None:
        super().__init__()
        self.endpoints = list(endpoints)
        if not self.endpoints:
            raise ValueError("an etcd store needs at least one endpoint")
        self.job = job
        self.prefix = job_prefix(job)
        self.request_timeout_s = request_timeout_s
        self._auth = auth
        self._tls = tls
        self._token: Optional[str] = None  # etcd's, while it takes it
        self._good = 0  # the endpoint that answered last
        self._local = threading.local()  # each thread's kept-alive connections, by endpoint
        self._id = uuid.uuid4().hex  # names this store's receipts
        self._receipts = itertools.count(1)
        self._lease: Optional[Tuple[str, float]] = None  # the receipts' lease, and when it was granted
        self._clones: List[EtcdStore] = []
        self.set_timeout(timeout)

    @classmethod
    def at(cls, url: str, timeout: timedelta = DEFAULT_TIMEOUT,
           request_timeout_s: float = REQUEST_TIMEOUT_S) -> "EtcdStore":
        """The store of ``job`` at ``etcd://h1:2379,h2:2379/job``, authenticated as the
        user of ``COMMSLAYER_ETCD_USER`` if set, over TLS if ``COMMSLAYER_ETCD_CA`` is."""
        endpoints, job = parse_url(url)
        tls = config.etcd_tls()
        return cls(endpoints, job, timeout, request_timeout_s, config.etcd_auth(), tls_context(*tls) if tls else None)

    @property
    def address(self) -> str:
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.endpoints) + (f"/{self.job}" if self.job else "")

    def clone(self) -> "EtcdStore":
        twin = EtcdStore(self.endpoints, self.job, self._store_timeout(), self.request_timeout_s, self._auth,
                         self._tls)
        # c10d's PrefixStore.clone keeps only a C++ reference to what this returns; without a Python
        # one the object goes, and its methods with it ("Tried to call pure virtual function")
        self._clones.append(twin)
        return twin

    def _store_timeout(self) -> timedelta:
        """How long ``get`` and ``wait`` wait (``set_timeout``'s, kept by c10d)."""
        return self.timeout  # type: ignore[attr-defined,no-any-return]  # c10d's property, untyped

    # ------------------------------------------------------------- transport
    def _post(self, path: str, body: Dict[str, Any], parse: Callable[[Dict[str, Any]], T],
              timeout_s: Optional[float] = None) -> T:
        """One call: its request to the endpoints in turn, from the one that served last,
        each given ``ATTEMPT_S``, round after round until one serves it, with an answer
        that ``parse`` takes, or ``timeout_s`` (default ``request_timeout_s``) passes
        (``DistNetworkError``).  A request that got no answer may have been applied, so
        every request made here must be one that can be applied twice (``_update``
        makes add and append so)."""
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        failures: List[str] = []
        while True:
            for index, host, port in self._in_turn():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    data = parse(self._attempt(index, host, port, path, body, min(ATTEMPT_S, left)))
                except _NotServed as exc:
                    failures.append(f"{host}:{port}: {exc}")
                    continue
                self._good = index
                return data
            if time.monotonic() >= deadline:
                seen = "; ".join(list(dict.fromkeys(failures))[-2 * len(self.endpoints):])  # each reason once
                raise dist.DistNetworkError(f"etcd at {self.address} did not serve {path} within "
                                            f"{timeout_s:g}s: {seen}")
            time.sleep(0.05)  # every endpoint failed at once (none up yet): pace the next round

    def _attempt(self, index: int, host: str, port: int, path: str, body: Dict[str, Any],
                 timeout_s: float, authorized: bool = True) -> Dict[str, Any]:
        """The request to one endpoint, on this thread's kept-alive connection to it (a
        fresh one if there is none, or if the kept one had been closed before the
        request went out), with the token unless not ``authorized``: its answer, a JSON
        object; ``_NotServed`` saying why not."""
        headers = self._headers(index, host, port, timeout_s) if authorized else {}
        kept: Dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault("conns", {})
        conn = kept.pop(index, None)
        deadline = time.monotonic() + timeout_s
        for fresh in (conn is None, True):
            if conn is None:
                conn = self._connection(host, port, timeout_s)
            elif conn.sock is not None:
                conn.sock.settimeout(timeout_s)
            try:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
                response = conn.getresponse()
                raw = _body(response, deadline)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                conn.close()
                conn = None
                if fresh or isinstance(exc, TimeoutError):
                    raise _NotServed(str(exc) or type(exc).__name__) from None
                continue  # the server had closed the kept connection: once more on a fresh one
            except _NotServed:
                conn.close()  # the rest of a refused answer is never read
                raise
            kept[index] = conn
            data = _parsed(raw)
            if response.status != 200:  # the member cannot serve now (no leader, no quorum, timed out)
                self._refused(response.status)
                raise _NotServed(f"HTTP {response.status} {str(data.get('error') or data.get('message'))[:200]}")
            return data
        raise AssertionError("unreachable")

    def _connection(self, host: str, port: int, timeout_s: float) -> http.client.HTTPConnection:
        """A new connection to one endpoint (HTTPS with ``tls``)."""
        if self._tls is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=self._tls)
        return http.client.HTTPConnection(host, port, timeout=timeout_s)

    def _headers(self, index: int, host: str, port: int, timeout_s: float) -> Dict[str, str]:
        """A request's own headers: with ``auth``, etcd's token, got from this endpoint first
        if none is held."""
        if self._auth is None:
            return {}
        if self._token is None:
            user, password = self._auth
            try:
                self._token = _token(self._attempt(index, host, port, "/v3/auth/authenticate",
                                                   {"name": user, "password": password}, timeout_s, authorized=False))
            except _NotServed as exc:
                raise _NotServed(f"authenticating as {user!r}: {exc}") from None
        return {"Authorization": self._token}

    def _refused(self, status: int) -> None:
        """An answer of ``status``: 401 (an expired or unknown token) drops the token, so
        that the next try authenticates again."""
        if status == 401:
            self._token = None

    def _in_turn(self) -> List[Tuple[int, str, int]]:
        """(index, host, port) of every endpoint, from the one that answered last."""
        n = len(self.endpoints)
        return [((self._good + i) % n, *self.endpoints[(self._good + i) % n]) for i in range(n)]

    def _key(self, key: str) -> str:
        return _b64(self.prefix + key.encode())

    def _range(self, key: str) -> Tuple[Optional[Kv], int]:
        """(the key's ``Kv``, or None; the store's revision)."""
        return self._post("/v3/kv/range", {"key": self._key(key)}, _ranged(self._key(key)))

    def _txn(self, compare: List[Dict[str, Any]], success: List[Dict[str, Any]],
             failure: List[Dict[str, Any]]) -> Txn:
        return self._post("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure},
                          _transacted(success, failure))

    # ------------------------------------------------------------- requests
    def set(self, key: str, value: Any) -> None:
        self._post("/v3/kv/put", _write(self._key(key), _bytes(value))["request_put"], _revision)

    def get(self, key: str) -> bytes:
        return self._present([key])[0].value

    def _kvs(self, keys: Sequence[str]) -> Tuple[List[Optional[Kv]], int]:
        """(each key's ``Kv``, None where it does not exist; the store's revision), read in
        one transaction."""
        txn = self._txn([], [_read(self._key(k)) for k in keys], [])
        return txn.kvs, txn.revision

    def _present(self, keys: List[str]) -> List[Kv]:
        """Each key's ``Kv``, once every one of them exists (waiting as ``wait`` does)."""
        while True:
            found, _ = self._kvs(keys)
            kvs = [kv for kv in found if kv is not None]
            if len(kvs) == len(keys):
                return kvs
            self.wait(keys)

    def check(self, keys: List[str]) -> bool:
        return all(kv is not None for kv in self._kvs(keys)[0])

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return [kv.value for kv in self._present(list(keys))]

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        self._txn([], [_write(self._key(k), _bytes(v)) for k, v in zip(keys, values)], [])

    def delete_key(self, key: str) -> bool:
        return self._post("/v3/kv/deleterange", {"key": self._key(key)}, _counted("deleted")) > 0

    def num_keys(self) -> int:
        return self._post("/v3/kv/range", {**self._everything(), "count_only": True}, _counted("count"))

    def delete_all(self, keep: str = "") -> int:
        """Delete every key of the job but ``keep`` (a job starting afresh on a cluster
        that keeps what earlier jobs wrote); how many there were."""
        everything = self._everything()
        if not keep:
            return self._post("/v3/kv/deleterange", everything, _counted("deleted"))
        kept = self._key(keep)
        after = _b64(self.prefix + keep.encode() + b"\0")
        return self._txn([], [{"request_delete_range": {"key": everything["key"], "range_end": kept}},
                              {"request_delete_range": {"key": after, "range_end": everything["range_end"]}}],
                         []).deleted

    def _everything(self) -> Dict[str, str]:
        """The range of every key of the job: from its prefix to the prefix with its
        closing ``/`` one higher (``0``)."""
        return {"key": _b64(self.prefix), "range_end": _b64(self.prefix[:-1] + b"0")}

    def claim(self, key: str, value: Any, ttl_s: float) -> Optional["Claim"]:
        """Write ``key`` if nobody holds it, under a lease of ``ttl_s`` seconds that a
        thread renews (``Claim``): the key disappears at most ``ttl_s`` after this
        process ends or loses the cluster. None if the key exists (someone holds it)."""
        lease = self._post("/v3/lease/grant", {"TTL": max(1, round(ttl_s))}, _lease_id)
        txn = self._txn([_absent(self._key(key))], [_write(self._key(key), _bytes(value), lease)],
                        [_read(self._key(key))])
        holder = txn.kvs[0]
        if txn.succeeded or (holder is not None and holder.lease == lease):  # ours, perhaps from a try applied
            # renewed on a store of its own, whose calls give up in time for the next renewal
            return Claim(EtcdStore(self.endpoints, self.job, self._store_timeout(), ttl_s / 3, self._auth,
                                   self._tls),
                         lease, ttl_s)
        self._post("/v3/lease/revoke", {"ID": lease}, _revision)
        return None

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        if expected_b:
            compare = {"key": self._key(key), "target": "VALUE", "result": "EQUAL", "value": _b64(expected_b)}
        else:
            compare = _absent(self._key(key))
        txn = self._txn([compare], [_write(self._key(key), desired_b)], [_read(self._key(key))])
        if txn.succeeded:
            return desired_b
        kv = txn.kvs[0]
        return kv.value if kv is not None else expected_b  # c10d: a missing key is left alone

    def add(self, key: str, amount: int) -> int:
        return int(self._update(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: Any) -> None:
        tail = _bytes(value)
        self._update(key, lambda old: (old or b"") + tail)

    def _update(self, key: str, change: Callable[[Optional[bytes]], bytes]) -> bytes:
        """Write ``change(old value or None)`` if nobody wrote the key in between (again,
        from the new value, if somebody did), exactly once: the transaction also writes
        a receipt of its own, and applies only where that receipt does not exist, so
        one that may have been applied is sent again as it was, and either applies
        now or answers with its receipt."""
        receipt, target = _b64(self._receipt()), self._key(key)
        kv, _ = self._range(key)
        while True:
            new = change(None if kv is None else kv.value)
            unchanged = _absent(target) if kv is None else \
                {"key": target, "target": "MOD", "result": "EQUAL", "mod_revision": str(kv.mod_revision)}
            txn = self._txn([_absent(receipt), unchanged],
                            [_write(target, new), _write(receipt, new, self._receipt_lease())],
                            [_read(receipt), _read(target)])
            if txn.succeeded:
                return new
            mine, kv = txn.kvs
            if mine is not None:  # an earlier try was applied
                return mine.value

    def _receipt(self) -> bytes:
        """A key no other call, of this store or any other, ever uses."""
        return RECEIPTS + f"{self._id}/{next(self._receipts)}".encode()

    def _receipt_lease(self) -> str:
        """A lease that ends receipts ``RECEIPT_TTL_S`` after they were written at the
        earliest (a new one each half of that)."""
        now = time.monotonic()
        if self._lease is None or now - self._lease[1] > RECEIPT_TTL_S / 2:
            self._lease = (self._post("/v3/lease/grant", {"TTL": RECEIPT_TTL_S}, _lease_id), now)
        return self._lease[0]

    def has_extended_api(self) -> bool:
        return True

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None or timeout.total_seconds() <= 0:  # c10d's "no timeout given"
            timeout = self._store_timeout()
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            found, revision = self._kvs(keys)
            missing = [k for k, kvs in zip(keys, found) if not kvs]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0 or not self._watch(missing[0], revision + 1, left):
                raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: "
                                          + ", ".join(f"{self.job}/{k}" if self.job else k for k in keys))

    def _watch(self, key: str, from_revision: int, timeout_s: float) -> bool:
        """Whether ``key`` was written at or after ``from_revision`` within ``timeout_s``."""
        failures = []
        for index, host, port in self._in_turn():
            conn = self._connection(host, port, min(timeout_s, ATTEMPT_S))
            try:
                conn.request("POST", "/v3/watch", json.dumps(
                    {"create_request": {"key": self._key(key), "start_revision": str(from_revision)}}),
                    self._headers(index, host, port, min(timeout_s, ATTEMPT_S)))
                response = conn.getresponse()
                if response.status != 200:
                    self._refused(response.status)
                    failures.append(f"{host}:{port}: HTTP {response.status}")
                    continue
                deadline = time.monotonic() + timeout_s
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    if conn.sock is not None:
                        conn.sock.settimeout(left)
                    try:
                        line = response.readline(MAX_REPLY_BYTES + 1)
                    except TimeoutError:
                        return False
                    if _watched(line):
                        return True
            except (OSError, http.client.HTTPException, ValueError, _NotServed) as exc:
                if INVALID_TOKEN in str(exc):
                    self._token = None  # authenticate again for the next watch
                failures.append(f"{host}:{port}: {exc}")
            finally:
                conn.close()
        raise dist.DistNetworkError(f"etcd at {self.address} could not watch {key!r}: " + "; ".join(failures))


def _watched(line: bytes) -> bool:
    """Whether one line of a watch's answer reports a write (or that the revision watched
    from was compacted: the caller reads the key again); ``_NotServed`` for the end of the
    stream, a watch that etcd cancelled (its token refused, say), or a line that is not
    etcd's."""
    if not line:
        raise _NotServed("the watch stream ended")
    if len(line) > MAX_REPLY_BYTES:
        raise _NotServed(f"a line of over {MAX_REPLY_BYTES} bytes, the cap")
    result = _object(_parsed(line).get("result"), "'result'")
    _revision(result)
    if result.get("canceled"):
        if _number(result, "compact_revision", 0) > 0:
            return True
        raise _NotServed(f"the watch was cancelled: {str(result.get('cancel_reason'))[:200]}")
    events = result.get("events", [])
    if not isinstance(events, list):
        raise _NotServed("a wrong-shaped answer: 'events' is not a list")
    return bool(events)


class Claim:
    """A key held under a lease (``EtcdStore.claim``), renewed every third of its
    time to live until ``release``; ``lost`` says why renewing stopped working.
    Other keys can be put under the same lease (``put``)."""

    def __init__(self, store: EtcdStore, lease: str, ttl_s: float) -> None:
        self._store, self._lease, self._ttl_s = store, lease, ttl_s
        self.lost: Optional[str] = None
        self._released = threading.Event()
        threading.Thread(target=self._renew, name="commslayer-etcd-lease", daemon=True).start()

    def _renew(self) -> None:
        while not self._released.wait(self._ttl_s / 3):
            try:
                left = self._store._post("/v3/lease/keepalive", {"ID": self._lease}, _kept_alive)
            except dist.DistNetworkError as exc:
                self.lost = str(exc)
                continue  # the lease may still be alive: try again while it can be
            if left <= 0:
                self.lost = "the lease expired"
                return
            self.lost = None

    def put(self, key: str, value: Any) -> None:
        """Write ``key`` under this claim's lease: it goes when the claim does."""
        self._store._post("/v3/kv/put", _write(self._store._key(key), _bytes(value), self._lease)["request_put"],
                          _revision)

    def release(self) -> None:
        """Stop renewing and delete the keys now (the lease revoked)."""
        self._released.set()
        try:  # briefly: the process that releases is ending, and a lease not revoked expires on its own
            self._store._post("/v3/lease/revoke", {"ID": self._lease}, _revision, timeout_s=RELEASE_S)
        except dist.DistNetworkError:
            pass
