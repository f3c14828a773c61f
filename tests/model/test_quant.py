"""--quantization int8 | int4 (model/quant.py): the layers against float references, the GGUF's
Q4_1 weights recovered exactly by int4, and the embedded SmolLM2 quantized against itself and
against transformers' greedy tokens.

Bounds are loose on purpose (int8 re-quantizes the GGUF's 4-bit weights per channel) but each
could fail: a wrong shard offset, scale layout or packing moves logits by tens, not units.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from poise.cli.options import add_engine_args, engine_config_from_args
from poise.config import EngineConfig
from poise.model.cpu_build import cpu_flags
from poise.model.gguf_dequant import _dequant_torch
from poise.model.linear_kernel import amx_available, load_linear_kernel
from poise.model.llama import Linear
from poise.model.loader import load_model
from poise.model.quant import (
    INT4_GROUP,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    quantize_int4,
    quantize_int8,
)
from poise.runner.factory import create_model_runner
from tests.model.harness import PagedHarness
from tests.model.test_gguf import CHAT_IDS, GREEDY


def _layer(cls: type[QuantLinear], w: torch.Tensor, dtype: torch.dtype) -> QuantLinear:
    """A quantized layer loaded from w in two shards (as q then k/v of a fused qkv_proj)."""
    layer = cls(w.shape[1], w.shape[0], bias=False)
    for name, buf in list(layer.named_buffers()):
        layer.register_buffer(name, buf.to(dtype))
    with torch.no_grad():
        layer.load_rows(0, w[:32])
        layer.load_rows(32, w[32:])
        layer.finalize()
    return layer


NO_KERNEL = "neither AVX512-BF16 / VNNI nor AVX2, or no C++ compiler"


@pytest.mark.skipif(
    not {"avx512_bf16", "avx512_vnni"} <= cpu_flags() and not {"avx2", "fma"} <= cpu_flags(),
    reason="neither AVX512-BF16 / VNNI nor AVX2 / FMA",
)
def test_linear_kernel_builds_where_the_cpu_can_run_it() -> None:
    # Every kernel test below skips when the library is missing, so a build that fails on one
    # kind of CPU (AMX intrinsics on an AVX-512 CPU without AMX did) would pass unseen. CPUs
    # with AVX2 but not AVX512-BF16 / VNNI build cpu_linear_avx2.cpp.
    assert load_linear_kernel() is not None
    assert amx_available() == ("amx_bf16" in cpu_flags() and "amx_int8" in cpu_flags())


@pytest.mark.skipif(load_linear_kernel() is None, reason=NO_KERNEL)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 17, 32, 40, 150])
@pytest.mark.parametrize(("n", "k"), [(64, 96), (48, 160), (112, 64), (96, 576)])
def test_int8_kernel_matches_torch_kernel(m: int, n: int, k: int) -> None:
    """Our kernel (bf16 activations as 16-bit integers, packed int8 weights) against torch's
    _weight_int8pack_mm on the same int8 weights and bf16 scales: row counts through the
    streamed and tiled paths (every register block height, partial 16-row tiles, more than one
    128-row chunk), channel groups of 1, 2 and 4 tiles (48, 96, 64 / 112), widths padded to the
    64-input block (96, 160)."""
    torch.manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k) * torch.linspace(0.01, 1.0, n)[:, None]
    layer = _layer(Int8Linear, w, torch.bfloat16)
    assert isinstance(layer, Int8Linear) and layer.kernel is not None
    x = torch.randn(m, k).bfloat16()
    q, scale = quantize_int8(w)
    want = torch.ops.aten._weight_int8pack_mm(x, q, scale.bfloat16())
    got = layer(x)
    # Both sum in float32 and round once to bf16: at most one bf16 ulp apart, plus the order.
    torch.testing.assert_close(
        got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=1e-2
    )


@pytest.mark.skipif(load_linear_kernel() is None, reason=NO_KERNEL)
@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_kernel_rows_do_not_depend_on_the_batch(cls: type[QuantLinear]) -> None:
    """int8's paths (streamed, blocked, tiled) sum the same integers, and int4's streamed and
    blocked ones the same products in the same order, so a row's output is the same bits alone
    or among 40 rows: a request's greedy tokens do not depend on its batch. (int4 on AMX
    decodes its weights to bf16 from 4 rows on: not the same bits.)"""
    if cls is Int4Linear and amx_available():
        pytest.skip("int4's AMX tiled path rounds its decoded weights to bf16")
    torch.manual_seed(1)
    w = torch.randn(128, 1088)  # int8: 272 quads, four 64-quad chunks and a partial one;
    layer = _layer(cls, w, torch.bfloat16)  # int4: 34 groups, four 8-group chunks and 2
    x = torch.randn(40, 1088).bfloat16()
    together = layer(x)
    for r in (0, 3, 4, 39):
        assert torch.equal(layer(x[r : r + 1]), together[r : r + 1])


@pytest.mark.skipif(load_linear_kernel() is None, reason=NO_KERNEL)
def test_int8_kernel_any_even_width() -> None:
    """in_features 130: torch's bf16 int8 kernel returns garbage unless in_features % 16 == 0
    (torch 2.13); ours takes any even width."""
    torch.manual_seed(0)
    w = torch.randn(48, 130)
    layer = _layer(Int8Linear, w, torch.bfloat16)
    x = torch.randn(9, 130).bfloat16()
    q, scale = quantize_int8(w)
    want = F.linear(x.float(), q.float() * scale.bfloat16().float()[:, None])
    torch.testing.assert_close(layer(x).float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)


@pytest.mark.skipif(load_linear_kernel() is None, reason=NO_KERNEL)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 16, 17, 32, 33, 150])
@pytest.mark.parametrize(("n", "k"), [(64, 96), (48, 160), (112, 576)])
def test_int4_kernel_matches_dequantized_weights(m: int, n: int, k: int) -> None:
    """Our int4 kernel against a float32 matmul on the dequantized weights (d and m rounded to
    bf16, as the kernel keeps them): the streamed path (1-3 rows), the scaled AMX products (one
    16-row block), the decoded tiles (more), channel groups of 1, 2 and 4 tiles."""
    torch.manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k) * torch.linspace(0.01, 1.0, n)[:, None]
    layer = _layer(Int4Linear, w, torch.bfloat16)
    assert isinstance(layer, Int4Linear) and layer.kernel is not None
    x = torch.randn(m, k).bfloat16()
    q, d, low = quantize_int4(w)
    deq = q.float().reshape(n, -1, INT4_GROUP) * d.bfloat16().float()[..., None]
    deq = (deq + low.bfloat16().float()[..., None]).reshape(n, k)
    want = x.float() @ deq.t()
    torch.testing.assert_close(
        layer(x).float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2
    )


def _q4_1(w: torch.Tensor) -> torch.Tensor:
    """w through a GGUF Q4_1 round trip (what the embedded model's weights are)."""
    raw = torch.from_numpy(quantize(w.numpy(), Q.Q4_1).reshape(-1).copy())
    out = _dequant_torch(raw, Q.Q4_1)
    assert out is not None
    return out.reshape(w.shape)


def test_int8_per_channel_error_and_shards() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64) * torch.linspace(0.01, 1.0, 96)[:, None]  # rows of very different scale
    q, scale = quantize_int8(w)
    # Each element within half a step of its row's scale; rows keep their own scale.
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(5, 64)
    got = _layer(Int8Linear, w, torch.float32)(x)
    want = F.linear(x, q.float() * scale[:, None])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_holds_gguf_q4_1_weights_exactly(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = _q4_1(torch.randn(64, 96) * 0.05)
    x = torch.randn(7, 96)
    got = _layer(Int4Linear, w, dtype)(x.to(dtype)).float()
    want = F.linear(x.to(dtype).float(), w)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # as close as a bf16 F.linear over the same weights
        bf16 = F.linear(x.to(dtype), w.to(dtype)).float()
        assert (got - want).abs().max() <= 2 * (bf16 - want).abs().max() + 1e-3


def test_int4_refuses_shapes_its_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="int4 needs in_features divisible by 32"):
        Int4Linear(40, 64, bias=False)


