"""A reference for sampling-field tests: greedy decoding over a transformers model's logits with
logit_bias, min_tokens and the penalties written out one token at a time, in vLLM's order."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch


def greedy_reference(
    hf: Any,
    prompt: list[int],
    n: int,
    *,
    bias: dict[int, float] | None = None,
    freq: float = 0.0,
    pres: float = 0.0,
    rep: float = 1.0,
    min_tokens: int = 0,
    stops: tuple[int, ...] = (),
) -> list[int]:
    """``n`` greedy tokens after ``prompt``; the repetition penalty is transformers' own
    ``RepetitionPenaltyLogitsProcessor`` (prompt and output tokens), frequency and presence
    OpenAI's formula over the output tokens."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
            for token, b in (bias or {}).items():
                logits[token] += b
            if len(out) < min_tokens:
                logits[list(stops)] = float("-inf")
            if rep != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([ids]), logits[None])[0]
            for token, count in Counter(out).items():
                logits[token] -= freq * count + pres
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out
