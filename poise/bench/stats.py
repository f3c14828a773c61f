"""Benchmark metric math: pure functions from per-request records to per-cell summaries.

No I/O, no aiohttp: the load client, the simulator and tests all feed ``RequestRecord``s in.
Definitions (times in seconds on one monotonic clock; summaries in ms):

- token event: an SSE event that carries generated text (content or reasoning) or a growing
  per-chunk usage count. Role-only and usage-only events are never token events.
- ``ttft = t(first token event) - t_sent``; ``e2e = t(last token event) - t_sent``;
  ``e2e_stream = t(stream end) - t_sent`` (includes the usage chunk and [DONE]).
- ``n_out``: ``usage.completion_tokens`` when the server gave it, else the sum of per-event
  counts, else the number of token events (``n_out_source`` says which).
- ``tpot = (e2e - ttft) / (n_out - 1)`` for n_out >= 2 (vLLM's TPOT; GenAI-Perf's "ITL").
- ``icl``: raw gaps between consecutive token events (one sample per chunk).
- ``itl``: per-token: each gap is split evenly over the k tokens its event carries (k from
  per-chunk usage, else estimated in proportion to the event's text length); token-weighted.
- ``max_stall = max(icl)``; ``sched_lag = t_sent - t_intended``; ``*_sched = * + sched_lag``
  (latency from the schedule, corrected for coordinated omission).
- Rates use the measurement window [first measured send, last measured end]; warmup records
  are excluded from every summary. Failures count as not-good in goodput and attainment.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request (or what a simulator computed for it)."""

    index: int
    class_name: str
    start: float  # t_sent
    intended: float | None = None  # t_int: when the schedule wanted it sent
    header: float | None = None  # response headers received
    events: list[float] = field(default_factory=list)  # token event times
    event_tokens: list[int | None] = field(default_factory=list)  # tokens per event, if known
    event_chars: list[int] = field(default_factory=list)  # characters per event
    end: float | None = None  # stream end
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    max_tokens: int | None = None
    ok: bool = True
    error: str | None = None
    timed_out: bool = False
    warmup: bool = False
    finish_reason: str | None = None

    @classmethod
    def from_token_times(
        cls, index: int, class_name: str, start: float, token_times: Sequence[float], **kw: Any
    ) -> RequestRecord:
        """One event per token (e.g. a simulator): exact per-token ITL."""
        n = len(token_times)
        rec = cls(index, class_name, start, events=list(token_times), event_tokens=[1] * n, **kw)
        if rec.end is None and n:
            rec.end = token_times[-1]
        if rec.usage_completion_tokens is None:
            rec.usage_completion_tokens = n
        return rec

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class RequestStats:
    """Derived per-request latencies (seconds) and token counts."""

    ttft: float | None
    e2e: float | None
    e2e_stream: float | None
    tpot: float | None
    n_out: int
    n_out_source: str
    tokens_per_event: list[int]
    icl: list[float]
    itl: list[float]
    itl_source: str
    max_stall: float | None
    sched_lag: float | None