def test_quantization_refused_off_cpu_and_by_config() -> None:
    with pytest.raises(ValueError, match="quantization: int8 runs on CPU only"):
        load_model(None, torch.float32, torch.device("meta"), quantization="int8")
    with pytest.raises(ValueError, match="quantization: must be one of"):
        EngineConfig.from_kwargs(quantization="fp8")


def test_quantization_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, positional_model=True)
    assert engine_config_from_args(parser.parse_args([])).model.quantization is None
    args = parser.parse_args(["--quantization", "int4"])
    assert engine_config_from_args(args).model.quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp8"])


def _dequantized(w: torch.Tensor, quantization: str) -> torch.Tensor:
    """The float weight a quantized layer computes with (the reference's weights)."""
    if quantization == "int8":
        q, scale = quantize_int8(w)
        return q.float() * scale[:, None]
    q4, d, low = quantize_int4(w)
    n, k = w.shape
    groups = q4.float().reshape(n, -1, INT4_GROUP) * d[..., None] + low[..., None]
    return groups.reshape(n, k)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tiny_quantized_equals_float_model_on_dequantized_weights(
    tiny_checkpoints: dict[str, Path], kind: str, quantization: str
) -> None:
    """HF checkpoints, loaded shard by shard into fused q/k/v and gate/up (qkv bias for qwen2):
    the quantized model computes what the float model does with each projection's weight (and
    int8's lm_head) replaced by its dequantized values."""
    path = str(tiny_checkpoints[kind])
    ids = list(range(3, 40))
    ref = load_model(path, torch.float32, torch.device("cpu")).model
    for module in ref.model.layers.modules():
        if isinstance(module, Linear):
            module.weight.copy_(_dequantized(module.weight, quantization))
    # Both run the lm_head in int8 (tied: an int8 copy of the embedding).
    head = ref.lm_head.weight if ref.lm_head is not None else ref.model.embed_tokens.weight
    ref.lm_head = Linear(head.shape[1], head.shape[0], bias=False)
    ref.lm_head.weight = torch.nn.Parameter(_dequantized(head, "int8"), requires_grad=False)
    quant = load_model(path, torch.float32, torch.device("cpu"), quantization=quantization).model
    logits = []
    for model in (ref, quant):
        model.init_rope(64)
        logits.append(PagedHarness(model).step([("a", ids, 0)])["a"])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    dummy = load_model(
        f"dummy:{path}", torch.float32, torch.device("cpu"), quantization=quantization
    )
    dummy.model.init_rope(64)
    assert torch.isfinite(PagedHarness(dummy.model).step([("a", ids, 0)])["a"]).all()


