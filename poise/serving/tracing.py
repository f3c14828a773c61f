"""OpenTelemetry request traces (vLLM's ``--otlp-traces-endpoint``), over OTLP/HTTP.

One span per client request, kind SERVER, named ``{gen_ai.operation.name} {model}`` ("chat m",
"text_completion m") as the GenAI semantic conventions name inference spans, from the moment
the handler started (arrival, where TTFT starts) to the end of its last sample. Its children
are the parts of the request's life that ``core.timing.derive`` defines, so a trace, the
Prometheus histograms and the response's ``metrics`` say the same:

    ingress                  arrival -> taken in by the engine (template, tokenization, the wait)
    queue                    -> first scheduled
    prefill                  the compute of the steps that fed its prompt (prefill_compute)
    first_token_scheduling   the waits between those steps, up to the first token
    decode                   first token -> last token

The four first ones add up to TTFT. ``prefill`` and ``first_token_scheduling`` are totals:
with a chunked prompt, steps and waits interleave; the spans lay the two totals end to end
between the first scheduling and the first token (their attributes say so). With ``n > 1``
the timing is that of the sample that finished last, as in the response.

Attributes: ``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.response.model``,
``gen_ai.response.id``, ``gen_ai.request.max_tokens`` / ``temperature`` / ``top_p`` /
``seed`` / ``choice.count``, ``gen_ai.usage.input_tokens`` / ``output_tokens``,
``gen_ai.response.finish_reasons``; poise's ``poise.class``, ``poise.priority``,
``poise.policy`` and the latencies in seconds (``poise.latency.*``). A request refused at
admission (400, 429, 503) gets its span too, status ERROR with ``error.type``.

A ``traceparent`` header (W3C Trace Context) makes the request's span a child of the client's,
in the client's trace. Spans are built after the request ends, with its recorded timestamps
(the engine's monotonic clock, mapped to wall time when the span is written), and exported in
batches off the event loop by the SDK's ``BatchSpanProcessor``: nothing is sent per token.

The OpenTelemetry SDK and exporter are the optional ``otel`` extra; they are imported only
when a server is started with the flag.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from poise.core.request import RequestTimes
from poise.core.timing import derive

INSTALL_HINT = "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'poise[otel]'"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: as given, or with ``/v1/traces`` when it names no path (the
    collector's base address, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` does)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"otlp_traces_endpoint: an http(s) URL, got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def check_available(endpoint: str) -> None:
    """ValueError (before a model loads) when the URL is malformed or the extra is absent."""
    import importlib.util

    traces_url(endpoint)
    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError(INSTALL_HINT)


class RequestTracer:
    """The server's tracer provider and exporter; ``start`` one ``RequestTrace`` per request."""

    def __init__(
        self,
        endpoint: str,
        *,
        policy: str,
        clock: Callable[[], float],
        service_name: str = "poise",
        export_delay_s: float = 1.0,
    ) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise ValueError(INSTALL_HINT) from exc
        self.endpoint = traces_url(endpoint)
        self.policy = policy
        self._clock = clock
        # Its own provider, not the global one: a library embedding poise keeps its own.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=self.endpoint),
                schedule_delay_millis=int(export_delay_s * 1000),
            )
        )
        self._tracer = self._provider.get_tracer("poise.serving")
        self._propagator = TraceContextTextMapPropagator()

    def start(
        self,
        headers: Mapping[str, str],
        operation: str,
        model: str,
        arrival: float,
        attributes: dict[str, Any],
    ) -> RequestTrace:
        """A request's trace; ``headers``' ``traceparent``, if any, is its parent."""
        parent = self._propagator.extract(carrier={k.lower(): v for k, v in headers.items()})
        attrs = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "poise.policy": self.policy,
            **attributes,
        }
        return RequestTrace(self, parent, f"{operation} {model}", attrs, arrival)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self._provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        self._provider.shutdown()  # exports what is still queued

    def emit(self, trace: RequestTrace) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        times, now = trace.times, self._clock()
        # Engine-clock seconds -> Unix nanoseconds, one offset for the whole tree (two clock
        # reads per timestamp would jitter the spans' joins by microseconds).
        offset = time.time_ns() - int(now * 1e9)

        def wall(t: float) -> int:
            return offset + int(t * 1e9)

        start = trace.arrival
        end = times.finished if times is not None and times.finished is not None else now
        root = self._tracer.start_span(
            trace.name,
            context=trace.parent,
            kind=SpanKind.SERVER,
            start_time=wall(start),
            attributes=trace.attributes,
        )
        if trace.error is not None:
            root.set_status(Status(StatusCode.ERROR, trace.error[1]))
            root.set_attribute("error.type", trace.error[0])
        if times is not None:
            from opentelemetry.trace import set_span_in_context

            inside = set_span_in_context(root)
            for name, a, b, attrs in _parts(times):
                child = self._tracer.start_span(
                    name, context=inside, start_time=wall(a), attributes=attrs
                )
                child.end(end_time=wall(b))
            for key, value in _latencies(times).items():
                root.set_attribute(key, value)
        root.end(end_time=wall(max(end, start)))