def output_tokens(rec: RequestRecord) -> tuple[int, str]:
    """(n_out, source): server usage first, then per-event counts, then one per event."""
    if rec.usage_completion_tokens is not None:
        return rec.usage_completion_tokens, "usage"
    if rec.event_tokens and all(k is not None for k in rec.event_tokens):
        return sum(k or 0 for k in rec.event_tokens), "event_usage"
    return len(rec.events), "events"


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder), giving
    every slot at least one when ``total >= len(weights)`` (each event carried some text)."""
    n = len(weights)
    if n == 0:
        return []
    wsum = sum(weights)
    shares = [total * w / wsum for w in weights] if wsum > 0 else [total / n] * n
    ints = [math.floor(s) for s in shares]
    order = sorted(range(n), key=lambda i: shares[i] - ints[i], reverse=True)
    for i in order[: total - sum(ints)]:
        ints[i] += 1
    if total >= n:
        for i in range(n):
            if ints[i] == 0:  # take one from the biggest slot
                ints[max(range(n), key=lambda j: ints[j])] -= 1
                ints[i] = 1
    return ints


def tokens_per_event(rec: RequestRecord, n_out: int) -> tuple[list[int], str]:
    """Tokens carried by each token event, and how we know: 'event_usage' (per-chunk usage),
    'text' (n_out spread by text length), 'one_per_event' (no total to spread)."""
    ks = rec.event_tokens
    if len(ks) == len(rec.events) and ks and all(k is not None for k in ks):
        return [int(k or 0) for k in ks], "event_usage"
    if not rec.events:
        return [], "none"
    if rec.usage_completion_tokens is None:
        return [1] * len(rec.events), "one_per_event"
    chars = rec.event_chars if len(rec.event_chars) == len(rec.events) else [1] * len(rec.events)
    return apportion(n_out, [max(c, 1) for c in chars]), "text"


def derive(rec: RequestRecord) -> RequestStats:
    n_out, n_src = output_tokens(rec)
    ks, k_src = tokens_per_event(rec, n_out)
    ev = rec.events
    ttft = ev[0] - rec.start if ev else None
    e2e = ev[-1] - rec.start if ev else None
    tpot = (
        (e2e - ttft) / (n_out - 1) if ttft is not None and e2e is not None and n_out > 1 else None
    )
    icl = [b - a for a, b in zip(ev, ev[1:], strict=False)]
    itl: list[float] = []
    # The first event's extra tokens arrive with the first token: they are part of TTFT, not
    # of any gap; every later gap is shared by the tokens its event delivers.
    for gap, k in zip(icl, ks[1:], strict=False):
        if k > 0:
            itl.extend([gap / k] * k)
    return RequestStats(
        ttft=ttft,
        e2e=e2e,
        e2e_stream=(rec.end - rec.start) if rec.end is not None else None,
        tpot=tpot,
        n_out=n_out,
        n_out_source=n_src,
        tokens_per_event=ks,
        icl=icl,
        itl=itl,
        itl_source=k_src,
        max_stall=max(icl) if icl else None,
        sched_lag=(rec.start - rec.intended) if rec.intended is not None else None,
    )


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; +inf values sort last and stay inf."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    frac = pos - lo
    if frac == 0 or data[hi] == data[lo]:
        return data[lo]
    if math.isinf(data[hi]):
        return math.inf
    return data[lo] + (data[hi] - data[lo]) * frac


def summarize(values: Iterable[float | None], scale: float = 1000.0) -> dict[str, Any]:
    """n, mean, p50/p90/p95/p99, max of the non-None values, multiplied by ``scale``."""
    data = [v * scale for v in values if v is not None]
    out: dict[str, Any] = {"n": len(data)}
    out["mean"] = sum(data) / len(data) if data else None
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(data, q)
    out["max"] = max(data) if data else None
    return out


@dataclass(frozen=True)
class SLO:
    """Latency targets: defaults for every request, optionally overridden per class
    (``per_class[name] = (ttft_ms, tpot_ms)``; None in a slot keeps the default)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    per_class: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        slots = [self.ttft_ms, self.tpot_ms, *(x for p in self.per_class.values() for x in p)]
        return any(x is not None for x in slots)

    def targets(self, class_name: str) -> tuple[float | None, float | None]:
        ttft, tpot = self.per_class.get(class_name, (None, None))
        return (self.ttft_ms if ttft is None else ttft, self.tpot_ms if tpot is None else tpot)

    def met(self, rec: RequestRecord, st: RequestStats) -> bool:
        if not rec.ok or st.ttft is None:
            return False
        ttft_ms, tpot_ms = self.targets(rec.class_name)
        if ttft_ms is not None and st.ttft * 1000 > ttft_ms:
            return False
        # A one-token answer has no TPOT; it cannot violate a TPOT SLO.
        return not (tpot_ms is not None and st.tpot is not None and st.tpot * 1000 > tpot_ms)


def measurement_window(records: Sequence[RequestRecord]) -> tuple[float, float] | None:
    """[first measured send, last measured end] over non-warmup records."""
    meas = [r for r in records if not r.warmup]
    if not meas:
        return None
    w0 = min(r.start for r in meas)
    ends = [r.end if r.end is not None else (r.events[-1] if r.events else r.start) for r in meas]
    return w0, max(ends)


def _tokens_in_window(records: Sequence[RequestRecord], w0: float, w1: float) -> int:
    """Output tokens whose events fall inside [w0, w1], from every request (warmup too): what
    the server produced in the window, nothing straddling the edges dropped or doubled."""
    total = 0
    for rec in records:
        st = derive(rec)
        total += sum(
            k for t, k in zip(rec.events, st.tokens_per_event, strict=False) if w0 <= t <= w1
        )
    return total


