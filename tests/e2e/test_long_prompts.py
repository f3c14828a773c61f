"""Long prompts through the CPU kernels: greedy outputs still equal transformers (float32).

The default tiny checkpoints have head_dim 16 and 256 positions, so they only reach the
kernels' generic loops and short contexts. This one has head_dim 64 (the AVX-512 register
kernels where the CPU has them), 3 query heads per kv head (SmolLM2's grouping) and prompts of
~1,000 tokens, fed in chunks of 128: every chunk after the first goes to the blocked prefill
kernel (several query blocks of 32 and key blocks of 64, the last ones partial), decodes read
several 256-key partitions, and with prefix caching a cached prefix plus a short tail goes
through the decode-row kernel.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from poise.core import SamplingParams
from poise.engine.llm import LLM
from poise.model.attention.cpu_kernel import load_cpu_kernel
from tests.e2e.test_greedy_equivalence import reference_outputs

pytestmark = pytest.mark.skipif(load_cpu_kernel() is None, reason="no C++ compiler")

MAX_NEW = 12


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=384,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # wider than HF's init, so attention is not flat (as tiny_models.py)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
    path = tmp_path_factory.mktemp("long_llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def long_prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(600)]
    lengths = [1100, 777, 130]
    out = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    # A common 600-token prefix: with prefix caching the second one's tail (after cached
    # blocks) is a short chunk at a long offset.
    return [*out, shared + [5, 6, 7], shared + [rng.randrange(3, 500) for _ in range(200)]]


@pytest.fixture(scope="module")
def long_reference(long_llama_dir: Path) -> list[list[int]]:
    return reference_outputs(long_llama_dir, long_prompts())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 128},
        {"max_num_batched_tokens": 128, "enable_prefix_caching": True, "max_num_seqs": 1},
        {"max_num_batched_tokens": 2048, "max_num_seqs": 2},
    ],
    ids=["chunks-of-128", "prefix-cache", "whole-prompts"],
)
def test_long_prompts_equal_transformers(
    kwargs: dict[str, object], long_llama_dir: Path, long_reference: list[list[int]]
) -> None:
    llm = LLM(
        model=str(long_llama_dir),
        dtype="float32",
        attention_backend="cpu",
        num_kv_blocks=512,
        block_size=16,
        **kwargs,
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(long_prompts(), params, use_tqdm=False)]
    assert got == long_reference
    assert len({tuple(o) for o in got}) > 1, "degenerate model: all outputs equal"
    if not kwargs.get("enable_prefix_caching"):  # (cached blocks stay held by the cache)
        assert llm.engine.kv.num_free_blocks == 512
