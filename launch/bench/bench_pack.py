"""What per-rank mode's snapshot costs a rank at each step boundary: calling-thread
CPU per ``Packer.pack`` of a synthetic state shaped like launch/train.py's (53
parameters with AdamW's two moments and step: 212 tensors, 7.66 MB), into the
three buffers the peer copies rotate, while a scheduler's epoch, its learning rate
and a data loader's position change at every pack, as they do in training.

    python launch/bench/bench_pack.py [--packs 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from commslayer.train.packing import Packer  # noqa: E402
from launch.bench.measure import median_range, parse  # noqa: E402


def snapshot(params: List[torch.Tensor], step: int) -> Dict[str, Any]:
    """The shape of ``_State.snapshot()`` at ``step``."""
    lr = 1e-3 * 0.99 ** step
    state = [{"step": (torch.tensor(float(step)), False), "exp_avg": (p, True), "exp_avg_sq": (p, True)}
             for p in params]
    return {"modules": {"model": {f"p{i}": p for i, p in enumerate(params)}},
            "optimizers": {"opt": {"state": state, "groups": [{"lr": lr, "betas": (0.9, 0.999)}]}},
            "objects": {"sched": {"last_epoch": step, "_last_lr": [lr]}, "data": {"position": 32 * step}}}


def one_run(packs: int) -> float:
    """The median CPU seconds of a pack, the first 10 (warm-up) left out."""
    params = [torch.randn(12000) for _ in range(53)]
    packer = Packer()
    buffers = [packer.pack(snapshot(params, 0)) for _ in range(3)]
    times = []
    for step in range(1, packs + 11):
        snap = snapshot(params, step)
        began = time.thread_time()
        buffers[step % 3] = packer.pack(snap, into=buffers[step % 3])
        times.append(time.thread_time() - began)
    return statistics.median(times[10:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--packs", type=int, default=50, help="timed packs per run (default 50)")
    p.add_argument("--repeats", type=int, default=3, help="runs (default 3)")
    p.add_argument("--smoke", action="store_true", help="one run of 5 packs")
    args = parse(p, {"packs": 5, "repeats": 1})
    runs = [one_run(args.packs) for _ in range(args.repeats)]
    print("| what | CPU per pack, median (ms) | min–max over runs (ms) |\n|---|---|---|")
    print(f"| pack, values changing every step | {median_range(runs, 1e3)} |")
    print(f"\ncommand: python launch/bench/bench_pack.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
