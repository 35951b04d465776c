"""Exposed communication time from the caller's wait: c10d issues every op of our
backend as an async op and waits on it, so before the caller's ``Work.wait`` was
traced, a c10d job (FSDP, DDP) showed 0 s exposed.  Two real ranks run
``dist.all_reduce`` through ``init_process_group("commslayer")`` (blocking for the
caller) and an async op waited on only after a sleep (hidden: its wait is short)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.harness import run_ranks
from tests.viewer_traces import run_cli

SLEEP_S = 0.3


def _job(rank, size, store, trace_dir):
    import torch.distributed as dist

    from tracing.record.recorder import install

    rec = install(trace_dir, signals=False)
    dist.init_process_group("commslayer", store=store, rank=rank, world_size=size)
    t = torch.ones(1 << 16)
    for _ in range(5):
        dist.all_reduce(t)  # the caller blocks: exposed
    work = dist.all_reduce(t, async_op=True)
    time.sleep(SLEEP_S)  # the op is long done when the caller waits: hidden
    work.wait()
    rec.dump("end of run")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_exposed_time_of_a_c10d_job_comes_from_the_callers_wait(tmp_path):
    run_ranks(_job, 2, str(tmp_path), timeout=90)
    d = json.loads(run_cli("overlap", "--json", str(tmp_path))[1])
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    docs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for row, doc in zip(d["ranks"], docs):
        ops = [r for r in doc["records"] if r["op"] == "all_reduce" and r["comm"].startswith("c10d")]
        assert len(ops) == 6 and all(r["async_op"] for r in ops)  # the adapter issues them async
        assert all(r["wait_ns"] <= r["wait_end_ns"] for r in ops)
        # sequential ops: the union is the sum of each wait cut to its op's flight
        waited = sum(max(0, min(r["wait_end_ns"], r["end_ns"]) - max(r["wait_ns"], r["start_ns"])) for r in ops) / 1e9
        assert row["exposed_comm_s"] > 0 and abs(row["exposed_comm_s"] - waited) < 1e-6, (row, waited)
        late = ops[5]
        assert late["wait_ns"] - late["end_ns"] > SLEEP_S * 0.5 * 1e9  # waited on well after it ended
        assert late["wait_end_ns"] - late["wait_ns"] < 0.05 * 1e9
        assert row["exposed_comm_s"] < row["comm_s"] + 0.002
