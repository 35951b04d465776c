"""Loaded by ``import torch`` through the ``torch.backends`` entry point.

With ``COMMSLAYER_TRACE_DIR`` set, every communicator of the process is
recorded from the start, also in a job that never imports ``tracing``.
"""


def autoload() -> None:
    # An exception here would make `import torch` itself fail: warn instead.
    try:
        from commslayer import config

        if config.trace_dir():
            from .recorder import install

            install()
    except Exception as exc:  # pragma: no cover - depends on the environment
        import warnings

        warnings.warn(f"commslayer tracing could not start: {exc!r}", stacklevel=1)
