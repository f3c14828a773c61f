"""Sampling fields through the offline API on a tiny random Llama (float32), each against a
reference computed here from transformers' logits: repetition penalty through transformers'
own ``generate``; frequency / presence penalties, logit_bias and min_tokens through a greedy
loop over the transformers model's logits with OpenAI's / vLLM's formulas written out; ``n``
samples distinct, reproducible and equal to single requests with vLLM's child seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from poise import LLM, SamplingParams
from tests.sampling_reference import greedy_reference

N = 12
PROMPT = [1, 520, 33, 980, 33, 4051, 77, 33, 12, 9000, 77, 33]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _ids(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def _reference(hf: Any, n: int, **kw: Any) -> list[int]:
    return greedy_reference(hf, PROMPT, n, **kw)


def test_no_field_set_is_plain_greedy(llm: LLM, hf: Any) -> None:
    plain = _ids(llm, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    assert plain == _reference(hf, N)


def test_repetition_penalty_equals_transformers_generate(llm: LLM, hf: Any) -> None:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=N,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
    got = _ids(
        llm, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, repetition_penalty=1.8)
    )
    assert got == want
    assert got != _reference(hf, N)  # the penalty changed the output


def test_frequency_presence_and_logit_bias(llm: LLM, hf: Any) -> None:
    plain = _reference(hf, N)
    kw: dict[str, Any] = {"temperature": 0.0, "max_tokens": N, "ignore_eos": True}
    got = _ids(llm, SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, **kw))
    assert got == _reference(hf, N, freq=1.5, pres=0.5) and got != plain
    banned, forced = plain[0], 4242
    bias = {banned: -100.0, forced: 7.0}
    got = _ids(llm, SamplingParams(logit_bias=bias, **kw))
    assert got == _reference(hf, N, bias=bias)
    assert banned not in got and got != plain


def test_min_tokens_holds_back_stop_tokens(llm: LLM, hf: Any) -> None:
    plain = _reference(hf, N)
    stop = plain[1]  # plain greedy stops at its first occurrence
    kw: dict[str, Any] = {"temperature": 0.0, "max_tokens": N, "ignore_eos": True}
    early = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(stop_token_ids=[stop], **kw), use_tqdm=False
    )[0]
    assert early.outputs[0].token_ids == plain[: plain.index(stop) + 1]
    out = llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(stop_token_ids=[stop], min_tokens=6, **kw),
        use_tqdm=False,
    )[0].outputs[0]
    want = _reference(hf, N, min_tokens=6, stops=(stop,))
    assert stop not in out.token_ids[:6]
    # Masked until 6 tokens exist; after that the stop token ends the sequence when it comes.
    cut = want.index(stop, 6) + 1 if stop in want[6:] else N
    assert out.token_ids == want[:cut]


def test_n_samples_are_distinct_reproducible_and_seeded_per_child(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3] and first.finished
    assert len(set(samples)) == 4  # distinct
    assert samples == [tuple(c.token_ids) for c in again.outputs]  # reproducible
    # Child i is the request with seed + i (vLLM's rule), whatever ran beside it.
    for i, sample in enumerate(samples):
        single = SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=8, ignore_eos=True)
        assert tuple(_ids(llm, single)) == sample
    assert all(c.text and c.finish_reason == "length" for c in first.outputs)
    assert not llm.engine.has_unfinished_requests()
