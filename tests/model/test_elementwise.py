"""The fused bf16 elementwise kernels (model/elementwise.py) against torch's ops.

SiLU x up rounds exactly as torch (bit-identical); the norm sums its squares in another order,
so a value may land one bf16 ulp away, rarely. Covers rows longer than a vector and a tail
(dims 576, 100, 17), strided rows (a view of a wider tensor), and the residual added in place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from poise.model import elementwise
from poise.model.cpu_build import _compiler
from poise.model.llama import RMSNorm

needs_kernel = pytest.mark.skipif(
    elementwise.load_elementwise_kernel() is None, reason="no C++ compiler"
)


def test_kernel_builds_where_there_is_a_compiler() -> None:
    # Every test below skips without the library, so a build error (on one kind of CPU, say)
    # would otherwise pass unseen as "no C++ compiler".
    if _compiler() is None:
        pytest.skip("no C++ compiler")
    assert elementwise.load_elementwise_kernel() is not None


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).abs()
    return float((diff / (want.float().abs() * 2**-7).clamp_min(1e-30)).max().detach())


@needs_kernel
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (300, 576), (9, 100), (4, 17)])
def test_add_and_norm_matches_torch(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    wide = (3 * torch.randn(rows, dim + 8, generator=gen)).bfloat16()
    x = wide[:, :dim]  # strided rows
    delta = torch.randn(rows, dim, generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).bfloat16()
    want_x = x + delta
    padding = wide[:, dim:].clone()
    want = F.rms_norm(want_x.float(), (dim,), None, 1e-5).to(torch.bfloat16) * weight

    got = elementwise.rms_norm(x, weight, 1e-5, delta)
    assert torch.equal(x, want_x)  # the residual, added in place
    assert torch.equal(wide[:, dim:], padding)  # past each row: untouched
    assert _ulps(got, want) <= 1.01
    assert (got != want).float().mean() < 1e-3
    assert torch.equal(elementwise.rms_norm(want_x.clone(), weight, 1e-5), got)


@needs_kernel
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (200, 1536), (5, 40), (3, 7)])
def test_silu_mul_is_torchs(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=gen)).bfloat16()
    gate, up = gate_up.split(inter, dim=-1)
    assert torch.equal(elementwise.silu_mul(gate_up), F.silu(gate) * up)


@needs_kernel
def test_silu_mul_at_extreme_gates_is_torchs() -> None:
    # e^-g overflows for g below about -88.7 (SiLU -> -0) and is below 2^-24 above 87: the
    # vector exp must give the same bits as torch there, on every build.
    values = [-100.0, -89.3, -89.1, -89.0, -88.5, -88.3, -87.5, -20.0, 0.0, 20.0, 87.5, 88.5, 100.0]
    gate = torch.tensor(values * 3).bfloat16()
    up = torch.linspace(-2, 2, gate.numel()).bfloat16()
    gate_up = torch.cat([gate, up])[None]
    assert torch.equal(elementwise.silu_mul(gate_up), F.silu(gate[None]) * up)


@needs_kernel
def test_rmsnorm_module_uses_the_kernel_only_where_it_applies() -> None:
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.linspace(0.5, 1.5, 64)
    x = torch.randn(6, 64)
    # float32: torch's fused op, unchanged.
    torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6), rtol=0, atol=0)
    norm.bfloat16()
    xb = x.bfloat16()
    assert elementwise.applies(xb, norm.weight)
    assert not elementwise.applies(xb.view(6, 4, 16)[:, :2])  # 3-D (q/k norms): torch's ops
    h, out = norm.add_and_norm(xb.clone(), xb)
    assert torch.equal(h, xb + xb)
    assert _ulps(out, F.rms_norm(h.float(), (64,), None, 1e-6).bfloat16() * norm.weight) <= 1.01


@needs_kernel
@pytest.mark.parametrize(("tokens", "head_dim"), [(1, 64), (50, 64), (7, 128), (3, 24)])
def test_rope_is_torchs(tokens: int, head_dim: int) -> None:
    from poise.checkpoint.arch import RopeConfig
    from poise.model.rope import RotaryEmbedding, apply_rope

    gen = torch.Generator().manual_seed(tokens + head_dim)
    rotary = RotaryEmbedding(
        RopeConfig(theta=10000.0), head_dim, 4096, torch.bfloat16, torch.device("cpu")
    )
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rotary.tables(positions)
    qkv = (4 * torch.randn(tokens, 5, head_dim, generator=gen)).bfloat16()
    x = qkv[:, :3]  # q and k heads of a wider qkv row, as the model rotates them
    swapped = x.roll(head_dim // 2, dims=-1)
    want = x * cos + swapped * sin  # torch's ops (the fallback), three bf16 roundings
    untouched = qkv[:, 3:].clone()
    assert elementwise.rope_applies(x, cos, sin)
    apply_rope(x, cos, sin, out=x)  # in place, through the kernel
    assert torch.equal(x, want)
    assert torch.equal(qkv[:, 3:], untouched)
