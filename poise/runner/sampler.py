"""Token sampling for one engine step: greedy, temperature, top-k, top-p, min-p, per-request seed.

``sample(logits, params, output_indices)`` turns the logits rows of the requests sampled this
step into one token id each. Row ``i`` of ``logits`` belongs to ``params[i]``, whose next token
is its ``output_indices[i]``-th output token.

Invariants and choices:
- Before anything else, ``penalties.adjust`` applies ``logit_bias``, ``min_tokens`` and the
  repetition / frequency / presence penalties to the rows that ask for them (vLLM's order);
  greedy rows take the argmax of the adjusted logits, as in vLLM.
- All math is float32, whatever the logits dtype.
- ``temperature == 0`` (and ``top_k == 1``) is greedy: the argmax of the raw logits. A batch of
  only greedy rows takes one ``argmax`` and nothing else.
- Filters apply in this order on the temperature-scaled distribution: top-k, top-p (on the
  distribution renormalised after top-k), min-p (relative to the most likely token). Each one
  becomes a per-row *probability threshold*: a token survives iff its probability is at least
  the largest of the row's thresholds. Thresholds make ties behave the same on every code path
  (top-k keeps all tokens tied with the k-th one) and vectorise across rows.
- No full-vocabulary sort: top-k/top-p look at a ``topk`` candidate set that grows only for
  rows whose top-p mass is not yet covered. The thresholds found do not depend on the
  candidate count, so a row's result does not depend on its neighbours.
- Sampling is inverse-CDF: one uniform ``u`` per row, ``searchsorted`` in the row's cumulative
  probabilities. A token with probability 0 can never be chosen (its CDF step is flat).
- Seeded requests draw ``u`` from a hash of ``(seed, output_index)``: the same token whatever
  else is in the batch, in whatever order, and again when the request is recomputed after a
  preemption. Unseeded rows draw from ``generator`` (torch's default generator when None).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from poise.core.sampling_params import SamplingParams
from poise.runner import penalties
from poise.runner.penalties import TokenHistory

# First candidate count for top-p; it grows by _GROWTH until the row's top-p mass is covered.
_TOP_P_CANDIDATES = 256
_GROWTH = 8
_MASK64 = (1 << 64) - 1


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_indices: list[int],
    *,
    generator: torch.Generator | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """One token id per logits row. ``logits`` is [S, V] in any float dtype.

    ``histories[i]``: row ``i``'s (prompt, output) token ids, needed where its params ask for
    a penalty; ``eos_token_ids``: what ``min_tokens`` masks besides ``stop_token_ids``."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(output_indices):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [S, V] with S == len(params) == "
            f"len(output_indices) ({len(params)}, {len(output_indices)})"
        )
    if not params:
        return []
    logits = penalties.adjust(logits, params, output_indices, histories, eos_token_ids)
    is_greedy = [p.temperature == 0.0 or p.top_k == 1 for p in params]
    if all(is_greedy):
        # Fast path: argmax is exact in any float dtype, no float32 copy needed.
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    dev = logits.device
    out = [0] * len(params)
    greedy_rows = [i for i, g in enumerate(is_greedy) if g]
    if greedy_rows:
        picked = logits[torch.tensor(greedy_rows, device=dev)].argmax(dim=-1).tolist()
        for row, tok in zip(greedy_rows, picked, strict=True):
            out[row] = int(tok)

    rows = [i for i, g in enumerate(is_greedy) if not g]
    sub_params = [params[i] for i in rows]
    # [R, V], a copy we may modify; no gather when every row samples (an index op costs as
    # much as the copy itself at vocabulary width).
    if greedy_rows:
        sub = logits[torch.tensor(rows, device=dev)].to(torch.float32)
    else:
        sub = logits.to(torch.float32, copy=True)
    probs = _filtered_probs(sub, sub_params)
    uniforms = _uniforms(sub_params, [output_indices[i] for i in rows], generator)
    for row, tok in zip(rows, _inverse_cdf(probs, uniforms), strict=True):
        out[row] = tok
    return out


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p as one threshold per row; zeroes filtered tokens.

    ``logits`` [R, V] float32 is scaled in place. Returns unnormalised probabilities [R, V].
    """
    n_rows, vocab = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    logits.div_(temps.unsqueeze(1))
    probs = torch.softmax(logits, dim=-1)  # [R, V]

    # top_k <= 0 (or >= V) disables it; k == V keeps everything anyway.
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    use_kp = any(ks) or any(tp < 1.0 for tp in top_ps)
    use_min_p = any(m > 0.0 for m in min_ps)
    if not (use_kp or use_min_p):
        return probs
    thresholds = torch.zeros(n_rows, dtype=torch.float32, device=dev)
    if use_kp:
        thresholds = _topk_topp_threshold(probs, ks, top_ps)
    if use_min_p:
        max_prob = probs.amax(dim=-1)  # [R]
        min_p = torch.tensor(min_ps, dtype=torch.float32, device=dev)
        thresholds = torch.maximum(thresholds, min_p * max_prob)
    # The row's most likely token always survives: every threshold is <= its probability.
    return probs.masked_fill_(probs < thresholds.unsqueeze(1), 0.0)


def _topk_topp_threshold(probs: torch.Tensor, ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Per-row probability threshold implementing top-k then top-p, from topk candidates only.

    Rows whose top-p cutoff lies beyond the candidates are retried with _GROWTH times more.
    """
    n_rows, vocab = probs.shape
    thresholds = torch.zeros(n_rows, dtype=torch.float32, device=probs.device)
    todo = [i for i in range(n_rows) if ks[i] or top_ps[i] < 1.0]
    has_p = any(top_ps[i] < 1.0 and not ks[i] for i in todo)
    count = max([ks[i] for i in todo] + [_TOP_P_CANDIDATES if has_p else 0])
    while todo:
        count = min(count, vocab)
        idx = torch.tensor(todo, device=probs.device)
        candidates = probs if len(todo) == n_rows else probs[idx]  # no gather when all rows
        values = candidates.topk(count, dim=-1, sorted=True).values  # [T, count], descending
        thr, covered = _thresholds_from_candidates(
            values, [ks[i] for i in todo], [top_ps[i] for i in todo], complete=count == vocab
        )
        done = covered.tolist()
        keep = [j for j, ok in enumerate(done) if ok]
        if keep:
            rows = torch.tensor([todo[j] for j in keep], device=probs.device)
            thresholds[rows] = thr[torch.tensor(keep, device=probs.device)]
        todo = [row for row, ok in zip(todo, done, strict=True) if not ok]
        count *= _GROWTH
    return thresholds


