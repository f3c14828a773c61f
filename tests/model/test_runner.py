"""ModelRunner + create_model_runner, driven by hand-built SchedulerOutputs (no scheduler)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from poise.config import EngineConfig
from poise.core.outputs import ScheduledRequest, SchedulerOutput
from poise.core.sampling_params import SamplingParams
from poise.model.cpu_build import cpu_flags
from poise.model.linear_kernel import load_linear_kernel
from poise.runner.factory import create_model_runner
from poise.runner.kv_pool import bytes_per_block
from poise.runner.platform import (
    cpu_has_native_bf16,
    cpu_runs_bf16_fast,
    resolve_device,
    resolve_dtype,
)
from tests.model.tiny_models import build_tiny_model


class MiniScheduler:
    """Just enough scheduling to feed the runner: fixed chunk size, blocks handed out in a
    scrambled order, every request in every step."""

    def __init__(self, block_size: int, num_blocks: int, chunk: int) -> None:
        self.block_size, self.chunk = block_size, chunk
        self.free = list(range(num_blocks))[::-1][::2] + list(range(num_blocks))[::-1][1::2]
        self.reqs: dict[str, dict[str, Any]] = {}
        self.step_id = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, **params: Any) -> None:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
        self.reqs[rid] = {"prompt": prompt, "out": [], "done": 0, "blocks": [], "sp": sp}

    def schedule(self) -> SchedulerOutput:
        scheduled = []
        for rid, r in self.reqs.items():
            if len(r["out"]) >= r["sp"].max_tokens:
                continue
            tokens = r["prompt"] + r["out"]
            start = r["done"]
            ids = tokens[start : start + self.chunk]
            while len(r["blocks"]) * self.block_size < start + len(ids):
                r["blocks"].append(self.free.pop())
            scheduled.append(
                ScheduledRequest(
                    request_id=rid,
                    token_ids=ids,
                    start_position=start,
                    block_ids=list(r["blocks"]),
                    sample=start + len(ids) == len(tokens),
                    sampling_params=r["sp"],
                    output_index=len(r["out"]),
                    num_prompt_tokens=len(r["prompt"]),
                )
            )
        self.step_id += 1
        return SchedulerOutput(step_id=self.step_id, scheduled=scheduled)

    def run(self, runner: Any) -> dict[str, list[int]]:
        while True:
            out = self.schedule()
            if not out.scheduled:
                return {rid: r["out"] for rid, r in self.reqs.items()}
            result = runner.execute(out)
            for s in out.scheduled:
                r = self.reqs[s.request_id]
                r["done"] = s.start_position + s.num_tokens
                if s.sample:
                    r["out"].append(result.sampled_token_ids[s.request_id])
                else:
                    assert s.request_id not in result.sampled_token_ids


PROMPTS = {"a": [5, 17, 99, 4, 250, 31, 7], "b": [300, 2, 8], "c": list(range(40, 59))}


@functools.cache
def _hf(kind: str) -> Any:
    return build_tiny_model(kind)


def hf_greedy(kind: str, prompt: list[int], n: int) -> list[int]:
    hf = _hf(kind)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def make_runner(path: Path, **kw: Any) -> tuple[Any, Any]:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")  # compared with transformers' fp32: auto may be bf16
    return create_model_runner(EngineConfig.from_kwargs(model=str(path), **kw))


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_runner_greedy_equals_transformers(
    tiny_checkpoints: dict[str, Path], kind: str, chunk: int
) -> None:
    runner, _ = make_runner(tiny_checkpoints[kind])
    sched = MiniScheduler(block_size=4, num_blocks=64, chunk=chunk)
    for rid, p in PROMPTS.items():
        sched.add(rid, p, max_tokens=6)
    got = sched.run(runner)
    for rid, p in PROMPTS.items():
        assert got[rid] == hf_greedy(kind, p, 6), rid


def test_model_info(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]
    runner, info = make_runner(path, max_model_len=100)
    assert info.model_name == path.name
    assert (info.vocab_size, info.max_model_len, info.block_size) == (512, 100, 4)
    assert info.num_kv_blocks == runner.num_kv_blocks == 64
    assert info.eos_token_ids == frozenset({2})
    assert (info.dtype, info.device, info.tokenizer) == ("float32", "cpu", None)
    _, info = make_runner(path, max_model_len=10_000)  # clamped to the checkpoint
    assert info.max_model_len == 256


def test_kv_sizing_from_bytes(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]
    config = EngineConfig.from_kwargs(
        model=str(path), block_size=8, kv_cache_memory_bytes=1 << 20, dtype="float32"
    )
    runner, info = create_model_runner(config)
    from poise.checkpoint.arch import arch_from_hf_config

    arch = arch_from_hf_config(json.loads((path / "config.json").read_text()))
    assert info.num_kv_blocks == (1 << 20) // bytes_per_block(arch, 8, torch.float32)
    assert config.cache.num_kv_blocks is None  # never written back
    assert runner.kv_caches[0].shape == (info.num_kv_blocks, 8, 2 * 2, 16)


def test_dtype_resolution() -> None:
    # auto on CPU: bfloat16 exactly where the CPU has native bf16 matmul, or AVX2 + FMA with
    # poise's kernels built.
    flags = cpu_flags()
    fast = cpu_has_native_bf16() or ({"avx2", "fma"} <= flags and load_linear_kernel() is not None)
    want = torch.bfloat16 if fast else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == want
    assert cpu_runs_bf16_fast(frozenset({"avx2", "fma"}), kernels=True)
    assert not cpu_runs_bf16_fast(frozenset({"avx2", "fma"}), kernels=False)
    assert not cpu_runs_bf16_fast(frozenset({"avx", "sse4_2"}), kernels=True)
    assert cpu_runs_bf16_fast(frozenset({"amx_bf16"}), kernels=False)
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert cpu_has_native_bf16(frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cpu_has_native_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not cpu_has_native_bf16(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    cuda = torch.cuda.is_available()
    assert resolve_device("auto").type == ("cuda" if cuda else "cpu")
    assert resolve_device("cpu").type == "cpu"


def test_bfloat16_runs_and_mostly_agrees(tiny_checkpoints: dict[str, Path]) -> None:
    runner, info = make_runner(tiny_checkpoints["qwen2"], dtype="bfloat16")
    assert info.dtype == "bfloat16"
    assert runner.kv_caches[0].dtype == torch.bfloat16
    sched = MiniScheduler(block_size=4, num_blocks=64, chunk=5)
    sched.add("a", PROMPTS["c"], max_tokens=4)
    got = sched.run(runner)["a"]
    # bf16 rounding may flip a near-tie, so only the first token is required to agree.
    assert len(got) == 4 and got[0] == hf_greedy("qwen2", PROMPTS["c"], 1)[0]


def test_dummy_weights(tiny_checkpoints: dict[str, Path]) -> None:
    config_json = tiny_checkpoints["qwen2"] / "config.json"
    r1, info = make_runner(Path(f"dummy:{config_json}"), seed=3)
    r2, _ = make_runner(Path(f"dummy:{config_json}"), seed=3)
    assert info.vocab_size == 512
    s1, s2 = (MiniScheduler(4, 64, 4) for _ in range(2))
    s1.add("a", PROMPTS["a"], 3)
    s2.add("a", PROMPTS["a"], 3)
    assert s1.run(r1) == s2.run(r2)  # same seed, same weights, same tokens


def test_unsampled_chunks_and_empty_steps(tiny_checkpoints: dict[str, Path]) -> None:
    runner, _ = make_runner(tiny_checkpoints["llama"])
    params = SamplingParams(temperature=0.0)
    req = ScheduledRequest("x", [1, 2, 3, 4, 5], 0, [7, 9], False, params, 0, 10)
    out = runner.execute(SchedulerOutput(step_id=1, scheduled=[req]))
    assert out.sampled_token_ids == {}
    assert runner.execute(SchedulerOutput(step_id=2)).sampled_token_ids == {}


def test_seeded_sampling_independent_of_batch(tiny_checkpoints: dict[str, Path]) -> None:
    """A seeded request samples the same tokens alone or batched with others: the runner
    hands the sampler each row's own params and output index."""
    runner, _ = make_runner(tiny_checkpoints["llama"])
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}

    def run(with_others: bool) -> list[int]:
        sched = MiniScheduler(block_size=4, num_blocks=64, chunk=4)
        if with_others:
            sched.add("other", PROMPTS["c"], max_tokens=5)
        sched.add("s", PROMPTS["a"], max_tokens=5)
        sched.reqs["s"]["sp"] = SamplingParams(max_tokens=5, **seeded)
        return sched.run(runner)["s"]

    alone = run(False)
    assert alone == run(True)
    assert len(alone) == 5


