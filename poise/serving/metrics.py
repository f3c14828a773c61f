"""Prometheus metrics for one server, fed from StepStats, RequestDeltas and EngineState.

Invariants:
- One ``CollectorRegistry`` per ``ServingMetrics`` (per app); nothing is registered globally.
- Names carry the prefix ``poise:`` and follow vLLM's where the meaning is the same.
- Request latencies come only from ``poise.core.timing.derive`` on the delta's RequestTimes
  (TTFT from arrival). TTFT and its parts (the way in, queue, prefill compute, first-token
  scheduling; they add up to TTFT) and prefill time are observed with the first token, and each
  inter-token gap with its token, so a dashboard sees them at once and a request aborted or
  failed later still counts. Decode time, e2e and TPOT observe requests that finished with
  ``stop`` or ``length`` (served); aborted, rejected and failed requests are counted by their
  own ``request_success_total{finished_reason}`` series / ``requests_rejected_total{reason}``.
- A request with ``n > 1`` is one request (as in vLLM): ``request_success_total``, TTFT and
  its parts, the prompt tokens, latencies and SLO series count it once (its first sample's
  first token, its last sample's end), the generation tokens count every sample's
  (``sample_groups.py``).
- Per step: requests and tokens fed as prefill and as decode, and the token budget's use.
- Per traffic class (label ``class``): TTFT, queue and TPOT histograms, SLO attainment
  (``slo_ttft_total`` / ``slo_tpot_total`` with ``result`` met or missed, for requests whose
  class or request names a target), goodput tokens (output tokens of served requests that met
  every target they had) and preemptions.
- Engine state (running, waiting, KV usage, token budget, preemptions, speculative decoding's
  ``spec_decode_*`` counters, ``spec_metrics.py``) is read at scrape time
  from the latest ``EngineState`` snapshot the engine published: gauges are its values and the
  preemption counters its own totals, never re-derived here.
- Methods are called from the engine thread (steps, deltas) and the event loop (rejections);
  prometheus_client's metric objects are thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poise.core.outputs import RequestDelta, StepStats
from poise.core.request import SloTargets
from poise.core.timing import derive
from poise.engine.state import EngineState
from poise.serving.live_page import LiveFeed

# The metric prefix and histogram buckets, re-exported: they live in metric_buckets.py.
from poise.serving.metric_buckets import LATENCY_BUCKETS as LATENCY_BUCKETS
from poise.serving.metric_buckets import SERVED as SERVED
from poise.serving.metric_buckets import STEP_TOKEN_BUCKETS as STEP_TOKEN_BUCKETS
from poise.serving.metric_buckets import TOKEN_GAP_BUCKETS as TOKEN_GAP_BUCKETS
from poise.serving.metric_buckets import UTILISATION_BUCKETS as UTILISATION_BUCKETS
from poise.serving.metric_buckets import P as P
from poise.serving.request_log import log_request
from poise.serving.sample_groups import GroupEnd, SampleGroups
from poise.serving.spec_metrics import spec_decode_families


class ServingMetrics:
    def __init__(self, model_name: str, *, log_requests: bool = False) -> None:
        # --enable-log-requests: one structured line per finished request (request_log.py).
        self.log_requests = log_requests
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, {"model_name": model_name}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(P + name, doc, ["model_name"], buckets=buckets, registry=r)
            return h.labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, ["model_name"], registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(P + name, doc, ["model_name"], registry=r).labels(**labels)

        def by_class(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(P + name, doc, ["model_name", "class"], buckets=buckets, registry=r)

        def class_counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(P + name, doc, ["model_name", "class", *extra], registry=r)

        self._ttft = by_class(
            "time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS
        )
        self._queue_time = by_class(
            "request_queue_time_seconds",
            "Taken in by the engine to first scheduled.",
            LATENCY_BUCKETS,
        )
        self.ingress_time = hist(
            "request_ingress_time_seconds",
            "Arrival to taken in by the engine: chat template, tokenization, engine thread wait.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = hist(
            "request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS
        )
        self.prefill_compute = hist(
            "request_prefill_compute_seconds",
            "Time of the steps that fed a request's prompt chunks (part of prefill time).",
            LATENCY_BUCKETS,
        )
        self.first_token_sched = hist(
            "request_first_token_scheduling_seconds",
            "Prefill time not spent computing the prompt: waits between its chunks.",
            LATENCY_BUCKETS,
        )
        self.decode_time = hist(
            "request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Gap between consecutive tokens.", TOKEN_GAP_BUCKETS
        )
        self._tpot = by_class(
            "request_time_per_output_token_seconds",
            "Decode time / (output tokens - 1), per request.",
            TOKEN_GAP_BUCKETS,
        )
        self._slo_ttft = class_counter(
            "slo_ttft_total",
            "Requests whose first token met / missed its TTFT target.",
            ("result",),
        )
        self._slo_tpot = class_counter(
            "slo_tpot_total", "Served requests whose TPOT met / missed its target.", ("result",)
        )
        self._goodput = class_counter(
            "goodput_tokens_total", "Output tokens of served requests that met all targets."
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens served from the prefix cache."
        )
        self._success = Counter(
            P + "request_success_total",
            "Finished requests by finish reason (stop, length, abort, error, rejected).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._rejected = Counter(
            P + "requests_rejected_total",
            "Requests refused before running, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.step_prefill_tokens = hist(
            "step_prefill_tokens", "Prompt tokens per engine step.", STEP_TOKEN_BUCKETS
        )
        self.step_decode_tokens = hist(
            "step_decode_tokens", "Decode tokens per engine step.", STEP_TOKEN_BUCKETS
        )
        self.step_prefill_requests = hist(
            "step_prefill_requests", "Requests fed a prefill chunk per step.", STEP_TOKEN_BUCKETS
        )
        self.step_decode_requests = hist(
            "step_decode_requests", "Requests fed a decode per step.", STEP_TOKEN_BUCKETS
        )
        self.budget_utilisation = hist(
            "step_token_budget_utilization",
            "Tokens fed / the step's token budget.",
            UTILISATION_BUCKETS,
        )
        self.iteration_tokens = hist(
            "iteration_tokens_total", "All tokens per engine step.", STEP_TOKEN_BUCKETS
        )
        self.step_duration = hist(
            "step_duration_seconds", "Engine step wall time.", TOKEN_GAP_BUCKETS
        )
        self.engine_errors = counter("engine_errors_total", "Exceptions raised by engine steps.")
        # Where the server's CPU goes (docs/serving.md: thread or process for the engine?):
        # the engine thread (scheduling, input prep, torch ops it runs itself) and the event
        # loop thread (HTTP, SSE, detokenization); process_cpu_seconds_total has all threads.
        self.engine_thread_cpu = gauge(
            "engine_thread_cpu_seconds", "CPU time of the engine thread (its own, not torch's)."
        )
        self.loop_thread_cpu = gauge(
            "event_loop_thread_cpu_seconds", "CPU time of the HTTP event loop thread."
        )
        ProcessCollector(registry=r)
        self._model_name = model_name
        # The live page's one-point-a-second feed (poise.serving.live_page), fed from here.
        self.live = LiveFeed()
        # n > 1: a request's samples are counted as one request (sample_groups.py).
        self.groups = SampleGroups()

    # -- engine thread ---------------------------------------------------------------------

    def observe_step(self, stats: StepStats) -> None:
        self.step_prefill_tokens.observe(stats.num_prefill_tokens)
        self.step_decode_tokens.observe(stats.num_decode_tokens)
        self.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
        self.step_duration.observe(stats.step_duration)
        self.live.add_step(stats)
        self.step_prefill_requests.observe(stats.num_prefill_requests)
        self.step_decode_requests.observe(stats.num_decode_requests)
        if stats.token_budget > 0:
            self.budget_utilisation.observe(stats.budget_utilisation)
        self.prefix_cache_hits.inc(stats.num_prefix_cache_hit_tokens)

    def track_engine_state(self, state: Callable[[], EngineState]) -> None:
        """Expose the engine snapshot that ``state`` returns at each scrape (call once)."""
        self.registry.register(_EngineStateCollector(self._model_name, state))

    def observe_delta(self, delta: RequestDelta, prompt_len_if_first: int | None) -> None:
        """One request's step output. ``prompt_len_if_first``: its prompt length when this
        delta carries its first token (the prompt was prefilled)."""
        if delta.new_token_ids:
            self.generation_tokens.inc(len(delta.new_token_ids))
            self.groups.tokens(delta)
        if prompt_len_if_first and self.groups.first_token(delta.request_id):
            # n > 1: the samples share one prompt and one first token, the request's.
            self.prompt_tokens.inc(prompt_len_if_first)
            if delta.times is not None:
                self._observe_first_token(delta)
        if delta.new_token_ids and delta.times is not None:
            # The gaps before this delta's tokens, as they are produced (none before the first).
            tt = delta.times.token_times
            for i in range(max(1, len(tt) - len(delta.new_token_ids)), len(tt)):
                self.itl.observe(tt[i] - tt[i - 1])
        if not delta.finished:
            return
        if self.log_requests:
            log_request(delta)
        end = self.groups.finished(delta)
        if end is not None:
            self._observe_end(end)

    def samples_not_admitted(self, request_ids: list[str]) -> None:
        """Samples of an n > 1 request refused at admission (event loop)."""
        for end in self.groups.drop(request_ids):
            self._observe_end(end)

    def _observe_end(self, end: GroupEnd) -> None:
        self._success.labels(model_name=self._model_name, finished_reason=end.reason).inc()
        if end.reason in SERVED and end.delta.times is not None:
            self._observe_latencies(end.delta, end.num_output_tokens)

    def _cls(self, slo: SloTargets | None) -> dict[str, str]:
        return {"model_name": self._model_name, "class": slo.class_name if slo else "default"}

    def _observe_first_token(self, delta: RequestDelta) -> None:
        assert delta.times is not None
        m = derive(delta.times)
        labels = self._cls(delta.slo)
        target = delta.slo.ttft_s if delta.slo is not None else None
        self.live.add_first_token(m, labels["class"], target)
        if m.ttft is not None:
            self._ttft.labels(**labels).observe(m.ttft)
            if delta.slo is not None and delta.slo.ttft_s is not None:
                met = "met" if m.ttft <= delta.slo.ttft_s else "missed"
                self._slo_ttft.labels(**labels, result=met).inc()
        if m.queue_time is not None:
            self._queue_time.labels(**labels).observe(m.queue_time)
        for hist, value in (
            (self.ingress_time, m.ingress_time),
            (self.prefill_time, m.prefill_time),
            (self.prefill_compute, m.prefill_compute),
            (self.first_token_sched, m.first_token_sched),
        ):
            if value is not None:
                hist.observe(value)

    def _observe_latencies(self, delta: RequestDelta, num_output_tokens: int | None) -> None:
        """A served request's latencies (n > 1: its last sample's, every sample's tokens)."""
        assert delta.times is not None
        m = derive(delta.times)
        labels = self._cls(delta.slo)
        for hist, value in ((self.decode_time, m.decode_time), (self.e2e, m.e2e)):
            if value is not None:
                hist.observe(value)
        if m.tpot is not None:
            self._tpot.labels(**labels).observe(m.tpot)
        slo = delta.slo or SloTargets()
        good = True
        if slo.ttft_s is not None:
            good = m.ttft is not None and m.ttft <= slo.ttft_s
        if slo.tpot_s is not None and m.tpot is not None:
            met = m.tpot <= slo.tpot_s
            self._slo_tpot.labels(**labels, result="met" if met else "missed").inc()
            good = good and met
        if good:
            tokens = m.num_output_tokens if num_output_tokens is None else num_output_tokens
            self._goodput.labels(**labels).inc(tokens)

    # -- event loop ------------------------------------------------------------------------

    def rejected(self, reason: str) -> None:
        self._rejected.labels(model_name=self._model_name, reason=reason).inc()

    def render(self) -> bytes:
        """Called on the event loop thread, so it can sample that thread's CPU time."""
        self.loop_thread_cpu.set(time.thread_time())
        return generate_latest(self.registry)


