"""n > 1 as child requests (core/parallel.py): ids and seeds of the children, and the prompt
computed once: followers wait for the leader's prompt blocks, then share them (reference
counts, no copy), with prefix caching on or off."""

from __future__ import annotations

import pytest

from poise.core.parallel import fan_out
from poise.core.sampling_params import SamplingParams
from poise.errors import InvalidRequestError
from tests.unit.test_scheduler import make_engine

PROMPT = list(range(1, 41))  # 40 tokens: 9 full blocks of 4 before the last token's block


def test_fan_out_ids_and_seeds() -> None:
    one = fan_out("r", SamplingParams(n=1, seed=3))
    assert [(c.request_id, c.params.seed, c.prompt_leader) for c in one] == [("r", 3, None)]
    kids = fan_out("r", SamplingParams(n=3, seed=10, temperature=0.7))
    assert [c.request_id for c in kids] == ["0_r", "1_r", "2_r"]
    assert [c.params.seed for c in kids] == [10, 11, 12]  # vLLM's seed + index
    assert [c.prompt_leader for c in kids] == [None, "0_r", "0_r"]
    assert all(c.params.n == 1 and c.params.temperature == 0.7 for c in kids)
    assert [c.params.seed for c in fan_out("r", SamplingParams(n=2))] == [None, None]


def _prefill_tokens(n: int, caching: bool) -> tuple[int, list[int]]:
    engine, _ = make_engine(block_size=4, enable_prefix_caching=caching)
    params = SamplingParams(n=n, max_tokens=4, ignore_eos=True)
    for child in fan_out("r", params):
        engine.add_request(
            child.request_id, PROMPT, child.params, prompt_leader=child.prompt_leader
        )
    total, cached = 0, []
    while engine.has_unfinished_requests():
        deltas, stats = engine.step()
        engine.kv.check_invariants()
        total += stats.num_prefill_tokens if stats else 0
        cached += [d.num_cached_tokens for d in deltas if d.finished]
    return total, cached


@pytest.mark.parametrize("caching", [True, False])
def test_siblings_compute_the_prompt_once(caching: bool) -> None:
    alone, _ = _prefill_tokens(1, caching)
    four, cached = _prefill_tokens(4, caching)
    assert alone == 40
    # The leader computes 40 tokens; each follower only the 4 after the 9 shared blocks.
    assert four == 40 + 3 * 4
    assert sorted(cached) == [0, 36, 36, 36]


def test_engine_refuses_an_unfanned_request() -> None:
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("r", PROMPT, SamplingParams(n=2))
    assert info.value.param == "n"
