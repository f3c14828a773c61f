"""Top-k / top-p / min-p sampling from a few candidates per row instead of the whole vocabulary.

``sample_filtered(probs, rows, ks, top_ps, min_ps, uniforms)`` draws one token for each listed
row of ``probs`` [R, V] (the softmax of the temperature-scaled logits); ``inverse_cdf`` is the
draw itself, also used on whole rows that no filter touches.

Why: a filter keeps only tokens near the top of a row, yet a full-vocabulary ``topk`` / sort /
``cumsum`` over a batch of 32 x 49152 costs several ms per step on a CPU, more than a small
model's whole sampling budget. Here the only vocabulary-wide work is one ``amax`` per block of
64 tokens; everything else runs on the blocks that reach a row's cut and on the candidates in
them (tens to a few thousand per row).

Per row, vectorised over the rows of each pass:

1. Candidates: the tokens whose probability is at least ``level * max`` (read only from the
   blocks whose maximum reaches that cut). A set defined by a
   threshold is closed under ties, so it is exactly the row's ``c`` most likely tokens, ``c`` its
   size, and sorting it gives the first ``c`` values of the whole row sorted.
2. The top-k and top-p thresholds come from those sorted values (see ``_thresholds``); a token
   survives iff its probability is at least the row's threshold (ties stay in), min-p raising it.
3. A row is *covered* when its candidates provably hold every token its filters keep: top-k needs
   at least ``k`` candidates; top-p (without top-k) needs a candidate outside the nucleus, or
   the candidates' mass past ``top_p`` (the running mass reached it inside the candidates);
   min-p alone needs ``level <= min_p``.
   Uncovered rows go again at the next, lower level; the last level (0) takes every token.
4. Inverse CDF over the surviving candidates in vocabulary order.

Exactness: what survives and which token a given uniform draws are those of the same computation
over the whole vocabulary: the thresholds come from the same leading sorted values, and the CDF
is the running sum of the same non-zero terms in the same order (the full-vocabulary CDF only adds
zeros in between, and a CPU ``cumsum`` accumulates sequentially, so the partial sums are
bit-identical). ``tests/unit/test_sampler_candidates.py`` checks it against a full-vocabulary
reference, including rows that need every level.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Candidate levels (fractions of the row's largest probability), tried in order. In SmolLM2's
# penalised batches at top-p 0.95 the first covered ~85 % of the rows (tens to hundreds of
# tokens), 2^-14 the rest (the nucleus ends above 1.1e-4 of the maximum); 0 is every token.
LEVELS = (2.0**-10, 2.0**-14, 2.0**-20, 0.0)
# See _thresholds: float32 rounding of a running sum near 1 is ~6e-8.
_MASS_MARGIN = 2.0**-20
# Tokens per block of the block maxima (a power of two that divides real vocabularies).
_BLOCK = 64


def sample_filtered(
    probs: torch.Tensor,
    rows: Sequence[int],
    ks: Sequence[int],
    top_ps: Sequence[float],
    min_ps: Sequence[float],
    uniforms: Sequence[float],
) -> list[int]:
    """Token ids for ``rows`` of float32 ``probs`` [R, V] (in the order of ``rows``). ``ks``
    (0 = off, else < V), ``top_ps``, ``min_ps`` and ``uniforms`` are per listed row."""
    blocks = _Blocks(probs)
    out = [0] * len(rows)
    todo = list(range(len(rows)))  # positions in ``rows`` not drawn yet
    for level in LEVELS:
        if not todo:
            break
        tokens, covered = _draw_at_level(
            blocks,
            [rows[j] for j in todo],
            [ks[j] for j in todo],
            [top_ps[j] for j in todo],
            [min_ps[j] for j in todo],
            [uniforms[j] for j in todo],
            level,
        )
        for j, tok, ok in zip(todo, tokens, covered, strict=True):
            if ok:
                out[j] = tok
        todo = [j for j, ok in zip(todo, covered, strict=True) if not ok]
    return out


class _Blocks:
    """``probs`` cut into blocks of _BLOCK tokens with each block's maximum: one cheap reduction
    over the vocabulary, after which finding the tokens above a cut only reads the blocks whose
    maximum reaches it (a comparison plus ``nonzero`` over [R, V] costs ~10x an ``amax``)."""

    def __init__(self, probs: torch.Tensor) -> None:
        n_rows, vocab = probs.shape
        self.probs = probs
        self.per_row = -(-vocab // _BLOCK)
        pad = self.per_row * _BLOCK - vocab
        # Zero padding is never a candidate: every cut is > 0.
        padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs.contiguous()
        self.flat = padded.view(n_rows * self.per_row, _BLOCK)  # [R * NB, B]
        self.maxima = self.flat.amax(dim=1).view(n_rows, self.per_row)  # [R, NB]
        self.row_max = self.maxima.amax(dim=1)  # [R], the rows' largest probabilities


def _draw_at_level(
    blocks: _Blocks,
    rows: list[int],
    ks: list[int],
    top_ps: list[float],
    min_ps: list[float],
    uniforms: list[float],
    level: float,
) -> tuple[list[int], list[bool]]:
    """(token, covered) per listed row from its candidates at ``level``; a token is only
    meaningful where covered."""
    probs = blocks.probs
    dev = probs.device
    row_idx = torch.tensor(rows, device=dev)
    k = torch.tensor(ks, device=dev)  # [T], 0 = off
    top_p = torch.tensor(top_ps, dtype=torch.float32, device=dev)  # [T], 1 = off
    uses_kp = any(ks) or any(p < 1.0 for p in top_ps)
    cols: torch.Tensor | None = None
    if level > 0.0:
        vals, ordered, cols, counts = _candidates(blocks, row_idx, level)
    else:  # every token: the rows themselves, in vocabulary order
        vals = probs if rows == list(range(probs.shape[0])) else probs[row_idx]
        ordered = vals.sort(dim=1, descending=True).values if uses_kp else vals
        counts = torch.full((len(rows),), probs.shape[1], device=dev)
    thr = torch.zeros(len(rows), dtype=torch.float32, device=dev)
    covered = torch.ones(len(rows), dtype=torch.bool, device=dev)
    if uses_kp:
        thr, n_inside, past = _thresholds(ordered, k, top_p)
        covered = torch.where(k > 0, counts >= k, (top_p >= 1.0) | (n_inside < counts) | past)
    # min-p alone is covered once the level is at most min_p (then every kept token is a
    # candidate); with top-k / top-p it only raises their threshold.
    min_p = torch.tensor(min_ps, dtype=torch.float32, device=dev)
    covered &= ((k > 0) | (top_p < 1.0)) | (min_p >= level)
    if level == 0.0:  # every token was a candidate
        covered = torch.ones_like(covered)
    thr = torch.maximum(thr, min_p * blocks.row_max[row_idx])
    picked = inverse_cdf(torch.where(vals >= thr.unsqueeze(1), vals, 0.0), uniforms)
    tokens = picked if cols is None else cols.gather(1, picked.unsqueeze(1)).squeeze(1)
    return [int(t) for t in tokens.tolist()], covered.tolist()


def _candidates(
    blocks: _Blocks, row_idx: torch.Tensor, level: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each listed row's tokens with probability >= ``level * max``: (values in vocabulary
    order [T, W], the same sorted descending [T, W], their token ids [T, W], counts [T]),
    zero-padded to the widest row."""
    dev = row_idx.device
    n_listed = len(row_idx)
    cut = level * blocks.row_max[row_idx]  # [T]
    maxima = blocks.maxima if n_listed == blocks.maxima.shape[0] else blocks.maxima[row_idx]
    # Blocks that hold a candidate, then the candidates inside them; both nonzero calls list
    # by row first, so the hits come grouped by row, in vocabulary order. (1-D index ops only:
    # CPU advanced indexing with two index tensors is several times slower.)
    hit_row, hit_block = (maxima >= cut.unsqueeze(1)).nonzero(as_tuple=True)
    chunk = blocks.flat.index_select(
        0, row_idx.index_select(0, hit_row) * blocks.per_row + hit_block
    )
    inside = (chunk >= cut.index_select(0, hit_row).unsqueeze(1)).view(-1).nonzero().squeeze(1)
    which = inside // _BLOCK  # hit block of each candidate
    row = hit_row.index_select(0, which)
    col = hit_block.index_select(0, which) * _BLOCK + inside % _BLOCK
    val = chunk.view(-1).index_select(0, inside)
    counts = torch.bincount(row, minlength=n_listed)  # [T]
    pos = torch.arange(len(row), device=dev) - (torch.cumsum(counts, 0) - counts).index_select(
        0, row
    )
    width = max(1, int(counts.max()))
    at = row * width + pos  # flat place in [T, W]
    vals = val.new_zeros(n_listed * width).index_copy_(0, at, val).view(n_listed, width)
    cols = torch.zeros(n_listed * width, dtype=torch.long, device=dev).index_copy_(0, at, col)
    # Sorted by (row, value descending) in one integer sort: a non-negative float32's bits
    # order like the value. Rows keep their places, so each value lands at its row's ``pos``.
    key = (row << 31) | (0x7FFFFFFF - val.view(torch.int32).to(torch.long))
    ordered = torch.zeros_like(vals).view(-1).index_copy_(0, at, val[torch.sort(key).indices])
    return vals, ordered.view(n_listed, width), cols.view(n_listed, width), counts


