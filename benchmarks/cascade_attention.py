"""Decode attention of the seed mix with and without shared-prefix (cascade) groups, in the
C++ kernel alone (poise/model/attention/cpu_decode_cascade.h), in the same run.

One "step" is the decode kernel called once per layer over that layer's own KV cache (so the
step reads what a real one does: nothing stays in cache from the layer before), at the
embedded SmolLM2-135M's shapes (30 layers, 9 query heads, 3 kv heads, head_dim 64, bf16,
16-token blocks). Rows at concurrency C: C / 4 LONG rows at 3,363 prompt tokens + ``--decoded``
generated, all LONG prompts the same text (their first 210 blocks shared, as the prefix cache
stores them), and 3C / 4 SHORT rows at 45 + ``--decoded``, which share their first two blocks
(one SHORT prompt), all rows sharing the first block (the chat template's system prompt).

Per concurrency: the median step with cascade off (every row alone) and on, and with every
LONG prompt distinct (nothing shared but the first block) with cascade on: the floor it
cannot beat without the sharing, and the cost of looking for groups that are not there
(against off on the same tables). Also the KV bytes a step must read both ways.

    .venv/bin/python benchmarks/cascade_attention.py [--concurrency 8 16 32] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from poise.model.attention import AttentionMetadata, CpuPagedAttentionBackend
from poise.model.attention.cpu import CpuAttentionState

LAYERS, HEADS, KV_HEADS, HD, BLOCK = 30, 9, 3, 64, 16
LONG, SHORT = 3363, 45


def tables(concurrency: int, decoded: int, shared_long: bool) -> tuple[list[list[int]], list[int]]:
    """Block tables and contexts of the rows (blocks numbered from 0 up, no gaps)."""
    next_block = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    template = fresh(1)
    long_prefix = fresh(LONG // BLOCK - 1)
    short_prefix = fresh(SHORT // BLOCK - 1)
    rows, contexts = [], []
    for i in range(concurrency):
        is_long = i % 4 == 0
        ctx = (LONG if is_long else SHORT) + decoded
        prefix = long_prefix if is_long else short_prefix
        if is_long and not shared_long:
            prefix = fresh(len(long_prefix))
        total = -(-ctx // BLOCK)
        rows.append(template + prefix + fresh(total - 1 - len(prefix)))
        contexts.append(ctx)
    return rows, contexts


def state_for(
    rows: list[list[int]], contexts: list[int], backend: CpuPagedAttentionBackend
) -> CpuAttentionState:
    table = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)
    for i, t in enumerate(rows):
        table[i, : len(t)] = torch.tensor(t)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        block_size=BLOCK,
        num_decodes=len(rows),
        decode_block_tables=table,
        decode_context_lens=torch.tensor(contexts),
    )
    return backend.prepare(meta)


def step_seconds(
    backend: CpuPagedAttentionBackend,
    state: CpuAttentionState,
    caches: list[torch.Tensor],
    q: torch.Tensor,
) -> float:
    out = torch.empty_like(q)
    assert state.rows is not None
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    for cache in caches:
        backend._attend_rows(q, cache, state.rows, HD**-0.5, out)
    return clock() - start


def kv_bytes(rows: list[list[int]], contexts: list[int], once: bool) -> int:
    """KV bytes a step reads: every row's keys, or each distinct block once."""
    per_token = LAYERS * 2 * KV_HEADS * HD * 2
    if not once:
        return sum(contexts) * per_token
    seen: dict[int, int] = {}
    for t, c in zip(rows, contexts, strict=True):
        for b, block in enumerate(t):
            seen[block] = max(seen.get(block, 0), min(BLOCK, c - b * BLOCK))
    return sum(seen.values()) * per_token


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--decoded", type=int, default=80, help="Tokens generated so far per row.")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="Default: torch's (the cores).")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = CpuPagedAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    print(f"load: {os.getloadavg()[0]:.2f} (1 min); threads {torch.get_num_threads()}")
    print(
        "| conc | rows | KV MB/step per row / once | off ms | on ms | off/on | distinct LONG: off / on ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        shared_rows, ctx = tables(c, args.decoded, shared_long=True)
        distinct_rows, _ = tables(c, args.decoded, shared_long=False)
        blocks = max(max(t) for t in distinct_rows) + 1
        caches = [
            torch.randn(blocks, BLOCK, 2 * KV_HEADS, HD, generator=gen).to(torch.bfloat16)
            for _ in range(LAYERS)
        ]
        q = torch.randn(c, HEADS, HD, generator=gen).to(torch.bfloat16)
        shared, distinct = (
            state_for(shared_rows, ctx, backend),
            state_for(distinct_rows, ctx, backend),
        )
        variants = {"off": (shared, False), "on": (shared, True)}
        variants |= {"d-off": (distinct, False), "d-on": (distinct, True)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.reps + 2):  # interleaved, so drift hits all alike; 2 warm-ups
            for name, (state, cascade) in variants.items():
                backend.cascade = cascade
                if rep >= 2:
                    times[name].append(step_seconds(backend, state, caches, q))
                else:
                    step_seconds(backend, state, caches, q)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        per_row, once = (
            kv_bytes(shared_rows, ctx, False) / 1e6,
            kv_bytes(shared_rows, ctx, True) / 1e6,
        )
        print(
            f"| {c} | {c // 4} LONG + {c - c // 4} SHORT | {per_row:.0f} / {once:.0f} | {ms['off']:.1f} | {ms['on']:.1f} "
            f"| {ms['off'] / ms['on']:.2f}x | {ms['d-off']:.1f} / {ms['d-on']:.1f} |"
        )
        del caches
    print(f"load: {os.getloadavg()[0]:.2f} (1 min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
