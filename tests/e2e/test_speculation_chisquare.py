"""Sampling with speculation draws from the target's distribution: a chi-square test on a tiny
random model (issue 34, acceptance).

Drafts are forced (a proposer that always guesses the same two tokens, one of them among the
likely next tokens), so verification's acceptance and rejection both happen often. Each request
samples 4 tokens with temperature and top-k: t0 from its prefill, then one verify row
[t0, d1, d2]. t1's empirical distribution is tested against the target's p(. | P, t0), t2's
among the requests that kept d1 against p(. | P, t0, d1) (the verify row's second position),
both computed with transformers on the same weights. The expected counts pool each sample's own
conditional (t0 varies), a Pearson test over the categories expected >= 5 times plus one "rest".
The test's power is checked on the same counts: moving 2 % of the probability between two
categories must be rejected at p < 0.01.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from poise.core import SamplingParams
from poise.core.request import Request
from poise.engine.llm import LLM
from tests.model.tiny_models import build_tiny_model

PROMPT = [5, 17, 42, 99, 7, 300]
TEMPERATURE, TOP_K = 0.8, 8
NUM_SAMPLES = 4000


class ForcedProposer:
    """Always the same drafts, whatever the request's tokens."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, request: Request, k: int) -> list[int]:
        return self.drafts[:k]

    def forget(self, request_id: str) -> None:
        pass


def target_probs(model: torch.nn.Module, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
    """p(next | context) per context, after temperature and top-k, from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([list(c) for c in contexts])).logits[:, -1].double()
    logits = logits / TEMPERATURE
    kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)


def chi_square_p(observed: Counter[int], expected: torch.Tensor) -> float:
    """Pearson's test of ``observed`` counts against ``expected`` ones (over the vocabulary):
    the categories expected >= 5 times each, the others pooled."""
    n = sum(observed.values())
    assert abs(float(expected.sum()) - n) < 1e-6 * n
    big = [int(t) for t in torch.nonzero(expected >= 5).flatten()]
    obs = [float(observed.get(t, 0)) for t in big]
    exp = [float(expected[t]) for t in big]
    rest_exp = n - sum(exp)
    if rest_exp >= 5:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    df = torch.tensor((len(obs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def shifted(expected: torch.Tensor, fraction: float) -> torch.Tensor:
    """``expected`` with ``fraction`` of the total moved from its likeliest category to its
    second likeliest: the smallest shift the test must see."""
    out = expected.clone()
    top = expected.topk(2).indices
    move = fraction * float(expected.sum())
    out[top[0]] -= move
    out[top[1]] += move
    return out


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution(tiny_llama_dir: Path) -> None:
    model = build_tiny_model("llama")  # the weights tiny_llama_dir was written from
    first = target_probs(model, [PROMPT])[0]
    t0_likely = int(first.argmax())
    # d1: likely after the likeliest t0, so it is kept often; d2: anything.
    d1 = int(target_probs(model, [[*PROMPT, t0_likely]])[0].argmax())
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=2048,
        max_num_seqs=256,
        speculative_config={"num_speculative_tokens": 2, "adaptive": False},
    )
    spec = llm.engine.scheduler.spec
    assert spec is not None
    spec.proposer = ForcedProposer([d1, 3])
    params = SamplingParams(max_tokens=4, temperature=TEMPERATURE, top_k=TOP_K, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * NUM_SAMPLES, params, False)]
    assert spec.stats.num_drafts >= NUM_SAMPLES  # every request verified [d1, d2] once
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens

    t0s = sorted({o[0] for o in outs})
    after_t0 = dict(zip(t0s, target_probs(model, [[*PROMPT, t] for t in t0s]), strict=True))
    after_d1 = dict(zip(t0s, target_probs(model, [[*PROMPT, t, d1] for t in t0s]), strict=True))
    kept = [o for o in outs if o[1] == d1]
    assert len(kept) >= 300, len(kept)
    for sample, cond, pos in ((outs, after_t0, 1), (kept, after_d1, 2)):
        observed = Counter(o[pos] for o in sample)
        expected = sum((cond[o[0]] for o in sample), torch.zeros_like(first))
        p = chi_square_p(observed, expected)
        assert p > 0.01, f"token {pos}: p = {p:.2g}"
        if pos == 1:  # enough samples to see a 2 % shift
            assert chi_square_p(observed, shifted(expected, 0.02)) < 0.01
    # The prefill's own token is a sanity check of the comparison itself.
    assert chi_square_p(Counter(o[0] for o in outs), first * NUM_SAMPLES) > 0.01
