"""One layer's decode attention, bf16 KV against int8 KV, in the same run (issue 33).

The shape of the seed mix at concurrency 32 with every LONG prompt distinct: 8 rows of
~3,500 tokens and 24 of ~300, SmolLM2-135M's heads (9 query heads, 3 kv heads of 64), blocks
of 16 scattered at random over the pool. Times the cpu backend's forward (K/V write included)
for each cache, median of ``--repeats``, and the KV bytes each reads, x30 layers per step.
Calls cycle over ``--layers`` distinct caches (default 8, ~240 MB in bf16), so that, as in a
real step, a layer's K/V is not still in L3 from the call before.

    .venv/bin/python benchmarks/kv_int8_decode.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from poise.model.attention import AttentionMetadata, CpuPagedAttentionBackend
from poise.model.attention.kv_int8 import quantize_rows
from poise.runner.inputs import decode_groups

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def case(contexts: list[int]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    blocks_per_row = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(blocks_per_row) + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(contexts), max(blocks_per_row), dtype=torch.int64)
    used = 0
    for i, nb in enumerate(blocks_per_row):
        table[i, :nb] = perm[used : used + nb]
        used += nb
    ctx = torch.tensor(contexts)
    rows = torch.arange(len(contexts))
    slots = table[rows, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK
    order = torch.argsort(ctx, descending=True)
    meta = AttentionMetadata(
        slot_mapping=slots[order],
        block_size=BLOCK,
        num_decodes=len(contexts),
        decode_block_tables=table[order],
        decode_context_lens=ctx[order],
        decode_groups=decode_groups(((ctx[order] - 1) // BLOCK + 1).numpy()),
    )
    cache = torch.randn(num_blocks, BLOCK, 2 * KV_HEADS, HEAD_DIM, generator=gen)
    qkv = torch.randn(len(contexts), HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen)
    return meta, cache.to(torch.bfloat16), qkv.to(torch.bfloat16)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [3500 + 7 * i for i in range(8)] + [300 + 11 * i for i in range(24)]
    meta, cache_bf16, qkv = case(contexts)
    backend = CpuPagedAttentionBackend()
    state = backend.prepare(meta)
    q, kv = qkv[:, :HEADS], qkv[:, HEADS:]
    tokens = sum(contexts)
    print(f"rows {len(contexts)}, keys {tokens}, threads {args.threads}")
    print("| KV cache | ms / layer | ms / step (x30) | KV MB read / step | vs bf16 |")
    print("|---|---|---|---|---|")
    base = None
    layers = [cache_bf16] + [cache_bf16.clone() for _ in range(args.layers - 1)]
    for name, caches in (("bf16", layers), ("int8", [quantize_rows(c) for c in layers])):
        for cache in caches:
            backend.forward(q, kv, cache, state, HEAD_DIM**-0.5)
        times = []
        for i in range(args.repeats):
            cache = caches[i % len(caches)]
            t0 = time.perf_counter()
            backend.forward(q, kv, cache, state, HEAD_DIM**-0.5)
            times.append(time.perf_counter() - t0)
        ms = 1000 * statistics.median(times)
        base = base or ms
        row_bytes = cache.shape[-1] * cache.element_size()
        mb = tokens * 2 * KV_HEADS * row_bytes * LAYERS / 1e6
        print(f"| {name} | {ms:.2f} | {ms * LAYERS:.1f} | {mb:.0f} | {ms / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
