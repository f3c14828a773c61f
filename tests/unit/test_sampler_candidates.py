"""The candidate-set sampler (runner/candidates.py) against the full-vocabulary computation.

The reference below sorts the whole row, takes the top-k / top-p / min-p thresholds from it,
and draws by inverse CDF over the whole vocabulary: what the sampler did before it looked at
candidates only. For every row and every uniform tried, the sampler must draw the reference's
token (so the kept set and its CDF are the same), including rows whose nucleus or top-k lies
far past the first candidate level and rows that need every level down to the whole row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from poise.core.sampling_params import SamplingParams
from poise.runner import candidates
from poise.runner.sampler import sample, seeded_uniform


def _reference(row: torch.Tensor, p: SamplingParams, us: list[float]) -> tuple[set[int], list[int]]:
    """(kept token ids, the token drawn at each of ``us``) for one logits row, over the whole
    vocabulary."""
    probs = torch.softmax(row.float().unsqueeze(0) / p.temperature, dim=-1)[0]  # [V]
    ordered = probs.sort(descending=True).values
    vocab = len(ordered)
    k = p.top_k if 0 < p.top_k < vocab else 0
    thr = torch.tensor(0.0)
    if k or p.top_p < 1.0:
        head = ordered[:k] if k else ordered
        thr = ordered[k - 1] if k else thr
        if p.top_p < 1.0:
            total = head.sum() if k else torch.tensor(1.0)
            exclusive = head.cumsum(0) - head
            n_inside = max(1, int((exclusive < p.top_p * total).sum()))
            thr = torch.maximum(thr, head[n_inside - 1])
    thr = torch.maximum(thr, p.min_p * ordered[0])
    kept = torch.where(probs >= thr, probs, 0.0)
    cdf = kept.cumsum(0)
    target = torch.minimum(torch.tensor(us) * cdf[-1], torch.nextafter(cdf[-1], torch.tensor(0.0)))
    tokens = torch.searchsorted(cdf, target, right=True).tolist()
    return set(kept.nonzero().squeeze(1).tolist()), tokens


def _rows(vocab: int) -> list[tuple[torch.Tensor, SamplingParams]]:
    """Logits rows of very different shapes, each with the filters it stresses."""
    g = torch.Generator().manual_seed(vocab)
    peaked = torch.randn(vocab, generator=g) * 6
    moderate = torch.randn(vocab, generator=g) * 2
    flat = torch.randn(vocab, generator=g) * 0.05  # nucleus of most of the vocabulary
    certain = torch.full((vocab,), -200.0)
    certain[vocab // 3] = 0.0  # probability 1 for one token, 0 for the rest
    ties = (torch.randn(vocab, generator=g) * 2).round()  # many equal probabilities
    slope = -torch.arange(vocab, dtype=torch.float32) / vocab  # nucleus ~ a third of the row
    return [
        (peaked, SamplingParams(temperature=0.8, top_p=0.95)),
        (moderate, SamplingParams(temperature=1.0, top_p=0.9)),
        (moderate, SamplingParams(temperature=0.7, top_k=40, top_p=0.8)),
        (moderate, SamplingParams(temperature=1.3, min_p=0.05)),
        (moderate, SamplingParams(temperature=1.0, min_p=1e-9)),  # min-p alone below every level
        (moderate, SamplingParams(temperature=1.0, top_k=vocab - 100)),  # past every level's count
        (flat, SamplingParams(temperature=1.0, top_p=0.95)),
        (flat, SamplingParams(temperature=1.0, top_k=vocab // 2, top_p=0.99)),
        (certain, SamplingParams(temperature=1.0, top_p=0.95)),
        (ties, SamplingParams(temperature=1.0, top_k=7, top_p=0.9)),
        (ties, SamplingParams(temperature=0.5, top_p=0.6, min_p=0.02)),
        (slope, SamplingParams(temperature=1.0, top_p=0.5)),
        (slope, SamplingParams(temperature=0.3, top_p=0.999, top_k=3000)),
    ]


@pytest.fixture
def levels_used(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[float]]:
    """Counts, per candidate level, the rows that level covered."""
    used: Counter[float] = Counter()
    draw = candidates._draw_at_level

    def spy(*args: object) -> tuple[list[int], list[bool]]:
        tokens, covered = draw(*args)  # type: ignore[arg-type]
        used[args[-1]] += sum(covered)  # type: ignore[index]
        return tokens, covered

    monkeypatch.setattr(candidates, "_draw_at_level", spy)
    yield used


# 49152 (SmolLM2) splits into whole blocks; 5000 leaves a partial last block.
@pytest.mark.parametrize("vocab", [49152, 5000])
def test_same_kept_set_and_token_as_the_full_vocabulary(
    vocab: int, levels_used: Counter[float]
) -> None:
    rows = _rows(vocab)
    logits = torch.stack([r for r, _ in rows])
    params = [replace(p, seed=1000 + i) for i, (_, p) in enumerate(rows)]
    # Each output index is a different uniform; 30 of them spread over every row's CDF.
    indices = range(30)
    got = [sample(logits, params, [index] * len(rows)) for index in indices]
    for i, (row, p) in enumerate(rows):
        kept, want = _reference(row, p, [seeded_uniform(1000 + i, j) for j in indices])
        assert [step[i] for step in got] == want, (vocab, i)
        assert set(want) <= kept
    # The rows reached every level, down to the whole row.
    assert set(levels_used) == set(candidates.LEVELS)


def test_one_certain_row_is_covered_without_the_whole_row(levels_used: Counter[float]) -> None:
    # Probability 1 on one token: the nucleus is that token and nothing follows it. It must
    # not fall through to the full-row level (a sort of the vocabulary) for want of a second
    # candidate.
    logits = torch.full((1, 49152), -200.0)
    logits[0, 123] = 5.0
    assert sample(logits, [SamplingParams(top_p=0.95, seed=1)], [0]) == [123]
    assert set(levels_used) == {candidates.LEVELS[0]}


def test_draws_follow_the_nucleus_distribution() -> None:
    # Many uniforms on one wide row: the frequencies match the renormalised nucleus.
    row = -torch.arange(2048, dtype=torch.float32) / 400  # p_i ~ exp(-i / 400)
    p = SamplingParams(top_p=0.6)
    kept, _ = _reference(row, p, [])
    n = 2000
    out = sample(
        row.unsqueeze(0).expand(n, -1), [p] * n, [0] * n, generator=torch.Generator().manual_seed(5)
    )
    assert set(out) <= kept
    probs = torch.softmax(row, dim=0)[sorted(kept)]
    mean = float((probs / probs.sum() * torch.tensor(sorted(kept), dtype=torch.float32)).sum())
    assert abs(sum(out) / n - mean) < 5 * (max(kept) / 12**0.5) / n**0.5
