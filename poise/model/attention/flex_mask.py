"""The FlexAttention backend's per-step tables: which cache slots each flat query may see.

FlexAttention (``torch.nn.attention.flex_attention``) attends ONE query sequence to ONE key
sequence through a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and a block-sparse ``BlockMask``
saying which key blocks each query block reads at all. Here (as in vLLM's FlexAttention
backend) the query sequence is the step's flat batch, padded to a bucket, and the key
sequence is the WHOLE paged cache of the layer viewed as ``num_blocks * block_size`` slots in
physical order: no K/V is gathered or copied; the tables below map a physical slot back to a
request's logical position.

Tables (all shapes fixed by the bucket, so a compiled kernel is reused across steps):

- ``q_row [Tp]``: the request row of each flat query (decodes 0..D-1, then one per chunk);
  padded queries use row 0 with ``q_pos = -1``, which sees nothing;
- ``q_pos [Tp]``: each query's position (decode: context_len - 1; chunk: start + i);
- ``tables [Tp, Wp]``: each row's block table, -1 past its last used block (the metadata pads
  decode tables with block 0, which another request may own: -1 never matches a block);
- ``block_logical [num_blocks]``: the logical index of each physical block in the tables that
  hold it (-1: no request of this step). A block shared through the prefix cache sits at the
  same logical index in every table that holds it (its hash chains from the first token), and
  ``prepare`` checks that.

A query at (row r, position p) sees slot s = b * block_size + o iff ``tables[r,
block_logical[b]] == b`` (r holds b) and ``block_logical[b] * block_size + o <= p`` (causal),
and, with a sliding window W, ``p - (that position) < W`` (transformers' rule: the last W
keys, itself included).

The block mask lists, per block of ``q_block`` queries (16 on CPU, 128 on CUDA: see
flex.py), the key blocks (``kv_block`` slots,
a multiple of the cache block size) any of its queries needs: the blocks of their requests up
to their positions. Decode rows of different requests share a query block, so each reads the
union of their blocks and the mask_mod discards the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poise.model.attention.metadata import AttentionMetadata

# Queries per block of the block mask on CPU; also the smallest query bucket there.
Q_BLOCK = 16
# Smallest width bucket of the request block tables.
MIN_TABLE_WIDTH = 16


# Each bucket is this many times the one before: few distinct shapes, so few compiles. Why
# coarse: a padded query (position -1) reads no key block, so the kernel skips it, and a
# wider table only makes its lookups land in a larger array.
BUCKET_GROWTH = 4


def bucket(n: int, floor: int) -> int:
    """The smallest floor * 4^k >= n."""
    size = floor
    while size < n:
        size *= BUCKET_GROWTH
    return size


@dataclass(frozen=True)
class FlexTables:
    """The step's tables (module docstring), padded to ``padded_tokens`` queries."""

    num_tokens: int
    padded_tokens: int
    q_row: torch.Tensor  # [Tp] int64
    q_pos: torch.Tensor  # [Tp] int64
    tables: torch.Tensor  # [Tp, Wp] int64
    block_logical: torch.Tensor  # [num_blocks] int64
    # Per query block: how many key blocks it reads, and which ([1, 1, nqb] / [1, 1, nqb, K]).
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor


def _fill_rows(
    meta: AttentionMetadata, tables: torch.Tensor, q_row: torch.Tensor, q_pos: torch.Tensor
) -> None:
    """Each request row's used blocks (the rest stay -1) and each query's row and position.

    The decode part is tensor work only (no host read), so a decode-only step's tables can be
    built inside a captured graph (runner/graphs.py)."""
    device = tables.device
    d = meta.num_decodes
    if d:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        dt, ctx = meta.decode_block_tables, meta.decode_context_lens
        used = torch.arange(dt.shape[1], device=device)[None, :] * meta.block_size < ctx[:, None]
        tables[:d, : dt.shape[1]] = torch.where(used, dt, -1)
        q_row[:d] = torch.arange(d, device=device)
        q_pos[:d] = ctx - 1
    for k, chunk in enumerate(meta.prefills):
        tables[d + k, : chunk.block_table.shape[0]] = chunk.block_table
        s, n = chunk.query_start, chunk.query_len
        q_row[s : s + n] = d + k
        q_pos[s : s + n] = torch.arange(n, device=device) + chunk.start_position


def _table_width(meta: AttentionMetadata) -> int:
    widths = [c.block_table.shape[0] for c in meta.prefills]
    if meta.decode_block_tables is not None:
        widths.append(meta.decode_block_tables.shape[1])
    return bucket(max(widths, default=1), MIN_TABLE_WIDTH)


def build_tables(
    meta: AttentionMetadata,
    num_blocks: int,
    kv_block: int,
    window: int | None,
    check: bool = True,
    q_block: int = Q_BLOCK,
) -> FlexTables:
    """The step's tables for a cache of ``num_blocks`` blocks (see the module docstring).

    No host read and no data-dependent shape (scatters go to a sink index past the end,
    dropped after), so the decode-only case can be captured; ``check`` (one host read) tests
    that no block sits at two logical indexes."""
    device = meta.slot_mapping.device
    bs = meta.block_size
    t = meta.num_tokens
    tp = bucket(t, q_block)
    width = _table_width(meta)
    tables = torch.full((tp, width), -1, dtype=torch.int64, device=device)
    q_row = torch.zeros(tp, dtype=torch.int64, device=device)
    q_pos = torch.full((tp,), -1, dtype=torch.int64, device=device)
    _fill_rows(meta, tables, q_row, q_pos)

    held = tables >= 0
    columns = torch.arange(width, device=device).expand(tp, width)
    sink = torch.where(held, tables, num_blocks)  # unheld entries land on index num_blocks
    block_logical = torch.full((num_blocks + 1,), -1, dtype=torch.int64, device=device)
    block_logical.scatter_(0, sink.flatten(), columns.flatten())
    block_logical = block_logical[:num_blocks]
    if check:
        seen = block_logical[tables.clamp(min=0)]
        if bool((held & (seen != columns)).any()):
            raise ValueError("flex attention: a KV block sits at two logical indexes in one step")

    # Key blocks each query block reads: its queries' blocks at logical index <= position
    # (and not wholly before the window).
    tok_tables = tables[q_row[:t]]  # [T, Wp]
    pos = q_pos[:t, None]
    need = (tok_tables >= 0) & (columns[:t] * bs <= pos)
    if window is not None:
        need &= (columns[:t] + 1) * bs - 1 > pos - window
    num_kv = -(-num_blocks * bs // kv_block)
    qblock = (torch.arange(t, device=device) // q_block)[:, None]
    # Flat index into [nqb, num_kv + 1]; column num_kv is the sink of entries not needed.
    flat = qblock * (num_kv + 1) + torch.where(need, tok_tables * bs // kv_block, num_kv)
    dense = torch.zeros((tp // q_block) * (num_kv + 1), dtype=torch.bool, device=device)
    dense.index_fill_(0, flat.flatten(), True)
    dense = dense.view(tp // q_block, num_kv + 1)[:, :num_kv]
    kv_num_blocks = dense.sum(-1, dtype=torch.int32)
    # Listed blocks first (stable: ascending physical order within them).
    kv_indices = dense.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    return FlexTables(
        num_tokens=t,
        padded_tokens=tp,
        q_row=q_row,
        q_pos=q_pos,
        tables=tables,
        block_logical=block_logical,
        kv_num_blocks=kv_num_blocks[None, None],
        kv_indices=kv_indices.to(torch.int32)[None, None],
    )
