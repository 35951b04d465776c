"""The packed-state format (commslayer/train/packing.py): what peer copies, heals and reshards carry.

A snapshot reads back equal, tensor for tensor and bit for bit, to what went in and to
what ``torch.save``/``torch.load`` (the format before) gives; a pack into a buffer used
before lands in that buffer; bytes that are not a packed state raise ``BadState``, never
a crash or a wrong state."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from commslayer.errors import CommError
from commslayer.train import packing


def snapshot(seed: int) -> dict:
    """The shape of ``_State.snapshot()``: modules' tensors, optimizer state with sharded flags, objects."""
    g = torch.Generator().manual_seed(seed)
    return {
        "modules": {"model": [torch.randn(33, 7, generator=g), torch.randn(5, generator=g).to(torch.bfloat16),
                              torch.zeros(0), torch.tensor(True), torch.arange(6, dtype=torch.int64).view(2, 3).t()]},
        "optimizers": {"opt": {"state": [{"step": (torch.tensor(float(seed)), False),
                                          "exp_avg": (torch.randn(33, 7, generator=g), True)}, {}],
                               "groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "name": "a"}]}},
        "objects": {"sched": {"last_epoch": seed, 3: [1.5, "x", (1, 2)], "nested": {"t": torch.ones(2, 2)}}},
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_round_trip_equals_torch_save():
    snap = snapshot(1)
    packed = packing.pack(snap)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    back = packing.unpack(packed)
    buf = io.BytesIO()
    torch.save(snap, buf)
    buf.seek(0)
    assert same(back, snap)
    assert same(back, torch.load(buf, weights_only=True))
    back["modules"]["model"][0].add_(1)  # the tensors read back are their own, not views of the packed bytes
    assert same(packing.unpack(packed), snap)


def test_pack_into_a_buffer_used_before():
    first = packing.pack(snapshot(1))
    second = packing.pack(snapshot(2), into=first)
    assert second.data_ptr() == first.data_ptr()  # no new buffer
    assert same(packing.unpack(second), snapshot(2))
    small = torch.zeros(16, dtype=torch.uint8)
    third = packing.pack(snapshot(3), into=small)  # too small: a new buffer, the old one untouched
    assert third.data_ptr() != small.data_ptr() and not small.any()
    assert same(packing.unpack(third), snapshot(3))


def test_a_packer_reused_across_steps_and_buffers():
    """Per-rank mode's use: one packer, a pack per step into the buffers the copies
    rotate, the structure mostly unchanged. Each pack reads back as the snapshot it
    was given, also where only a number's type changed (1 and 1.0 and True pickle
    differently), where a value, a shape or the set of tensors changed, and in the
    buffers whose views the packer kept from before such a change."""
    packer = packing.Packer()
    buffers = [packer.pack(snapshot(0)) for _ in range(3)]
    changes = [lambda s: s, lambda s: s["optimizers"]["opt"]["groups"][0].update(lr=1),
               lambda s: s["optimizers"]["opt"]["groups"][0].update(lr=1.0),
               lambda s: s["optimizers"]["opt"]["groups"][0].update(lr=True),
               lambda s: s["objects"]["sched"].update(last_epoch=-1),
               lambda s: s["modules"]["model"].append(torch.randn(3, 4)),
               lambda s: s["modules"]["model"].__setitem__(0, torch.randn(7, 33)),
               lambda s: s["optimizers"]["opt"]["state"][1].update(step=(torch.tensor(2.0), False))]
    for step in range(3 * len(changes)):
        snap = snapshot(step)
        changes[step // 3](snap)
        buf = buffers[step % len(buffers)]
        packed = packer.pack(snap, into=buf)
        assert packed.data_ptr() == buf.data_ptr() or buf.numel() < packed.numel(), step
        assert same(packing.unpack(packed), snap), step
        assert same(packing.unpack(packed), packing.unpack(packing.pack(snap))), step
        buffers[step % len(buffers)] = packed if packed.data_ptr() != buf.data_ptr() else buf


def test_values_that_change_every_step_keep_the_tensors_in_place():
    """A scheduler's epoch and a loader's position change at every step: the header is
    written again, but the tensors stay where they were, so each buffer's views are
    reused (not made again per tensor), also when the header grows a little; a longer
    header than the room left moves them, and every pack still reads back."""
    packer = packing.Packer()
    buf = packer.pack(snapshot(0))
    views = packer._views[buf.data_ptr()]
    for epoch in (1, 10**6, -5):
        snap = snapshot(0)
        snap["objects"]["sched"]["last_epoch"] = epoch
        assert packer.pack(snap, into=buf).data_ptr() == buf.data_ptr()
        assert packer._views[buf.data_ptr()] is views, epoch
        assert same(packing.unpack(buf[:packer._start + packer._bytes]), snap)
    snap = snapshot(0)
    snap["objects"]["sched"]["long"] = "x" * 10_000
    packed = packer.pack(snap, into=buf)
    assert packer._views.get(buf.data_ptr()) is not views
    assert same(packing.unpack(packed), snap)


def hostile(packed: torch.Tensor) -> list:
    header = packed[:4].clone()
    flipped = packed.clone()
    flipped[12:40] = 0xFF  # inside the header
    return [torch.empty(0, dtype=torch.uint8), header, packed[:100].clone(), packed[:-1].clone(),
            torch.cat([packed, torch.zeros(64, dtype=torch.uint8)]), flipped,
            torch.frombuffer(bytearray(b"CLST" + b"\xff" * 60), dtype=torch.uint8),
            packed.view(2, -1) if packed.numel() % 2 == 0 else packed[:-1].view(2, -1),
            packed[::2], packed.to(torch.int16)]


def test_bytes_that_are_not_a_packed_state():
    packed = packing.pack(snapshot(1))
    for i, data in enumerate(hostile(packed)):
        with pytest.raises(packing.BadState) as err:
            packing.unpack(data)
        assert isinstance(err.value, CommError) and "unpack" in str(err.value), i
