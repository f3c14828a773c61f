"""bf16 greedy outputs and logprobs do not depend on the batch where poise's linear kernels run
(AVX512-BF16, or AVX2 through cpu_linear_avx2.cpp; issues 34, 35).

In float32 the equality suite holds against transformers token for token; in bf16 a row's sums
used to depend on the row count (the linear layers switched kernels by rows) and on its
neighbours (shared-prefix attention grouped keys in other partitions), so a request's greedy
tokens changed with its batch, with speculation and with in-flight followers. With the packed
AMX kernel for every row count (linear_kernel.PackedBf16; without AMX, the rows kernel for every
row count, linear_kernel.bf16_linear) and cascade groups in whole
partitions (cpu_decode_cascade.h), a request alone, batched, speculated or following another
gets the same tokens. And with every prompt token through the blocked prefill kernel (its
tail after a prefix-cache hit too) and every generated one through the decode kernel
(model/attention/cpu.py), the same prompt answers the same cold and cached.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from poise.core import SamplingParams
from poise.engine.llm import LLM
from poise.model import linear_kernel as lk
from poise.model.attention import CpuPagedAttentionBackend

pytestmark = pytest.mark.skipif(
    lk.load_linear_kernel() is None,
    reason="bf16 is batch-invariant through poise's linear kernels (AVX512-BF16 or AVX2, a compiler)",
)

MAX_NEW = 24
NGRAM_FIXED = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        attention_backend="cpu",
        num_kv_blocks=256,
        block_size=16,
        **kwargs,
    )


# Per request: its tokens and, per position, the top logprobs' exact floats: a single bit of
# another sum in a row's logits shows here (on the tiny model the tokens alone rarely move).
Output = tuple[list[int], list[list[tuple[int, float]]]]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Output]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        assert c.logprobs is not None
        lps = [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs]
        outs.append((c.token_ids, lps))
    return outs


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Repeating patterns, so that prompt lookup drafts (and some drafts are rejected).
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 500) for _ in range(4 + i % 3)]
        out.append((motif * 12)[: 20 + 9 * i] + [rng.randrange(3, 500) for _ in range(3)])
    return out


@pytest.mark.parametrize("kind", ["llama", "tied", "llama_hd64"])
def test_alone_equals_batched(kind: str, tiny_checkpoints: dict[str, Path]) -> None:
    prompts = _prompts(8, seed=1)
    llm = _llm(tiny_checkpoints[kind])
    batched = _generate(llm, prompts)
    alone = [_generate(llm, [p])[0] for p in prompts]
    assert batched == alone
    assert len({tuple(o[0]) for o in alone}) > 1, "degenerate model: all outputs equal"


def test_speculation_does_not_change_a_token(tiny_llama_dir: Path) -> None:
    prompts = _prompts(6, seed=2)
    off = _generate(_llm(tiny_llama_dir), prompts)
    llm = _llm(tiny_llama_dir, speculative_config=NGRAM_FIXED)
    assert _generate(llm, prompts) == off
    spec = llm.engine.scheduler.spec
    assert spec is not None
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens


@pytest.fixture
def _small_partitions() -> Iterator[None]:
    # The tiny model's 256 positions hold no 256-key partition past a prompt: 32-key
    # partitions, so that the followers' shared document forms cascade groups.
    saved = CpuPagedAttentionBackend.PARTITION_SIZE
    CpuPagedAttentionBackend.PARTITION_SIZE = 32
    yield
    CpuPagedAttentionBackend.PARTITION_SIZE = saved


@pytest.mark.usefixtures("_small_partitions")
@pytest.mark.parametrize("kind", ["llama", "llama_hd64"])
def test_requests_on_one_document_answer_as_alone(
    kind: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """A document, then questions on it at once (their decode rows share the document's
    blocks: cascade groups) against each question alone with the document cached. At head_dim
    64 the decode rows run on AMX tiles where the CPU has them (cpu_decode_amx.h)."""
    rng = random.Random(4)
    doc = [rng.randrange(3, 500) for _ in range(150)]
    questions = [[rng.randrange(3, 500) for _ in range(5 + q)] for q in range(6)]
    llm = _llm(tiny_checkpoints[kind], enable_prefix_caching=True)
    _generate(llm, [doc])  # cache the document
    alone = [_generate(llm, [doc + q])[0] for q in questions]
    together = _generate(llm, [doc + q for q in questions])
    assert together == alone
    assert len({tuple(o[0]) for o in alone}) > 1


def test_a_prompt_answers_the_same_cold_and_cached(tiny_llama_dir: Path) -> None:
    """A prompt cold, then again with all its full blocks in the prefix cache (its tail after
    them through the same prefill kernel), then as the tail after another prompt's cached
    document: the same tokens and logprob bits each time."""
    rng = random.Random(5)
    doc = [rng.randrange(3, 500) for _ in range(150)]
    questions = [[rng.randrange(3, 500) for _ in range(3 + 7 * q)] for q in range(4)]
    llm = _llm(tiny_llama_dir, enable_prefix_caching=True)
    for i, q in enumerate(questions):
        prompt = [500 + i] + doc[1:] + q  # its own first block: nothing of it is cached
        cold = _generate(llm, [prompt])[0]
        assert _generate(llm, [prompt])[0] == cold  # every full block cached
        assert _generate(llm, [prompt[:-1] + [7]])[0] != cold  # the check can see a change
    # Questions on one document: each cold (a fresh document) against each after it cached.
    llm = _llm(tiny_llama_dir, enable_prefix_caching=True)
    _generate(llm, [doc])
    cached = [_generate(llm, [doc + q])[0] for q in questions]
    cold = [_generate(_llm(tiny_llama_dir), [doc + q])[0] for q in questions]
    assert cached == cold
