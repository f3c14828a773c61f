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
- No full-vocabulary sort or cumsum for filtered rows: runner/candidates.py finds each row's
  thresholds and draws its token from the few tokens near the top of the row, widening the
  candidate set only for rows whose filters may reach past it. The result is the
  full-vocabulary one, so a row's token does not depend on its neighbours.
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
from poise.runner.candidates import inverse_cdf, sample_filtered
from poise.runner.penalties import F32_MAX, TokenHistory

_MASK64 = (1 << 64) - 1


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row [R, V] -> [R]: the first maximal index, NaN counted as the
    maximum, as ``argmax``. Through ``max(dim)``, whose indices are the same (checked on rows
    full of ties, NaN and infinities): on CPU torch's bf16 ``argmax`` took 0.73 / 2.9 ms for 8 /
    32 rows of SmolLM2's 49,152 logits, ``max`` 0.16 / 0.66 ms."""
    return logits.max(dim=-1).indices


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_indices: list[int],
    *,
    generator: torch.Generator | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
    logits_writable: bool = False,
) -> list[int]:
    """One token id per logits row. ``logits`` is [S, V] in any float dtype.

    ``histories[i]``: row ``i``'s (prompt, output) token ids, needed where its params ask for
    a penalty; ``eos_token_ids``: what ``min_tokens`` masks besides ``stop_token_ids``;
    ``logits_writable``: the caller is done with ``logits``, so the penalties and the
    temperature may work in them instead of an [S, V] copy each (else they stay untouched)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(output_indices):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [S, V] with S == len(params) == "
            f"len(output_indices) ({len(params)}, {len(output_indices)})"
        )
    if not params:
        return []
    raw = logits
    logits = penalties.adjust(
        logits, params, output_indices, histories, eos_token_ids, inplace=logits_writable
    )
    is_greedy = [p.temperature == 0.0 or p.top_k == 1 for p in params]
    if all(is_greedy):
        # Fast path: argmax is exact in any float dtype, no float32 copy needed.
        return [int(t) for t in greedy_tokens(logits).tolist()]

    dev = logits.device
    out = [0] * len(params)
    greedy_rows = [i for i, g in enumerate(is_greedy) if g]
    if greedy_rows:
        picked = greedy_tokens(logits[torch.tensor(greedy_rows, device=dev)]).tolist()
        for row, tok in zip(greedy_rows, picked, strict=True):
            out[row] = int(tok)

    rows = [i for i, g in enumerate(is_greedy) if not g]
    sub_params = [params[i] for i in rows]
    # [R, V]: no row gather when every row samples (an index op costs as much as a copy at
    # vocabulary width). Scaled in place where we may write (a gather, the penalties' copy, or
    # logits the caller gave up), else the division makes the copy.
    sub = logits[torch.tensor(rows, device=dev)] if greedy_rows else logits
    # At most float32's largest value: a larger temperature (JSON allows 1e305) became inf,
    # and a grammar's masked -inf / inf is NaN, which sampled forbidden tokens (the API fuzzer
    # found it). Any temperature past ~1e30 already makes every finite logit 0 (uniform), so
    # the bound does not change the distribution.
    temps = torch.tensor(
        [min(p.temperature, F32_MAX) for p in sub_params], dtype=torch.float32, device=dev
    )
    if (logits_writable or sub is not raw) and sub.dtype == torch.float32:
        scaled = sub.div_(temps.unsqueeze(1))
    else:
        scaled = sub.to(torch.float32) / temps.unsqueeze(1)
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    uniforms = _uniforms(sub_params, [output_indices[i] for i in rows], generator)
    vocab = probs.shape[1]
    # top_k <= 0 (or >= V) disables it; k == V keeps everything anyway.
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in sub_params]
    filtered = [j for j, p in enumerate(sub_params) if ks[j] or p.top_p < 1.0 or p.min_p > 0.0]
    if filtered:
        picked = sample_filtered(
            probs,
            filtered,
            [ks[j] for j in filtered],
            [sub_params[j].top_p for j in filtered],
            [sub_params[j].min_p for j in filtered],
            [uniforms[j] for j in filtered],
        )
        for j, tok in zip(filtered, picked, strict=True):
            out[rows[j]] = tok
    is_filtered = set(filtered)
    plain = [j for j in range(len(rows)) if j not in is_filtered]
    if plain:  # no filter: the whole row is the support
        dense = probs if len(plain) == len(rows) else probs[torch.tensor(plain, device=dev)]
        drawn = inverse_cdf(dense, [uniforms[j] for j in plain]).tolist()
        for j, tok in zip(plain, drawn, strict=True):
            out[rows[j]] = int(tok)
    return out


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
