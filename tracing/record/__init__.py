"""The recorder side of tracing, which runs inside the job: the flight
recorder (recorder), one op's record as the hot path fills it (oprecord), and
the sinks that write records off the hot path (sinks, jsonl, otel).  It may
import torch, commslayer and the trace format at ``tracing``'s root, never
the reader (``tracing.read``).
"""
