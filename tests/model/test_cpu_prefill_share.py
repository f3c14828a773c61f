"""Prefill chunks that share cached prefix blocks (cpu_prefill_share.h): in one kernel call
they pack those keys once and, on the vector path, walk them together; every chunk's output
must be bit for bit what the same chunk gives alone, and match the torch reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from poise.model.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from poise.model.attention.cpu import CpuPagedAttentionBackend
from poise.model.attention.cpu_kernel import load_cpu_kernel, use_prefill_amx
from poise.model.attention.kv_int8 import quantize_rows
from poise.model.attention.torch_ref import TorchAttentionBackend

pytestmark = pytest.mark.skipif(load_cpu_kernel() is None, reason="no C++ compiler")

HEADS, KV_HEADS, HD, BS = 9, 3, 64, 16


def _chunks(seed: int, num_blocks: int) -> list[tuple[int, int, torch.Tensor]]:
    """(start, query_len, block table) of 1-8 groups of chunks: each group's members begin
    with one prefix of 1-700 tokens and add their own blocks; members start anywhere from 0
    (a cold prompt that computes the prefix itself) to past the prefix (a prefix-cache hit's
    tail of 1-70 queries)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()

    def take(n: int) -> list[int]:
        out = perm[:n]
        del perm[:n]
        return out

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    chunks = []
    for _ in range(draw(1, 8)):
        prefix_len = draw(1, 700)
        prefix = take(-(-prefix_len // BS))
        for _ in range(draw(1, 5)):
            cold = draw(0, 4) == 0
            start = draw(0, prefix_len) if cold else prefix_len + draw(-(prefix_len % BS), 20)
            n = draw(1, 70)
            shared = min(len(prefix), start // BS)  # full blocks before its own tokens
            own = take(-(-(start + n) // BS) - shared)
            chunks.append((start, n, torch.tensor(prefix[:shared] + own)))
    order = torch.randperm(len(chunks), generator=gen).tolist()
    return [chunks[i] for i in order]


def _attend(
    backend: AttentionBackend[Any],
    cache: torch.Tensor,
    q: torch.Tensor,
    chunks: list[tuple[int, int, torch.Tensor]],
) -> list[torch.Tensor]:
    """Every chunk in one call; the step's K/V is what the cache holds (nothing written)."""
    prefills, slots, offset = [], [], 0
    for start, n, table in chunks:
        prefills.append(PrefillChunk(offset, n, start, table))
        pos = torch.arange(start, start + n)
        slots.append(table[pos // BS] * BS + pos % BS)
        offset += n
    slot_mapping = torch.cat(slots)
    meta = AttentionMetadata(slot_mapping=slot_mapping, block_size=BS, prefills=prefills)
    if cache.dtype == torch.int8:  # attend only: the int8 writer would requantize the cache
        assert isinstance(backend, CpuPagedAttentionBackend)
        chunks_state = backend.prepare(meta).chunks
        assert chunks_state is not None
        out = q.new_empty(q[:offset].shape)
        backend._attend_chunks(q[:offset], cache, chunks_state, HD**-0.5, out, True)
    else:
        flat = cache.view(-1, 2 * KV_HEADS, HD)
        kv = flat[slot_mapping].clone()
        out = backend.forward(q[:offset], kv, cache, backend.prepare(meta), HD**-0.5)
    ends = torch.tensor([n for _, n, _ in chunks]).cumsum(0).tolist()
    return [out[e - n : e] for e, (_, n, _) in zip(ends, chunks, strict=True)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
def test_shared_prefix_chunks_answer_as_alone(seed: int, cache_dtype: str) -> None:
    dtype = torch.float32 if cache_dtype == "float32" else torch.bfloat16
    gen = torch.Generator().manual_seed(100 + seed)
    num_blocks = 8 * 5 * (700 // BS + 10)
    cache = torch.randn(num_blocks, BS, 2 * KV_HEADS, HD, generator=gen).to(dtype)
    if cache_dtype == "int8":
        cache = quantize_rows(cache)
    chunks = _chunks(seed, num_blocks)
    q = torch.randn(sum(n for _, n, _ in chunks), HEADS, HD, generator=gen).to(dtype)
    backend = CpuPagedAttentionBackend()
    for amx in (False, True):  # the vector path stacks shared walks; AMX only shares packing
        if amx and not use_prefill_amx(True):
            continue
        use_prefill_amx(amx)
        try:
            together = _attend(backend, cache, q, chunks)
            offset = 0
            for i, (start, n, table) in enumerate(chunks):
                alone = _attend(backend, cache, q[offset:], [(start, n, table)])[0]
                assert torch.equal(together[i], alone), (amx, i, start, n)
                offset += n
        finally:
            use_prefill_amx(True)
    if cache_dtype != "int8":  # the float reference over the same cache
        want = _attend(TorchAttentionBackend(), cache, q, chunks)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for got, ref in zip(together, want, strict=True):
            torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