@pytest.fixture(scope="module")
def smollm2_float() -> Any:
    runner, _ = create_model_runner(EngineConfig.from_kwargs(num_kv_blocks=32, dtype="float32"))
    return PagedHarness(runner.model, block_size=16, num_blocks=32).step([("a", CHAT_IDS, 0)])["a"]


def test_embedded_int4_is_the_gguf_model() -> None:
    """The embedded GGUF is Q4_1: in float32, int4 runs its very weights, so the logits are the
    dequantized model's with the lm_head in int8 (int4 keeps the head at 8 bits). (float32 is
    for this check: the int4/int8 CPU kernels are fast in bfloat16 only.)"""
    runner, _ = create_model_runner(EngineConfig.from_kwargs(num_kv_blocks=32, dtype="float32"))
    ref = runner.model
    head = ref.model.embed_tokens.weight
    ref.lm_head = Linear(head.shape[1], head.shape[0], bias=False)
    ref.lm_head.weight = torch.nn.Parameter(_dequantized(head, "int8"), requires_grad=False)
    cfg = EngineConfig.from_kwargs(num_kv_blocks=32, dtype="float32", quantization="int4")
    quant, _ = create_model_runner(cfg)
    # The first 8 prompt tokens only (causal: their logits are the full prompt's first 8 rows).
    got, want = (
        PagedHarness(model, block_size=16, num_blocks=32).step([("a", CHAT_IDS[:8], 0)])["a"]
        for model in (quant.model, ref)
    )
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_embedded_bfloat16_quantized_close_to_float(
    smollm2_float: torch.Tensor, quantization: str
) -> None:
    """Logit closeness to the float32 model, and transformers' greedy tokens (float32, same
    GGUF) followed up to bf16 ties. Measured (bf16): max |diff| 2.39 (int8) / 1.33 (int4) /
    1.56 (unquantized bf16) on logits spread over ~40; 35 / 36 / 36 of 37 argmaxes equal.

    Why ties: the answer's first token is a near tie (504 over 60 by 0.125 in float32 int8,
    one bf16 step at 25): int4 in bf16 picks 60 with torch's kernel as with ours on an
    AVX512-AMX CPU, 504 on an AVX512-BF16 AMD one. So along the reference's tokens (teacher
    forced) each step's argmax is the reference's token or within two bf16 steps of it."""
    cfg = EngineConfig.from_kwargs(num_kv_blocks=32, dtype="bfloat16", quantization=quantization)
    runner, _ = create_model_runner(cfg)
    got = PagedHarness(runner.model, block_size=16, num_blocks=32).step([("a", CHAT_IDS, 0)])["a"]
    assert (got - smollm2_float).abs().max() < 4.0
    agree = (got.argmax(-1) == smollm2_float.argmax(-1)).float().mean().item()
    assert agree >= 0.85
    forced = PagedHarness(runner.model, block_size=16, num_blocks=32).step(
        [("a", [*CHAT_IDS, *GREEDY[:-1]], 0)]
    )["a"][len(CHAT_IDS) - 1 :]
    chosen = forced.gather(1, torch.tensor(GREEDY)[:, None])[:, 0]
    gaps = forced.max(dim=1).values - chosen
    assert (gaps <= 0.25).all(), gaps.tolist()
    assert (gaps == 0).float().mean().item() >= 0.75  # int4 measured 7 / 8


