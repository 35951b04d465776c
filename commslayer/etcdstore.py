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
* ``wait`` (and ``get`` of a key not written yet): a watch from the revision
  at which the key was seen missing, so the server answers when it is
  written; one request, no polling.

Every key lives under ``prefix``.  Endpoints are tried in order, starting
from the last one that answered; when none answers, or the cluster cannot
serve (no quorum: etcd answers with an error), the call raises
``DistNetworkError``, which ``commslayer.store.bounded`` turns into
``StoreUnreachable``.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(seconds=300)  # c10d's default store timeout: how long get and wait wait for a key
REQUEST_TIMEOUT_S = 5.0  # one HTTP request to one endpoint


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # c10d hands over lists of ints for std::vector<uint8_t>


def endpoints_from_url(url: str) -> List[Tuple[str, int]]:
    """``etcd://h1:2379,h2:2379`` as (host, port) pairs; ``ValueError`` saying why not."""
    if not url.startswith("etcd://"):
        raise ValueError(f"{url!r} is not an etcd:// address")
    out = []
    for part in url[len("etcd://"):].rstrip("/").split(","):
        parsed = urlsplit(f"//{part}")
        if not parsed.hostname or parsed.port is None:
            raise ValueError(f"{part!r} in {url!r} is not host:port")
        out.append((parsed.hostname, parsed.port))
    return out


