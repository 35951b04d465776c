"""Loaded by ``import torch`` through the ``torch.backends`` entry point.

It registers the ``"commslayer"`` c10d backend name, and with
``COMMSLAYER_ROUTE_C10D=1`` routes every group an unmodified job creates
through commslayer.
"""


def autoload() -> None:
    import sys

    if "commslayer" in sys.modules:
        from .startup import is_ready

        if not is_ready():
            return  # commslayer is importing torch; its __init__ registers the backend itself
    # An exception here would make `import torch` itself fail: warn instead.
    try:
        from . import config
        from .c10d import install_routing, register_backend

        register_backend()
        if config.route_c10d():
            install_routing()
    except Exception as exc:  # pragma: no cover - depends on the torch build
        import warnings

        warnings.warn(f"commslayer could not register with torch.distributed: {exc!r}", stacklevel=1)
