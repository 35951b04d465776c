"""A plain torch.distributed job with no commslayer in it: all-reduces until a peer is lost.

Run by torchrun: ``peer_loss_job.py OUT_DIR``.  Every rank writes
``pid<R>`` once its first all-reduce is done, then all-reduces until an op
raises; it then writes ``error<R>.json`` (class, message, the ``ranks`` a
``CommError`` names, the wall time it was caught) and exits 0.  Under
``COMMSLAYER_ROUTE_C10D=1`` the ops run on commslayer.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1024)
    dist.all_reduce(t)
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    try:
        for _ in range(600):
            dist.all_reduce(t)
            time.sleep(0.05)
        error = None
    except Exception as exc:  # what a user's job would see
        error = {"type": type(exc).__name__, "msg": str(exc), "ranks": list(getattr(exc, "ranks", ())),
                 "t": time.time()}
    with open(os.path.join(out, f"error{rank}.json"), "w") as f:
        json.dump(error, f)


if __name__ == "__main__":
    main()