def _thresholds(
    values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(threshold [T], n_inside [T], past [T]) of top-k then top-p from each row's leading
    sorted values [T, W] (descending). Index math, per row, W = 6, k = 4, top_p = 0.8::

        values     .30 .25 .20 .15 | .06 .04      kept = first k (top-k renormalises over them)
        exclusive  0   .30 .55 .75 |              mass before each kept value (total .90)
        inside     y   y   y   n                  exclusive < top_p * total = .72
        threshold  .20                            the last value inside; ties stay in

    ``n_inside`` counts the inside positions; where it reaches the row's candidate count the
    nucleus may extend past the candidates, unless ``past``: the values' whole mass is beyond
    ``top_p * total`` (by a margin larger than the rounding of ``exclusive``), so whatever
    follows them is outside (a row whose first token has probability 1 has one candidate)."""
    width = values.shape[1]
    col = torch.arange(width, device=values.device).unsqueeze(0)  # [1, W]
    kept = (col < k.unsqueeze(1)) | (k == 0).unsqueeze(1)  # [T, W]
    masked = values * kept
    kth = values.gather(1, (k - 1).clamp(0, width - 1).unsqueeze(1)).squeeze(1)
    thr_k = torch.where(k > 0, kth, 0.0)
    # Mass of the top-k-renormalised distribution: the kept values' sum when top-k is on, else
    # the whole row's softmax mass, 1 up to rounding.
    total = torch.where(k > 0, masked.sum(dim=1), torch.ones_like(top_p))
    running = torch.cumsum(masked, dim=1)  # [T, W]
    exclusive = running - masked
    bound = top_p * total
    inside = (exclusive < bound.unsqueeze(1)) & kept
    n_inside = inside.sum(dim=1).clamp(min=1)  # the first value is always inside
    thr_p = values.gather(1, (n_inside - 1).clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    thr = torch.where(top_p < 1.0, torch.maximum(thr_k, thr_p), thr_k)
    return thr, n_inside, running[:, -1] >= bound + _MASS_MARGIN


def inverse_cdf(probs: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """Column drawn in each row of unnormalised ``probs`` [R, W] at its uniform ([R] long)."""
    cdf = torch.cumsum(probs, dim=-1)  # [R, W], non-decreasing
    total = cdf[:, -1:]  # [R, 1]
    u = torch.tensor(list(uniforms), dtype=torch.float32, device=probs.device)
    target = u.unsqueeze(1) * total
    # u < 1, but u * total can round up to total; keep the target strictly below it so the
    # search lands on a token with non-zero probability.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    # right=True: the first index whose CDF is > target, so flat (zero-prob) steps are skipped.
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)
