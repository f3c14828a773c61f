"""Logit adjustments before sampling: ``logit_bias``, ``min_tokens`` and vLLM's three penalties.

``adjust(logits, params, output_indices, histories, eos_token_ids)`` returns the logits the
sampler should use. Only the rows whose request asks for an adjustment are touched, and a batch
where nobody asks returns ``logits`` itself after one pass over the params (no tensor work).
Raw logits are never modified in place (a caller may still read them, e.g. for logprobs).

vLLM's semantics and order, all on float32 rows:

1. ``logit_bias`` (token id -> value): added to that token's logit.
2. ``min_tokens``: while fewer output tokens exist, the request's stop tokens (its
   ``stop_token_ids``, and the model's EOS ids unless ``ignore_eos``) get ``-inf``.
3. ``repetition_penalty`` r (transformers' and vLLM's rule): every token seen in the prompt *or*
   the output so far has its logit divided by r when positive, multiplied by r otherwise.
4. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's definitions): over the output
   tokens only, ``logit -= f * count(token) + p * (count(token) > 0)``.

Counting is vectorised over the batch: the rows' tokens are concatenated once into flat
``row * V + token`` keys and counted with one ``bincount`` (no Python loop over the vocabulary;
the only per-row Python work is handing over each row's token list).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from poise.core.sampling_params import SamplingParams

# (prompt token ids, output token ids so far) of one sampled request; None when not needed.
TokenHistory = tuple[Sequence[int], Sequence[int]]


def _active(params: SamplingParams, output_index: int) -> bool:
    return bool(params.logit_bias) or output_index < params.min_tokens or params.needs_token_history


def adjust(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    histories: Sequence[TokenHistory | None] | None,
    eos_token_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """``logits`` [S, V] with each requested adjustment applied to its row (see the module)."""
    rows = [i for i, (p, k) in enumerate(zip(params, output_indices, strict=True)) if _active(p, k)]
    if not rows:
        return logits
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    sub = logits.index_select(0, idx).to(torch.float32)  # [R, V], a copy
    sub_params = [params[i] for i in rows]
    _add_bias(sub, sub_params)
    _mask_stops(sub, sub_params, [output_indices[i] for i in rows], eos_token_ids)
    penalised = [j for j, p in enumerate(sub_params) if p.needs_token_history]
    if penalised:
        if histories is None or any(histories[rows[j]] is None for j in penalised):
            raise ValueError("penalties need the request's token history (ScheduledRequest)")
        hist = [histories[rows[j]] for j in penalised]
        _penalise(sub, penalised, [sub_params[j] for j in penalised], hist)  # type: ignore[arg-type]
    out = logits.to(torch.float32, copy=True)
    return out.index_copy_(0, idx, sub)


def _add_bias(sub: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    r_idx: list[int] = []
    t_idx: list[int] = []
    values: list[float] = []
    for j, p in enumerate(params):
        if p.logit_bias:
            r_idx += [j] * len(p.logit_bias)
            t_idx += [int(t) for t in p.logit_bias]
            values += [float(v) for v in p.logit_bias.values()]
    if values:
        dev = sub.device
        sub.index_put_(
            (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
            torch.tensor(values, dtype=torch.float32, device=dev),
            accumulate=True,
        )


def _mask_stops(
    sub: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    eos_token_ids: frozenset[int],
) -> None:
    r_idx: list[int] = []
    t_idx: list[int] = []
    for j, (p, k) in enumerate(zip(params, output_indices, strict=True)):
        if k < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            r_idx += [j] * len(stops)
            t_idx += sorted(stops)
    if t_idx:
        dev = sub.device
        sub.index_put_(
            (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
            torch.tensor(float("-inf"), device=dev),
        )


def _flat_keys(token_lists: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """``row * vocab + token`` for every token of every row, as one int64 array."""
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    total = int(lengths.sum())
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
    return np.repeat(np.arange(len(token_lists), dtype=np.int64) * vocab, lengths) + flat


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] int64: how often each token occurs in each row's list."""
    keys = torch.from_numpy(_flat_keys(token_lists, vocab)).to(device)
    return torch.bincount(keys, minlength=len(token_lists) * vocab).view(len(token_lists), vocab)


def _penalise(
    sub: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
) -> None:
    """Repetition, frequency and presence penalties on ``sub``'s ``rows`` (in place)."""
    dev = sub.device
    vocab = sub.shape[1]
    idx = torch.tensor(rows, device=dev)
    x = sub.index_select(0, idx)  # [P, V]
    out_counts = _counts([h[1] for h in histories], vocab, dev).to(torch.float32)  # [P, V]
    seen_out = out_counts > 0
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)
    if bool((rep != 1.0).any()):
        seen = seen_out | (_counts([h[0] for h in histories], vocab, dev) > 0)
        r = torch.where(seen, rep.unsqueeze(1), 1.0)  # [P, V]; 1 where unseen or unpenalised
        x = torch.where(x > 0, x / r, x * r)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)
    x = x - freq.unsqueeze(1) * out_counts - pres.unsqueeze(1) * seen_out.to(torch.float32)
    sub.index_copy_(0, idx, x)
