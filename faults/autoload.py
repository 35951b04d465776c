"""Loaded by ``import torch`` through the ``torch.backends`` entry point.

With ``COMMSLAYER_FAULTS`` or ``COMMSLAYER_FAULTS_LOG`` set (the fault
harness sets both), every communicator of the process gets the injector's
hooks from the start, also in a job that never imports ``faults``.
"""


def autoload() -> None:
    import os
    import sys

    if not (os.environ.get("COMMSLAYER_FAULTS") or os.environ.get("COMMSLAYER_FAULTS_LOG")):
        return
    package = sys.modules.get("commslayer")
    if package is not None and not getattr(package, "_ready", False):
        package.__dict__.setdefault("_when_ready", []).append(_install)  # commslayer is importing torch
        return
    _install()


def _install() -> None:
    from .inject import install

    install()  # a bad COMMSLAYER_FAULTS raises here: a fault run must not go on without its faults
