"""Greedy outputs of the whole engine equal transformers, whatever the schedule.

The strongest oracle we have: the same tiny random checkpoint through transformers'
``generate(do_sample=False)`` prompt by prompt, and through poise with many requests batched
together under different budgets, request caps, policies, a pool small enough to force
preemption, prefix caching and shuffled arrival order.

``POISE_TEST_ATTENTION_BACKEND=flex`` (or any registered name) runs the whole suite on that
attention backend; tests/e2e/test_flex_equivalence.py runs part of it on ``flex`` by default.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from poise.core import SamplingParams
from poise.engine.llm import LLM

MAX_NEW = 12
# Speculative decoding must not change a greedy token (issue 34): fixed k and the adaptive
# depth, prompt lookup. The tiny model's greedy outputs repeat themselves, so drafts are
# accepted as well as rejected.
NGRAM_FIXED = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
NGRAM_ADAPTIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
# The attention backend every poise run here uses (auto: the runner's choice).
ATTENTION_BACKEND = os.environ.get("POISE_TEST_ATTENTION_BACKEND", "auto")


def make_prompts(n: int = 9, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 15, 16, 17, 33, 50, 64][:n]
    shared = [rng.randrange(3, 500) for _ in range(20)]
    out = [[rng.randrange(3, 500) for _ in range(length)] for length in lengths]
    out.append(shared + [5, 6])  # two prompts with a common prefix, for prefix caching
    out.append(shared + [7, 8, 9])
    return out


def reference_outputs(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(gen[0, len(prompt) :].tolist())
    return outs


def poise_outputs(
    model_dir: Path, prompts: list[list[int]], **kwargs: Any
) -> tuple[list[list[int]], LLM]:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("attention_backend", ATTENTION_BACKEND)
    kwargs.setdefault("num_kv_blocks", 256)  # not the default 1 GiB pool: tests stay light
    llm = LLM(model=str(model_dir), **kwargs)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir: Path) -> list[list[int]]:
    return reference_outputs(tiny_llama_dir, make_prompts())


# llama3 rope scaling and tied embeddings are covered at the logits level in tests/model.
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_batched_greedy_equals_transformers(kind: str, tiny_checkpoints: dict[str, Path]) -> None:
    prompts = make_prompts()
    expected = reference_outputs(tiny_checkpoints[kind], prompts)
    got, _ = poise_outputs(tiny_checkpoints[kind], prompts, max_num_batched_tokens=64)
    assert got == expected
    assert len({tuple(o) for o in got}) > 1, "degenerate model: all outputs equal"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 16},
        {"max_num_batched_tokens": 64},
        {"max_num_batched_tokens": 4096},
        {"max_num_seqs": 1},
        {"max_num_seqs": 3},
        {"max_num_seqs": 64},
        {"scheduling_policy": "prefill_first", "max_num_batched_tokens": 32},
        {"scheduling_policy": "fifo", "max_num_batched_tokens": 32},
        {"long_prefill_token_threshold": 8, "max_num_batched_tokens": 64},
        {"enable_prefix_caching": True, "max_num_seqs": 1},
        {"enable_prefix_caching": False, "max_num_batched_tokens": 32},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
        {"scheduling_policy": "priority", "max_num_seqs": 3, "max_num_batched_tokens": 32},
        {"scheduling_policy": "slo", "traffic_classes": "default", "max_num_batched_tokens": 32},
        {
            "scheduling_policy": "slo",
            "traffic_classes": "a:ttft_p95_ms=100,share=0.5;b:prompt_tokens>=16,share=0.5",
            "token_budget_controller": True,
            "target_tpot_ms": 1.0,
            "max_num_seqs": 4,
        },
        {"traffic_classes": "a:ttft_p95_ms=600000", "admission_control": "predictive"},
        {"scheduling_policy": "static", "max_num_seqs": 4, "max_num_batched_tokens": 64},
        {"scheduling_policy": "dynamic", "max_num_seqs": 4, "max_batch_delay_ms": 5.0},
        {"scheduling_policy": "lpm", "enable_prefix_caching": True, "max_num_seqs": 2},
        {"speculative_config": NGRAM_FIXED, "max_num_batched_tokens": 16},
        {"speculative_config": NGRAM_FIXED, "max_num_seqs": 1},
        {"speculative_config": NGRAM_ADAPTIVE, "max_num_batched_tokens": 64},
        {"speculative_config": NGRAM_FIXED, "scheduling_policy": "slo", "max_num_seqs": 3},
        {"speculative_config": NGRAM_FIXED, "enable_prefix_caching": True, "max_num_seqs": 2},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_invariance_across_schedules(
    kwargs: dict[str, Any], tiny_llama_dir: Path, llama_reference: list[list[int]]
) -> None:
    got, llm = poise_outputs(tiny_llama_dir, make_prompts(), **kwargs)
    assert got == llama_reference
    spec = llm.engine.scheduler.spec
    # Fixed k always verifies drafts, and some are kept (adaptive may judge it does not pay
    # here: 11 prompts share a small budget).
    if kwargs.get("speculative_config") is NGRAM_FIXED:
        assert spec is not None and spec.stats.num_accepted_tokens > 0


def test_invariance_under_preemption(
    tiny_llama_dir: Path, llama_reference: list[list[int]]
) -> None:
    # 12 blocks of 8 tokens: far less than 11 requests need at once.
    runs = (
        (False, "fifo", None),
        (True, "fifo", None),
        (True, "slo", None),
        (False, "priority", None),
        (True, "fifo", NGRAM_FIXED),
    )
    for caching, policy, spec in runs:
        got, llm = poise_outputs(
            tiny_llama_dir,
            make_prompts(),
            num_kv_blocks=12,
            block_size=8,
            safety_margin=0.0,
            enable_prefix_caching=caching,
            scheduling_policy=policy,
            speculative_config=spec,
        )
        assert llm.engine.scheduler.num_preemptions_total > 0
        assert got == llama_reference
        assert llm.engine.kv.num_free_blocks == 12


def test_invariance_under_shuffled_order(
    tiny_llama_dir: Path, llama_reference: list[list[int]]
) -> None:
    prompts = make_prompts()
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    got, _ = poise_outputs(tiny_llama_dir, [prompts[i] for i in order], max_num_batched_tokens=32)
    assert [got[order.index(i)] for i in range(len(prompts))] == llama_reference


def test_invariance_with_per_request_priorities_and_classes(
    tiny_llama_dir: Path, llama_reference: list[list[int]]
) -> None:
    """SamplingParams carry priority, class and SLO overrides in the offline API."""
    prompts = make_prompts()
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=256,
        max_num_seqs=2,
        scheduling_policy="slo",
        traffic_classes="chat:ttft_p95_ms=500;docs:ttft_p95_ms=9000",
        attention_backend=ATTENTION_BACKEND,
    )
    params = [
        SamplingParams(
            max_tokens=MAX_NEW,
            temperature=0.0,
            ignore_eos=True,
            priority=i % 3,
            traffic_class="docs" if i % 2 else "chat",
            ttft_slo_ms=None if i % 4 else 50.0,
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == llama_reference
