"""The reader side of tracing, which runs after or beside the job:
``commslayer-trace`` (cli), reading and checking trace files (traceio), the
one pass over a job's records (analysis, scan_rows, layout), the recovery
story (story), the HTML view (viewer), the Perfetto export (perfetto) and the
live terminal view (watch).  It imports neither torch, commslayer nor the
recorder side: only the trace format at ``tracing``'s root.
"""
