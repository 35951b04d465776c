"""Argument checks that run on the calling rank before anything is sent.

Each check raises ``InvalidArgument`` naming the communicator, the op and this
rank.  They are cheap (a few attribute reads per tensor) because they run on
every op.
"""

from __future__ import annotations

import numbers
from datetime import timedelta
from typing import Any, FrozenSet, List, Optional, Sequence, Union

import torch

from commslayer.config import MAX_TIMEOUT_S
from commslayer.errors import InvalidArgument
from commslayer.reduce_op import ReduceOp, coerce

Timeout = Union[timedelta, float, int, None]
# A name is in every store key of its communicator, and a split's keys hold its
# parent's name too; the store drops the connection of a key near 16 KB (measured),
# which every communicator of the process shares.
MAX_NAME_CHARS = 200


def shown_name(name: object) -> str:
    """``name`` as error messages show it: cut to ``MAX_NAME_CHARS`` characters."""
    text = str(name)
    return text if len(text) <= MAX_NAME_CHARS else f"{text[:MAX_NAME_CHARS]}... ({len(text)} characters)"


class Checker:
    """Checks for one op of one communicator: its name, the op, this rank, and what
    the group needs of a tensor (the group's size, device type and dtypes)."""

    __slots__ = ("comm", "op", "rank", "size", "device_type", "dtypes")

    def __init__(self, comm: str, op: str, rank: int, size: int = 0, device_type: str = "cpu",
                 dtypes: FrozenSet[torch.dtype] = frozenset()) -> None:
        self.comm = comm
        self.op = op
        self.rank = rank
        self.size = size
        self.device_type = device_type
        self.dtypes = dtypes

    def fail(self, what: str) -> InvalidArgument:
        return InvalidArgument(what, comm=self.comm, op=self.op, ranks=(self.rank,))

    def fits(self, t: Any) -> bool:
        """Whether ``t`` is a dense, contiguous tensor on the group's device type, of a
        dtype the backend carries as it is (not complex): three attribute reads."""
        device_type = self.device_type
        try:
            on_device = t.is_cpu if device_type == "cpu" else t.device.type == device_type
            return bool(on_device and t.dtype in self.dtypes and t.is_contiguous())
        except (AttributeError, RuntimeError):  # not a tensor, or a sparse one
            return False

    def fits_sized(self, big: Any, small: Any) -> bool:
        """Whether ``big`` and ``small`` both ``fit``, share a dtype, and ``big`` holds
        the group's size times ``small``'s elements (what ``sized`` checks)."""
        return self.fits(big) and self.fits(small) and big.dtype is small.dtype \
            and big.numel() == small.numel() * self.size

    def tensor(self, t: Any, what: str) -> None:
        """A dense, contiguous tensor on the group's device type, of a dtype it carries."""
        if self.fits(t):
            return
        device_type = self.device_type
        if not isinstance(t, torch.Tensor):
            raise self.fail(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != device_type:
            raise self.fail(f"{what} is on {t.device}; this communicator needs {device_type} tensors")
        if t.dtype not in self.dtypes and not t.is_complex():
            raise self.fail(f"{what} has dtype {t.dtype}, which this backend does not carry")
        if t.layout != torch.strided:
            raise self.fail(f"{what} has layout {t.layout}; this op takes dense tensors "
                            "(all_reduce also takes sparse COO ones)")
        if not t.is_contiguous():
            raise self.fail(f"{what} must be contiguous (call .contiguous())")

    def sparse(self, t: torch.Tensor, what: str) -> None:
        """A sparse COO tensor on the group's device type, of a dtype it carries."""
        if t.layout != torch.sparse_coo:
            raise self.fail(f"{what} has layout {t.layout}; a sparse op takes sparse COO tensors")
        if t.device.type != self.device_type:
            raise self.fail(f"{what} is on {t.device}; this communicator needs {self.device_type} tensors")
        if t.dtype not in self.dtypes:
            raise self.fail(f"{what} has dtype {t.dtype}, which this backend does not carry")

    def name(self, name: object, what: str = "name", forbidden: str = "") -> str:
        """A communicator's name: a non-empty string of at most ``MAX_NAME_CHARS``
        characters, none of them in ``forbidden``."""
        rule = f"a non-empty string of at most {MAX_NAME_CHARS} characters" + \
            "".join(f" without {c!r}" for c in forbidden)
        if not isinstance(name, str) or not name or any(c in name for c in forbidden):
            raise self.fail(f"{what} must be {rule}, got {shown_name(repr(name))}")
        if len(name) > MAX_NAME_CHARS:
            raise self.fail(f"{what} must be {rule}, got one of {len(name)} characters")
        return name

    def same_dtype(self, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        if a.dtype != b.dtype:
            raise self.fail(f"{what}: dtypes differ ({a.dtype} vs {b.dtype})")

    def sized(self, big: torch.Tensor, small: torch.Tensor, names: str) -> None:
        """``big`` holds the group's size times as many elements as ``small``
        (``names``: "output ... input" as the message names them, big first)."""
        if big.numel() != small.numel() * self.size:
            big_name, small_name = names.split(" ")
            raise self.fail(f"{big_name} has {big.numel()} elements; needs {small_name}.numel() x size = "
                            f"{small.numel()} x {self.size}")

    def tensor_list(self, ts: object, what: str, like: torch.Tensor, uneven: bool = False) -> List[torch.Tensor]:
        """One tensor per rank, each of ``like``'s dtype and shape; with ``uneven`` (the
        v ops) only this rank's own is shaped like ``like``, the others' sizes are free."""
        size = self.size
        if not isinstance(ts, (list, tuple)):
            raise self.fail(f"{what} must be a list of {size} tensors, got {type(ts).__name__}")
        if len(ts) != size:
            raise self.fail(f"{what} has {len(ts)} tensors; the group has {size} ranks")
        for i, t in enumerate(ts):
            self.tensor(t, f"{what}[{i}]")
            free = uneven and i != self.rank
            if t.dtype != like.dtype or not (free or t.shape == like.shape):
                expected = f"{like.dtype}" + ("" if free else f"{list(like.shape)}")
                raise self.fail(f"{what}[{i}] is {t.dtype}{list(t.shape)}, expected {expected}"
                                + (" (this rank's own)" if uneven and not free else ""))
        return list(ts)

    def root_list(self, ts: object, what: str, root: int, like: torch.Tensor) -> List[torch.Tensor]:
        """The list only the root passes (gather's outputs, scatter's inputs); empty elsewhere."""
        if root == self.rank:
            return self.tensor_list(ts, what, like)
        if ts:
            raise self.fail(f"{what} must be empty on non-root rank {self.rank} (root is {root})")
        return []

    def rank_arg(self, r: object, what: str, me: Optional[int] = None) -> int:
        """A rank of the group, other than ``me`` when given."""
        size = self.size
        if isinstance(r, bool) or not isinstance(r, int):
            raise self.fail(f"{what} must be an int rank, got {r!r}")
        if not 0 <= r < size:
            raise self.fail(f"{what}={r} is out of range for a group of {size} ranks")
        if me is not None and r == me:
            raise self.fail(f"{what}={r} is this rank itself")
        return r

    def rank_list(self, ranks: Sequence[object], what: str) -> List[int]:
        """A non-empty list of distinct ranks of the group."""
        checked = [self.rank_arg(r, f"{what}[]") for r in ranks]
        if not checked:
            raise self.fail(f"{what} is empty")
        if len(set(checked)) != len(checked):
            raise self.fail(f"{what} has duplicates: {checked}")
        return checked

    def member_ids(self, members: object) -> List[int]:
        """A non-empty list of distinct member ids (ints >= 0)."""
        if not isinstance(members, (list, tuple)) or not members or any(
                isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0 for m in members) \
                or len(set(members)) != len(members):
            raise self.fail(f"members must be a non-empty list of member ids (ints >= 0) without duplicates, "
                            f"got {members!r}")
        return [int(m) for m in members]

    def reduce_op(self, op: object, dtype: torch.dtype) -> ReduceOp:
        """``op`` as a ``ReduceOp``, checked against the tensors' ``dtype``."""
        if op is ReduceOp.SUM:  # the common case is valid for every dtype
            return op
        try:
            op = coerce(op)
        except ValueError as exc:
            raise self.fail(str(exc)) from None
        is_int = not dtype.is_floating_point and not dtype.is_complex
        if op.is_bitwise and not is_int:
            raise self.fail(f"{op} is defined for integer and bool tensors, not {dtype}")
        if op.name == "AVG" and dtype == torch.bool:
            raise self.fail("ReduceOp.AVG is not defined for bool tensors")
        if op.name == "PREMUL_SUM":
            if not (dtype.is_floating_point or dtype.is_complex):
                raise self.fail(f"ReduceOp.PREMUL_SUM is defined for floating-point tensors, not {dtype}")
            f = op.factor
            if isinstance(f, torch.Tensor) and f.numel() != 1:
                raise self.fail("ReduceOp.PREMUL_SUM factor must be a scalar or a one-element tensor")
            if not isinstance(f, (int, float, torch.Tensor)) or isinstance(f, bool):
                raise self.fail(f"ReduceOp.PREMUL_SUM factor must be a number, got {f!r}")
        if dtype.is_complex and op.name not in ("SUM", "AVG", "PREMUL_SUM"):
            raise self.fail(f"{op} is not defined for complex tensors")
        return op

    def splits(self, splits: Optional[Sequence[int]], what: str, rows: int) -> Optional[List[int]]:
        size = self.size
        if splits is None:
            if rows % size:
                raise self.fail(f"{what} is None, so dim 0 ({rows}) must divide evenly by the group size {size}")
            return None
        splits = list(splits)
        if len(splits) != size:
            raise self.fail(f"{what} has {len(splits)} entries; the group has {size} ranks")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in splits):
            raise self.fail(f"{what} must be non-negative ints, got {splits}")
        if sum(splits) != rows:
            raise self.fail(f"{what} sums to {sum(splits)} but the tensor's dim 0 is {rows}")
        return splits


def timeout_seconds(timeout: Timeout, default_s: float, check: Checker) -> float:
    """A deadline in seconds: ``timeout`` (a timedelta, or seconds as an int or a float,
    as torch users pass them) or ``default_s`` when it is None."""
    if timeout is None:
        return default_s
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise check.fail(f"timeout must be a timedelta or a number of seconds, got {timeout!r}")
    if not 0 < seconds < MAX_TIMEOUT_S:  # also rejects nan and inf
        raise check.fail(f"timeout must be positive, finite and below 10 years, got {timeout!r}")
    return float(seconds)
