"""Shared-prefix (cascade) decode attention in the C++ kernel (cpu_decode_cascade.h): on
random block tables with 1 to 8 groups of rows that begin with the same blocks, the kernel's
output with cascade is bit-identical to per-row attention (the same kernel, cascade off: groups
share whole partitions, so a row's sums are the same), within float32 / bf16 rounding of a
float64 reference, and the groups it forms are the ones built. Where the CPU has AMX, bf16 rows
at head_dim 64 / 128 run on tiles (cpu_decode_amx.h); the vector path is checked there too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from poise.model.attention import AttentionMetadata, CpuPagedAttentionBackend
from poise.model.attention.cpu_kernel import load_cpu_kernel, use_decode_amx, use_decode_cascade

pytestmark = pytest.mark.skipif(load_cpu_kernel() is None, reason="no C++ compiler")

BLOCK = 16
NUM_BLOCKS = 1700  # the most 8 groups and 3 lone rows of _tables can use: 8 * 143 + 3 * 38
PART = CpuPagedAttentionBackend.PARTITION_SIZE  # groups share whole partitions of keys


@pytest.fixture(autouse=True)
def _restore_cascade() -> Iterator[None]:
    yield
    use_decode_cascade(True)
    use_decode_amx(True)


def _tables(
    num_groups: int, gen: torch.Generator, short_rows: bool = True
) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Rows' block tables, contexts and the keys each shares with its group (0: alone).

    Groups of 2-5 rows share a prefix of 8-48 blocks (0-3 whole partitions of 256 keys); then
    each row has 0-300 keys of its own blocks. With ``short_rows`` some rows end inside the
    shared prefix (their group then shares at most what its shortest row sees; the kernel may
    rather leave that row alone), and a few rows share nothing.
    """
    perm = iter(torch.randperm(NUM_BLOCKS, generator=gen).tolist())

    def fresh(n: int) -> list[int]:
        return [next(perm) for _ in range(n)]

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    tables, contexts, shared = [], [], []
    for _ in range(num_groups):
        prefix = fresh(rand(8, 48))
        size = rand(2, 5)
        ctxs = [len(prefix) * BLOCK + rand(0, 300) for _ in range(size)]
        if short_rows and rand(0, 3) == 0:  # one row stops inside the prefix, at any key
            ctxs[0] = rand(BLOCK, len(prefix) * BLOCK)
        group_shared = min(min(ctxs), len(prefix) * BLOCK) // PART * PART
        for c in ctxs:
            own = -(-c // BLOCK) - len(prefix)
            tables.append(torch.tensor(prefix[: -(-c // BLOCK)] + fresh(max(own, 0))))
            contexts.append(c)
            shared.append(group_shared)
    for _ in range(rand(0, 3)):  # rows alone
        c = rand(1, 600)
        tables.append(torch.tensor(fresh(-(-c // BLOCK))))
        contexts.append(c)
        shared.append(0)
    order = torch.randperm(len(tables), generator=gen).tolist()  # groups interleaved
    return [tables[i] for i in order], [contexts[i] for i in order], [shared[i] for i in order]


def _reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: list[torch.Tensor],
    contexts: list[int],
    block: int = BLOCK,
) -> torch.Tensor:
    """Per row, in float64: softmax(q K^T * scale) V over its visible keys (GQA: repeat_kv)."""
    heads, hd = q.shape[1], q.shape[2]
    kv_heads = cache.shape[2] // 2
    flat = cache.double().reshape(-1, 2 * kv_heads, hd)
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, (t, c) in enumerate(zip(tables, contexts, strict=True)):
        pos = torch.arange(c)
        kv = flat[t[pos // block] * block + pos % block]  # [c, 2Hkv, hd]
        k = kv[:, :kv_heads].repeat_interleave(heads // kv_heads, dim=1)
        v = kv[:, kv_heads:].repeat_interleave(heads // kv_heads, dim=1)
        w = torch.softmax(torch.einsum("hd,khd->hk", q[r].double(), k) * hd**-0.5, dim=-1)
        out[r] = torch.einsum("hk,khd->hd", w, v)
    return out


def _attend(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: list[torch.Tensor],
    contexts: list[int],
    cascade: bool,
    block: int = BLOCK,
) -> torch.Tensor:
    rows = len(tables)
    table = torch.zeros(rows, max(len(t) for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    ctx = torch.tensor(contexts)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),  # no K/V written: the cache is given
        block_size=block,
        num_decodes=rows,
        decode_block_tables=table,
        decode_context_lens=ctx,
    )
    backend = CpuPagedAttentionBackend()
    backend.cascade = cascade
    state = backend.prepare(meta)
    assert state.rows is not None
    out = q.new_empty(q.shape)
    backend._attend_rows(q, cache, state.rows, q.shape[2] ** -0.5, out)
    return out


def _groups(tables: list[torch.Tensor], contexts: list[int]) -> tuple[int, list[int]]:
    lib = load_cpu_kernel()
    assert lib is not None
    table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    ctx = torch.tensor(contexts, dtype=torch.int64)
    shared = torch.zeros(len(tables), dtype=torch.int64)
    row_table = torch.arange(len(tables))  # alive through the call
    n = lib.poise_decode_groups(
        table.data_ptr(),
        table.stride(0),
        row_table.data_ptr(),
        ctx.data_ptr(),
        len(tables),
        BLOCK,
        PART,
        shared.data_ptr(),
    )
    return int(n), shared.tolist()


@pytest.mark.parametrize("num_groups", range(1, 9))
def test_groups_found_are_the_built_ones(num_groups: int) -> None:
    gen = torch.Generator().manual_seed(num_groups)
    tables, contexts, shared = _tables(num_groups, gen, short_rows=False)
    n, got = _groups(tables, contexts)
    # The groups sharing at least one partition (a group's rows begin with its own blocks).
    assert n == len({int(t[0]) for t, s in zip(tables, shared, strict=True) if s})
    assert got == shared


def test_nested_prefixes_keep_the_long_group() -> None:
    """8 rows share 210 blocks; 24 more share only the first block with them (a chat
    template's): one group of the 8 at 210 blocks beats one of all 32 at one block."""
    head, long = [7], list(range(100, 309))
    tables = [torch.tensor(head + long + [1000 + i]) for i in range(8)]
    tables += [torch.tensor(head + [2000 + 4 * i, 2001 + 4 * i]) for i in range(24)]
    contexts = [211 * BLOCK + 5] * 8 + [3 * BLOCK - 2] * 24
    n, shared = _groups(tables, contexts)
    assert n == 1
    assert shared == [210 * BLOCK // PART * PART] * 8 + [0] * 24


_SHAPES = [(9, 3, 64), (8, 8, 64), (28, 4, 128), (6, 2, 24)]  # GQA, MHA, hd 128, generic
_DTYPES = [torch.float32, torch.bfloat16]
# Default: each shape and dtype once, 1 to 8 groups among them; slow: every combination.
_FAST = [
    (1 + (3 * i + j) % 8, *shape, dt)
    for i, shape in enumerate(_SHAPES)
    for j, dt in enumerate(_DTYPES)
]
_CASES = [
    (g, *shape, dt)
    if (g, *shape, dt) in _FAST
    else pytest.param(g, *shape, dt, marks=pytest.mark.slow)
    for g in range(1, 9)
    for shape in _SHAPES
    for dt in _DTYPES
]


@pytest.mark.parametrize(("num_groups", "heads", "kv_heads", "head_dim", "dtype"), _CASES)
def test_cascade_equals_per_row_attention(
    num_groups: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(100 * num_groups + heads)
    tables, contexts, _ = _tables(num_groups, gen)
    cache = torch.randn(NUM_BLOCKS, BLOCK, 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(tables), heads, head_dim, generator=gen).to(dtype)
    want = _reference(q, cache, tables, contexts)
    cascade = _attend(q, cache, tables, contexts, cascade=True)
    per_row = _attend(q, cache, tables, contexts, cascade=False)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(cascade.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(per_row.double(), want, atol=tol, rtol=tol)
    # Against per-row: the same bits (the same partitions, summed and merged in the same order).
    assert torch.equal(cascade, per_row)


def test_backend_flag_reaches_the_kernel() -> None:
    assert CpuPagedAttentionBackend().cascade is True  # on unless --disable-cascade-attn
    tables, contexts, _ = _tables(2, torch.Generator().manual_seed(5))
    cache = torch.zeros(NUM_BLOCKS, BLOCK, 2, 8)
    q = torch.zeros(len(tables), 1, 8)
    for cascade in (False, True):
        _attend(q, cache, tables, contexts, cascade)
        assert use_decode_cascade() is cascade


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (28, 4, 128)])
def test_bf16_on_vectors_and_on_tiles(heads: int, kv_heads: int, head_dim: int) -> None:
    """The same tables through both bf16 paths: each within bf16 rounding of the reference, each
    bit-identical with cascade on and off (a group of 5 rows at 7 query heads per kv head is
    three sets of up to 16 queries on tiles). Where the CPU has no AMX both runs take the
    vectors."""
    gen = torch.Generator().manual_seed(7 + heads)
    tables, contexts, _ = _tables(4, gen)
    cache = torch.randn(NUM_BLOCKS, BLOCK, 2 * kv_heads, head_dim, generator=gen).bfloat16()
    q = torch.randn(len(tables), heads, head_dim, generator=gen).bfloat16()
    want = _reference(q, cache, tables, contexts)
    outs = {}
    for amx in (False, True):
        use_decode_amx(amx)
        cascade = _attend(q, cache, tables, contexts, cascade=True)
        per_row = _attend(q, cache, tables, contexts, cascade=False)
        torch.testing.assert_close(cascade.double(), want, atol=1e-2, rtol=1e-2)
        assert torch.equal(cascade, per_row)
        outs[amx] = cascade
    if use_decode_amx():  # the tiles ran: another order of sums, the same values within rounding
        torch.testing.assert_close(outs[True], outs[False], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("block", [8, 32])
def test_bf16_other_block_sizes(block: int) -> None:
    """Blocks of 32 keys (two 16-key tile runs each) on tiles, blocks of 8 on the vectors (a tile
    run would cross blocks): each within bf16 rounding of the reference, cascade on and off the
    same bits. Rows of 1-700 keys, three sharing their first 40 blocks."""
    gen = torch.Generator().manual_seed(block)
    perm = iter(torch.randperm(NUM_BLOCKS, generator=gen).tolist())
    shared = [next(perm) for _ in range(40)]
    contexts = [40 * block + 17, 40 * block + 90, 40 * block + 3, 1, 255, 700]
    tables = []
    for i, c in enumerate(contexts):
        need = -(-c // block)
        head = shared[:need] if i < 3 else []
        tables.append(torch.tensor(head + [next(perm) for _ in range(need - len(head))]))
    cache = torch.randn(NUM_BLOCKS, block, 6, 64, generator=gen).bfloat16()
    q = torch.randn(len(tables), 9, 64, generator=gen).bfloat16()
    want = _reference(q, cache, tables, contexts, block)
    cascade = _attend(q, cache, tables, contexts, True, block)
    torch.testing.assert_close(cascade.double(), want, atol=1e-2, rtol=1e-2)
    assert torch.equal(cascade, _attend(q, cache, tables, contexts, False, block))
