"""Property-based fuzzing of the viewer (issue 16): no trace input makes a
subcommand raise.  Hypothesis builds jobs of one to three ranks whose dumps
(``rank<R>.json``) and JSON lines (``rank<R>.jsonl``) start from valid ones
(tests/viewer_traces.py) and then get fields replaced by arbitrary JSON or
by values near the edges (wrong types, integers past int64, negative times,
placeholders, terminal escapes), fields deleted, junk lines inserted, or
files cut short.  Every subcommand (``watch --once`` too) then runs
in-process; it must exit 0, 1 (``diagnose`` only) or 2, never with a
traceback or an internal error, and what it writes must be valid.
Derandomized, so CI sees the same examples; a failure is shrunk by
Hypothesis to a minimal input."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.viewer_traces import dump_doc, jsonl_lines, record, run_cli
from tracing.records import RECORD_FIELDS

EDGE_INTS = [0, 1, -1, 2, 7, 2 ** 31, 2 ** 62 - 1, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 10 ** 30, -(2 ** 63)]
EDGE_TEXT = ["", "1", "abc", "a.0", "completed", "started", "all_reduce", "reduce_scatter_single", "%DATA%",
             "%SCRIPT%", "\x1b]0;t\x07\x1b[31m", "</script>", "line\nbreak", "\u202e"]
SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(),
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EDGE_TEXT),
                    st.text(max_size=8))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=6)


def _like(value):
    """Values of the type of ``value``, edges included: a record with them may
    still be valid, and then it is the analysis, not the reader, that meets them."""
    if type(value) is int:
        return st.one_of(st.sampled_from(EDGE_INTS), st.integers())
    if type(value) is str:
        return st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=8))
    return JSON


@st.composite
def mutated(draw, base):
    """``base`` (a JSON object) with up to three of its fields replaced by a
    value of their type, by any JSON value, or deleted; now and then replaced
    by any JSON value as a whole."""
    if not isinstance(base, dict) or not base or draw(st.integers(0, 19)) == 0:
        return draw(JSON)
    out = dict(base)
    for key in draw(st.lists(st.sampled_from(sorted(base)), max_size=3, unique=True)):
        how = draw(st.integers(0, 3))
        if how == 0:
            del out[key]
        else:
            out[key] = draw(JSON if how == 1 else _like(base[key]))
    return out


@st.composite
def maybe_mutated(draw, base):
    return draw(mutated(base)) if draw(st.integers(0, 5)) == 0 else base


@st.composite
def dump(draw, rank, recs):
    doc = dump_doc(rank, recs)
    doc["clock"] = draw(maybe_mutated(doc["clock"]))
    doc["communicators"]["a.0"] = draw(maybe_mutated(doc["communicators"]["a.0"]))
    return draw(maybe_mutated(doc))


@st.composite
def jsonl(draw, rank, recs):
    events = jsonl_lines(rank, [])
    events[0]["clock"] = draw(maybe_mutated(events[0]["clock"]))
    events += [{"event": "collective", "rank": rank, **r} if isinstance(r, dict) else r for r in recs]
    lines = [json.dumps(draw(maybe_mutated(e))).encode() + b"\n" for e in events]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        junk = draw(st.one_of(st.binary(max_size=12), st.just(lines[-1][: len(lines[-1]) // 2]),
                              st.just(b'{"event": "sink_dropped", "dropped": "lots"}'),
                              st.builds(lambda v: json.dumps({"event": "collective", **v}).encode(),
                                        st.dictionaries(st.sampled_from(RECORD_FIELDS), JSON, max_size=8))))
        lines.insert(draw(st.integers(1, len(lines))), junk + b"\n")
    return lines


@st.composite
def jobs(draw):
    """{file name: bytes} of a job."""
    files = {}
    for rank in range(draw(st.integers(1, 3))):
        recs = [draw(maybe_mutated(record(i, rank=rank, op=draw(st.sampled_from(["all_reduce", "broadcast",
                                                                               "all_gather_single",
                                                                               "reduce_scatter_single", "send"])))))
                for i in range(1, draw(st.integers(0, 4)) + 1)]
        layout = draw(st.sampled_from(["dump", "jsonl", "both"]))
        if layout in ("dump", "both"):
            files[f"rank{rank}.json"] = json.dumps(draw(dump(rank, recs))).encode()
        if layout in ("jsonl", "both"):
            files[f"rank{rank}.jsonl"] = b"".join(draw(jsonl(rank, recs)))
    if draw(st.integers(0, 9)) == 0:  # a file cut short, as a full disk or a copy in progress leaves it
        name = draw(st.sampled_from(sorted(files)))
        files[name] = files[name][: draw(st.integers(0, len(files[name])))]
    return files


def _strict_json(text):
    def no_constant(name):
        raise ValueError(f"{name} in the output")
    return json.loads(text, parse_constant=no_constant)


@pytest.mark.timeout(300)
@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(jobs(), st.booleans())
def test_no_input_makes_a_subcommand_raise(files, skip_bad):
    with tempfile.TemporaryDirectory() as d:
        traces = os.path.join(d, "traces")
        os.mkdir(traces)
        for name, content in files.items():
            with open(os.path.join(traces, name), "wb") as f:
                f.write(content)
        html, chrome = os.path.join(d, "view.html"), os.path.join(d, "trace.json")
        flags = ["--skip-bad"] if skip_bad else []
        for args in (["summary", "--json"], ["diagnose"], ["diagnose", "--json"], ["overlap", "--json"],
                     ["summary"], ["export", "--perfetto", chrome], ["view", "-o", html], ["watch", "--once"]):
            rc, out, err = run_cli(*args, *(flags if args[0] != "watch" else []), traces)  # watch always skips
            allowed = (0, 1, 2) if args[0] == "diagnose" else (0, 2)
            assert rc in allowed and "Traceback" not in err and "internal error" not in err, (args, rc, err)
            if args[0] == "watch":
                assert "\x1b" not in out + err and all(x.startswith("commslayer-trace: warning: skipped ")
                                                      for x in err.splitlines()), err
                continue
            if rc == 2:
                assert err.startswith("commslayer-trace: error: ") and len(err.splitlines()) <= 2, err
                continue
            assert "\x1b" not in out + err
            if "--json" in args:
                _strict_json(out)
            elif args[0] == "export":
                _strict_json(open(chrome).read())
            elif args[0] == "view":
                page = open(html).read()
                assert page.count('<script type="application/json" id="data">') == 1
                _strict_json(page.split('id="data">', 1)[1].split("</script>", 1)[0])
