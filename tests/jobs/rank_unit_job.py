"""A rank under ``commslayer-run``'s per-rank mode that only reads its environment,
talks to the job's store and writes files: tests/test_supervisor.py checks the
launcher's side of the store contract with it, fast (no collectives).

``rank_unit_job.py SCENARIO OUT``; every life writes ``OUT/rank<r>-life<n>.json``
(its environment) first, then:

- ``exit``: exits 0.
- ``fail-once``: rank 1's life 0 exits 1; everything else exits 0.
- ``stop``: rank 1's life 0 writes its pid and SIGSTOPs itself; rank 0 waits
  until it is stopped and writes ``rank/1/lost/0``; rank 1's life 1 writes the
  state of life 0 (from /proc) into ``OUT/life0-seen-by-life1``.
- ``always-fail``: rank 1 exits 1 in every life; rank 0 waits for ``rank/1/gone``
  and writes its value into ``OUT/gone``.
- ``job-failed``: rank 0 writes ``job/failed``; rank 1 sleeps; rank 2 waits for
  ``job/failed``, writes ``OUT/rank2-dumped`` and exits 0.
- ``sleep``: sleeps (until the launcher ends it).
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
       "TORCHELASTIC_RESTART_COUNT", "COMMSLAYER_JOB_STORE", "COMMSLAYER_RESTART_UNIT", "COMMSLAYER_NODE",
       "COMMSLAYER_JOB_RANK", "OMP_NUM_THREADS", "COMMSLAYER_RUN_DIR", "COMMSLAYER_TRACE_DIR",
       "COMMSLAYER_FAULTS_LOG", "COMMSLAYER_REPLICA", "COMMSLAYER_REPLICAS")
DEADLINE_S = 30


def store():
    import torch.distributed as dist

    host, _, port = os.environ["COMMSLAYER_JOB_STORE"].rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=DEADLINE_S), use_libuv=True)


def wait_for(what, done):
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if time.monotonic() > deadline:
            sys.exit(f"rank_unit_job: {what} did not come within {DEADLINE_S}s")
        time.sleep(0.05)


def state(pid):
    """The /proc state letter of ``pid`` (T: stopped), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    rank, life = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(out, f"rank{rank}-life{life}.json"), "w") as f:
        json.dump({name: os.environ.get(name) for name in ENV}, f)
    if scenario == "fail-once" and (rank, life) == (1, 0):
        sys.exit(1)
    if scenario == "always-fail":
        if rank == 1:
            sys.exit(1)
        if rank == 0:
            s = store()
            wait_for("rank/1/gone", lambda: s.check(["rank/1/gone"]))
            with open(os.path.join(out, "gone"), "w") as f:
                f.write(s.get("rank/1/gone").decode())
    if scenario == "stop":
        pid_file = os.path.join(out, "life0.pid")
        if (rank, life) == (1, 0):
            with open(pid_file + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
            os.kill(os.getpid(), signal.SIGSTOP)
            sys.exit("rank_unit_job: life 0 of rank 1 ran again")  # only SIGCONT gets here: not in this test
        if rank == 0:
            wait_for("life 0 of rank 1 stopped", lambda: os.path.exists(pid_file) and
                     state(int(open(pid_file).read())) == "T")
            store().set("rank/1/lost/0", "stopped")
        if (rank, life) == (1, 1):
            pid = int(open(pid_file).read())
            with open(os.path.join(out, "life0-seen-by-life1"), "w") as f:
                json.dump({"pid": pid, "state": state(pid), "me": os.getpid()}, f)
    if scenario == "sleep":
        time.sleep(DEADLINE_S)
        sys.exit("rank_unit_job: not ended")
    if scenario == "job-failed":
        if rank == 0:
            store().set("job/failed", "rank 0 found that the job cannot go on\nsecond line")
        if rank == 1:
            time.sleep(DEADLINE_S)
            sys.exit("rank_unit_job: rank 1 was not ended")
        if rank == 2:
            s = store()
            wait_for("job/failed", lambda: s.check(["job/failed"]))
            open(os.path.join(out, "rank2-dumped"), "w").close()


if __name__ == "__main__":
    main()
