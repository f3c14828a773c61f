"""The int8 KV cache (--kv-cache-dtype int8, model/attention/kv_int8.py): its quantization
rule, the C++ writer against it bit for bit, the cpu decode and prefill kernels against the
torch reference on the same int8 cache and against float attention on the unquantized one
(paged, random block tables: tests/model/test_cpu_attention.py's cases), the pool's size, the
startup refusals, and the non-finite scrub."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from poise import LLM, SamplingParams
from poise.config import EngineConfig, kv_bytes_per_token
from poise.model.attention.cpu_kernel import load_cpu_kernel
from poise.model.attention.kv_int8 import (
    dequantize_rows,
    quantize_rows,
    scrub_nonfinite_int8,
    write_kv_int8,
)
from poise.runner.attention import BACKENDS
from poise.runner.kv_pool import allocate_kv_caches, bytes_per_block, num_kv_blocks
from poise.runner.platform import resolve_kv_cache_dtype
from poise.sim.cost import FixedCostModel
from tests.model.test_cpu_attention import _case
from tests.model.test_kv_pool import ARCH, CPU, _config

needs_kernel = pytest.mark.skipif(load_cpu_kernel() is None, reason="no C++ compiler")


def test_quantize_rows_rounds_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, 64, generator=gen) * torch.logspace(-4, 3, 64)[:, None, None]
    x[0, 0] = 0.0  # a row of zeros keeps scale 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (64, 6, 66)
    scale = rows[..., 64:].contiguous().view(torch.bfloat16).float()
    amax = x.abs().amax(-1, keepdim=True)
    # Rounded up: every value fits in +-127, and the scale is within one bf16 ulp of amax / 127.
    assert bool((scale >= amax / 127).all()) and bool((scale <= amax / 127 * (1 + 2**-7)).all())
    assert int(rows[..., :64].abs().max()) <= 127
    err = (dequantize_rows(rows, torch.float32) - x).abs()
    assert bool((err <= scale / 2 * (1 + 1e-6)).all())
    assert float(scale[0, 0]) == 0.0 and not rows[0, 0, :64].any()
    # A non-finite value makes its row's scale non-finite: whatever reads it sees it.
    x[1, 2, 5] = float("nan")
    x[2, 3, 7] = float("inf")
    bad = quantize_rows(x)[..., 64:].contiguous().view(torch.bfloat16).float()
    assert not torch.isfinite(bad[1, 2]).any() and not torch.isfinite(bad[2, 3]).any()
    assert int((~torch.isfinite(bad)).sum()) == 2


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_cpu_writer_matches_the_torch_quantizer(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(37, 9 + 6, head_dim, generator=gen) * 5).to(dtype)
    kv = qkv[:, 9:]  # strided as the model hands it over
    kv[3, 1] = 0.0
    slots = torch.randperm(8 * 16, generator=gen)[:37]
    caches = [torch.zeros(8, 16, 6, head_dim + 2, dtype=torch.int8) for _ in range(2)]
    write_kv_int8(kv, caches[0], slots)
    backend = BACKENDS["cpu"].create()
    backend._write_kv_native(backend._write_int8, kv, caches[1], slots)  # type: ignore[attr-defined]
    assert torch.equal(caches[0], caches[1])
    assert caches[0].view(-1, 6, head_dim + 2)[slots].any()


def _attend(
    name: str, int8: bool, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    meta, cache, qkv = _case(heads, kv_heads, head_dim, dtype, seed=heads + head_dim)
    if int8:
        cache = quantize_rows(cache)
    backend = BACKENDS[name].create()
    state = backend.prepare(meta)
    out = backend.forward(qkv[:, :heads], qkv[:, heads:], cache, state, head_dim**-0.5)
    return out.float(), cache


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (28, 4, 128), (8, 8, 64), (6, 2, 24)]
)
def test_int8_kernels_match_the_reference(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Decode rows (contexts past one partition, shared prefix blocks), a prefix-hit tail
    and longer chunks through the blocked prefill kernel, over one int8 cache."""
    got, cache_cpu = _attend("cpu", True, heads, kv_heads, head_dim, dtype)
    want, cache_torch = _attend("torch", True, heads, kv_heads, head_dim, dtype)
    assert torch.equal(cache_cpu, cache_torch)  # the step's K/V quantized to the same bits
    # Same int8 inputs: only float (or, in bf16, the output's rounding) differs.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # Against float attention over the unquantized cache: the error int8 rounding allows. Each
    # value moves by at most half a step (max|x| / 254, ~0.015 for these N(0, 1) heads); the
    # output, a convex mix of values whose weights move with the keys' error, by about that.
    exact, _ = _attend("torch", False, heads, kv_heads, head_dim, dtype)
    err = (got - exact).abs()
    assert float(err.max()) < 0.05
    assert float(err.mean()) < 0.003


