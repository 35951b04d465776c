"""A torch.distributed job with no commslayer in it: ``NOPS`` all-reduces, then the
end; with ``DIE_RANK`` set, that rank ends a second after them (its trace sink has
written its lines by then; no goodbye, no dump) while the others block in one more;
with ``CHDIR`` set, it changes into that directory once its group is built, as a
Hydra run does.  Run by torchrun (``tests/test_trace_reuse.py``)."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if os.environ.get("CHDIR"):
    os.chdir(os.environ["CHDIR"])
for _ in range(int(os.environ["NOPS"])):
    dist.all_reduce(torch.ones(4))
if os.environ.get("DIE_RANK"):
    if dist.get_rank() == int(os.environ["DIE_RANK"]):
        time.sleep(1.0)
        os._exit(1)
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
