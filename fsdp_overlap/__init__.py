"""fsdp_overlap: FSDP2's gradient reduce-scatter on its own commslayer communicator.

``enable(module)`` moves the reduce-scatter of every FSDP2 parameter group in
``module`` onto a communicator split from the shard communicator (traced,
with deadlines, like any other), optionally bound to its own network
interface, and makes backward all-gathers asynchronous on CPU so the two
really overlap. ``disable(module)`` undoes it. See docs/fsdp_overlap.md.
"""

from .extension import FsdpInternalsChanged, disable, enable

__all__ = ["enable", "disable", "FsdpInternalsChanged"]
