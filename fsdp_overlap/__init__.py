"""FSDP2 extension that runs reduce-scatter on its own commslayer communicator.

Built in a later issue; this package exists so the distribution's layout is
fixed from the start.
"""
