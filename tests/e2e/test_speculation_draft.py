"""The draft-model proposer (issue 34): greedy outputs stay token-identical to transformers
with a tiny draft checkpoint, whether the draft is always right (the target itself) or mostly
wrong (other random weights); a draft with another vocabulary is refused at startup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from poise.engine.llm import LLM
from tests.e2e.test_greedy_equivalence import make_prompts, poise_outputs, reference_outputs
from tests.model.tiny_models import build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    return reference_outputs(tiny_llama_dir, make_prompts())


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tied-embeddings tiny Llama: the same vocabulary, other weights."""
    path = tmp_path_factory.mktemp("draft")
    build_tiny_model("tied", seed=7).save_pretrained(path, safe_serialization=True)
    return path


def _spec(draft: Path, **kw: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, **kw}


@pytest.mark.parametrize(
    ("which", "kwargs"),
    [
        ("self", {"adaptive": False}),
        ("other", {"adaptive": False}),
        ("self", {}),
    ],
)
def test_greedy_outputs_equal_transformers_with_a_draft_model(
    which: str,
    kwargs: dict[str, Any],
    tiny_llama_dir: Path,
    other_draft: Path,
    reference: list[list[int]],
) -> None:
    draft = tiny_llama_dir if which == "self" else other_draft
    got, llm = poise_outputs(
        tiny_llama_dir,
        make_prompts(),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        speculative_config=_spec(draft, **kwargs),
    )
    assert got == reference
    spec = llm.engine.scheduler.spec
    assert spec is not None and spec.stats.num_draft_tokens > 0
    if which == "self":  # the target drafting for itself: every draft is kept
        assert spec.stats.num_accepted_tokens == spec.stats.num_draft_tokens
    else:
        assert spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    draft_kv = spec.proposer.kv  # type: ignore[attr-defined]
    assert draft_kv.num_free_blocks == draft_kv.num_blocks  # finished requests' draft KV freed


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.vocab_size = 640
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match=r"^speculative_config\.model: .*640 tokens.*512"):
        LLM(
            model=str(tiny_llama_dir),
            dtype="float32",
            num_kv_blocks=64,
            speculative_config=_spec(tmp_path),
        )


def test_greedy_outputs_hold_under_preemption_with_a_draft_model(
    tiny_llama_dir: Path, other_draft: Path, reference: list[list[int]]
) -> None:
    # 12 blocks of 8 tokens: far less than 11 requests need at once (the draft's pool as well).
    got, llm = poise_outputs(
        tiny_llama_dir,
        make_prompts(),
        num_kv_blocks=12,
        block_size=8,
        safety_margin=0.0,
        enable_prefix_caching=True,
        speculative_config=_spec(other_draft, adaptive=False),
    )
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert got == reference
    assert llm.engine.kv.num_free_blocks == 12
