"""Logit adjustments before sampling: ``logit_bias``, ``min_tokens`` and vLLM's three penalties.

``adjust(logits, params, output_indices, histories, eos_token_ids)`` returns the logits the
sampler should use. Only the rows whose request asks for an adjustment are touched, and a batch
where nobody asks returns ``logits`` itself after one pass over the params (no tensor work).
Raw logits are modified in place only when the caller says it no longer needs them
(``inplace``: the model runner, which took the raw logprobs before sampling).

vLLM's semantics and order, all on float32 rows:

1. ``logit_bias`` (token id -> value): added to that token's logit.
2. ``min_tokens``: while fewer output tokens exist, the request's stop tokens (its
   ``stop_token_ids``, and the model's EOS ids unless ``ignore_eos``) get ``-inf``.
3. ``repetition_penalty`` r (transformers' and vLLM's rule): every token seen in the prompt *or*
   the output so far has its logit divided by r when positive, multiplied by r otherwise.
4. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's definitions): over the output
   tokens only, ``logit -= f * count(token) + p * (count(token) > 0)``.

Counting is vectorised over the batch and sparse: the rows' tokens are concatenated once into
flat ``row * V + token`` keys (numpy), the output tokens' keys are counted with ``unique``, and
only the logits at those positions are gathered, changed and scattered back (no Python loop over
the vocabulary, no [S, V] temporaries; the only per-row Python work is handing over each row's
token list). The one dense operation is the float32 copy of the logits that every adjusted batch
makes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from poise.core.sampling_params import SamplingParams

# (prompt token ids, output token ids so far) of one sampled request; None when not needed.
TokenHistory = tuple[Sequence[int], Sequence[int]]

# The largest float32: a larger factor (JSON allows 1e300) would become inf in float32, and a
# logit of exactly 0 times inf is NaN. Any factor past ~1e30 already sends every seen token's
# logit to 0 or -inf, so the bound changes nothing else.
F32_MAX = float(np.finfo(np.float32).max)


def _active(params: SamplingParams, output_index: int) -> bool:
    return bool(params.logit_bias) or output_index < params.min_tokens or params.needs_token_history


def adjust(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    histories: Sequence[TokenHistory | None] | None,
    eos_token_ids: frozenset[int] = frozenset(),
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """``logits`` [S, V] with each requested adjustment applied to its row (see the module).

    ``inplace``: the caller no longer needs the raw logits, so float32 ``logits`` are adjusted
    and returned themselves (no [S, V] copy); otherwise they are never modified."""
    rows = [i for i, (p, k) in enumerate(zip(params, output_indices, strict=True)) if _active(p, k)]
    if not rows:
        return logits
    if inplace and logits.dtype == torch.float32:
        out = logits
    else:
        out = logits.to(torch.float32, copy=True)  # [S, V]; the caller's logits stay raw
    _add_bias(out, rows, params)
    _mask_stops(out, rows, params, output_indices, eos_token_ids)
    penalised = [i for i in rows if params[i].needs_token_history]
    if penalised:
        if histories is None or any(histories[i] is None for i in penalised):
            raise ValueError("penalties need the request's token history (ScheduledRequest)")
        _penalise(out, penalised, params, histories)  # type: ignore[arg-type]
    return out


def _add_bias(out: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> None:
    r_idx: list[int] = []
    t_idx: list[int] = []
    values: list[float] = []
    for i in rows:
        bias = params[i].logit_bias
        if bias:
            r_idx += [i] * len(bias)
            t_idx += [int(t) for t in bias]
            values += [float(v) for v in bias.values()]
    if values:
        dev = out.device
        out.index_put_(
            (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
            torch.tensor(values, dtype=torch.float32, device=dev),
            accumulate=True,
        )


def _mask_stops(
    out: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    eos_token_ids: frozenset[int],
) -> None:
    r_idx: list[int] = []
    t_idx: list[int] = []
    for i in rows:
        p = params[i]
        if output_indices[i] < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            r_idx += [i] * len(stops)
            t_idx += sorted(stops)
    if t_idx:
        dev = out.device
        out.index_put_(
            (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
            torch.tensor(float("-inf"), device=dev),
        )


def _flat_keys(
    rows: list[int], token_lists: Sequence[Sequence[int]], vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """(``row * vocab + token`` for every token of every listed row as one int64 array, the
    number of tokens of each listed row)."""
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    total = int(lengths.sum())
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
    return np.repeat(np.asarray(rows, dtype=np.int64) * vocab, lengths) + flat, lengths


def _penalise(
    out: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
) -> None:
    """Repetition, then frequency and presence penalties on ``rows`` of ``out`` (in place).

    Sparse: only the logits of tokens a row has seen change, so the work is gathered and
    scattered at those flat positions rather than over [S, V]."""
    dev = out.device
    vocab = out.shape[1]
    flat = out.view(-1)
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:
        # Every occurrence of a seen token, duplicates included: each copy of a position
        # computes the same new value from the same gathered logit, so the scatter needs no
        # ``unique`` (a sort of the whole prompt, the step's largest cost before).
        seqs = [histories[i][0] for i in rep_rows] + [histories[i][1] for i in rep_rows]
        seen, lengths = _flat_keys(rep_rows + rep_rows, seqs, vocab)
        factor = np.repeat(
            np.asarray(
                [min(params[i].repetition_penalty, F32_MAX) for i in rep_rows * 2], dtype=np.float32
            ),
            lengths,
        )
        at = torch.from_numpy(seen).to(dev)
        r = torch.from_numpy(factor).to(dev)
        x = flat.index_select(0, at)
        # index_copy_ with repeated positions: every copy carries the same value.
        flat.index_copy_(0, at, torch.where(x > 0, x / r, x * r))
    counted = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
    if counted:
        out_keys, lengths = _flat_keys(counted, [histories[i][1] for i in counted], vocab)
        keys, counts = np.unique(out_keys, return_counts=True)
        row = keys // vocab
        per_row = np.zeros((2, out.shape[0]), dtype=np.float32)  # frequency, presence
        for i in counted:
            per_row[:, i] = (params[i].frequency_penalty, params[i].presence_penalty)
        delta = per_row[0, row] * counts.astype(np.float32) + per_row[1, row]
        at = torch.from_numpy(keys).to(dev)
        flat.index_add_(0, at, -torch.from_numpy(delta).to(dev))  # unique positions
