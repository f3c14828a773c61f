"""Speculative decoding's torch-free parts: the config's checks, prompt lookup, the depth
rules, and exact block accounting when drafts are rolled back (issue 34)."""

from __future__ import annotations

import pytest

from poise.config import EngineConfig, SpeculativeConfig
from poise.core.request import Request
from poise.core.sampling_params import SamplingParams
from poise.kv.manager import KVCacheManager
from poise.sched.speculation import DepthInputs, balanced_depth, expected_tokens, fixed_depth
from poise.spec.ngram import lookup


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ('{"method": "eagle"}', "speculative_config.method"),
        ('{"method": "ngram", "k": 3}', "speculative_config.k"),
        ('{"num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"num_speculative_tokens": 17}', "speculative_config.num_speculative_tokens"),
        (
            '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}',
            "speculative_config.prompt_lookup_min",
        ),
        ('{"method": "draft_model"}', "speculative_config.model"),
        ("[1]", "speculative_config"),
        ("{not json", "speculative_config"),
    ],
)
def test_bad_config_names_the_field(value: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}[:.]" if field.count(".") else f"^{field}:"):
        EngineConfig.from_kwargs(speculative_config=value)


def test_config_takes_vllm_shape() -> None:
    cfg = EngineConfig.from_kwargs(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    ).scheduler.speculative_config
    assert cfg == SpeculativeConfig("ngram", 4, 4, 2)
    assert EngineConfig.from_kwargs(
        speculative_config={"adaptive": False}
    ).scheduler.speculative_config == SpeculativeConfig(adaptive=False)
    assert EngineConfig().scheduler.speculative_config is None


def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(tokens, 3, 1, 3) == [7, 8, 5]  # the most recent [1, 2, 3] came before 7 8 5
    assert lookup(tokens, 2, 1, 3) == [7, 8]
    assert lookup([4, 5, 6], 3, 1, 3) == []  # nothing earlier to copy
    assert lookup([5, 6, 5], 2, 2, 3) == []  # no 2-gram repeats


def _inputs(acceptance: float, rows: int, k: int = 4) -> DepthInputs:
    return DepthInputs(k, acceptance, rows, rows, lambda n: 0.02 + 1.5e-4 * n, None, None)


def test_balanced_depth_speculates_when_it_pays_and_not_when_it_does_not() -> None:
    assert balanced_depth(_inputs(0.8, 1)) == 4  # alone: verify tokens are almost free
    assert balanced_depth(_inputs(0.05, 64)) == 0  # busy step, drafts rarely kept
    assert fixed_depth(_inputs(0.05, 64)) == 4
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_trim_rolls_back_exactly_the_rejected_slots() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = Request("r", list(range(7)), SamplingParams(max_tokens=8), 0.0)
    assert kv.allocate_slots("r", num_computed_tokens=0, num_new_tokens=7) is not None
    # A decode at position 7 verifying 5 drafts: slots up to position 12, 4 blocks.
    assert kv.allocate_slots("r", num_computed_tokens=7, num_new_tokens=6) is not None
    assert len(kv.get_block_ids("r")) == 4
    kv.trim("r", 9)  # one draft kept: 9 tokens computed
    assert len(kv.get_block_ids("r")) == 3
    assert kv.num_free_blocks == 5
    kv.check_invariants()
    kv.free(req)
    assert kv.num_free_blocks == 8
    kv.check_invariants()