def _thresholds_from_candidates(
    values: torch.Tensor, ks: list[int], top_ps: list[float], complete: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold [T], covered [T] bool) from descending candidate probabilities [T, C].

    ``covered`` is False where the top-p cutoff may lie beyond the C candidates. Top-k always
    fits (C >= k). Index math, per row, C = 6, k = 4, top_p = 0.8::

        values     .30 .25 .20 .15 | .06 .04      kept = first k (top-k renormalises over them)
        exclusive  0   .30 .55 .75 |              mass before each kept value (total .90)
        inside     y   y   y   n                  exclusive < top_p * total = .72
        threshold  .20                            the last value inside; ties stay in
    """
    n, count = values.shape
    dev = values.device
    k = torch.tensor(ks, device=dev)  # [T], 0 = off
    top_p = torch.tensor(top_ps, dtype=torch.float32, device=dev)  # [T], 1 = off
    col = torch.arange(count, device=dev).unsqueeze(0)  # [1, C]
    kept = (col < k.unsqueeze(1)) | (k == 0).unsqueeze(1)  # [T, C]
    masked = values * kept
    thr_k = torch.where(k > 0, values.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    # Mass of the top-k-renormalised distribution: the kept values' sum when top-k is on, else
    # the whole row's softmax mass, 1 up to rounding.
    total = torch.where(k > 0, masked.sum(dim=1), torch.ones_like(top_p))
    exclusive = torch.cumsum(masked, dim=1) - masked  # [T, C]
    inside = (exclusive < (top_p * total).unsqueeze(1)) & kept
    n_inside = inside.sum(dim=1).clamp(min=1)  # the first candidate is always inside
    thr_p = values.gather(1, (n_inside - 1).unsqueeze(1)).squeeze(1)
    thr = torch.where(top_p < 1.0, torch.maximum(thr_k, thr_p), thr_k)
    covered = (top_p >= 1.0) | (k > 0) | (n_inside < count)
    if complete:
        covered = torch.ones_like(covered)
    return thr, covered


def _uniforms(
    params: Sequence[SamplingParams], output_indices: Sequence[int], gen: torch.Generator | None
) -> list[float]:
    """One uniform in [0, 1) per row: hashed from (seed, index) when seeded, else from ``gen``."""
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    # Draw on the generator's own device (a CUDA generator cannot fill a CPU tensor).
    device = gen.device if gen is not None else torch.device("cpu")
    drawn = torch.rand(len(unseeded), dtype=torch.float64, generator=gen, device=device).tolist()
    by_row = dict(zip(unseeded, drawn, strict=True))
    return [
        by_row[i] if p.seed is None else seeded_uniform(p.seed, output_indices[i])
        for i, p in enumerate(params)
    ]


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """Sample each row of unnormalised ``probs`` [R, V] at its uniform."""
    cdf = torch.cumsum(probs, dim=-1)  # [R, V], non-decreasing
    total = cdf[:, -1:]  # [R, 1]
    u = torch.tensor(uniforms, dtype=torch.float32, device=probs.device)
    target = u.unsqueeze(1) * total
    # u < 1, but u * total can round up to total; keep the target strictly below it so the
    # search lands on a token with non-zero probability.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    # right=True: the first index whose CDF is > target, so flat (zero-prob) steps are skipped.
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return [int(t) for t in picked.clamp_(max=probs.shape[1] - 1).tolist()]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, output_index: int) -> float:
    """The uniform in [0, 1) that a request with ``seed`` uses for its ``output_index``-th token.

    A pure function of its arguments (no generator state), so batch composition, order and
    recompute after preemption cannot change it.
    """
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))
