"""The server's view: Prometheus ``/metrics`` scrapes mapped to common names, and their
summaries over a measurement window.

Adapters map each engine's series to: ``kv_usage`` (fraction 0..1), ``running``, ``waiting``,
``preemptions`` (a counter), ``ttft`` (a histogram, seconds), ``spec`` (speculative decoding's
counters: drafts, draft tokens, accepted tokens). Engines: poise (``poise:``, the
vLLM names), vLLM, SGLang, TGI, llama.cpp. A series an engine does not expose stays absent
and its summary is None: we never invent zeros (TGI and llama.cpp have no preemption counter).
Samples are summed over label sets (vLLM labels by model and engine index).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Adapter:
    engine: str
    kv_usage: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    ttft: tuple[str, ...] = ()  # histogram base names (without _bucket)
    queue_time: tuple[str, ...] = ()  # arrival -> first scheduled (histogram)
    prefill_time: tuple[str, ...] = ()  # first scheduled -> first token (histogram)
    # TGI: KV usage as a ratio of two gauges (current max tokens / max total tokens).
    kv_ratio: tuple[str, str] | None = None
    # Prompt tokens served from the prefix cache / looked up in it (counters; vLLM's meaning).
    prefix_hits: tuple[str, ...] = ()
    prefix_queries: tuple[str, ...] = ()
    # Speculative decoding's counters (vLLM's): drafts, draft tokens, accepted tokens.
    spec: tuple[str, str, str] | None = None


def _vllm_like(prefix: str, engine: str) -> Adapter:
    return Adapter(
        engine,
        kv_usage=(f"{prefix}kv_cache_usage_perc", f"{prefix}gpu_cache_usage_perc"),
        running=(f"{prefix}num_requests_running",),
        waiting=(f"{prefix}num_requests_waiting",),
        preemptions=(f"{prefix}num_preemptions_total", f"{prefix}num_preemptions"),
        ttft=(f"{prefix}time_to_first_token_seconds",),
        queue_time=(f"{prefix}request_queue_time_seconds",),
        prefill_time=(f"{prefix}request_prefill_time_seconds",),
        prefix_hits=(f"{prefix}prefix_cache_hits_total", f"{prefix}prefix_cache_hits"),
        prefix_queries=(f"{prefix}prefix_cache_queries_total", f"{prefix}prefix_cache_queries"),
        spec=(
            f"{prefix}spec_decode_num_drafts_total",
            f"{prefix}spec_decode_num_draft_tokens_total",
            f"{prefix}spec_decode_num_accepted_tokens_total",
        ),
    )


ADAPTERS: dict[str, Adapter] = {
    "poise": _vllm_like("poise:", "poise"),
    "vllm": _vllm_like("vllm:", "vllm"),
    "sglang": Adapter(
        "sglang",
        kv_usage=("sglang:token_usage",),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        preemptions=("sglang:num_retracted_requests_total", "sglang:num_retracted_requests"),
        ttft=("sglang:time_to_first_token_seconds",),
        queue_time=("sglang:queue_time_seconds",),
    ),
    "tgi": Adapter(
        "tgi",
        running=("tgi_batch_current_size",),
        waiting=("tgi_queue_size",),
        queue_time=("tgi_request_queue_duration",),
        kv_ratio=("tgi_batch_current_max_tokens", "tgi_batch_max_total_tokens"),
    ),
    "llamacpp": Adapter(
        "llamacpp",
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
    ),
}


def parse_samples(text: str) -> tuple[dict[str, float], dict[str, list[tuple[float, float]]]]:
    """Prometheus text -> (sample name -> value summed over labels, histogram base name ->
    cumulative buckets [(le, count)] summed over labels, sorted by le)."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") and "le" in s.labels:
                base = s.name[: -len("_bucket")]
                le = float(s.labels["le"])
                per = buckets.setdefault(base, {})
                per[le] = per.get(le, 0.0) + s.value
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return values, {k: sorted(v.items()) for k, v in buckets.items()}


def detect_engine(names: Sequence[str]) -> str | None:
    for prefix, engine in (
        ("poise:", "poise"),
        ("vllm:", "vllm"),
        ("sglang:", "sglang"),
        ("llamacpp:", "llamacpp"),
        ("tgi_", "tgi"),
    ):
        if any(n.startswith(prefix) for n in names):
            return engine
    return None


@dataclass
class Scrape:
    """One scrape mapped to common names (absent ones are None)."""

    t: float
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    ttft_buckets: list[tuple[float, float]] = field(default_factory=list)
    # Other server histograms by common name ("queue_time", "prefill_time").
    hists: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # Replicas in rotation behind a poise router (``poise serve --replicas``); None: one server.
    replicas: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    # (drafts, draft tokens, accepted tokens) totals; None: the server does not speculate.
    spec: tuple[float, float, float] | None = None


def _first(values: dict[str, float], names: Sequence[str]) -> float | None:
    for n in names:
        if n in values:
            return values[n]
    return None


# poise's router (poise/deploy/merged_metrics.py): 1 per replica in rotation, so the sum counts them.
REPLICAS_METRIC = "poise_router_replica_healthy"


