"""A rank's state as bytes: the format that peer copies, heals and reshards carry.

A snapshot (``_State.snapshot``: nested dicts, lists and tuples of tensors,
numbers and strings) is packed as a fixed head (magic, the header's length,
where the tensors begin), a small header, the snapshot with each tensor
replaced by its index, dtype and shape (``torch.save``, read back with
``torch.load(weights_only=True)``: the bytes come from other processes), then,
from a 64-byte boundary that may leave room for a longer header, every
tensor's bytes, each at a 64-byte boundary, in one 1-D ``uint8`` tensor that
the collectives carry as it is.  Per-rank mode packs the state at
every step boundary (docs/bench/step-cost.md): a ``torch.save`` of the whole
snapshot into bytes, and the copies in and out of ``bytes`` around each
transfer, cost a rank milliseconds of CPU per 2.6 MB here, most of it page
faults of fresh buffers; packing into a buffer used before costs a fraction.

The bytes name no version: every process of a job runs the same commslayer.
"""

from __future__ import annotations

import ctypes
import io
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from commslayer.errors import CommError

_MAGIC = b"CLST"
_HEAD = struct.Struct("<4sQQ")  # magic, header bytes, where the tensors begin
_ALIGN = 64
_TENSOR = "commslayer.packing.tensor"  # the header's stand-in for a tensor: (_TENSOR, index)


class BadState(CommError):
    """Bytes that are not a packed state (cut short, or from something else)."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


_SAME = object()


def _rebuilt(obj: Any, swap: Callable[[Any], Any]) -> Any:
    """``obj`` with every part for which ``swap`` returns something other than ``_SAME``
    replaced by that (dicts, lists and tuples rebuilt around them)."""
    new = swap(obj)
    if new is not _SAME:
        return new
    if isinstance(obj, dict):
        return {k: _rebuilt(v, swap) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_rebuilt(v, swap) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _strip(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by its stand-in, the tensors appended to ``tensors``."""
    def swap(part: Any) -> Any:
        if not isinstance(part, torch.Tensor):
            return _SAME
        tensors.append(part)
        return (_TENSOR, len(tensors) - 1)
    return _rebuilt(obj, swap)


