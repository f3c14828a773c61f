"""Greedy outputs equal transformers with in-flight prefix sharing (sched/inflight.py): requests
that arrive together with one opening wait for the first one's prefill instead of computing it,
and a follower whose leader is cancelled mid-prefill takes over with the same output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from poise.core import SamplingParams
from poise.engine.llm import LLM
from tests.e2e.test_greedy_equivalence import (
    ATTENTION_BACKEND,
    MAX_NEW,
    poise_outputs,
    reference_outputs,
)

BLOCK = 8


def burst_prompts() -> list[list[int]]:
    """One 48-token opening: four prompts that continue it differently, two identical."""
    rng = random.Random(3)
    opening = [rng.randrange(3, 500) for _ in range(48)]
    tails = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 9, 17)]
    return [opening + t for t in tails] + [opening + [11, 12]] * 2


@pytest.fixture(scope="module")
def burst_reference(tiny_llama_dir: Path) -> list[list[int]]:
    return reference_outputs(tiny_llama_dir, burst_prompts())


@pytest.mark.parametrize("policy", ["fifo", "slo", "prefill_first"])
def test_followers_give_the_greedy_outputs(
    policy: str, tiny_llama_dir: Path, burst_reference: list[list[int]]
) -> None:
    # The cap keeps the leader to 8 tokens a step, so the others arrive at blocks still
    # being computed (without it the leader takes the whole step and there is nothing to share).
    got, llm = poise_outputs(
        tiny_llama_dir,
        burst_prompts(),
        block_size=BLOCK,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=8,
        scheduling_policy=policy,
    )
    assert got == burst_reference
    stats = llm.engine.kv.prefix_stats
    assert stats.inflight_hits == 5 and stats.inflight_hit_tokens >= 5 * 40, stats
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_a_follower_whose_leader_is_cancelled_mid_prefill_gives_the_greedy_output(
    tiny_llama_dir: Path, burst_reference: list[list[int]]
) -> None:
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        block_size=BLOCK,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=8,
        attention_backend=ATTENTION_BACKEND,
    )
    engine = llm.engine
    prompts = burst_prompts()
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine.add_request("leader", prompts[3], params)
    engine.add_request("follower", prompts[4], params)
    for _ in range(3):  # the leader has computed 24 of its 65 tokens; the follower waits
        engine.step()
    assert engine.scheduler.requests["leader"].num_computed_tokens == 24
    assert engine.scheduler.inflight.followers == 1
    engine.abort(["leader"])
    out: list[int] = []
    while engine.has_unfinished_requests():
        deltas, _ = engine.step()
        engine.kv.check_invariants()
        out += [t for d in deltas if d.request_id == "follower" for t in d.new_token_ids]
    assert out == burst_reference[4]
    assert engine.kv.pool.num_used_blocks == 0 and len(engine.kv.pending) == 0
    # It started from the leader's 3 written blocks and computed the rest of the opening.
    assert engine.kv.prefix_stats.inflight_hit_tokens == 3 * BLOCK
