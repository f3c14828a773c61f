"""``--enable-log-requests``: one structured line per finished request, as it ends.

Logged on the engine thread from the finishing delta (logger ``poise.requests``), as JSON:
id, class, prompt / cached / output tokens, the TTFT parts, TTFT, TPOT, e2e (ms), preemptions
and finish reason. Never the prompt or the generated text.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from poise.core.outputs import RequestDelta
from poise.core.timing import derive

logger = logging.getLogger("poise.requests")


def ms(value: float | None) -> float | None:
    """Seconds as milliseconds rounded to the microsecond (the log line's and responses' unit)."""
    return None if value is None else round(value * 1000.0, 3)


def request_record(delta: RequestDelta) -> dict[str, Any]:
    m = derive(delta.times) if delta.times is not None else None
    record: dict[str, Any] = {
        "id": delta.request_id,
        "class": delta.slo.class_name if delta.slo is not None else "default",
        "prompt_tokens": delta.num_prompt_tokens,
        "cached_tokens": delta.num_cached_tokens,
        "output_tokens": m.num_output_tokens if m is not None else 0,
        "finish_reason": delta.finish_reason,
        "preemptions": delta.num_preemptions,
    }
    if m is not None:
        record.update(
            ingress_ms=ms(m.ingress_time),
            queue_ms=ms(m.queue_time),
            prefill_ms=ms(m.prefill_time),
            prefill_compute_ms=ms(m.prefill_compute),
            first_token_sched_ms=ms(m.first_token_sched),
            ttft_ms=ms(m.ttft),
            tpot_ms=ms(m.tpot),
            e2e_ms=ms(m.e2e),
        )
    return record


def log_request(delta: RequestDelta) -> None:
    logger.info("request finished %s", json.dumps(request_record(delta), sort_keys=False))