def test_failed_request_blocks_are_scrubbed(tiny_checkpoints: dict[str, Path]) -> None:
    """A request whose values go non-finite fails alone, and its blocks hold no NaN when the
    engine frees them (a backend reading whole blocks, flex, would pass 0 * NaN on to the
    next owner); a block it only read (a prefix-cache hit) keeps its finite contents."""
    runner, _ = make_runner(tiny_checkpoints["llama"], num_kv_blocks=16)
    bs = runner.block_size
    with torch.no_grad():
        runner.model.model.embed_tokens.weight[7] = float("nan")
        for cache in runner.kv_caches:
            cache[9].normal_()
    shared = [cache[9].clone() for cache in runner.kv_caches]
    greedy = SamplingParams(temperature=0.0)
    bad = ScheduledRequest("bad", [7, 3, 4], bs, [9, 2], True, greedy, 0, bs + 3)
    good = ScheduledRequest("good", [1, 2, 3], 0, [5], True, greedy, 0, 3)
    out = runner.execute(SchedulerOutput(step_id=1, scheduled=[bad, good]))
    assert set(out.failed) == {"bad"} and "good" in out.sampled_token_ids
    for cache, before in zip(runner.kv_caches, shared, strict=True):
        assert bool(torch.isfinite(cache[2]).all())  # the failed request's own block
        assert torch.equal(cache[9], before)  # the block it only read
