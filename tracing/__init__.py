"""Collective tracing: the trace records, the flight recorder and its dumps,
and the sinks (structlog JSON lines, OpenTelemetry).

``records`` (the trace format) and the analysis/viewer modules import neither
torch nor commslayer; ``recorder`` and the sinks attach to commslayer's hooks.
"""
