"""Measure the real ModelRunner's step time over a grid of batch shapes (``poise profile``).

The runner is driven with hand-built ``SchedulerOutput`` objects, so no scheduler is involved:
each grid point is a prefill chunk of ``prefill`` tokens starting at ``prefill_start`` plus
``batch`` decode requests at context ``context``. The runner keeps no per-request state, so a
decode at position 2000 needs no earlier prefill: it reads whatever the pool holds there, which
costs the same time as real context. Each point runs ``warmup`` times unmeasured, then
``repeats`` times; the median is kept.

The engine's own share of a step (``engine/overhead.py``) is measured beside this, by the CLI:
the runner imports nothing of the engine, which imports the runner (lazily) to build one.

Invariants: block ids handed to the runner are always inside the pool; shapes never exceed the
engine limits given (token budget, request cap, pool size, max_model_len).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from poise.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from poise.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GridPoint:
    prefill: int  # tokens of the prefill chunk (0 = none)
    prefill_start: int  # its start position (0 = a whole prompt, which samples)
    batch: int  # decode requests
    context: int  # each decode request's context length (its position + 1)
    skew: int = 0  # when set, the first decode request's context instead (a mixed batch)
    # Decode requests share their blocks but the last (identical prompts, prefix caching).
    shared: bool = False
    # Prefill chunks of ``prefill`` tokens each at ``prefill_start``, one request each (a burst
    # of prefix-cache hits: many small chunks after cached tokens, as a closed loop's new wave).
    chunks: int = 1
    # The chunk ends its prompt, so it samples (a prefix-cache hit's remainder); a chunk at 0
    # is a whole prompt and always samples, a later chunk of a long prompt does not.
    last_chunk: bool = False
    # Each decode request verifies this many draft tokens (speculative decoding): 1 + drafts
    # query rows over its context, sampled at each (runner/verify.py).
    drafts: int = 0


GRIDS: dict[str, dict[str, tuple[int, ...]]] = {
    # prefill chunk sizes, decode batch sizes, context lengths, mixed (prefill, batch) pairs
    "quick": {
        "prefill": (16, 128, 512),
        "batch": (1, 8, 32),
        "context": (64, 1024),
    },
    "standard": {
        "prefill": (16, 64, 256, 1024, 2048),
        "batch": (1, 4, 16, 32, 64),
        "context": (64, 512, 2048, 4096),
    },
}


def build_grid(
    name: str,
    *,
    max_tokens: int,
    max_seqs: int,
    capacity_tokens: int,
    max_len: int,
) -> list[GridPoint]:
    """Grid points within the token budget, request cap, KV pool and max_model_len.

    Points that do not fit are shrunk (fewer tokens, shorter context) rather than dropped, so
    small models and small pools still get a grid that spans every feature; duplicates go.
    """
    g = GRIDS[name]
    raw: list[GridPoint] = []
    ctx_mid = g["context"][len(g["context"]) // 2]
    ctx_max = g["context"][-1]
    for n in g["prefill"]:
        raw.append(GridPoint(n, 0, 0, 0))  # whole prompt: samples
        # A later chunk of a longer prompt (big chunks far in: the second chunk of a long one).
        raw.append(GridPoint(n, ctx_max if n >= 256 else ctx_mid, 0, 0))
    for b in g["batch"]:
        for c in g["context"]:
            raw.append(GridPoint(0, 0, b, c))
    for b in g["batch"][1:]:
        # One long context among short ones: sum of contexts != batch x the longest.
        raw.append(GridPoint(0, 0, b, g["context"][0], skew=ctx_max))
        # Requests sharing one long prefix: the same arithmetic, a fraction of the KV traffic.
        for c in g["context"][1:]:
            raw.append(GridPoint(0, 0, b, c, shared=True))
    for n in g["prefill"][1::2]:
        for b in g["batch"][1::2]:
            raw.append(GridPoint(n, 0, b, ctx_mid))
    # Bursts of prefix-cache hits beside decodes: many short chunks after a short cached
    # prefix, and a few after a long one shared by all (per-request costs, row-wise attention).
    for k in (8, 24):
        raw.append(GridPoint(16, 48, g["batch"][1], ctx_mid, chunks=k, last_chunk=True))
    for k in (4, 8):
        raw.append(
            GridPoint(16, ctx_max, g["batch"][1], ctx_mid, shared=True, chunks=k, last_chunk=True)
        )
    # A chat prompt whose system prompt is cached: one short chunk after a block or two, alone
    # and beside decodes (the first step of most requests under prefix caching). Small chunks
    # cost more per token than big ones, which a grid of whole prompts and bursts misses.
    raw.append(GridPoint(48, 16, 0, 0, last_chunk=True))
    raw.append(GridPoint(32, 32, g["batch"][1], ctx_mid, chunks=2, last_chunk=True))
    # Verify rows (speculative decoding): k + 1 queries and k + 1 sampled positions per request
    # cost more than a decode by more than their tokens (the per-position sampling path); a
    # grid of one sample per request could not tell the fit what a sampled position costs.
    for b in (g["batch"][0], g["batch"][1]):
        for k in (2, 4):
            raw.append(GridPoint(0, 0, b, ctx_mid, drafts=k))
    raw.append(GridPoint(0, 0, g["batch"][-1], g["context"][0], drafts=2))
    out: list[GridPoint] = []
    for p in raw:
        q = _shrink(p, max_tokens, max_seqs, capacity_tokens, max_len)
        if q is not None and q not in out:
            out.append(q)
    return out


def _shrink(
    p: GridPoint, max_tokens: int, max_seqs: int, capacity: int, max_len: int
) -> GridPoint | None:
    chunks = min(p.chunks, max_seqs, max(1, max_tokens // max(1, p.prefill))) if p.prefill else 1
    n_prefill_seqs = chunks if p.prefill else 0
    rows = 1 + p.drafts  # tokens per decode request
    batch = min(
        p.batch, max_seqs - n_prefill_seqs, max(0, max_tokens - p.prefill * n_prefill_seqs) // rows
    )
    prefill = min(p.prefill, (max_tokens - batch) // max(1, n_prefill_seqs), max_len - 1)
    if batch <= 0 and prefill <= 0:
        return None
    # Context of each decode and the chunks' start: within max_len and a fair share of the pool.
    share = capacity // max(1, batch + n_prefill_seqs)
    context = min(p.context, max_len - 1 - p.drafts, share - p.drafts) if batch else 0
    start = min(p.prefill_start, max_len - 1 - prefill, max(0, share - prefill)) if prefill else 0
    if batch and context < 1:
        return None
    skew = min(p.skew, max_len - 1, capacity - (batch - 1) * context) if p.skew and batch else 0
    return GridPoint(
        max(prefill, 0),
        max(start, 0),
        max(batch, 0),
        context,
        max(skew, 0),
        p.shared,
        chunks,
        p.last_chunk,
        p.drafts,
    )


def make_output(
    p: GridPoint, block_size: int, num_blocks: int, step_id: int = 0
) -> SchedulerOutput:
    """A SchedulerOutput for one grid point, with disjoint block tables (wrapping the pool)."""
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    next_block = 0

    def table(n_tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-n_tokens // block_size)
        ids = [(next_block + i) % num_blocks for i in range(n)]
        next_block += n
        return ids

    scheduled = []
    shared_prefix = table(p.context - 1) if p.shared and p.batch else []
    for i in range(p.batch):
        pos = (p.skew if i == 0 and p.skew else p.context) - 1
        if p.shared:  # the common full blocks, then a block of its own
            blocks = shared_prefix[: pos // block_size] + table(block_size)
        else:
            blocks = table(pos + 1)
        k = p.drafts
        if k:  # its own blocks for the drafts' positions too
            blocks = blocks + table(pos + 1 + k - len(blocks) * block_size)
        scheduled.append(
            ScheduledRequest(
                f"d{i}", [7] * (1 + k), pos, blocks, True, params, 1, pos, num_draft_tokens=k
            )
        )
    if p.prefill:
        end = p.prefill_start + p.prefill
        sample = p.prefill_start == 0 or p.last_chunk
        tokens = [11 + (j % 97) for j in range(p.prefill)]
        # Shared chunks: the cached start's full blocks are common (identical prompts).
        common = table(p.prefill_start) if p.shared and p.chunks > 1 else []
        full = p.prefill_start // block_size
        for k in range(p.chunks):
            if common:
                blocks = common[:full] + table(end - full * block_size)
            else:
                blocks = table(end)
            rid = "p" if p.chunks == 1 else f"p{k}"
            scheduled.append(
                ScheduledRequest(rid, tokens, p.prefill_start, blocks, sample, params, 0, end)
            )
    return SchedulerOutput(step_id=step_id, scheduled=scheduled)


# What a step's "time" is. wall: elapsed time, right on a machine of one's own. cpu: the
# calling thread's CPU time, which other processes on a shared machine do not inflate (with one
# torch thread all of the forward runs on the calling thread); a simulation then scales it by
# how much of a core the server gets (CostModel.time_scale, calibrated at one load point).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def measure_grid(
    execute: Callable[[SchedulerOutput], ModelRunnerOutput],
    points: Sequence[GridPoint],
    *,
    block_size: int,
    num_blocks: int,
    warmup: int = 1,
    repeats: int = 3,
    clock: str = "wall",
    progress: Callable[[int, int, GridPoint, float], None] | None = None,
) -> list[tuple[SchedulerOutput, float]]:
    """(the output run, median seconds) per point; the caller turns outputs into features.

    Repeats are interleaved (``repeats`` passes over the whole grid after ``warmup`` passes),
    so a burst of outside load spreads over all points instead of skewing a few of them.
    """
    tick = CLOCKS[clock]
    outs = [make_output(p, block_size, num_blocks, step_id=i) for i, p in enumerate(points)]
    times: list[list[float]] = [[] for _ in points]
    for rep in range(warmup + repeats):
        for i, out in enumerate(outs):
            t0 = tick()
            execute(out)
            dt = tick() - t0
            if rep >= warmup:
                times[i].append(dt)
            if progress is not None and rep == warmup + repeats - 1:
                progress(i + 1, len(points), points[i], statistics.median(times[i]))
    return [(out, statistics.median(ts)) for out, ts in zip(outs, times, strict=True)]
