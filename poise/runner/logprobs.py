"""Log probabilities for one step, only for the requests that asked (poise.core.logprobs).

Raw logprobs: ``log_softmax`` in float32 of the model's logits, before temperature, top-k/p or
any other processing of the sampler (vLLM's default ``raw_logprobs``), so they compare with
``log_softmax`` of a reference model's logits. A step where nobody asked costs one pass over the
step's requests in Python and no tensor work.

Prompt logprobs need logits at prompt positions the step does not sample; they are projected
from the step's hidden states in slabs of ``_SLAB`` rows, so a long prompt never holds
[prompt_len, vocab] float32 logits at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from poise.core.logprobs import TokenLogprob
from poise.core.outputs import ScheduledRequest

# Rows of prompt logits projected at a time: 256 x 49k vocab x 4 bytes = 50 MB.
_SLAB = 256


def raw_logprobs(
    logits: torch.Tensor, requests: Sequence[ScheduledRequest]
) -> tuple[list[int], torch.Tensor | None]:
    """(rows, their log_softmax [R, V] float32) for the requests that asked for logprobs.

    Call before sampling: the result is a new tensor, so whatever the sampler later does to
    ``logits`` (penalties, masks) cannot reach it.
    """
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not rows:
        return rows, None
    idx = torch.tensor(rows, device=logits.device)
    return rows, torch.log_softmax(logits[idx].float(), dim=-1)


def sampled_logprobs(
    raw: tuple[list[int], torch.Tensor | None],
    requests: Sequence[ScheduledRequest],
    tokens: Sequence[int],
) -> dict[str, TokenLogprob]:
    """Logprob of each sampled token, from ``raw_logprobs``' result (rows align with
    ``requests`` and ``tokens``)."""
    rows, logp = raw
    if logp is None:
        return {}
    ks = [int(requests[i].sampling_params.logprobs or 0) for i in rows]
    out = _score(logp, [tokens[i] for i in rows], ks)
    return {requests[i].request_id: lp for i, lp in zip(rows, out, strict=True)}


def prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    scheduled: Sequence[ScheduledRequest],
    flat_starts: dict[str, int],
) -> dict[str, list[TokenLogprob]]:
    """Logprobs of the prompt tokens each chunk's ``prompt_logprobs`` span scores.

    ``hidden`` [T, H] is the step's final hidden states in the flat layout; ``flat_starts``
    says where each request's chunk begins in it.
    """
    wanted = [r for r in scheduled if r.prompt_logprobs is not None]
    if not wanted:
        return {}
    rows: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    for r in wanted:
        span = r.prompt_logprobs
        assert span is not None
        first = flat_starts[r.request_id] + span.row
        rows.extend(range(first, first + len(span.targets)))
        targets.extend(span.targets)
        ks.extend([int(r.sampling_params.prompt_logprobs or 0)] * len(span.targets))
    scored: list[TokenLogprob] = []
    for lo in range(0, len(rows), _SLAB):
        idx = torch.tensor(rows[lo : lo + _SLAB], device=hidden.device)
        logp = torch.log_softmax(compute_logits(hidden[idx]).float(), dim=-1)
        scored.extend(_score(logp, targets[lo : lo + _SLAB], ks[lo : lo + _SLAB]))
    out: dict[str, list[TokenLogprob]] = {}
    pos = 0
    for r in wanted:
        n = len(r.prompt_logprobs.targets)  # type: ignore[union-attr]
        out[r.request_id] = scored[pos : pos + n]
        pos += n
    return out


def _score(logp: torch.Tensor, targets: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """Per row of ``logp`` [R, V]: the target's logprob and rank, and the row's top-k."""
    tgt = torch.tensor(list(targets), device=logp.device).unsqueeze(1)
    chosen = logp.gather(1, tgt)  # [R, 1]
    # Rank as vLLM counts it: 1 + the tokens strictly more likely than the target.
    ranks = ((logp > chosen).sum(dim=1) + 1).tolist()
    chosen_l = chosen.squeeze(1).tolist()
    kmax = max(ks)
    top_v: list[list[float]] = [[] for _ in targets]
    top_i: list[list[int]] = [[] for _ in targets]
    if kmax > 0:
        top = logp.topk(kmax, dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprob(int(t), float(c), int(rk), tuple(ti[:k]), tuple(tv[:k]))
        for t, c, rk, ti, tv, k in zip(targets, chosen_l, ranks, top_i, top_v, ks, strict=True)
    ]
