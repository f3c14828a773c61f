"""The C++ CPU attention kernel vs the torch backend on the same paged cache.

Covers the kernel's specialised paths: head_dim 64 and 128 (AVX-512 register kernels) and an
odd one (generic loops), 1 to 7 query heads per kv head (the 1-4 head kernels and their
remainders), contexts longer than one partition (the cross-partition merge), rows that share
prefix blocks, a prefix-cache-hit tail, and chunks through the blocked prefill kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from poise.model.attention import AttentionMetadata, PrefillChunk
from poise.model.attention.cpu_kernel import load_cpu_kernel, use_prefill_amx
from poise.runner.attention import BACKENDS, resolve_backend_name
from poise.runner.inputs import decode_groups

pytestmark = pytest.mark.skipif(load_cpu_kernel() is None, reason="no C++ compiler")


def _case(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 16, 400
    cache = torch.randn(num_blocks, block_size, 2 * kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    shared = perm[:40]  # 640 tokens of common prefix, > 2 partitions of 256
    next_free = 40

    def blocks(n: int) -> torch.Tensor:
        nonlocal next_free
        out = perm[next_free : next_free + n]
        next_free += n
        return out

    # Decode contexts: two rows sharing the prefix, then short and odd lengths.
    contexts = [700, 650, 257, 100, 17, 1]
    tables = []
    for i, c in enumerate(contexts):
        nb = -(-c // block_size)
        tables.append(torch.cat([shared, blocks(nb - 40)]) if i < 2 else blocks(nb))
    d = len(contexts)
    table = torch.zeros(d, max(len(t) for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    ctx = torch.tensor(contexts)
    slots = [table[torch.arange(d), (ctx - 1) // block_size] * block_size + (ctx - 1) % block_size]
    # Chunks after cached tokens: 5 queries (the tail of a prefix-cache hit) and 80 (each
    # item ending inside a key block), plus a fresh one whose last item is one query.
    prefills, offset = [], d
    for start, n in ((640, 5), (300, 80), (0, 33)):
        t = (
            torch.cat([shared, blocks(-(-(start + n) // block_size) - 40)])
            if start >= 640
            else (blocks(-(-(start + n) // block_size)))
        )
        pos = torch.arange(start, start + n)
        slots.append(t[pos // block_size] * block_size + pos % block_size)
        prefills.append(PrefillChunk(offset, n, start, t))
        offset += n
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_size=block_size,
        num_decodes=d,
        decode_block_tables=table,
        decode_context_lens=ctx,
        decode_groups=decode_groups(((ctx - 1) // block_size + 1).numpy()),
        prefills=prefills,
    )
    qkv = torch.randn(offset, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    return meta, cache, qkv


@pytest.fixture(params=["amx", "vectors"])
def prefill_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The bf16 prefill kernel on AMX tiles (where the CPU has them) and on AVX512-BF16 vectors
    (what CPUs without AMX run), both checked on this machine."""
    if request.param == "amx" and not use_prefill_amx(True):
        pytest.skip("no AMX on this CPU (or this OS does not allow it)")
    use_prefill_amx(request.param == "amx")
    yield request.param
    use_prefill_amx(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (8, 8, 64), (28, 4, 128), (14, 2, 64), (6, 2, 24)],
)
def test_cpu_kernel_matches_torch_backend(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, prefill_path: str
) -> None:
    results = []
    for name in ("torch", "cpu"):
        meta, cache, qkv = _case(heads, kv_heads, head_dim, dtype, seed=heads + head_dim)
        backend = BACKENDS[name].create()
        state = backend.prepare(meta)
        out = backend.forward(qkv[:, :heads], qkv[:, heads:], cache, state, head_dim**-0.5)
        results.append((out.float(), cache))
    (want, cache_torch), (got, cache_cpu) = results
    assert torch.equal(cache_torch, cache_cpu)  # both wrote this step's K/V to the same slots
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37, 1500])  # 1,500: over 1 MB, on every thread
def test_cpu_kv_writer_equals_torch_index_copy(dtype: torch.dtype, tokens: int) -> None:
    from poise.model.attention.common import write_kv

    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 9 + 6, 64, generator=gen).to(dtype)
    kv = qkv[:, 9:]  # strided, as the model hands it over
    slots = torch.randperm(128 * 16, generator=gen)[:tokens]
    caches = [torch.full((128, 16, 6, 64), 7.0, dtype=dtype) for _ in range(2)]
    write_kv(kv, caches[0], slots)
    backend = BACKENDS["cpu"].create()
    backend._write_kv_native(backend._write_plain, kv, caches[1], slots)  # type: ignore[attr-defined]
    # Every written slot holds its token's K and V, every other slot is untouched.
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(caches[1].view(-1, 6, 64)[slots], kv)


def test_cpu_backend_rejects_non_contiguous_cache() -> None:
    meta, cache, qkv = _case(9, 3, 64, torch.float32, seed=1)
    backend = BACKENDS["cpu"].create()
    state = backend.prepare(meta)
    strided = cache.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        backend.forward(qkv[:, :9], qkv[:, 9:], strided, state, 0.125)


def test_backend_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu, torch.bfloat16) == "cpu"
    assert resolve_backend_name("auto", cpu, torch.float16) == "torch"  # no fp16 kernel
    assert resolve_backend_name("torch", cpu, torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend_name("cpu", cpu, torch.float16)
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend_name("flash", cpu, torch.float32)


def test_auto_falls_back_to_torch_without_the_kernel() -> None:
    import subprocess
    import sys

    code = (
        "import torch; from poise.runner.attention import resolve_backend_name; "
        "print(resolve_backend_name('auto', torch.device('cpu'), torch.bfloat16))"
    )
    env = {**__import__("os").environ, "POISE_DISABLE_CPU_KERNEL": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_rows_do_not_depend_on_the_chunk_start(dtype: torch.dtype) -> None:
    """The blocked prefill kernel's vector path (forced: what CPUs without AMX run): one
    700-token prompt as one chunk and as its tail after 130-699 cached tokens (a prefix-cache
    hit's tail of 1-10 queries among them) gives every query the same bits (key blocks at fixed
    positions, each row summed alone), so a prompt answers the same cold and cached. Before
    every chunk went through this kernel, tails of up to 64 queries ran as decode rows, which
    sum in another order and answered otherwise."""
    from poise.model.attention.cpu import CpuPagedAttentionBackend

    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, hd, bs, length = 9, 3, 64, 16, 700
    cache = torch.randn(100, bs, 2 * kv_heads, hd, generator=gen).to(dtype)
    table = torch.randperm(100, generator=gen)[: -(-length // bs)]
    q = torch.randn(length, heads, hd, generator=gen).to(dtype)
    pos = torch.arange(length)
    slots = table[pos // bs] * bs + pos % bs
    backend = CpuPagedAttentionBackend()

    def attend(start: int) -> torch.Tensor:
        chunk = PrefillChunk(0, length - start, start, table)
        meta = AttentionMetadata(slot_mapping=slots[start:], block_size=bs, prefills=[chunk])
        state = backend.prepare(meta)
        assert state.rows is None and state.chunks is not None
        kv = cache.view(-1, 2 * kv_heads, hd)[slots[start:]].clone()  # what the cache holds
        return backend.forward(q[start:], kv, cache, state, hd**-0.5)

    use_prefill_amx(False)
    try:
        whole = attend(0)
        for start in (130, 417, 560, 650, 690, 697, 699):
            assert torch.equal(attend(start), whole[start:]), start
    finally:
        use_prefill_amx(True)