class _EngineStateCollector(Collector):
    """The engine-state gauges and counters, read from the latest snapshot at scrape time."""

    def __init__(self, model_name: str, state: Callable[[], EngineState]) -> None:
        self._model_name = model_name
        self._state = state

    def collect(self) -> Iterator[Metric]:
        s, m = self._state(), self._model_name
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests in the waiting queue.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", s.kv_cache_usage),
            (
                "token_budget",
                "Per-step token budget now (moves with the budget controller).",
                s.token_budget,
            ),
        ):
            gauge = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            gauge.add_metric([m], value)
            yield gauge
        total = CounterMetricFamily(
            P + "num_preemptions", "Preemptions (recompute).", labels=["model_name"]
        )
        total.add_metric([m], s.num_preemptions)
        yield total
        by_class = CounterMetricFamily(
            P + "class_preemptions",
            "Preemptions (recompute) per traffic class.",
            labels=["model_name", "class"],
        )
        for cls, n in sorted(s.preemptions_by_class.items()):
            by_class.add_metric([m, cls], n)
        yield by_class
        paced = GaugeMetricFamily(
            P + "paced_prefill_tokens",
            "Prefill tokens per step a paced traffic class may take now (slo policy: steps kept "
            "short for the tightest TTFT target; the whole budget when the cap is lifted).",
            labels=["model_name", "class"],
        )
        for cls, n in s.paced_prefill_tokens.items():
            paced.add_metric([m, cls], n)
        yield paced
        for name, doc, value in (
            (
                "prefix_cache_queries",
                "Prompt tokens of admitted requests looked up in the "
                "prefix cache (vLLM's meaning; hits: prefix_cache_hits).",
                s.prefix_cache.query_tokens,
            ),
            (
                "prefix_cache_inflight_hits",
                "Prompt tokens served from blocks another request's running prefill computed "
                "while this one waited for them (in-flight sharing; part of prefix_cache_hits).",
                s.prefix_cache.inflight_hit_tokens,
            ),
            (
                "prefix_cache_evictions",
                "Cached KV blocks evicted for other use.",
                s.prefix_cache_evictions,
            ),
        ):
            family = CounterMetricFamily(P + name, doc, labels=["model_name"])
            family.add_metric([m], value)
            yield family
        lookups = CounterMetricFamily(
            P + "prefix_cache_requests",
            "Admitted requests that looked their prefix up, by result (hit: >= 1 cached block).",
            labels=["model_name", "result"],
        )
        lookups.add_metric([m, "hit"], s.prefix_cache.hits)
        lookups.add_metric([m, "miss"], s.prefix_cache.queries - s.prefix_cache.hits)
        yield lookups
        yield from spec_decode_families(m, s)