def test_pool_holds_about_twice_the_blocks() -> None:
    config = _config("--kv-cache-memory-base 256MiB")
    blocks = {
        dtype: num_kv_blocks(config.cache, config.scheduler, ARCH, torch.bfloat16, CPU, dtype)
        for dtype in (torch.bfloat16, torch.int8)
    }
    # head_dim 64: 66 bytes a row against 128.
    assert blocks[torch.int8] == (256 << 20) // bytes_per_block(ARCH, 16, torch.int8)
    assert 1.9 < blocks[torch.int8] / blocks[torch.bfloat16] < 2.0
    pool = allocate_kv_caches(ARCH, 4, 16, torch.int8, CPU)
    assert len(pool) == ARCH.num_layers
    assert pool[0].shape == (4, 16, 2 * ARCH.num_kv_heads, ARCH.head_dim + 2)
    per_block = sum(c.numel() for c in pool) // 4
    assert per_block == bytes_per_block(ARCH, 16, torch.int8)
    # The simulator sizes the same int8 pool.
    int8_per_token = kv_bytes_per_token(
        ARCH.num_layers, ARCH.num_kv_heads, ARCH.head_dim, "int8", 1
    )
    sim = FixedCostModel(
        kv_bytes_per_token=bytes_per_block(ARCH, 1, torch.bfloat16),
        kv_int8_bytes_per_token=int8_per_token,
    )
    int8_config = _config("--kv-cache-memory-base 256MiB --kv-cache-dtype int8")
    assert sim.num_kv_blocks(int8_config) == blocks[torch.int8]
    assert sim.num_kv_blocks(config) == blocks[torch.bfloat16]
    with pytest.raises(ValueError, match="int8 KV bytes per token"):
        FixedCostModel().num_kv_blocks(int8_config)


def test_kv_cache_dtype_resolution_and_refusals() -> None:
    bf16 = torch.bfloat16
    assert resolve_kv_cache_dtype("auto", CPU, "cpu", bf16) == bf16
    assert resolve_kv_cache_dtype("int8", CPU, "cpu", bf16) == torch.int8
    assert resolve_kv_cache_dtype("int8", CPU, "torch", bf16) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int8' runs with attention_backend"):
        resolve_kv_cache_dtype("int8", CPU, "flex", bf16)
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int8' runs on CPU only"):
        resolve_kv_cache_dtype("int8", torch.device("cuda"), "torch", bf16)
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8' runs on a CUDA device only.*int8"):
        resolve_kv_cache_dtype("fp8", CPU, "cpu", bf16)
    assert EngineConfig.from_kwargs(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"


def test_scrub_zeroes_only_rows_with_a_nonfinite_scale() -> None:
    x = torch.randn(2, 4, 6, 64)
    x[1, 2, 3, 9] = float("inf")
    rows = quantize_rows(x)
    clean = scrub_nonfinite_int8(rows)
    assert not clean[1, 2, 3].any()
    keep = torch.ones(2, 4, 6, dtype=torch.bool)
    keep[1, 2, 3] = False
    assert torch.equal(clean[keep], rows[keep])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_engine_runs_an_int8_cache_end_to_end(
    tiny_checkpoints: dict[str, Path], backend: str
) -> None:
    """Through the runner (pool allocation, chunked prefill, decode): prompt and sampled
    logprobs with an int8 cache stay close to those with a float32 one on the same model."""
    if backend == "cpu" and load_cpu_kernel() is None:
        pytest.skip("no C++ compiler")
    prompt = {"prompt_token_ids": [(7 * i + 3) % 97 + 1 for i in range(30)]}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    got = {}
    for kv in ("auto", "int8"):
        llm = LLM(
            model=str(tiny_checkpoints["llama"]),
            dtype="float32",
            num_kv_blocks=32,
            kv_cache_dtype=kv,
            attention_backend=backend,
            max_num_batched_tokens=8,
            enable_chunked_prefill=True,
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        ids = list(out.prompt_token_ids[1:])
        got[kv] = [float(e[t].logprob) for e, t in zip(out.prompt_logprobs[1:], ids, strict=True)]
    diffs = [abs(a - b) for a, b in zip(got["auto"], got["int8"], strict=True)]
    assert 0 < max(diffs) < 0.05
