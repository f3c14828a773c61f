"""Logprobs in the offline API (vLLM's shape) equal log_softmax of transformers' float32 logits:
sampled tokens (greedy and sampled, with top-k alternatives) and prompt tokens, whatever the
chunking (a prompt split over several steps), with a prefix-cache hit available (a request
that wants prompt logprobs does not read the cache), and in a batch beside requests that did
not ask."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from poise import LLM, SamplingParams
from poise.errors import InvalidRequestError

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _ref_logprobs(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row i predicts token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_position(entry: dict[int, Any], token: int, ref_row: torch.Tensor, k: int) -> None:
    assert token in entry
    assert math.isclose(entry[token].logprob, float(ref_row[token]), abs_tol=TOL)
    # The rank up to float noise: tokens within TOL of the token's logprob may order either way.
    value = float(ref_row[token])
    above = int((ref_row > value + TOL).sum())
    assert above + 1 <= entry[token].rank <= int((ref_row > value - TOL).sum()) + 1
    top = ref_row.topk(k)
    alternatives = [t for t in entry if t != token or entry[t].rank <= k]
    assert set(top.indices.tolist()) <= set(entry) and len(alternatives) <= k + 1
    for tid, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert math.isclose(entry[tid].logprob, value, abs_tol=TOL)


@pytest.mark.parametrize("chunk", [8, 256])
def test_prompt_and_sampled_logprobs_equal_transformers(
    tiny_model_dir: Path, hf_model: Any, chunk: int
) -> None:
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=128,
        max_num_batched_tokens=chunk,
        enable_chunked_prefill=True,
    )
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away."
    params = SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out, neighbour = llm.generate([prompt, "Another prompt"], [params, plain], use_tqdm=False)
    ids = out.prompt_token_ids
    assert len(ids) > chunk or chunk == 256
    completion = out.outputs[0]
    ref = _ref_logprobs(hf_model, ids + completion.token_ids)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry is not None
        _check_position(entry, ids[i], ref[i - 1], 2)
    assert completion.logprobs is not None and len(completion.logprobs) == 5
    for j, token in enumerate(completion.token_ids):
        _check_position(completion.logprobs[j], token, ref[len(ids) + j - 1], 3)
        assert completion.logprobs[j][token].rank == 1  # greedy
    total = sum(completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(total)
    # The neighbour did not ask: vLLM's None.
    assert neighbour.prompt_logprobs is None and neighbour.outputs[0].logprobs is None


def test_prefix_cache_hit_keeps_prompt_logprobs(tiny_model_dir: Path, hf_model: Any) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=16)
    prompt = " ".join(["cached prefix words"] * 12)
    warm = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    again = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert again[0].num_cached_tokens > 0  # the cache would serve this prompt
    scored = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert scored.num_cached_tokens == 0  # ... but not to a request that scores the prompt
    ids = warm[0].prompt_token_ids
    ref = _ref_logprobs(hf_model, ids)
    assert scored.prompt_logprobs is not None
    for i in range(1, len(ids)):
        entry = scored.prompt_logprobs[i]
        assert entry is not None and list(entry) == [ids[i]]  # k = 0: the token alone
        assert math.isclose(entry[ids[i]].logprob, float(ref[i - 1, ids[i]]), abs_tol=TOL)


def test_sampled_tokens_logprobs_are_raw(tiny_model_dir: Path, hf_model: Any) -> None:
    """With temperature the logprob is still the raw distribution's (vLLM's raw_logprobs)."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(
        temperature=1.5, top_k=20, seed=3, max_tokens=4, ignore_eos=True, logprobs=0
    )
    out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    c = out.outputs[0]
    ref = _ref_logprobs(hf_model, [5, 6, 7, 8] + c.token_ids)
    assert c.logprobs is not None
    for j, token in enumerate(c.token_ids):
        assert math.isclose(c.logprobs[j][token].logprob, float(ref[3 + j, token]), abs_tol=TOL)
        assert c.logprobs[j][token].decoded_token == llm.get_tokenizer().decode([token])


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_is_refused(field: str, value: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.param == field


def test_n_samples_each_have_logprobs_and_the_prompt_is_scored_once(
    tiny_model_dir: Path, hf_model: Any
) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=16)
    ids = list(range(20, 60))
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    out = llm.generate([ids], params, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    ref = _ref_logprobs(hf_model, ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry is not None
        _check_position(entry, ids[i], ref[i - 1], 1)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.logprobs is not None and len(c.logprobs) == 3
        full = _ref_logprobs(hf_model, ids + c.token_ids)
        for j, token in enumerate(c.token_ids):
            _check_position(c.logprobs[j], token, full[len(ids) + j - 1], 1)
