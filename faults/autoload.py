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
    if "commslayer" not in sys.modules:
        _install()
        return
    from commslayer.startup import when_ready

    when_ready(_install)  # commslayer may be importing torch: then it runs once the package is complete


def _install() -> None:
    from commslayer.startup import when_placed

    from .inject import install

    # a bad COMMSLAYER_FAULTS raises here: a fault run must not go on without its faults; a warm
    # spare arms the faults of the rank it adopts, when it adopts one
    when_placed(install)
