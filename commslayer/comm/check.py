"""Cross-rank check mode (``COMMSLAYER_CHECK=1`` or ``new_comm(..., check=True)``).

Before an op is sent, every rank publishes the op's fingerprint (op, reduce
op, dtype, the shapes that must agree, the root, all_to_all's splits) in the
store under the op's sequence number and reads everyone else's (a wait that
ends as soon as the communicator knows a member is lost).  A difference
becomes ``CollectiveMismatch`` on every rank, naming the ranks and what
differs, instead of a Gloo abort of the process or a hang.  It costs a few
store round trips per op, so it is a debugging mode, like
``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from commslayer.errors import CollectiveMismatch, CollectiveTimeout
from commslayer.reduce_op import ReduceOp
from commslayer.agree.store import wait_for_keys


Fingerprint = Dict[str, Any]


def fingerprint(op: str, t: torch.Tensor, reduce_op: Optional[ReduceOp] = None, *, root: Optional[int] = None,
                extra_shape: Optional[List[int]] = None) -> Fingerprint:
    """What every rank's call of one op must agree on: op, dtype, the shape that
    must match (``extra_shape`` where only the trailing dimensions must), reduce op, root."""
    fp: Fingerprint = {"op": op, "dtype": str(t.dtype),
                          "shape": extra_shape if extra_shape is not None else list(t.shape)}
    if reduce_op is not None:
        fp["reduce_op"] = repr(reduce_op)
    if root is not None:
        fp["root"] = root
    return fp


def _describe(fp: Fingerprint) -> str:
    return ", ".join(f"{k}={v}" for k, v in fp.items() if k != "splits")


def _differences(mine: Fingerprint, theirs: Fingerprint) -> List[str]:
    keys = [k for k in mine.keys() | theirs.keys() if k != "splits"]
    return [f"{k}: {mine.get(k)} vs {theirs.get(k)}" for k in sorted(keys) if mine.get(k) != theirs.get(k)]


class CrossRankCheck:
    """Exchanges fingerprints for one communicator."""

    def __init__(self, store: dist.Store, comm: str, rank: int, size: int,
                 interrupted: Callable[[str, int], Optional[Exception]]) -> None:
        self.store = dist.PrefixStore("check/", store)
        self.comm = comm
        self._interrupted = interrupted  # (op, seq) -> the error a wait ends with once the communicator broke
        self.rank = rank
        self.size = size
        self._last_key: Optional[str] = None
        self._last_p2p: Dict[Tuple[int, int], str] = {}

    def _gather(self, key_of: Callable[[int], str], ranks: List[int], fp: Fingerprint, op: str, seq: int,
                timeout_s: float) -> Dict[int, Fingerprint]:
        mine = key_of(self.rank)
        self.store.set(mine, json.dumps(fp))
        keys = {r: key_of(r) for r in ranks if r != self.rank}
        if not wait_for_keys(self.store, list(keys.values()), lambda: self._interrupted(op, seq), timeout_s):
            missing = [r for r, k in keys.items() if not self.store.check([k])]
            raise CollectiveTimeout(
                "check mode: these ranks never reached this op",
                comm=self.comm, op=op, seq=seq, timeout_s=timeout_s, ranks=missing,
            ) from None
        values = self.store.multi_get(list(keys.values())) if keys else []
        got = {r: json.loads(v) for r, v in zip(keys, values)}
        got[self.rank] = fp
        return got

    def collective(self, fp: Fingerprint, seq: int, timeout_s: float) -> None:
        """Raise ``CollectiveMismatch`` unless every rank's fingerprint agrees."""
        got = self._gather(lambda r: f"{seq}/{r}", list(range(self.size)), fp, fp["op"], seq, timeout_s)
        reference = got[0]
        odd = [r for r in range(self.size) if _differences(reference, got[r])]
        problems = [f"rank 0 ({_describe(reference)}) vs rank {r}: " + "; ".join(_differences(reference, got[r]))
                    for r in odd]
        if "splits" in fp:
            for r in range(self.size):
                for peer in range(self.size):
                    sent, expected = got[r]["splits"][0][peer], got[peer]["splits"][1][r]
                    if sent != expected:
                        problems.append(f"rank {r} sends {sent} rows to rank {peer}, which expects {expected}")
                        odd += [r, peer]
        # Everyone has published key `seq` once this returns, so `seq-1`'s are read.
        if self._last_key is not None:
            self.store.delete_key(self._last_key)
        self._last_key = f"{seq}/{self.rank}"
        if problems:
            raise CollectiveMismatch(
                "ranks disagree on the collective: " + " | ".join(problems),
                comm=self.comm, op=fp["op"], seq=seq, ranks=odd or [0],
            )

    def p2p(self, fp: Fingerprint, src: int, dst: int, n: int, timeout_s: float) -> None:
        """Sender and receiver compare dtype and shape of the n-th message src→dst."""
        got = self._gather(lambda r: f"p2p/{src}-{dst}/{n}/{r}", [src, dst], fp, fp["op"], n, timeout_s)
        a, b = got[src], got[dst]
        diffs = [d for d in _differences({**a, "op": None}, {**b, "op": None})]
        pair = (src, dst)
        if pair in self._last_p2p:
            self.store.delete_key(self._last_p2p[pair])
        self._last_p2p[pair] = f"p2p/{src}-{dst}/{n}/{self.rank}"
        if diffs:
            raise CollectiveMismatch(
                f"send on rank {src} and recv on rank {dst} disagree: " + "; ".join(diffs),
                comm=self.comm, op=fp["op"], seq=n, ranks=[src, dst],
            )