def _fill(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``_strip`` undone."""
    return _rebuilt(obj, lambda part: tensors[part[1]] if isinstance(part, tuple) and len(part) == 2
                    and part[0] == _TENSOR else _SAME)


class Packer:
    """Packs the snapshots of one state, again and again, into buffers used before.

    Per-rank mode packs at every step boundary.  From one step to the next the
    snapshot's tensors (their dtypes and shapes) seldom change, while its other
    values do at every step (a scheduler's epoch, a data loader's position).  So
    each tensor's place is worked out only when the tensors change, each buffer's
    views of those places are kept for the next pack into it, and the tensors are
    copied in one ``torch._foreach_copy_``: per tensor, the Python of a slice, two
    views and a copy cost about 5 µs, 1 ms a pack for the 212 tensors of
    ``launch/train.py``'s state.  The header is written again when the structure
    changes (compared by its ``repr``, which tells ``1`` from ``1.0`` and ``True``
    and writes a float exactly); the tensors begin after room for a header of
    twice its first length, so a longer one seldom moves them."""

    _KEPT = 4  # buffers whose views are kept: the peer copies rotate three

    def __init__(self) -> None:
        self._specs: List[Tuple[torch.dtype, torch.Size]] = []
        self._text: Optional[str] = None  # the repr of the structure the header holds
        self._prefix = torch.empty(0, dtype=torch.uint8)  # the head and the header
        self._start = 0  # where the tensors begin
        self._offsets: List[int] = []  # each tensor's offset from there
        self._bytes = 0  # the tensors' bytes, padding included
        self._views: Dict[int, List[torch.Tensor]] = {}  # a buffer's data pointer -> its views, per tensor

    def pack(self, snapshot: Any, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``snapshot`` packed (see the module doc): a 1-D ``uint8`` tensor, in the front of
        ``into`` where that is large enough (a buffer an earlier pack returned, no longer
        in use: a fresh one of this size costs page faults worth more than the copy), else
        in a new buffer.  The padding between tensors holds whatever an earlier pack into
        the same buffer left there."""
        tensors: List[torch.Tensor] = []
        structure = _strip(snapshot, tensors)
        specs = [(t.dtype, t.shape) for t in tensors]
        text = repr(structure)
        if specs != self._specs:
            self._place(tensors)
            self._specs, self._text = specs, None
        if text != self._text:
            self._write_header(structure, tensors)
            self._text = text
        size = self._start + self._bytes
        if into is None or into.numel() < size:
            into = torch.zeros(size, dtype=torch.uint8)
        out = into[:size]
        out[:self._prefix.numel()] = self._prefix
        with torch.no_grad():  # the copies record no autograd history: no detach() per tensor
            torch._foreach_copy_(self._views_of(out, tensors), tensors)
        return out

    def _place(self, tensors: List[torch.Tensor]) -> None:
        self._offsets, at = [], 0
        for t in tensors:
            self._offsets.append(at)
            at = _aligned(at + t.numel() * t.element_size())
        self._bytes = at
        self._views.clear()

    def _write_header(self, structure: Any, tensors: List[torch.Tensor]) -> None:
        specs = [(str(t.dtype).removeprefix("torch."), list(t.shape), at) for t, at in zip(tensors, self._offsets)]
        header = io.BytesIO()
        torch.save({"structure": structure, "tensors": specs, "bytes": self._bytes}, header)
        length = header.tell()
        if _HEAD.size + length > self._start:  # the tensors move: room for twice this header
            self._start = _aligned(_HEAD.size + 2 * length)
            self._views.clear()
        self._prefix = torch.frombuffer(bytearray(_HEAD.pack(_MAGIC, length, self._start) + header.getvalue()),
                                        dtype=torch.uint8)

    def _views_of(self, out: torch.Tensor, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Each tensor's place in ``out``, as a tensor of its dtype and shape; kept per
        buffer (a view keeps its buffer alive, so no other buffer has its address)."""
        views = self._views.get(out.data_ptr())
        if views is None:
            start = self._start
            views = [out[start + at:start + at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                     for at, t in zip(self._offsets, tensors)]
            if len(self._views) >= self._KEPT:
                del self._views[next(iter(self._views))]
            self._views[out.data_ptr()] = views
        return views


def pack(snapshot: Any, into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``snapshot`` packed once (``Packer.pack``)."""
    return Packer().pack(snapshot, into)


def unpack(data: torch.Tensor) -> Any:
    """The snapshot that ``pack`` made ``data`` (a 1-D ``uint8`` tensor) of; its tensors are
    copies of their own."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous() or data.numel() < _HEAD.size:
        raise BadState(f"a {data.dtype} tensor of shape {list(data.shape)} that is not a packed state", op="unpack")
    magic, size, start = _HEAD.unpack(ctypes.string_at(data.data_ptr(), _HEAD.size))
    if magic != _MAGIC or size > data.numel() - _HEAD.size or not _HEAD.size + size <= start <= data.numel():
        raise BadState(f"{data.numel()} bytes that are not a packed state", op="unpack")
    try:
        header = torch.load(io.BytesIO(ctypes.string_at(data.data_ptr() + _HEAD.size, size)), weights_only=True)
        if start + header["bytes"] != data.numel():
            raise BadState(f"a packed state of {start + header['bytes']} bytes in {data.numel()}", op="unpack")
        tensors = []
        for dtype_name, shape, offset in header["tensors"]:
            dtype = getattr(torch, dtype_name)
            n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            if offset < 0 or offset + n > header["bytes"]:
                raise BadState(f"a packed state whose tensor at {offset} overruns it", op="unpack")
            raw = data[start + offset:start + offset + n]
            tensors.append(raw.clone().view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype))
        return _fill(header["structure"], tensors)
    except BadState:
        raise
    except Exception as exc:  # a header torch.load refuses, a dtype that is not one, a malformed spec
        raise BadState(f"a packed state that does not read back: {type(exc).__name__}: {exc}", op="unpack") from exc
