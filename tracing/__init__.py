"""Collective tracing, in two sides that share the trace format at this root.

``tracing.record`` runs in the job: the flight recorder and its sinks
(structlog JSON lines, OpenTelemetry), attached to commslayer's hooks.
``tracing.read`` runs after or beside it: ``commslayer-trace``, its analysis,
the HTML view, the Perfetto export and the live watch; it imports neither
torch nor commslayer.  The root holds what both sides read and write: the
record fields and states (records), the dump files (dumps), the flight
recorder's c10d-compatible dump (fr_format), the shared wording (messages),
and the ``torch.backends`` entry point (autoload), which imports the recorder
only when ``COMMSLAYER_TRACE_DIR`` asks for it.
"""
