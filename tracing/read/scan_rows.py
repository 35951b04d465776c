"""How the viewer's one pass over a job (``tracing.read.analysis.JobScan``) keeps a
collective: one flat array of integers per (communicator, generation,
sequence number), ``WIDTH`` values per rank that recorded it, ranks in
ascending order, so 16 ranks x 100,000 records fit in a few hundred MB.

Shared by the analysis and the recovery story (``tracing.read.story``), below
both.  Imports neither torch nor commslayer.
"""

from __future__ import annotations

from itertools import repeat
from operator import sub
from typing import Dict, List, Sequence, Tuple

from tracing.records import COMPLETED, STATES

STATE_CODES = {s: i for i, s in enumerate(STATES)}
COMPLETED_CODE = STATE_CODES[COMPLETED]
# A collective's flat array holds WIDTH values per rank, at these offsets (JobScan.collectives):
# rank, enqueue, start, end (-1: none), fingerprint id, state code, call site id.
RANK, ENQ, START, END, FP, STATE, SITE = range(7)
WIDTH = 7


def arrivals(a: Sequence[int], off: Dict[int, int]) -> Tuple[Tuple[int, ...], List[int]]:
    """The ranks of collective array ``a`` and the enqueue of each on the common axis;
    ``off``: each rank's clock offset (ns), 0 where unknown."""
    ranks = tuple(a[RANK::WIDTH])
    return ranks, list(map(sub, a[ENQ::WIDTH], map(off.get, ranks, repeat(0))))
