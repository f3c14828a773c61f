"""Per-request timing in the response body (vLLM's ``--enable-per-request-metrics``).

A client that sends ``"include_metrics": true`` to a server started with
``--enable-per-request-metrics`` gets a top-level ``metrics`` object on the response (and on the
last streamed chunk): vLLM's five fields, plus poise's split of the first token's time into the
seed's parts, so a client can see its own queue / prefill split without a Prometheus query.

vLLM's fields: ``time_to_first_token_ms``, ``generation_time_ms`` (arrival to the last token),
``queue_time_ms``, ``mean_itl_ms``, ``tokens_per_second`` (output tokens over generation time).
poise's: ``ingress_time_ms`` (chat template, tokenization, waiting for the engine thread),
``prefill_time_ms`` = ``prefill_compute_ms`` + ``first_token_sched_ms``, ``decode_time_ms``,
``tpot_ms``, ``num_cached_tokens``, ``num_preemptions``. All derived by ``core.timing.derive``,
the same definitions as the Prometheus histograms and the benchmarks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from poise.core.outputs import RequestDelta
from poise.core.timing import derive
from poise.serving.request_log import ms


def response_metrics(delta: RequestDelta, num_output_tokens: int) -> dict[str, Any] | None:
    """The ``metrics`` object for a request whose last delivered delta is ``delta``, counting
    the ``num_output_tokens`` the client received (a stop string can end a request in the
    client's eyes while the engine thread still appends a token: those are not counted)."""
    if delta.times is None:
        return None
    times = dataclasses.replace(
        delta.times, token_times=delta.times.token_times[:num_output_tokens]
    )
    m = derive(times)
    generation = None
    if m.ttft is not None:
        generation = m.ttft + (m.decode_time or 0.0)
    mean_itl = sum(m.itl) / len(m.itl) if m.itl else None
    rate = m.num_output_tokens / generation if generation else None
    return {
        "time_to_first_token_ms": ms(m.ttft),
        "generation_time_ms": ms(generation),
        "queue_time_ms": ms(m.queue_time),
        "mean_itl_ms": ms(mean_itl),
        "tokens_per_second": None if rate is None else round(rate, 3),
        "ingress_time_ms": ms(m.ingress_time),
        "prefill_time_ms": ms(m.prefill_time),
        "prefill_compute_ms": ms(m.prefill_compute),
        "first_token_sched_ms": ms(m.first_token_sched),
        "decode_time_ms": ms(m.decode_time),
        "tpot_ms": ms(m.tpot),
        "num_cached_tokens": delta.num_cached_tokens,
        "num_preemptions": delta.num_preemptions,
    }
