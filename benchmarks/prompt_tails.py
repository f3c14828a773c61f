"""Prompt tails after cached tokens in the C++ attention kernels, in the same run: through the
blocked prefill kernel (what poise runs: cpu.py routes every prompt token there) against the
decode kernel as rows (the route before: tails of up to 64 queries went there, which made a
prompt's answer depend on its cache state), over the same steps.

One "step" is each kernel called once per layer over that layer's own KV cache, at the embedded
SmolLM2-135M's shapes (30 layers, 9 query heads, 3 kv heads, head_dim 64, bf16, 16-token
blocks), the seed mix's rows as benchmarks/cascade_attention.py builds them (C / 4 LONG rows
sharing a 3,363-token prompt, the rest SHORT). Steps: decode rows alone; with one LONG tail (a
prefix-cache hit's 3 queries after 3,360 cached tokens); with two SHORT tails (20 queries after
16); a closed loop's refill (8 LONG and 24 SHORT tails at once, with and without decode rows);
and a cold burst's followers (7 tails of 38 queries after one 2,992-token document).

    .venv/bin/python benchmarks/prompt_tails.py [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cascade_attention import BLOCK, HD, HEADS, KV_HEADS, LAYERS, tables

from poise.model.attention import AttentionMetadata, CpuPagedAttentionBackend, PrefillChunk

# (decode rows, tails as (row whose prefix blocks the tail shares, start, queries)).
STEPS: dict[str, tuple[int, list[tuple[int, int, int]]]] = {
    "8 decode rows": (8, []),
    "8 decode rows + a SHORT tail (13 after 32)": (8, [(1, 32, 13)]),
    "8 decode rows + a LONG tail (3 after 3,360)": (8, [(0, 3360, 3)]),
    "32 decode rows": (32, []),
    "32 decode rows + a LONG tail (3 after 3,360)": (32, [(0, 3360, 3)]),
    "32 decode rows + 2 SHORT tails (20 after 16)": (32, [(1, 16, 20), (2, 16, 20)]),
    "refill: 8 LONG + 24 SHORT tails, 32 decode rows": (
        32,
        [(0, 3360, 3)] * 8 + [(1, 32, 13)] * 24,
    ),
    "refill: 8 LONG + 24 SHORT tails, no decode rows": (0, [(0, 3360, 3)] * 8 + [(1, 32, 13)] * 24),
    "cold burst: 7 tails of 38 after a 2,992-token document": (1, [(0, 2992, 38)] * 7),
}


def step_meta(
    decodes: int, tails: list[tuple[int, int, int]], as_rows: bool
) -> tuple[AttentionMetadata, int, int]:
    """The step's metadata, its flat tokens and the blocks its tables use. as_rows: every tail
    marked as generated tokens, which cpu.py attends as decode rows (the former route)."""
    rows, contexts = tables(max(decodes, 4), 40, True)
    next_block = max(max(r) for r in rows) + 1
    chunks, token = [], decodes
    for src, start, n in tails:
        keep = start // BLOCK
        need = -(-(start + n) // BLOCK)
        table = rows[src][:keep] + list(range(next_block, next_block + need - keep))
        next_block += need - keep
        chunks.append(PrefillChunk(token, n, start, torch.tensor(table), n if as_rows else 0))
        token += n
    table = torch.zeros(decodes, max(map(len, rows)), dtype=torch.int64)
    for i, t in enumerate(rows[:decodes]):
        table[i, : len(t)] = torch.tensor(t)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(token, dtype=torch.int64),
        block_size=BLOCK,
        num_decodes=decodes,
        decode_block_tables=table if decodes else None,
        decode_context_lens=torch.tensor(contexts[:decodes]) if decodes else None,
        prefills=chunks,
    )
    return meta, token, next_block


def step_ms(meta: AttentionMetadata, tokens: int, blocks: int, repeats: int) -> float:
    backend = CpuPagedAttentionBackend()
    state = backend.prepare(meta)
    caches = [
        torch.randn(blocks, BLOCK, 2 * KV_HEADS, HD).to(torch.bfloat16) for _ in range(LAYERS)
    ]
    q = torch.randn(tokens, HEADS, HD).to(torch.bfloat16)
    out = torch.empty_like(q)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for cache in caches:  # attend only: the step's K/V is what the cache holds
            if state.rows is not None:
                backend._attend_rows(q, cache, state.rows, HD**-0.5, out)
            if state.chunks is not None:
                backend._attend_chunks(q, cache, state.chunks, HD**-0.5, out)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, ms per step (30 layers), median of {args.repeats}")
    print(
        "| step | tails as decode rows (before) | tails in the prefill kernel (now) | now / before |"
    )
    print("|---|---|---|---|")
    for name, (decodes, tails) in STEPS.items():
        # Alternated, so drift hits both: rows, kernel, rows, kernel.
        rows, kernel = [], []
        for _ in range(2):
            rows.append(step_ms(*step_meta(decodes, tails, True), args.repeats))
            kernel.append(step_ms(*step_meta(decodes, tails, False), args.repeats))
        r, k = min(rows), min(kernel)
        print(f"| {name} | {r:.1f} | {k:.1f} | {k / r:.2f} |")


if __name__ == "__main__":
    main()