class EtcdStore(dist.Store):
    """The keys under ``prefix`` of the etcd cluster at ``endpoints`` ((host, port)
    pairs, or an ``etcd://h1:2379,h2:2379`` address), as a c10d store."""

    def __init__(self, endpoints: "Sequence[Tuple[str, int]] | str", prefix: str = "",
                 timeout: timedelta = DEFAULT_TIMEOUT, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        super().__init__()
        self.endpoints = endpoints_from_url(endpoints) if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("an etcd store needs at least one endpoint")
        self.prefix = prefix.encode()
        self.request_timeout_s = request_timeout_s
        self._good = 0  # the endpoint that answered last
        self._local = threading.local()  # each thread's kept-alive connections, by endpoint
        self.set_timeout(timeout)

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def clone(self) -> "EtcdStore":
        return EtcdStore(self.endpoints, self.prefix.decode(), self._store_timeout(), self.request_timeout_s)

    def _store_timeout(self) -> timedelta:
        """How long ``get`` and ``wait`` wait (``set_timeout``'s, kept by c10d)."""
        return self.timeout  # type: ignore[attr-defined,no-any-return]  # c10d's property, untyped

    # ------------------------------------------------------------- transport
    def _post(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        """One request, to the first endpoint (from the last good one) that answers, on a
        kept-alive connection of this thread (a fresh one if the kept one went stale)."""
        failures = []
        kept: Dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault("conns", {})
        for index, host, port in self._in_turn():
            for fresh in (index not in kept, True):
                conn = kept.pop(index, None) if not fresh else None
                if conn is None:
                    conn = http.client.HTTPConnection(host, port, timeout=self.request_timeout_s)
                try:
                    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                    response = conn.getresponse()
                    data: Dict[str, Any] = json.loads(response.read() or b"{}")
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    conn.close()
                    if fresh:
                        failures.append(f"{host}:{port}: {exc}")
                        break
                    continue  # a kept connection the server closed meanwhile: once more on a fresh one
                kept[index] = conn
                if response.status != 200:  # the cluster answered but cannot serve (no leader, no quorum)
                    failures.append(f"{host}:{port}: HTTP {response.status} "
                                    f"{data.get('error') or data.get('message')}")
                    break
                self._good = index
                return data
        raise dist.DistNetworkError(f"etcd at {self.address} did not serve {path}: " + "; ".join(failures))

    def _in_turn(self) -> List[Tuple[int, str, int]]:
        """(index, host, port) of every endpoint, from the one that answered last."""
        n = len(self.endpoints)
        return [((self._good + i) % n, *self.endpoints[(self._good + i) % n]) for i in range(n)]

    def _key(self, key: str) -> str:
        return _b64(self.prefix + key.encode())

    def _range(self, key: str) -> Tuple[Optional[Dict[str, Any]], int]:
        """(the key's kv, or None; the store's revision)."""
        data = self._post("/v3/kv/range", {"key": self._key(key)})
        kvs = data.get("kvs") or []
        return (kvs[0] if kvs else None), int(data["header"]["revision"])

    def _txn(self, compare: List[Dict[str, Any]], success: List[Dict[str, Any]],
             failure: List[Dict[str, Any]]) -> Dict[str, Any]:
        return self._post("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure})

    def _put(self, key: str, value: bytes) -> Dict[str, Any]:
        return {"request_put": {"key": self._key(key), "value": _b64(value)}}

    def _get_op(self, key: str) -> Dict[str, Any]:
        return {"request_range": {"key": self._key(key)}}

    @staticmethod
    def _value(kv: Dict[str, Any]) -> bytes:
        return base64.b64decode(kv.get("value", ""))

    # ------------------------------------------------------------- requests
    def set(self, key: str, value: Any) -> None:
        self._post("/v3/kv/put", {"key": self._key(key), "value": _b64(_bytes(value))})

    def get(self, key: str) -> bytes:
        kv, _ = self._range(key)
        if kv is None:
            self.wait([key])
            kv, _ = self._range(key)
            assert kv is not None  # keys are never deleted under a waiter in commslayer's use
        return self._value(kv)

    def check(self, keys: List[str]) -> bool:
        data = self._txn([], [self._get_op(k) for k in keys], [])
        return all(r["response_range"].get("kvs") for r in data.get("responses", []))

    def multi_get(self, keys: List[str]) -> List[bytes]:
        self.wait(list(keys))
        data = self._txn([], [self._get_op(k) for k in keys], [])
        return [self._value(r["response_range"]["kvs"][0]) for r in data["responses"]]

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        self._txn([], [self._put(k, _bytes(v)) for k, v in zip(keys, values)], [])

    def delete_key(self, key: str) -> bool:
        return int(self._post("/v3/kv/deleterange", {"key": self._key(key)}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        end = _b64(self.prefix + b"\xff") if self.prefix else _b64(b"\0")
        data = self._post("/v3/kv/range", {"key": _b64(self.prefix or b"\0"), "range_end": end, "count_only": True})
        return int(data.get("count", 0))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        if expected_b:
            compare = {"key": self._key(key), "target": "VALUE", "result": "EQUAL", "value": _b64(expected_b)}
        else:
            compare = {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        data = self._txn([compare], [self._put(key, desired_b)], [self._get_op(key)])
        if data.get("succeeded"):
            return desired_b
        kvs = data["responses"][0]["response_range"].get("kvs")
        return self._value(kvs[0]) if kvs else expected_b  # c10d: a missing key is left alone

    def add(self, key: str, amount: int) -> int:
        return int(self._update(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: Any) -> None:
        tail = _bytes(value)
        self._update(key, lambda old: (old or b"") + tail)

    def _update(self, key: str, change: Callable[[Optional[bytes]], bytes]) -> bytes:
        """Write ``change(old value or None)`` if nobody wrote the key in between; again if they did."""
        while True:
            kv, _ = self._range(key)
            if kv is None:
                compare = {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                new = change(None)
            else:
                compare = {"key": self._key(key), "target": "MOD", "result": "EQUAL",
                           "mod_revision": kv["mod_revision"]}
                new = change(self._value(kv))
            if self._txn([compare], [self._put(key, new)], []).get("succeeded"):
                return new

    def has_extended_api(self) -> bool:
        return True

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None or timeout.total_seconds() <= 0:  # c10d's "no timeout given"
            timeout = self._store_timeout()
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            data = self._txn([], [self._get_op(k) for k in keys], [])
            missing = [k for k, r in zip(keys, data.get("responses", [])) if not r["response_range"].get("kvs")]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0 or not self._watch(missing[0], int(data["header"]["revision"]) + 1, left):
                raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: "
                                          + ", ".join(self.prefix.decode() + k for k in keys))

    def _watch(self, key: str, from_revision: int, timeout_s: float) -> bool:
        """Whether ``key`` was written at or after ``from_revision`` within ``timeout_s``."""
        failures = []
        for _, host, port in self._in_turn():
            conn = http.client.HTTPConnection(host, port, timeout=min(timeout_s, self.request_timeout_s))
            try:
                conn.request("POST", "/v3/watch", json.dumps(
                    {"create_request": {"key": self._key(key), "start_revision": str(from_revision)}}))
                response = conn.getresponse()
                if response.status != 200:
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
                        line = response.readline()
                    except TimeoutError:
                        return False
                    if not line:
                        raise OSError("the watch stream ended")
                    result = json.loads(line).get("result", {})
                    if result.get("events"):
                        return True
            except (OSError, http.client.HTTPException, ValueError) as exc:
                failures.append(f"{host}:{port}: {exc}")
            finally:
                conn.close()
        raise dist.DistNetworkError(f"etcd at {self.address} could not watch {key!r}: " + "; ".join(failures))