def _parts(times: RequestTimes) -> list[tuple[str, float, float, dict[str, Any]]]:
    """(name, start, end, attributes) of each part that happened, on the engine's clock."""
    m = derive(times)
    out: list[tuple[str, float, float, dict[str, Any]]] = []
    t = times.arrival
    laid = {"poise.laid_end_to_end": True}  # a total of interleaved intervals (see above)
    for name, value, attrs in (
        ("ingress", m.ingress_time, {}),
        ("queue", m.queue_time, {}),
        ("prefill", m.prefill_compute, laid),
        ("first_token_scheduling", m.first_token_sched, laid),
    ):
        if value is None:
            return out
        out.append((name, t, t + value, attrs))
        t += value
    if m.decode_time is not None and times.first_token is not None:
        out.append(
            (
                "decode",
                times.first_token,
                times.first_token + m.decode_time,
                {"gen_ai.usage.output_tokens": m.num_output_tokens},
            )
        )
    return out


def _latencies(times: RequestTimes) -> dict[str, float]:
    m = derive(times)
    named = {
        "ttft": m.ttft,
        "queue": m.queue_time,
        "prefill": m.prefill_time,
        "decode": m.decode_time,
        "tpot": m.tpot,
        "e2e": m.e2e,
    }
    return {f"poise.latency.{k}_s": v for k, v in named.items() if v is not None}


@dataclass
class RequestTrace:
    """One request's trace, filled as it goes; ``RequestTracer.emit`` writes it at the end."""

    tracer: RequestTracer
    parent: Any  # the client's context (traceparent), or an empty one
    name: str
    attributes: dict[str, Any]
    arrival: float = 0.0
    times: RequestTimes | None = None
    error: tuple[str, str] | None = None
    _tokens: dict[int, int] = field(default_factory=dict)
    _reasons: dict[int, str] = field(default_factory=dict)
    _ended: bool = False

    def admitted(self, preps: list[Any]) -> None:
        """What the engine was asked (generation.Prepared, one per prompt): the effective
        sampling parameters, after the model's defaults."""
        params = preps[0].params
        self.attributes.update(
            {
                "gen_ai.response.id": preps[0].request_id,
                "gen_ai.response.model": self.attributes["gen_ai.request.model"],
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.usage.input_tokens": sum(len(p.prompt_token_ids) for p in preps),
            }
        )
        if params.seed is not None:
            self.attributes["gen_ai.request.seed"] = params.seed
        if params.n > 1 or len(preps) > 1:
            self.attributes["gen_ai.request.choice.count"] = params.n * len(preps)

    def refused(self, exc: BaseException) -> None:
        """Refused before any piece (400, 429, 503): a span with the error."""
        self.error = (type(exc).__name__, str(exc))
        self.end()

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._tokens:
            self.attributes["gen_ai.usage.output_tokens"] = sum(self._tokens.values())
        if self._reasons:
            self.attributes["gen_ai.response.finish_reasons"] = [
                self._reasons[i] for i in sorted(self._reasons)
            ]
        self.tracer.emit(self)

    async def watch(self, pieces: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``pieces`` (generation.Piece) passed through; the trace ends when they do (done,
        failed, or closed by a client that left)."""
        try:
            async for piece in pieces:
                self._tokens[piece.index] = piece.num_tokens
                if piece.finish_reason is not None:
                    self._reasons[piece.index] = piece.finish_reason
                    self.times = piece.times or self.times  # the last to finish: the request's
                yield piece
        except Exception as exc:
            self.error = (type(exc).__name__, str(exc))
            raise
        finally:
            if len(self._reasons) < max(len(self._tokens), 1) and self.error is None:
                self.error = ("Aborted", "the client left before the end")
            self.end()
            await pieces.aclose()  # type: ignore[attr-defined]
