"""Decode attention of real model shapes in the C++ kernel alone, against reading its KV once.

One "step" is the decode kernel (poise/model/attention/cpu_paged_attention.cpp) called once
per layer over that layer's own KV cache, so nothing stays cached from the layer before, as in
a real step. Each row has its own blocks, scattered over the pool as a running server's are
(a random permutation). The floor is the step's KV bytes (every row's keys and values, every
layer) over the DRAM read bandwidth, and the peer measured beside it in the same rounds is a
streaming read of those same caches (hardware.py's kernel), interleaved with the kernel's
steps so that the machine's drift hits both.

    .venv/bin/python benchmarks/decode_attention.py [--shapes smollm2-1.7b,...]
        [--rows 1,16] [--contexts 64,1024] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it, before torch loads

import torch  # noqa: E402
from hardware import _read_kernel  # noqa: E402

from poise.model.attention import AttentionMetadata, CpuPagedAttentionBackend  # noqa: E402
from poise.model.attention.cpu import CpuAttentionState  # noqa: E402

SHAPES = Path(__file__).parent / "shapes"
BLOCK = 16


def shape_of(name: str) -> tuple[int, int, int, int]:
    """(layers, heads, kv heads, head_dim) from benchmarks/shapes/NAME/config.json."""
    c = json.loads((SHAPES / name / "config.json").read_text())
    heads = c["num_attention_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // heads
    return c["num_hidden_layers"], heads, c.get("num_key_value_heads", heads), hd


def state_for(
    backend: CpuPagedAttentionBackend, rows: int, context: int, blocks: int
) -> CpuAttentionState:
    per = -(-context // BLOCK)
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))[: rows * per]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        block_size=BLOCK,
        num_decodes=rows,
        decode_block_tables=perm.view(rows, per).contiguous(),
        decode_context_lens=torch.full((rows,), context, dtype=torch.int64),
    )
    return backend.prepare(meta)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="smollm2-1.7b,llama-3.2-1b,qwen2.5-1.5b")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--contexts", default="64,1024")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="Default: torch's (the cores).")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    read = _read_kernel()
    backend = CpuPagedAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    print(f"load {os.getloadavg()[0]:.2f}, threads {threads}, bf16 KV, {BLOCK}-token blocks")
    print("| shape | rows | context | KV MB/step | kernel ms | read ms | kernel / read |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        layers, heads, kv_heads, hd = shape_of(name)
        for rows in map(int, args.rows.split(",")):
            for context in map(int, args.contexts.split(",")):
                # A pool with twice the blocks the rows use, so theirs are scattered in it.
                blocks = 2 * rows * -(-context // BLOCK)
                caches = [
                    torch.randn(blocks, BLOCK, 2 * kv_heads, hd, generator=gen).bfloat16()
                    for _ in range(layers)
                ]
                q = torch.randn(rows, heads, hd, generator=gen).bfloat16()
                out = torch.empty_like(q)
                state = state_for(backend, rows, context, blocks)
                assert state.rows is not None
                kv_bytes = layers * rows * context * 2 * kv_heads * hd * 2
                kernel, stream = [], []
                for rep in range(args.reps + 1):  # interleaved; the first round warms up
                    start = time.perf_counter()
                    for cache in caches:
                        backend._attend_rows(q, cache, state.rows, hd**-0.5, out)
                    mid = time.perf_counter()
                    # As many bytes streamed: the rows' blocks are half of each cache's bytes.
                    for cache in caches:
                        read(cache.data_ptr(), cache.numel(), threads)
                    end = time.perf_counter()
                    if rep:
                        kernel.append(mid - start)
                        stream.append(end - mid)
                k, s = statistics.median(kernel), statistics.median(stream)
                print(
                    f"| {name} | {rows} | {context} | {kv_bytes / 1e6:.1f} | {k * 1e3:.2f} |"
                    f" {s * 1e3:.2f} | {k / s:.2f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
