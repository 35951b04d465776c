"""Collective tracing: records, the flight recorder, sinks and the trace viewer.

Built in a later issue; this package exists so the distribution's layout is
fixed from the start.
"""
