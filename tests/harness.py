"""The tests' process helpers: ranks on real processes (``faults.ranks``) and a free port."""

from commslayer.processes import free_port
from faults.ranks import RankDied, run_ranks

__all__ = ["RankDied", "free_port", "run_ranks"]
