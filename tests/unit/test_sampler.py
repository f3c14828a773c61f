"""Sampler: greedy, filters (top-k / top-p / min-p), temperature and per-request seeds."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from poise.core.sampling_params import SamplingParams
from poise.runner.sampler import sample, seeded_uniform

# 8-token distribution with well separated probabilities (sum = 1).
PROBS = [0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005]
LOGITS = torch.tensor(PROBS).log()


def _draw(params: SamplingParams, n: int = 3000, logits: torch.Tensor = LOGITS) -> Counter[int]:
    """n samples of one distribution in a single batch (unseeded rows, fixed global seed)."""
    torch.manual_seed(1234)
    batch = logits.unsqueeze(0).expand(n, -1)
    return Counter(sample(batch, [params] * n, [0] * n))


def test_greedy_is_argmax_in_any_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=g)
    params = [SamplingParams(temperature=0.0)] * 16
    assert sample(logits, params, [0] * 16) == logits.argmax(-1).tolist()
    assert sample(logits.bfloat16(), params, [0] * 16) == logits.bfloat16().argmax(-1).tolist()


def test_top_k_one_is_greedy_even_at_high_temperature() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 500, generator=g)
    params = [SamplingParams(temperature=2.0, top_k=1)] * 8
    assert sample(logits, params, list(range(8))) == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=g)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = sample(logits, params, [0] * 6)
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert all(0 <= t < 300 for t in out)


def test_empty_batch_and_shape_checks() -> None:
    assert sample(torch.empty(0, 10), [], []) == []
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), [SamplingParams()], [0])


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=-1), set(range(8))),
        # exclusive mass before tokens: 0, .40, .65, .80 -> nucleus of 0.7 keeps tokens 0..2
        (SamplingParams(top_p=0.7), {0, 1, 2}),
        (SamplingParams(top_p=0.3), {0}),
        # min_p 0.3 * 0.40 = 0.12 -> tokens with p >= 0.12
        (SamplingParams(min_p=0.3), {0, 1, 2}),
        (SamplingParams(min_p=0.1), {0, 1, 2, 3, 4}),
        # top-k 3 renormalises to [.5 .3125 .1875]: exclusive mass .8125 > .75 drops token 2
        # (without renormalisation it would be .65 and keep it)
        (SamplingParams(top_k=3, top_p=0.75), {0, 1}),
    ],
)
def test_filters_exclude_exactly(params: SamplingParams, allowed: set[int]) -> None:
    counts = _draw(params)
    # Excluded tokens never appear; every allowed one shows up (none is over-filtered).
    assert set(counts) == allowed


def test_unfiltered_frequencies_match_probabilities() -> None:
    n = 4000
    counts = _draw(SamplingParams(temperature=1.0), n)
    for tok, p in enumerate(PROBS):
        sd = (p * (1 - p) / n) ** 0.5
        assert abs(counts[tok] / n - p) < 5 * sd + 1e-3, (tok, counts[tok])


def test_top_p_frequencies_are_renormalised() -> None:
    n = 4000
    counts = _draw(SamplingParams(top_p=0.7), n)
    kept = PROBS[:3]
    for tok, p in enumerate(kept):
        q = p / sum(kept)
        assert abs(counts[tok] / n - q) < 5 * (q * (1 - q) / n) ** 0.5


def test_temperature_sharpens_and_flattens() -> None:
    hot = _draw(SamplingParams(temperature=2.0))[0]
    base = _draw(SamplingParams(temperature=1.0))[0]
    cold = _draw(SamplingParams(temperature=0.3))[0]
    assert hot < base < cold
    # T = 0.3: p0 = 0.4^(1/.3) / sum(p^(1/.3)) ~ 0.82
    assert abs(cold / 3000 - 0.82) < 0.05


@pytest.mark.parametrize("temperature", [1e30, 6.6e305])
def test_a_huge_temperature_is_uniform_over_what_a_mask_allows(temperature: float) -> None:
    # A grammar masks with -inf; a temperature past float32's range used to become inf, and
    # -inf / inf = NaN sampled masked tokens (the API fuzzer's large run found it).
    logits = LOGITS.clone()
    logits[[1, 3, 5]] = float("-inf")
    counts = _draw(SamplingParams(temperature=temperature), logits=logits)
    assert set(counts) == {0, 2, 4, 6, 7}
    assert min(counts.values()) > 3000 / 5 * 0.8  # uniform over the five allowed


def test_top_p_on_large_vocab_needs_many_candidates() -> None:
    # A slowly decaying distribution over 5000 tokens: p_i ~ exp(-i / 5000). The top-p 0.5
    # nucleus ends where (1 - e^-x) / (1 - e^-1) = 0.5, x ~ 0.380, i.e. ~1900 tokens, far past
    # the first candidate set, so the candidate count must grow.
    logits = -torch.arange(5000, dtype=torch.float32) / 5000
    counts = _draw(SamplingParams(top_p=0.5), 1500, logits)
    assert 1700 < max(counts) < 1920


def _seeded_batch(order: list[int], extra: int, index: int) -> dict[int, int]:
    """Sample request ids 0..3 (seeded) in the given order among ``extra`` unseeded rows."""
    g = torch.Generator().manual_seed(99)
    base = torch.randn(4, 2000, generator=g)  # one fixed logits row per seeded request
    noise = torch.randn(extra, 2000)
    seeded = [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.8, top_p=0.9, seed=12),
        SamplingParams(temperature=1.2, top_k=50, seed=13),
        SamplingParams(temperature=1.0, min_p=0.05, top_k=20, top_p=0.95, seed=14),
    ]
    rows = [base[i] for i in order] + list(noise)
    params = [seeded[i] for i in order] + [SamplingParams(top_p=0.8)] * extra
    out = sample(torch.stack(rows), params, [index] * len(rows))
    return {req: out[pos] for pos, req in enumerate(order)}


def test_seeded_requests_ignore_batch_composition_and_order() -> None:
    for index in (0, 1, 7):
        ref = _seeded_batch([0, 1, 2, 3], extra=0, index=index)
        assert _seeded_batch([3, 1, 0, 2], extra=5, index=index) == ref
        torch.manual_seed(index + 100)  # the global generator must not matter either
        assert _seeded_batch([2, 0, 3, 1], extra=24, index=index) == ref


def test_seeded_stream_depends_on_seed_and_index() -> None:
    us = {seeded_uniform(5, i) for i in range(200)}
    assert len(us) == 200 and all(0.0 <= u < 1.0 for u in us)
    assert seeded_uniform(5, 3) == seeded_uniform(5, 3)
    assert seeded_uniform(5, 3) != seeded_uniform(6, 3)
    # Over many indices a seeded request samples the distribution, not one token.
    logits = LOGITS.unsqueeze(0).expand(2000, -1)
    out = sample(logits, [SamplingParams(seed=7)] * 2000, list(range(2000)))
    assert set(out) == set(range(8))


def test_unseeded_uses_given_generator() -> None:
    logits = torch.zeros(32, 100)
    params = [SamplingParams()] * 32
    a = sample(logits, params, [0] * 32, generator=torch.Generator().manual_seed(3))
    b = sample(logits, params, [0] * 32, generator=torch.Generator().manual_seed(3))
    assert a == b and len(set(a)) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_filters_and_greedy() -> None:
    logits = LOGITS.to("cuda").unsqueeze(0).expand(2000, -1).contiguous()
    gen = torch.Generator(device="cuda").manual_seed(0)
    assert len(set(sample(logits, [SamplingParams()] * 2000, [0] * 2000, generator=gen))) == 8
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2000, [0] * 2000) == [0] * 2000
    out = sample(logits, [SamplingParams(top_k=3, top_p=0.75, seed=1)] * 2000, list(range(2000)))
    assert set(out) == {0, 1}
    out = sample(logits.half(), [SamplingParams(min_p=0.3)] * 2000, [0] * 2000)
    assert set(out) == {0, 1, 2}


def test_greedy_tokens_are_argmax_on_ties_nan_and_infinities() -> None:
    """greedy_tokens (through max(dim), faster on CPU) picks argmax's index: the first maximal
    one, NaN counted as the maximum."""
    from poise.runner.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        ties = (torch.randint(0, 12, (16, 4096), generator=gen).float() / 4).to(dtype)
        odd = torch.randn(4, 64, generator=gen).to(dtype)
        odd[0, 5] = odd[0, 40] = float("nan")
        odd[1, :] = float("-inf")
        odd[1, 7] = 0.0
        odd[2, 3] = odd[2, 9] = float("inf")
        odd[3, :] = float("-inf")
        for x in (ties, odd):
            assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))