def group_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    slo: SLO = SLO(),
    include_failures: bool = False,
) -> dict[str, Any]:
    """Summaries over ``records`` (already filtered to the measured ones of a group)."""
    stats = [derive(r) for r in records]
    ok = [(r, s) for r, s in zip(records, stats, strict=True) if r.ok]
    n_fail = len(records) - len(ok)
    # Error-aware tails: a failure is an infinitely slow request, not a missing one.
    pad = [math.inf] * n_fail if include_failures else []

    def lat(name: str) -> dict[str, Any]:
        return summarize([getattr(s, name) for _, s in ok] + pad)

    lags = [s.sched_lag for s in stats if s.sched_lag is not None]
    out: dict[str, Any] = {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": sum(1 for r in records if not r.ok and not r.timed_out),
        "num_timeouts": sum(1 for r in records if r.timed_out),
        "errors": dict(Counter(r.error or "unknown" for r in records if not r.ok)),
        "ttft_ms": lat("ttft"),
        "tpot_ms": lat("tpot"),
        "e2e_ms": lat("e2e"),
        "e2e_stream_ms": lat("e2e_stream"),
        "max_stall_ms": lat("max_stall"),
        "itl_ms": summarize([x for _, s in ok for x in s.itl]),
        "icl_ms": summarize([x for _, s in ok for x in s.icl]),
        "sched_lag_ms": summarize(lags),
        "ttft_sched_ms": summarize(
            [s.ttft + (s.sched_lag or 0.0) for _, s in ok if s.ttft is not None] + pad
        ),
        "e2e_sched_ms": summarize(
            [s.e2e + (s.sched_lag or 0.0) for _, s in ok if s.e2e is not None] + pad
        ),
    }
    n_out = [s.n_out for _, s in ok]
    events = sum(len(r.events) for r, _ in ok)
    out["output_tokens"] = sum(n_out)
    out["prompt_tokens"] = sum(r.usage_prompt_tokens or 0 for r, _ in ok)
    out["tokens_per_event_mean"] = sum(n_out) / events if events else None
    out["events_per_request_mean"] = events / len(ok) if ok else None  # the seed's avg_chunks
    out["n_out_sources"] = dict(Counter(s.n_out_source for _, s in ok))
    out["itl_sources"] = dict(Counter(s.itl_source for _, s in ok))
    out["output_tokens_per_s"] = sum(n_out) / duration if duration > 0 else None
    out["requests_per_s"] = len(ok) / duration if duration > 0 else None
    capped = [(r, s) for r, s in ok if r.max_tokens is not None]
    short = [r.index for r, s in capped if s.n_out < (r.max_tokens or 0)]
    out["shortfall"] = {"num_short": len(short), "of": len(capped), "indices": short[:20]}
    if slo.active:
        out["goodput"] = goodput(records, stats, duration, slo)
    return out


def goodput(
    records: Sequence[RequestRecord], stats: Sequence[RequestStats], duration: float, slo: SLO
) -> dict[str, Any]:
    """Requests meeting every SLO given, as rates and as attainment over all requests
    (failures included in the denominator: they are not good)."""
    good = [(r, s) for r, s in zip(records, stats, strict=True) if slo.met(r, s)]
    rate = 1.0 / duration if duration > 0 else None
    return {
        "slo_ttft_ms": slo.ttft_ms,
        "slo_tpot_ms": slo.tpot_ms,
        "slo_per_class": {k: list(v) for k, v in slo.per_class.items()} or None,
        "num_good": len(good),
        "requests_per_s": len(good) * rate if rate is not None else None,
        "output_tokens_per_s": sum(s.n_out for _, s in good) * rate if rate is not None else None,
        "slo_attainment": len(good) / len(records) if records else None,
    }


def cell_metrics(
    records: Sequence[RequestRecord], slo: SLO = SLO(), include_failures: bool = False
) -> dict[str, Any]:
    """Overall and per-class summaries of one cell; warmup records are excluded."""
    window = measurement_window(records)
    if window is None:
        return {"window_s": 0.0, "overall": group_metrics([], 0.0), "classes": {}}
    w0, w1 = window
    duration = w1 - w0
    meas = [r for r in records if not r.warmup]
    overall = group_metrics(meas, duration, slo, include_failures)
    overall["output_tokens_per_s_in_window"] = (
        _tokens_in_window(records, w0, w1) / duration if duration > 0 else None
    )
    classes = {}
    for name in sorted({r.class_name for r in meas}):
        group = [r for r in meas if r.class_name == name]
        classes[name] = group_metrics(group, duration, slo, include_failures)
    return {"window": [w0, w1], "window_s": duration, "overall": overall, "classes": classes}


def client_health(
    records: Sequence[RequestRecord],
    loop_lags: Sequence[float],
    max_lag_ms: float = 10.0,
    cpu_util: float | None = None,
) -> dict[str, Any]:
    """The client's own health in a cell. The cell is invalid when the client, not the server,
    set the pace: p99 scheduling lag or event-loop lag above ``max_lag_ms``. ``cpu_util`` (the
    client process's CPU seconds per wall second) tells the two causes apart: near 1.0 the
    client itself is saturated; low, the host is (e.g. the server shares its cores)."""
    lags = [r.start - r.intended for r in records if r.intended is not None and not r.warmup]
    sched = summarize(lags)
    loop = summarize(loop_lags)
    reasons = []
    if sched["p99"] is not None and sched["p99"] > max_lag_ms:
        reasons.append(f"sched_lag p99 {sched['p99']:.1f} ms > {max_lag_ms} ms")
    if loop["p99"] is not None and loop["p99"] > max_lag_ms:
        reasons.append(f"event-loop lag p99 {loop['p99']:.1f} ms > {max_lag_ms} ms")
    if reasons and cpu_util is not None:
        cause = "client saturated" if cpu_util > 0.8 else "host CPU contention"
        reasons.append(f"client CPU {cpu_util:.0%} of a core: likely {cause}")
    return {
        "sched_lag_ms": sched,
        "loop_lag_ms": loop,
        "cpu_util": cpu_util,
        "max_lag_ms": max_lag_ms,
        "valid": not reasons,
        "invalid_reasons": reasons,
    }
