"""Speculative decoding's counters on ``/metrics``: vLLM's names under ``poise:``.

``spec_decode_num_drafts`` (rows that verified at least one draft), ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (label ``position``, 0 the
first draft), all ``_total`` counters read from the engine snapshot's ``SpecDecodeStats`` at
scrape time. Exported only when speculation is configured, as vLLM does (a server without it
shows no spec_decode series rather than zeros that look like a draft that never hits).
Acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from poise.engine.state import EngineState
from poise.serving.metric_buckets import P

SPEC_COUNTERS: tuple[tuple[str, str], ...] = (
    ("spec_decode_num_drafts", "Rows that verified at least one draft token."),
    ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
)
PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def spec_decode_families(model_name: str, state: EngineState) -> Iterator[Metric]:
    stats = state.spec_decode
    if stats is None:
        return
    values = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    for (name, doc), value in zip(SPEC_COUNTERS, values, strict=True):
        family = CounterMetricFamily(P + name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    per_pos = CounterMetricFamily(
        P + PER_POS,
        "Drafts whose token at this position (0: the first) was accepted.",
        labels=["model_name", "position"],
    )
    for pos, n in enumerate(stats.accepted_per_pos):
        per_pos.add_metric([model_name, str(pos)], n)
    yield per_pos