def map_scrape(t: float, text: str, adapter: Adapter) -> Scrape:
    values, hists = parse_samples(text)
    kv = _first(values, adapter.kv_usage)
    if kv is None and adapter.kv_ratio is not None:
        num, den = (values.get(n) for n in adapter.kv_ratio)
        kv = num / den if num is not None and den else None
    replicas = values.get(REPLICAS_METRIC)
    if kv is not None and replicas:
        kv /= replicas  # the replicas' usages are summed over their label: report the mean
    ttft = next((hists[n] for n in adapter.ttft if n in hists), [])
    extra = {}
    for common, names in (
        ("queue_time", adapter.queue_time),
        ("prefill_time", adapter.prefill_time),
    ):
        found = next((hists[n] for n in names if n in hists), None)
        if found is not None:
            extra[common] = found
    return Scrape(
        t,
        kv,
        _first(values, adapter.running),
        _first(values, adapter.waiting),
        _first(values, adapter.preemptions),
        ttft,
        extra,
        replicas,
        _first(values, adapter.prefix_hits),
        _first(values, adapter.prefix_queries),
        _spec_totals(values, adapter.spec),
    )


def _spec_totals(
    values: dict[str, float], names: tuple[str, str, str] | None
) -> tuple[float, float, float] | None:
    if names is None or any(n not in values for n in names):
        return None
    return values[names[0]], values[names[1]], values[names[2]]


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style quantile (q in 0..1) of cumulative buckets, linear inside a bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # the open bucket: best we can say is its lower edge
            width = c - prev_c
            return prev_le + (le - prev_le) * ((rank - prev_c) / width if width > 0 else 1.0)
        prev_le, prev_c = le, c
    return prev_le


def _bucket_delta(
    a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    before = dict(a)
    return [(le, c - before.get(le, 0.0)) for le, c in b]


def _hist_summary(
    before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]
) -> dict[str, Any] | None:
    """Percentiles (ms) of the observations a histogram gained between two scrapes."""
    delta = _bucket_delta(before, after)
    if not delta or delta[-1][1] <= 0:
        return None
    out: dict[str, Any] = {"n": int(delta[-1][1])}
    for q in (50, 90, 95, 99):
        v = histogram_quantile(delta, q / 100)
        out[f"p{q}"] = v * 1000 if v is not None else None
    return out


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {
        "mean": sum(xs) / len(xs) if xs else None,
        "max": max(xs) if xs else None,
    }


def summarize_window(scrapes: Sequence[Scrape], w0: float, w1: float) -> dict[str, Any]:
    """Server metrics over [w0, w1]: gauges from the scrapes inside it; counters and
    histograms as the difference between the last scrape at or before w0 and the first at or
    after w1 (the nearest ones when the window edges have none)."""
    inside = [s for s in scrapes if w0 <= s.t <= w1] or list(scrapes)
    out: dict[str, Any] = {"num_scrapes": len(inside)}
    kv = [s.kv_usage for s in inside if s.kv_usage is not None]
    out["kv_usage"] = {"peak": max(kv) if kv else None, "mean": sum(kv) / len(kv) if kv else None}
    out["running"] = _stats([s.running for s in inside if s.running is not None])
    out["waiting"] = _stats([s.waiting for s in inside if s.waiting is not None])
    if not scrapes:
        out["preemptions"] = None
        out["server_ttft_ms"] = None
        return out
    before = [s for s in scrapes if s.t <= w0]
    after = [s for s in scrapes if s.t >= w1]
    first = before[-1] if before else scrapes[0]
    last = after[0] if after else scrapes[-1]
    if first.preemptions is not None and last.preemptions is not None:
        out["preemptions"] = int(round(last.preemptions - first.preemptions))
    else:
        out["preemptions"] = None
    out["server_ttft_ms"] = _hist_summary(first.ttft_buckets, last.ttft_buckets)
    out["prefix_cache_hit_rate"] = _hit_rate(first, last)
    out["spec_decode"] = _spec_summary(first, last)
    for name in ("queue_time", "prefill_time"):
        out[f"server_{name}_ms"] = _hist_summary(
            first.hists.get(name, []), last.hists.get(name, [])
        )
    return out


def _hit_rate(first: Scrape, last: Scrape) -> float | None:
    """Prompt tokens served from the prefix cache over those looked up, between two scrapes."""
    if None in (first.prefix_hits, last.prefix_hits, first.prefix_queries, last.prefix_queries):
        return None
    queries = last.prefix_queries - first.prefix_queries  # type: ignore[operator]
    hits = last.prefix_hits - first.prefix_hits  # type: ignore[operator]
    return hits / queries if queries > 0 else None


def _spec_summary(first: Scrape, last: Scrape) -> dict[str, Any] | None:
    """Speculative decoding over the window: the counters' deltas, the acceptance rate
    (accepted / draft tokens) and the mean accepted length (1 + accepted / drafts, vLLM's)."""
    if first.spec is None or last.spec is None:
        return None
    drafts, drafted, accepted = (
        int(round(b - a)) for a, b in zip(first.spec, last.spec, strict=True)
    )
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }


def timeseries(scrapes: Sequence[Scrape], t0: float) -> dict[str, list[Any]]:
    """Scrapes as columns, times relative to ``t0`` (for the record and the timeline plot)."""
    return {
        "t": [round(s.t - t0, 4) for s in scrapes],
        "kv_usage": [s.kv_usage for s in scrapes],
        "running": [s.running for s in scrapes],
        "waiting": [s.waiting for s in scrapes],
        "preemptions": [s.preemptions for s in scrapes],
    }