def test_simulate_refuses_quantization_its_cost_model_does_not_price(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from poise.cli import main

    argv = ["simulate", "--accelerator", "h100", "--concurrency", "2", "--quantization", "int8"]
    assert main(argv) == 2
    assert (
        "quantization: the roofline cost model prices weights in dtype" in capsys.readouterr().err
    )


def test_simulate_takes_quantization_from_a_profile_measured_with_it(
    tmp_path: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from poise.cli import main
    from poise.sim.fit import load_profile

    prof = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            str(tiny_llama_dir),
            "--grid",
            "quick",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--clock",
            "cpu",
            "--num-kv-blocks",
            "128",
            "--dtype",
            "float32",
            "--quantization",
            "int8",
            "-o",
            str(prof),
        ]
    )
    assert rc == 0
    assert load_profile(prof).provenance["quantization"] == "int8"
    sim = [
        "simulate",
        "--profile",
        str(prof),
        "--concurrency",
        "2",
        "--max-tokens",
        "4",
        "--num-requests",
        "2",
        "--class",
        "c:1:20:4",
        "--num-kv-blocks",
        "128",
        "-o",
        str(tmp_path / "s.yaml"),
    ]
    assert main([*sim, "--quantization", "int8"]) == 0
    assert main([*sim, "--quantization", "int4"]) == 2
    assert "the profile measured int8 weights" in capsys.readouterr().err
