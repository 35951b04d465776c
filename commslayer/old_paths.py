"""The modules' paths from before the subpackages, kept for one release.

``import commslayer.redundancy`` (docs/api.md named such paths) still works:
it warns with a ``DeprecationWarning`` that names the new path, and gives
the very module that lives there (``commslayer.train.redundancy``), so a
name set or patched through either path is seen through both.  The next
release drops this module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

_SUBPACKAGES = {
    "comm": "communicator collectives p2p op_path process_group create lifecycle work watchdog wire validation "
            "check batch ring native nan_check isolation backends exits",
    "detect": "liveness watch watchsim addresses",
    "agree": "membership agreement store etcdstore",
    "train": "job peerjob replicas gradients redundancy reshard failures",
    "run": "launcher launch supervisor processes",
}
MOVED = {f"commslayer.{name}": f"commslayer.{sub}.{name}"
         for sub, names in _SUBPACKAGES.items() for name in names.split()}


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the old path's spec on the module: give it back its own
        module.__spec__ = module.__spec__.loader_state  # type: ignore[union-attr]


def install() -> None:
    """Let the old paths import (idempotent)."""
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())
