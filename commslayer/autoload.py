"""Loaded by ``import torch`` through the ``torch.backends`` entry point.

It registers the ``"commslayer"`` c10d backend name, and with
``COMMSLAYER_ROUTE_C10D=1`` routes every group an unmodified job creates
through commslayer.  It also makes the process wait, at exit, for c10d Gloo's
worker threads to let go of their last op (commslayer.gloo_exit).
"""


def autoload() -> None:
    # commslayer.registration imports only torch.distributed: safe while any commslayer
    # module is half imported (the one whose `import torch` runs this).
    # An exception here would make `import torch` itself fail: warn instead.
    try:
        from commslayer import config, gloo_exit
        from commslayer.registration import install_routing, register_backend

        gloo_exit.install()
        register_backend()
        if config.route_c10d():
            install_routing()
    except Exception as exc:  # pragma: no cover - depends on the torch build
        import warnings

        warnings.warn(f"commslayer could not register with torch.distributed: {exc!r}", stacklevel=1)
