"""Logit adjustments (runner/penalties.py) against references: transformers' own logits
processors where the semantics match (repetition penalty, min_new_tokens, single-token sequence
bias), OpenAI's frequency / presence formula written out per token otherwise."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from poise.core.sampling_params import SamplingParams
from poise.errors import InvalidRequestError
from poise.runner.penalties import adjust
from poise.runner.sampler import sample

V = 300
PROMPT = [5, 9, 9, 17, 250]
OUTPUT = [17, 3, 3, 3, 42, 9]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4


def test_untouched_batch_is_the_same_tensor() -> None:
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)] * 2
    # No adjustment asked: the very same tensor comes back (no copy, no tensor work).
    assert adjust(logits, params, [0, 3, 1, 2], None) is logits
    # min_tokens already reached: nothing to do either.
    done = [SamplingParams(min_tokens=2)] * 4
    assert adjust(logits, done, [2, 3, 4, 5], None) is logits


def test_repetition_penalty_equals_transformers() -> None:
    logits = _logits(1)
    ids = torch.tensor([PROMPT + OUTPUT])
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    got = adjust(
        logits, [SamplingParams(repetition_penalty=1.7)], [len(OUTPUT)], [(PROMPT, OUTPUT)]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Below 1 it encourages the same tokens, the same way.
    want = RepetitionPenaltyLogitsProcessor(0.6)(ids, logits.clone())
    got = adjust(
        logits, [SamplingParams(repetition_penalty=0.6)], [len(OUTPUT)], [(PROMPT, OUTPUT)]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_huge_repetition_penalty_gives_no_nan() -> None:
    # 1e300 became inf in float32, and a seen token's logit of exactly 0 times inf is NaN (the
    # API fuzzer's large run warned of the overflow).
    logits = _logits(1)
    logits[0, PROMPT[0]] = 0.0
    got = adjust(
        logits, [SamplingParams(repetition_penalty=1e300)], [len(OUTPUT)], [(PROMPT, OUTPUT)]
    )
    assert not got.isnan().any()
    assert got[0, PROMPT[0]] == 0.0


def test_frequency_and_presence_count_output_tokens_only() -> None:
    logits = _logits(1, seed=1)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.25)
    got = adjust(logits, [params], [len(OUTPUT)], [(PROMPT, OUTPUT)])
    want = logits.clone()
    for token, count in Counter(OUTPUT).items():  # OpenAI: mu - c * a_f - (c > 0) * a_p
        want[0, token] -= count * 0.5 + 1.25
    torch.testing.assert_close(got, want)
    changed = set((got != logits).nonzero()[:, 1].tolist())
    assert changed == set(OUTPUT)  # prompt-only tokens (5, 250) untouched


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = _logits(1, seed=2)
    bias = {7: 100.0, 8: -100.0, 299: 3.5}
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(
        torch.tensor([PROMPT]), logits.clone()
    )
    got = adjust(logits, [SamplingParams(logit_bias=bias)], [0], [None])
    torch.testing.assert_close(got, want)
    assert sample(got, [SamplingParams(temperature=0.0, logit_bias=bias)], [0]) == [7]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = _logits(3, seed=3)
    eos = frozenset({2})
    p = SamplingParams(min_tokens=3, stop_token_ids=[11])
    got = adjust(
        logits, [p, p, SamplingParams(min_tokens=3, ignore_eos=True)], [0, 3, 1], [None] * 3, eos
    )
    # transformers' rule for EOS: -inf while fewer than min_new_tokens were generated.
    ref = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, eos_token_id=[2, 11])
    want0 = ref(torch.tensor([PROMPT]), logits[:1].clone())
    torch.testing.assert_close(got[:1], want0)
    torch.testing.assert_close(got[1], logits[1])  # reached: unchanged
    # ignore_eos: only the request's own stop ids would be held back (it has none).
    torch.testing.assert_close(got[2], logits[2])


def test_rows_are_independent_and_raw_logits_untouched() -> None:
    logits = _logits(4, seed=4)
    raw = logits.clone()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.3),
        SamplingParams(top_p=0.5),
        SamplingParams(logit_bias={1: 5.0}, presence_penalty=-0.5),
    ]
    hist = [None, (PROMPT, OUTPUT), None, ([1], [4, 4])]
    got = adjust(logits, params, [0, 6, 0, 2], hist)
    torch.testing.assert_close(logits, raw, rtol=0, atol=0)  # never modified in place
    torch.testing.assert_close(got[[0, 2]], raw[[0, 2]], rtol=0, atol=0)
    for row in (1, 3):  # each penalised row alone gives the same result as in the batch
        alone = adjust(raw[row : row + 1], [params[row]], [[0, 6, 0, 2][row]], [hist[row]])
        torch.testing.assert_close(got[row : row + 1], alone)


def test_writable_logits_give_the_same_result_without_a_copy() -> None:
    # The runner hands over logits it no longer needs: adjusted (and temperature-scaled) in
    # place, with exactly the values and tokens of the copying path.
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            presence_penalty=0.2,
            seed=3,
        ),
        SamplingParams(temperature=1.2, top_k=50, logit_bias={7: 3.0}, min_tokens=9, seed=4),
        SamplingParams(temperature=0.7, seed=5),
    ]
    hist = [(PROMPT, OUTPUT), (PROMPT, OUTPUT), None, None]
    logits = _logits(4, seed=6)
    copied = adjust(logits, params, [6, 6, 2, 0], hist, frozenset({0}))
    own = logits.clone()
    assert adjust(own, params, [6, 6, 2, 0], hist, frozenset({0}), inplace=True) is own
    torch.testing.assert_close(own, copied, rtol=0, atol=0)
    for index in range(5):
        want = sample(logits, params, [index] * 4, histories=hist, eos_token_ids=frozenset({0}))
        got = sample(
            logits.clone(),
            params,
            [index] * 4,
            histories=hist,
            eos_token_ids=frozenset({0}),
            logits_writable=True,
        )
        assert got == want


def test_greedy_rows_take_the_argmax_of_the_penalised_logits() -> None:
    logits = torch.zeros(2, V)
    logits[:, 3] = 5.0  # the favourite, repeated in the output
    logits[:, 4] = 4.0
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    assert sample(logits, params, [3, 3], histories=[([1], [3, 3, 3]), None]) == [4, 3]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("nan")),
        ("min_tokens", 17),
        ("min_tokens", -1),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {V: 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("n", 0),
    ],
)
def test_out_of_range_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=16, **{field: value}).validate(vocab_size=V)  # type: ignore[arg-type]
    assert info.value.param == field
