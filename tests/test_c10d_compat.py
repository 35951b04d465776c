"""Two-way compatibility: one ordinary torch.distributed job
(tests/jobs/c10d_compat_job.py: every collective and point-to-point op sync and
async, the collectives on tensors that are not contiguous, coalescing blocks, object
collectives, new_group and new_subgroups, a 2-D DeviceMesh and FSDP2 as HSDP on one,
DDP with a comm hook and its logging data, monitored_barrier, timeouts per group and
per op) runs under torchrun on plain Gloo and with ``COMMSLAYER_ROUTE_C10D=1``; both
runs' results and what the job can read about its groups, works and errors must be
equal, bitwise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from tests.harness import free_port

JOB = Path(__file__).parent / "jobs" / "c10d_compat_job.py"


def _torchrun(tmp_path: Path, routed: bool) -> List[Dict[str, Any]]:
    prefix = tmp_path / ("routed" if routed else "plain")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(JOB), str(prefix)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSLAYER_")}
    env.update(OMP_NUM_THREADS="1", **({"COMMSLAYER_ROUTE_C10D": "1"} if routed else {}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(f"{prefix}.{rank}.pt", weights_only=False) for rank in (0, 1)]


def differences(a: Any, b: Any, path: str = "") -> List[str]:
    """Where two results differ: tensors by dtype, shape and bits, containers key by key."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(a.keys() | b.keys(), key=str)
        return [d for k in keys for d in differences(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} vs {b!r}"]


@pytest.mark.timeout(240)
def test_a_job_cannot_tell_routed_commslayer_from_gloo(tmp_path: Path) -> None:
    plain = _torchrun(tmp_path, routed=False)
    routed = _torchrun(tmp_path, routed=True)
    for rank in (0, 1):
        diffs = differences(plain[rank], routed[rank])
        # docs/api.md (route switch): a collective that writes an expanded view runs on Gloo
        # and is refused by commslayer, at once
        for async_op in (False, True):
            part = f"non-contiguous async={async_op}"
            assert routed[rank][part]["all_reduce expanded"][0][:2] == \
                ("raised", ["RuntimeError", "ValueError", "Exception", "BaseException", "object"])
            ran = plain[rank][part]["all_reduce expanded"][0]  # a work's state, or a sync call's outcome
            assert isinstance(ran, dict) or ran[0] == "ok", ran
            diffs = [d for d in diffs if not d.startswith(f"/{part}/all_reduce expanded[0]")]
        # docs/api.md (route switch): plain Gloo's reduce-scatter works answer is_completed()
        # False even after wait() returned; commslayer's answer True
        assert sorted(diffs) == [f"/{part} async=True/{op}[0]/is_completed[1]: False vs True"
                                 for part, op in (("collectives", "reduce_scatter"),
                                                  ("collectives", "reduce_scatter_tensor"),
                                                  ("non-contiguous", "reduce_scatter_tensor"))], \
            f"rank {rank}:\n" + "\n".join(diffs)
    # the comparison is of runs that did something: results moved, timeouts fired
    ours = routed[0]
    assert ours["world"]["backend"] == "gloo" and ours["groups"]["mesh"]["dp"]["size"] == 2
    assert ours["collectives async=False"]["all_reduce"][1].tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    for async_op in (False, True):  # written through views that are not contiguous, as Gloo writes them
        strided = ours[f"non-contiguous async={async_op}"]
        assert strided["all_reduce"][1][0].tolist()[0] == [3.0, 15.0, 27.0], strided["all_reduce"]
        assert strided["reduce_scatter_tensor"][1][0].tolist()[0] == [3.0, 27.0, 51.0]
    assert ours["p2p"]["recv any"][0] == 1 and ours["p2p"]["batch"][1].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    # torch turns received bytes back into objects through numpy; without it both runs raised alike
    gathered = ours["objects"]["gather_object"]
    if importlib.util.find_spec("numpy") is not None:
        assert gathered == (("ok", None), [("g", 0), ("g", 1)]), gathered
    else:
        assert gathered[0][0] == "raised" and routed[1]["objects"]["gather_object"][0] == ("ok", None)
    assert [t.tolist() for t in ours["coalesced"]["all_reduce async=True"]] == [[3.0, 3.0], [0.0, 5.0, 10.0]]
    torch.manual_seed(1)  # HSDP trained: its first weight moved from where the job built it
    assert not torch.equal(ours["groups"]["hsdp"][0], torch.nn.Linear(8, 16).weight.detach())
    assert ours["ddp"]["logging"]["backend_name"] == "gloo" and ours["monitored_barrier"] == ("ok", None)
    assert ours["timeouts"]["group timeout"][0] == ours["timeouts"]["op timeout"][0] == "raised"
