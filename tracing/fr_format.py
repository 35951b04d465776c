"""Placeholder until the Flight Recorder export lands (being written now)."""


def to_flight_recorder(doc):
    return {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": []}
