"""OpenTelemetry spans and metrics for every op, built off the hot path.

An SDK span costs 20-70 µs in this Python, as much as a whole small Gloo op,
so the sink callable in ``FlightRecorder.sinks`` only queues the finished
``Record`` (``tracing.record.sinks.QueuedSink``); the sink's thread later builds
each span with the op's real start and end times, converted from the
record's monotonic clock to wall time with the recorder's clock anchor
(``wall = clock.wall_ns + (mono - clock.mono_ns)``).

One collective, one trace.  The trace id is a hash of (job, communicator
uid, generation, seq) (for send/recv: of the pair and its message number),
so every rank's span of the same collective lands in the same trace without
any rank talking to another, and a trace-id-ratio sampler
(``OTEL_TRACES_SAMPLER=traceidratio``) keeps or drops a collective on all
ranks alike.  The span id hashes the trace id with the global rank and the
rank in the communicator (the latter is unique among a trace's spans even
when ``RANK`` is unset).  The SDK takes ids from the provider's
``IdGenerator``; ours (``_ChosenIds``) returns the ids the sink thread set
just before ``start_span``, so each span is a real root span.  (A remote
parent ``SpanContext`` would also carry the trace id, but every span would
then name a parent span that does not exist.)

Export runs on the sink's thread too, one ``export`` call per drained batch
(at most ``EXPORT_CHUNK`` spans), through a small span processor rather
than a ``BatchSpanProcessor``: the hot path is already decoupled by our
queue, so a second queue and thread would only add a second place to lose
spans and make ``flush()`` less exact.  A slow exporter (a network one)
delays only the sink thread; if that backs up the queue, records are
dropped and counted, the op never waits.  Off the hot path is not free: the
sink thread spends ~50 µs of interpreter time per op (span, metrics, JSON),
which it takes from the training loop's share of the GIL.

Exporters follow the standard variables: ``OTEL_TRACES_EXPORTER`` and
``OTEL_METRICS_EXPORTER`` name exporters by their registered entry points
(``console``, ``otlp`` when opentelemetry-exporter-otlp is installed, ...);
unset or ``jsonl`` means our files, ``<trace_dir>/otel-spans-rank<R>.jsonl``
and ``<trace_dir>/otel-metrics-rank<R>.jsonl``; ``none`` turns one off.  An
exporter that is not installed is warned about once and replaced by the file.

Metrics are ``comms.ops`` (a counter per communicator, op and final state),
``comms.op.bytes`` (a histogram of the op's size, the larger of its input
and output, which is the size nccl-tests reports for all_gather and
reduce_scatter too) and ``comms.op.duration`` (ms, start to end), both per
communicator and op.  Each SDK measurement costs ~7 µs of the sink thread,
so the counter is summed per batch and the size is recorded once.  Metrics
are exported at ``flush()`` and at exit, and also every
``OTEL_METRIC_EXPORT_INTERVAL`` ms when that is set; each export appends
cumulative values, so the last line of a series holds its totals.

The tracer and meter providers are private and never installed as the
global ones.  ``set_tracer_provider`` works once per process: a library
that took the slot, even only when it was empty, would silently turn the
application's own later call into a no-op (with just a logged warning), and
its spans would go to our exporter.  The SDK's own span-count metrics are
switched off for the same reason (they would go to the global meter).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import math
import os
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import orjson
from opentelemetry import context as otel_context
from opentelemetry import metrics as metrics_api
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (Histogram, HistogramDataPoint, MetricExporter, MetricExportResult,
                                              MetricsData, PeriodicExportingMetricReader, Sum)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode

from tracing.dumps import AppendWriter
from tracing.record.oprecord import Record
from tracing.records import COMPLETED
from tracing.record.sinks import Item, QueuedSink

if TYPE_CHECKING:
    from tracing.record.recorder import FlightRecorder

log = logging.getLogger("commslayer.tracing")

# Where most ops fall: 50 µs to a minute, bytes 1 KiB to 4 GiB.
DURATION_BOUNDS_MS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000,
                      60000)
BYTES_BOUNDS = tuple(float(4 ** k) for k in range(5, 17))
EXPORT_CHUNK = 256  # spans per export call at most (bigger batches measured ~50% slower per span)

_INSTALL_HINTS = {  # exporter name -> the package that registers it
    "otlp": "opentelemetry-exporter-otlp", "otlp_proto_grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "otlp_proto_http": "opentelemetry-exporter-otlp-proto-http", "zipkin": "opentelemetry-exporter-zipkin",
    "prometheus": "opentelemetry-exporter-prometheus",
}
_warned: Set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


# ----------------------------------------------------------------------- ids
def _digest(data: bytes, size: int) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=size).digest(), "big")


def collective_trace_id(job: str, comm_id: str, generation: int, seq: int,
                        pair: Optional[Tuple[int, int]] = None) -> int:
    """The trace id every rank gives to one op: a 128-bit hash of where it ran.

    ``pair`` is ``(src, dst)`` (ranks in the communicator) for send/recv,
    whose ``seq`` numbers the messages of that pair; None for collectives.
    """
    key = f"{job}\0{comm_id}\0{generation}\0{seq}"
    if pair is not None:
        key += f"\0p2p\0{pair[0]}\0{pair[1]}"
    return _digest(key.encode(), 16) or 1


def rank_span_id(trace_id: int, rank: int, comm_rank: int) -> int:
    """The span id of one rank's part of a trace: unique among the trace's ranks."""
    return _digest(trace_id.to_bytes(16, "big") + f"{rank}\0{comm_rank}".encode(), 8) or 1


class _ChosenIds(IdGenerator):
    """Hands the SDK the ids set just before ``start_span`` (sink thread only)."""

    def __init__(self) -> None:
        self.trace_id = 1
        self.span_id = 1

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


# ----------------------------------------------------------------- exporters
class JsonlSpanExporter(SpanExporter):
    """Spans as JSON lines: ids in hex, wall-clock ns times, status and attributes."""

    def __init__(self, writer: AppendWriter) -> None:
        self.writer = writer
        self._resources: Dict[int, Tuple[Resource, orjson.Fragment]] = {}  # serialized once, not per span

    def _resource(self, resource: Resource) -> orjson.Fragment:
        cached = self._resources.get(id(resource))
        if cached is None or cached[0] is not resource:
            fragment = orjson.Fragment(orjson.dumps(dict(resource.attributes)))
            cached = self._resources[id(resource)] = (resource, fragment)
        return cached[1]

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            assert ctx is not None  # a finished span has its context
            lines.append(orjson.dumps({
                "trace_id": format(ctx.trace_id, "032x"),
                "span_id": format(ctx.span_id, "016x"),
                "parent_span_id": format(s.parent.span_id, "016x") if s.parent else None,
                "name": s.name,
                "kind": s.kind.name,
                "start_time_unix_nano": s.start_time,
                "end_time_unix_nano": s.end_time,
                "status": {"code": s.status.status_code.name, "description": s.status.description},
                "attributes": dict(s.attributes or {}),
                "resource": self._resource(s.resource),
                "scope": s.instrumentation_scope.name if s.instrumentation_scope else None,
            }))
        ok = self.writer.write(b"\n".join(lines) + b"\n", records=len(spans)) if lines else True
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        self.writer.close()


class JsonlMetricExporter(MetricExporter):
    """Metric data points as JSON lines, one per point and export.

    Temporality is cumulative, so the last line of a (name, attributes)
    series holds its totals; ``export`` numbers the exports.
    """

    def __init__(self, writer: AppendWriter, extra: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(preferred_temporality=None, preferred_aggregation=None)
        self.writer = writer
        self.extra = extra or {}
        self.exports = 0

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.exports += 1
        lines = []
        for rm in metrics_data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    data = metric.data
                    if isinstance(data, Histogram):
                        kind = "histogram"
                    elif isinstance(data, Sum):
                        kind = "sum" if data.is_monotonic else "up_down_sum"
                    else:
                        kind = type(data).__name__.lower()
                    temporality = getattr(data, "aggregation_temporality", None)
                    for p in data.data_points:
                        line = {**self.extra, "export": self.exports, "scope": sm.scope.name, "name": metric.name,
                                "unit": metric.unit, "kind": kind,
                                "temporality": None if temporality is None else temporality.name.lower(),
                                "attributes": dict(p.attributes or {}),
                                "start_time_unix_nano": p.start_time_unix_nano, "time_unix_nano": p.time_unix_nano}
                        if isinstance(p, HistogramDataPoint):
                            line.update(count=p.count, sum=p.sum, min=p.min, max=p.max,
                                        explicit_bounds=list(p.explicit_bounds), bucket_counts=list(p.bucket_counts))
                        elif hasattr(p, "value"):
                            line["value"] = p.value
                        else:  # exponential histograms and anything newer
                            line["point"] = orjson.loads(p.to_json(indent=None))
                        lines.append(orjson.dumps(line))
        ok = self.writer.write(b"\n".join(lines) + b"\n", records=len(lines)) if lines else True
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.writer.close()


class _ExportOnDrain(SpanProcessor):
    """Collects ended spans; the sink thread exports them once per batch."""

    def __init__(self, exporters: List[SpanExporter]) -> None:
        self.exporters = exporters
        self.failed_exports = 0
        self._pending: List[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self._pending.append(span)

    def export_pending(self) -> None:
        spans, self._pending = self._pending, []
        if not spans:
            return
        for exporter in self.exporters:
            try:
                ok = exporter.export(spans) == SpanExportResult.SUCCESS
            except Exception as exc:  # an exporter must not stop the others
                ok = False
                _warn_once(f"span-export-{id(exporter)}", "commslayer tracing: %s failed: %r (counted, not logged "
                           "again)", type(exporter).__name__, exc)
            if not ok:
                self.failed_exports += 1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.export_pending()
        for exporter in self.exporters:
            exporter.force_flush(timeout_millis)
        return True

    def shutdown(self) -> None:
        self.export_pending()
        for exporter in self.exporters:
            try:
                exporter.shutdown()
            except Exception:
                pass


def _exporters(signal: str, env_var: str, file_exporter: Callable[[], Optional[Any]]) -> List[Any]:
    """The exporters ``env_var`` names; ``file_exporter()`` for ``jsonl``, unset and fallbacks."""
    names = [n.strip().lower() for n in os.environ.get(env_var, "").split(",") if n.strip()] or ["jsonl"]
    if "none" in names:
        return []
    out: List[Any] = []
    want_file = False
    for name in dict.fromkeys(names):
        if name in ("jsonl", "file"):
            want_file = True
            continue
        eps = importlib.metadata.entry_points(group=f"opentelemetry_{signal}_exporter", name=name)
        try:
            if not eps:
                raise LookupError(f"no exporter named {name!r} is installed"
                                  + (f" (it comes with {_INSTALL_HINTS[name]})" if name in _INSTALL_HINTS else ""))
            out.append(next(iter(eps)).load()())
        except Exception as exc:
            _warn_once(f"{env_var}={name}", "commslayer tracing: %s=%s: %s; using the JSON-lines file instead",
                       env_var, name, exc)
            want_file = True
    if want_file:
        exporter = file_exporter()
        if exporter is not None:
            out.append(exporter)
    return out


class OtelSink(QueuedSink):
    """One OpenTelemetry span per op, plus op count, bytes and latency metrics."""

    thread_name = "commslayer-trace-otel"

    def __init__(self, rec: FlightRecorder, *, capacity: Optional[int] = None) -> None:
        super().__init__(rec, capacity=capacity)
        dumps = rec.writer  # its directory and file mode
        resource = Resource.create({
            "service.name": os.environ.get("OTEL_SERVICE_NAME") or "commslayer",
            "commslayer.train.job": rec.job, "commslayer.rank": self.rank, "host.name": rec.host,
            "process.pid": os.getpid(),
        })

        def file_for(kind: str) -> Optional[AppendWriter]:
            if dumps is None:
                _warn_once(f"no-dir-{kind}", "commslayer tracing: OpenTelemetry %s have no trace directory "
                           "(COMMSLAYER_TRACE_DIR) to go to; not exported", kind)
                return None
            return AppendWriter(os.path.join(dumps.directory, f"otel-{kind}-rank{self.rank}.jsonl"), dumps.mode)

        self.span_writer: Optional[AppendWriter] = None
        self.metric_writer: Optional[AppendWriter] = None

        def span_file() -> Optional[SpanExporter]:
            self.span_writer = file_for("spans")
            return None if self.span_writer is None else JsonlSpanExporter(self.span_writer)

        def metric_file() -> Optional[MetricExporter]:
            self.metric_writer = file_for("metrics")
            return None if self.metric_writer is None else JsonlMetricExporter(
                self.metric_writer, {"job": rec.job, "rank": self.rank})

        self._ids = _ChosenIds()
        self._processor = _ExportOnDrain(_exporters("traces", "OTEL_TRACES_EXPORTER", span_file))
        self.tracer_provider = TracerProvider(resource=resource, id_generator=self._ids, shutdown_on_exit=False,
                                              meter_provider=metrics_api.NoOpMeterProvider())
        self.tracer_provider.add_span_processor(self._processor)
        self._tracer = self.tracer_provider.get_tracer("commslayer.tracing")
        self._spans = bool(self._processor.exporters)

        raw = os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "")
        try:
            interval_ms = float(raw) if raw else math.inf
        except ValueError:
            _warn_once("metric-interval", "commslayer tracing: OTEL_METRIC_EXPORT_INTERVAL=%r is not a number; "
                       "exporting metrics at flush and exit only", raw)
            interval_ms = math.inf
        readers = [PeriodicExportingMetricReader(e, export_interval_millis=interval_ms)
                   for e in _exporters("metrics", "OTEL_METRICS_EXPORTER", metric_file)]
        self.meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
        self._metrics = bool(readers)
        meter = self.meter_provider.get_meter("commslayer.tracing")
        self._ops = meter.create_counter("comms.ops", unit="{op}", description="ops ended, by final state")
        self._bytes = meter.create_histogram("comms.op.bytes", unit="By",
                                             description="op size: the larger of its input and output bytes",
                                             explicit_bucket_boundaries_advisory=BYTES_BOUNDS)
        self._duration = meter.create_histogram("comms.op.duration", unit="ms",
                                                description="op latency, start to end",
                                                explicit_bucket_boundaries_advisory=DURATION_BOUNDS_MS)
        self._attr_cache: Dict[Tuple[str, str, str], Tuple[Dict[str, str], Dict[str, str]]] = {}

    @classmethod
    def attach(cls, rec: FlightRecorder) -> "OtelSink":
        """Emit a span and metrics for every op ``rec`` sees (idempotent)."""
        sink = cls.attached(rec)
        if sink is not None:
            return sink
        sink = cls(rec)
        sink._start()
        return sink

    def stats(self) -> Dict[str, int]:
        """Queue length and every kind of loss, for tests and health checks."""
        writers = [w for w in (self.span_writer, self.metric_writer) if w is not None]
        return {"queued": len(self._queue), "dropped": self.dropped,
                "failed_exports": self._processor.failed_exports,
                "failed_writes": sum(w.failed_writes for w in writers),
                "lost_records": sum(w.dropped_records for w in writers), "process_errors": self.process_errors}

    # ----------------------------------------------------------- sink thread
    def process(self, items: List[Item]) -> None:
        """Spans and measurements for a batch of records, then one export."""
        counts: Dict[Tuple[str, str, str], int] = {}
        for i, item in enumerate(items, 1):
            if isinstance(item, Record):
                fields = SimpleNamespace(**item.to_dict())  # the record's plain values
                if self._spans:
                    self._span(fields)
                if self._metrics:
                    self._measure(fields, counts)
            if i % EXPORT_CHUNK == 0:  # a few hundred spans per export keeps the working set small
                self._processor.export_pending()
        for key, n in counts.items():  # one counter update per series and batch
            self._ops.add(n, self._attrs(key)[1])
        self._processor.export_pending()

    def _span(self, r: SimpleNamespace) -> None:
        clock = self.rec.clock
        offset = clock["wall_ns"] - clock["mono_ns"]
        comm_rank, backend = self.comm_info(r.comm_id)
        if comm_rank is None:  # a communicator this sink never saw: the global rank still tells ranks apart
            comm_rank = self.rank
        pair = None
        if r.op in ("send", "recv") and r.peer is not None:
            pair = (comm_rank, r.peer) if r.op == "send" else (r.peer, comm_rank)
        trace_id = collective_trace_id(self.rec.job, r.comm_id, r.generation, r.seq, pair)
        self._ids.trace_id = trace_id
        self._ids.span_id = rank_span_id(trace_id, self.rank, comm_rank)
        attrs: Dict[str, Any] = {
            "comms.op": r.op, "comms.communicator": r.comm, "comms.communicator_id": r.comm_id,
            "comms.seq": r.seq, "comms.generation": r.generation, "comms.bytes_in": r.in_bytes,
            "comms.bytes_out": r.out_bytes, "comms.rank": self.rank, "comms.comm_rank": comm_rank,
            "comms.state": r.state, "comms.backend_op": r.backend_op, "comms.async_op": r.async_op,
            "comms.timeout_s": r.timeout_s,
        }
        for key, value in (("comms.dtype", r.dtype), ("comms.reduce_op", r.reduce_op), ("comms.peer", r.peer),
                           ("comms.root", r.root), ("comms.call_site", r.call_site),
                           ("comms.backend", backend)):
            if value is not None:
                attrs[key] = value
        start = r.start_ns if r.start_ns is not None else r.enqueue_ns
        end = r.end_ns if r.end_ns is not None else start
        span = self._tracer.start_span(r.op, context=otel_context.Context(), kind=SpanKind.INTERNAL,
                                       attributes=attrs, start_time=start + offset)
        if r.state != COMPLETED:
            span.set_attribute("error.type", r.state)
            span.set_status(Status(StatusCode.ERROR, r.error or r.state))
        span.end(end_time=end + offset)

    def _attrs(self, key: Tuple[str, str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
        """The metric attributes of (communicator, op) without and with the state, cached."""
        attrs = self._attr_cache.get(key)
        if attrs is None:
            base = {"comms.communicator": key[0], "comms.op": key[1]}
            attrs = self._attr_cache[key] = (base, {**base, "comms.state": key[2]})
        return attrs

    def _measure(self, r: SimpleNamespace, counts: Dict[Tuple[str, str, str], int]) -> None:
        key = (r.comm, r.op, r.state)
        counts[key] = counts.get(key, 0) + 1
        base = self._attrs(key)[0]
        self._bytes.record(max(r.in_bytes, r.out_bytes), base)
        if r.duration_ms is not None:
            self._duration.record(r.duration_ms, base)

    # ------------------------------------------------------------- lifecycle
    def flush(self) -> None:
        """Build and export the queued spans, then export the metrics, now."""
        super().flush()
        with self._lock:
            try:
                self.tracer_provider.force_flush()
                if self._metrics:
                    self.meter_provider.force_flush()
            except Exception:
                self.process_errors += 1
                log.exception("commslayer tracing: OpenTelemetry flush failed")

    def _shutdown(self) -> None:
        for provider in (self.tracer_provider, self.meter_provider):
            try:
                provider.shutdown()
            except Exception:
                pass
