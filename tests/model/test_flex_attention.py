"""The flex backend's own cases beyond the shared backend tests (test_attention.py): sliding
windows, blocks shared through the prefix cache, the bucketed shapes."""

from __future__ import annotations

import pytest
import torch

from poise.core.outputs import ScheduledRequest
from poise.core.sampling_params import SamplingParams
from poise.model.attention import FlexAttentionBackend
from poise.model.attention.flex_mask import bucket, build_tables
from poise.runner.inputs import build_step_inputs

BS, HKV, H, HD = 4, 2, 4, 8


def windowed_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None
) -> torch.Tensor:
    """q [n, H, hd] at positions start.. over k/v [start+n, Hkv, hd]; keys j with
    p - window < j <= p (transformers' sliding window), or all j <= p."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    qpos = torch.arange(q.shape[0])[:, None] + start
    kpos = torch.arange(k.shape[0])[None, :]
    hidden = kpos > qpos
    if window is not None:
        hidden |= qpos - kpos >= window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def _step(tables: dict[str, list[int]], shapes: dict[str, tuple[int, int]], seed: int) -> tuple:
    """A step over a random cache holding each request's earlier tokens; returns what the
    backend takes and the per-request dense inputs."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(32, BS, 2 * HKV, HD, generator=gen)
    ks, vs, qs, scheduled = {}, {}, {}, []
    for rid, (cached, n) in shapes.items():
        slots = [tables[rid][p // BS] * BS + p % BS for p in range(cached + n)]
        flat = cache.view(-1, 2 * HKV, HD)
        fresh = torch.randn(n, 2 * HKV, HD, generator=gen)
        ks[rid] = torch.cat((flat[slots[:cached], :HKV], fresh[:, :HKV]))
        vs[rid] = torch.cat((flat[slots[:cached], HKV:], fresh[:, HKV:]))
        qs[rid] = torch.randn(n, H, HD, generator=gen)
        scheduled.append(
            ScheduledRequest(
                rid, [0] * n, cached, tables[rid], True, SamplingParams(), 0, cached + n
            )
        )
    inputs = build_step_inputs(scheduled, BS, torch.device("cpu"))
    order = sorted(shapes, key=lambda r: inputs.flat_starts[r])
    q = torch.cat([qs[r] for r in order])
    kv = torch.cat([torch.cat((ks[r], vs[r]), 1)[shapes[r][0] :] for r in order])
    return inputs, order, cache, q, kv, (qs, ks, vs)


@pytest.mark.parametrize("window", [None, 3, 6])
def test_sliding_window_and_shared_prefix_blocks_match_dense(window: int | None) -> None:
    # "a" and "b" share blocks 3 and 9 (a cached prefix: same logical indexes); "b" is a chunk
    # after it, "a" and "c" decode, "d" is a fresh prompt.
    tables = {"a": [3, 9, 4, 11], "b": [3, 9, 20], "c": [7, 1], "d": [15, 16]}
    shapes = {"a": (13, 1), "b": (8, 3), "c": (5, 1), "d": (0, 6)}
    inputs, order, cache, q, kv, (qs, ks, vs) = _step(tables, shapes, seed=window or 0)
    backend = FlexAttentionBackend(sliding_window=window)
    out = backend.forward(q, kv, cache, backend.prepare(inputs.meta), HD**-0.5)
    for rid in order:
        s, (cached, n) = inputs.flat_starts[rid], shapes[rid]
        want = windowed_dense(qs[rid], ks[rid], vs[rid], cached, window)
        torch.testing.assert_close(out[s : s + n], want, atol=1e-5, rtol=1e-5)


def test_tables_are_bucketed_and_a_block_at_two_logical_indexes_is_refused() -> None:
    tables = {"a": [3, 9], "b": [5, 6, 7]}
    inputs, *_ = _step(tables, {"a": (6, 1), "b": (9, 2)}, seed=1)
    t = build_tables(inputs.meta, 32, BS, None)
    assert (t.padded_tokens, tuple(t.tables.shape)) == (16, (16, 16))
    assert t.q_pos[:3].tolist() == [6, 9, 10] and set(t.q_pos[3:].tolist()) == {-1}
    assert t.block_logical[[3, 9, 5, 6, 7]].tolist() == [0, 1, 0, 1, 2]
    assert int(t.kv_num_blocks.sum()) == 5  # one block of 16 queries reading 5 cache blocks
    assert [bucket(n, 16) for n in (1, 16, 17, 300)] == [16, 16, 64, 1024]
    bad, *_ = _step({"a": [3, 9], "b": [9, 3, 7]}, {"a": (6, 1), "b": (9, 2)}, seed=2)
    with pytest.raises(ValueError, match="two logical indexes"):
        build_tables(bad.meta, 32, BS, None)


def test_decode_tables_need_no_host_read() -> None:
    """A decode-only step's tables and block mask trace with fake tensors (no value read, no
    data-dependent shape): what a CUDA graph capture needs (runner/graphs.py). The checked
    build reads a value and does not trace."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention.flex_attention import BlockMask

    from poise.model.attention.metadata import AttentionMetadata

    def tables(check: bool) -> object:
        def build(slots: torch.Tensor, rows: torch.Tensor, ctx: torch.Tensor) -> tuple:
            meta = AttentionMetadata(
                slot_mapping=slots,
                block_size=BS,
                num_decodes=3,
                decode_block_tables=rows,
                decode_context_lens=ctx,
            )
            t = build_tables(meta, 40, BS, 8, check)
            mask = BlockMask.from_kv_blocks(
                t.kv_num_blocks, t.kv_indices, BLOCK_SIZE=(16, BS), seq_lengths=(16, 40 * BS)
            )
            return t.q_pos, t.tables, t.block_logical, mask.kv_indices, mask.q_indices

        args = (
            torch.tensor([1, 2, 3]),
            torch.tensor([[1, 2], [3, 4], [5, 6]]),
            torch.tensor([5, 6, 7]),
        )
        return make_fx(build, tracing_mode="fake")(*args)

    assert tables(check=False) is not None
    with pytest.raises(Exception, match="data.dependent|DataDependent"):
        tables(check=True)
