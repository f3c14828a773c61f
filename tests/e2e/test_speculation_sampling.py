"""Speculation keeps the target's distribution for sampled requests (issue 34).

A seeded request draws the uniform of each output token from (seed, output index), and
verification draws the target's own token at every draft position with that same uniform
(runner/verify.py), so with speculation on it must emit exactly the tokens it emits without:
a stronger check than a distribution test, through temperature, top-k/top-p, penalties and
logit_bias applied to the target's logits at each verified position.
"""

from __future__ import annotations

import random
from pathlib import Path

from poise.core import SamplingParams
from poise.engine.llm import LLM

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def test_seeded_sampling_is_unchanged_by_speculation(tiny_llama_dir: Path) -> None:
    rng = random.Random(3)
    base = [rng.randrange(3, 500) for _ in range(10)]
    prompts = [base * 4, base * 2 + [9], [rng.randrange(3, 500) for _ in range(20)]]
    params = [
        SamplingParams(max_tokens=24, temperature=0.1, seed=1, ignore_eos=True),
        SamplingParams(
            max_tokens=24,
            temperature=0.9,
            top_p=0.8,
            top_k=20,
            seed=2,
            repetition_penalty=1.2,
            ignore_eos=True,
        ),
        SamplingParams(
            max_tokens=24,
            temperature=0.5,
            seed=3,
            logit_bias={base[0]: 2.0},
            frequency_penalty=0.3,
            ignore_eos=True,
            logprobs=2,
        ),
    ]
    outs = {}
    for spec in (None, SPEC):
        llm = LLM(
            model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, speculative_config=spec
        )
        got = llm.generate(prompts, params)
        outs[spec is not None] = [o.outputs[0] for o in got]
        if spec is not None:
            stats = llm.engine.scheduler.spec.stats  # type: ignore[union-attr]
            assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        assert llm.engine.kv.num_free_blocks == 128
    off, on = outs[False], outs[True]
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    # Logprobs are the target's: one per emitted token, the same values.
    assert on[2].logprobs is not None and off[2].logprobs is not None
    assert len(on[2].logprobs) == len(on[2].token_ids)
    for a, b in zip(on[2].logprobs, off[2].logprobs, strict=True):
        tok = next(iter(b))
        assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
