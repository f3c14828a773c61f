"""Paged attention backends vs a dense per-request reference (causal, GQA via repeat)."""

from __future__ import annotations

import random

import pytest
import torch

from poise.core.outputs import ScheduledRequest
from poise.core.sampling_params import SamplingParams
from poise.model.attention import key_view, value_view
from poise.runner.attention import BACKENDS
from poise.runner.inputs import build_step_inputs


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, hd] at positions start.., k/v [start+n, Hkv, hd] -> [n, H, hd]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    qpos = torch.arange(q.shape[0])[:, None] + start
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(4, 4, 1), (4, 2, 4), (8, 2, 16)])
def test_paged_matches_dense(backend: str, heads: int, kv_heads: int, block_size: int) -> None:
    rng = random.Random(heads * 100 + block_size)
    gen = torch.Generator().manual_seed(block_size)
    hd, num_blocks = 8, 96
    cache = torch.zeros(num_blocks, block_size, 2 * kv_heads, hd)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # Each request: (tokens already cached, tokens fed now). Decodes, a first chunk, a later chunk.
    shapes = {"d1": (5, 1), "d2": (17, 1), "p0": (0, 7), "p1": (9, 6), "d3": (0, 1), "p2": (3, 2)}
    full_k = {r: torch.randn(c + n, kv_heads, hd, generator=gen) for r, (c, n) in shapes.items()}
    full_v = {r: torch.randn(c + n, kv_heads, hd, generator=gen) for r, (c, n) in shapes.items()}
    q = {r: torch.randn(n, heads, hd, generator=gen) for r, (_, n) in shapes.items()}
    tables, scheduled = {}, []
    for rid, (cached, n) in shapes.items():
        tables[rid] = [free.pop() for _ in range((cached + n + block_size - 1) // block_size)]
        for pos in range(cached):  # what earlier steps wrote
            block, off = tables[rid][pos // block_size], pos % block_size
            cache[block, off, :kv_heads] = full_k[rid][pos]
            cache[block, off, kv_heads:] = full_v[rid][pos]
        params = SamplingParams()
        scheduled.append(
            ScheduledRequest(rid, [0] * n, cached, tables[rid], True, params, 0, cached + n)
        )
    inputs = build_step_inputs(scheduled, block_size, torch.device("cpu"))
    order = sorted(shapes, key=lambda r: inputs.flat_starts[r])
    q_flat = torch.cat([q[r] for r in order])
    kv_flat = torch.cat(
        [torch.cat((full_k[r][shapes[r][0] :], full_v[r][shapes[r][0] :]), dim=1) for r in order]
    )
    if backend == "cpu":
        from poise.model.attention.cpu_kernel import load_cpu_kernel

        if load_cpu_kernel() is None:
            pytest.skip("no C++ compiler for the CPU kernel")
    impl = BACKENDS[backend].create()
    state = impl.prepare(inputs.meta)
    out = impl.forward(q_flat, kv_flat, cache, state, hd**-0.5)
    offset = 0
    for rid in order:
        cached, n = shapes[rid]
        want = dense_attention(q[rid], full_k[rid], full_v[rid], cached)
        torch.testing.assert_close(out[offset : offset + n], want, atol=1e-5, rtol=1e-5)
        offset += n
    # The new tokens were written where the slot mapping says.
    last = shapes["p1"][0] + shapes["p1"][1] - 1
    block, off = tables["p1"][last // block_size], last % block_size
    assert torch.equal(key_view(cache)[block, off], full_k["p1"][last])
    assert torch.equal(value_view(cache)[block, off], full_v["p1"][last])


def test_decode_groups_bound_padding_to_twice_the_need() -> None:
    import numpy as np

    from poise.runner.inputs import decode_groups

    # A row needing at most half the group's blocks starts a new group.
    assert decode_groups(np.array([200, 180, 101, 100, 3, 2, 1])) == [
        (0, 3, 200),
        (3, 4, 100),
        (4, 6, 3),
        (6, 7, 1),
    ]
    assert decode_groups(np.array([5, 5, 5])) == [(0, 3, 5)]
    assert decode_groups(np.array([], dtype=np.int64)) == []


def test_chunks_say_which_queries_are_generated_tokens() -> None:
    """A chunk's tokens past the prompt (a verify's, a recompute's) are marked for the
    backends that attend generated tokens as decodes (cpu.py); a prompt tail is not."""
    from poise.core.outputs import ScheduledRequest
    from poise.core.sampling_params import SamplingParams
    from poise.runner.inputs import build_step_inputs

    def chunk(rid: str, start: int, n: int) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=rid,
            token_ids=[1] * n,
            start_position=start,
            block_ids=list(range(8)),
            sample=True,
            sampling_params=SamplingParams(temperature=0.0),
            output_index=0,
            num_prompt_tokens=50,
        )

    scheduled = [chunk("tail", 40, 10), chunk("verify", 60, 4), chunk("recompute", 0, 70)]
    meta = build_step_inputs(scheduled, 16, torch.device("cpu")).meta
    assert [c.num_generated for c in meta.prefills] == [0, 4, 20]
