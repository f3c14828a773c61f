"""The bf16 kernels: the rows kernel (model/cpu_linear_bf16.h through linear_kernel.bf16_linear)
and, where the CPU has AMX, the packed one for every row count (cpu_linear_bf16_amx.h through
linear_kernel.PackedBf16): against a float reference for every row-block size and channel tail,
and a row's bits alone equal to the same row inside a batch (a request's greedy tokens must not
depend on its batch)."""

from __future__ import annotations

import pytest
import torch

from poise.model import linear_kernel as lk

NO_KERNEL = "neither AVX512-BF16 nor AVX2, or no C++ compiler"


def _ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    lib = lk.load_linear_kernel()
    m, k = x.shape
    y = torch.empty(m, w.shape[0], dtype=torch.bfloat16)
    assert (
        lib.poise_linear_bf16_rows(x.data_ptr(), m, k, w.data_ptr(), w.shape[0], y.data_ptr(), 2)
        == 0
    )
    return y


@pytest.mark.skipif(lk.load_linear_kernel() is None, reason=NO_KERNEL)
# 65 and 150: more rows than one pass (kBf16RowChunk = 64): chunks of 36 + 29 and 52 x 2 + 46.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 33, 65, 150])
@pytest.mark.parametrize(("n", "k"), [(64, 96), (13, 160), (18, 576), (7, 32)])
def test_bf16_rows_kernel_matches_float(m: int, n: int, k: int) -> None:
    # n = 13, 18, 7: channel tails past the 4-channel blocks (and no next block to prefetch).
    torch.manual_seed(m * 1000 + n)
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    want = x.float() @ w.float().T
    got = _ours(x, w).float()
    # One bf16 rounding of a float sum (the kernel's only rounding): 2^-8 relative.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=2**-8)


@pytest.mark.skipif(lk.load_linear_kernel() is None, reason=NO_KERNEL)
def test_bf16_rows_kernel_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    w = torch.randn(52, 1088).bfloat16()
    x = torch.randn(150, 1088).bfloat16()
    # 150 rows run in chunks (kBf16RowChunk); 11 and 3 in one pass: every row the same bits.
    together = _ours(x, w)
    assert torch.equal(_ours(x[:11].contiguous(), w), together[:11])
    assert torch.equal(_ours(x[70:73].contiguous(), w), together[70:73])
    for r in (0, 5, 10, 64, 103, 149):
        assert torch.equal(_ours(x[r : r + 1].contiguous(), w), together[r : r + 1])


@pytest.mark.skipif(lk.load_linear_kernel() is None, reason=NO_KERNEL)
def test_bf16_linear_adds_bias_and_refuses_nothing() -> None:
    # bf16_linear takes any shape: ours where it fits, torch's GEMM otherwise (k % 32 != 0).
    torch.manual_seed(2)
    for m, n, k in ((1, 24, 64), (2, 24, 40), (40, 24, 64)):
        x, w, b = (
            torch.randn(m, k).bfloat16(),
            torch.randn(n, k).bfloat16(),
            torch.randn(n).bfloat16(),
        )
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(lk.bf16_linear(x, w, b).float(), want, atol=0.05, rtol=0.02)


@pytest.mark.skipif(
    lk.load_linear_kernel() is None or lk.amx_available(),
    reason="without AMX (with AMX layers pack: test_packed_bf16_rows_do_not_depend_on_the_batch)",
)
def test_bf16_linear_rows_do_not_depend_on_the_batch_without_amx() -> None:
    # A prefill-sized batch and each of its rows alone through the one entry point the model
    # uses: with torch's GEMM past 32 rows, 7 of these 57,600 outputs differed in the last bit.
    torch.manual_seed(3)
    w = torch.randn(192, 576).bfloat16()
    x = torch.randn(300, 576).bfloat16()
    together = lk.bf16_linear(x, w, None)
    for r in range(300):
        assert torch.equal(lk.bf16_linear(x[r : r + 1], w, None), together[r : r + 1]), r


NO_AMX = "no AMX (the packed bf16 kernel runs where the CPU has AMX tiles)"


@pytest.mark.skipif(not lk.amx_available(), reason=NO_AMX)
@pytest.mark.parametrize(("n", "k"), [(64, 96), (48, 160), (16, 576), (96, 2048)])
def test_packed_bf16_matches_float(n: int, k: int) -> None:
    # n = 48, 16: groups of one tile (n not a multiple of 32); m past one and two row blocks.
    torch.manual_seed(n + k)
    w = torch.randn(n, k).bfloat16()
    packed = lk.pack_bf16(w)
    assert packed.tiles == (2 if n % 32 == 0 else 1)
    for m in (1, 5, 16, 17, 33, 130):
        x = torch.randn(m, k).bfloat16()
        want = x.float() @ w.float().T
        # One bf16 rounding of a float32 sum: 2^-8 relative.
        torch.testing.assert_close(packed(x).float(), want, atol=1e-4, rtol=2**-8)


@pytest.mark.skipif(not lk.amx_available(), reason=NO_AMX)
def test_packed_bf16_rows_do_not_depend_on_the_batch() -> None:
    # Any row, in any batch (alone, 16-row tile blocks, past a 128-row chunk), the same bits.
    torch.manual_seed(1)
    w = torch.randn(96, 576).bfloat16()
    x = torch.randn(300, 576).bfloat16()
    packed = lk.pack_bf16(w)
    together = packed(x)
    for lo, hi in ((0, 1), (7, 8), (5, 21), (16, 48), (100, 229), (299, 300), (0, 300)):
        assert torch.equal(packed(x[lo:hi]), together[lo:hi]), (lo, hi)


@pytest.mark.skipif(not lk.amx_available(), reason=NO_AMX)
def test_packed_bf16_takes_no_rows() -> None:
    y = lk.pack_bf16(torch.randn(32, 64).bfloat16())(torch.empty(0, 64, dtype=torch.bfloat16))
    assert y.shape == (0, 32)


@pytest.mark.skipif(not lk.amx_available(), reason=NO_AMX)
def test_packed_bf16_refuses_a_shape_it_was_not_packed_for() -> None:
    packed = lk.pack_bf16(torch.randn(32, 64).bfloat16())
    packed.in_features = 48  # not a multiple of the 32-input K block
    with pytest.raises(ValueError, match="does not fit its packing"):
        packed(torch.randn(1, 48).bfloat16())


def test_bf16_packs_only_what_the_kernel_runs() -> None:
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert lk.bf16_packs(w) == lk.amx_available()
    assert not lk.bf16_packs(w.float())  # float32 models keep torch's GEMM
    assert not lk.bf16_packs(torch.zeros(24, 64, dtype=torch.bfloat16))  # 24 % 16
    assert not lk.bf16_packs(torch.zeros(32, 40, dtype=torch.bfloat16))  # 40 % 32


@pytest.mark.skipif(not lk.amx_available(), reason=NO_AMX)
def test_packed_bf16_unpacks_to_the_weights() -> None:
    for n in (32, 48):
        w = torch.randn(n, 96).bfloat16()
        assert torch.equal(lk.pack_bf16(w).unpack(), w)
