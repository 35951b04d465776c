"""Loaded by ``import torch`` through the ``torch.backends`` entry point.

With ``COMMSLAYER_TRACE_DIR`` set, every communicator of the process is
recorded from the start, also in a job that never imports ``tracing``.
"""


def autoload() -> None:
    import os
    import sys

    if not os.environ.get("COMMSLAYER_TRACE_DIR"):
        return
    if "commslayer" not in sys.modules:
        _install()
        return
    from commslayer.startup import when_ready

    when_ready(_install)  # commslayer may be importing torch: then it runs once the package is complete


def _install() -> None:
    from commslayer import config
    from commslayer.startup import when_placed

    # A bad COMMSLAYER_* value fails here, at start-up (torch reports it as the cause of a
    # failed `import torch`): a job must not run on with tracing silently off.
    config.validate()
    when_placed(_record)  # a warm spare's files are named by the rank it adopts


def _record() -> None:
    # Anything else here would make `import torch` itself fail: warn instead.
    try:
        from tracing.record.recorder import install

        install()
    except Exception as exc:  # pragma: no cover - depends on the environment
        import warnings

        warnings.warn(f"commslayer tracing could not start: {exc!r}", stacklevel=1)
