"""Plain functions every backend may reuse: the cache layout, the K/V write, and SDPA paths.

Cache layout, per layer: ``kv_cache [num_blocks, block_size, 2 * Hkv, hd]``: for each token
slot, its K heads then its V heads. Why K and V share one tensor: a step then needs ONE
scatter (this step's k/v are already adjacent in the fused qkv output) and ONE gather per
layer instead of two, and gathers move whole blocks with ``index_select`` (contiguous rows
of block_size * 2Hkv * hd values), ~5x faster on CPU than advanced indexing. ``key_view`` /
``value_view`` give the familiar [num_blocks, block_size, Hkv, hd] views for other backends.

SDPA paths (used by the torch backend; the cpu backend has its own kernels for both):

- Decode: rows sharing one padded width in ONE batched SDPA call. Their K/V are gathered
  through the padded block tables into [D, L, 2Hkv, hd] and positions >= context_len are
  masked out, so no Python loop over requests runs per layer.
- Prefill: one SDPA call per chunk. A chunk at offset 0 attends to its own fresh k/v with
  ``is_causal``; a later chunk (chunked prefill, a prefix-cache hit, or recompute after
  preemption) reads its request's whole context back from the cache with an offset-causal
  mask::

      query i (position start+i) sees keys j <= start + i      (j in 0 .. start+n-1)

GQA: the H query heads are viewed as [Hkv, G] so each group shares its kv head, matching
transformers' ``repeat_kv`` order (query head h uses kv head h // G).

Masks depend only on the step, not on the layer: backends build them in ``prepare`` (once per
step) with ``decode_mask`` / ``sdpa_prefills`` and keep them in their state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from poise.model.attention.kv_int8 import dequantize_rows, is_int8_cache, write_kv_int8
from poise.model.attention.metadata import AttentionMetadata, PrefillChunk


def key_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """[N, bs, 2Hkv, hd] -> the K half [N, bs, Hkv, hd] (a strided view)."""
    return kv_cache[:, :, : kv_cache.shape[2] // 2]


def value_view(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache[:, :, kv_cache.shape[2] // 2 :]


# KV cache dtypes stored narrower than the model's (--kv-cache-dtype): plain casts, no scale
# (vLLM's default scale of 1.0). torch has no CPU index_copy_ / index_select for float8, so
# these move through a uint8 view of the same bytes.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def write_kv(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter kv [T, 2Hkv, hd] (k heads then v heads) into kv_cache at flat slots [T]
    (quantized, into an int8 cache: kv_int8.py)."""
    if is_int8_cache(kv_cache):
        write_kv_int8(kv, kv_cache, slot_mapping)
        return
    if kv_cache.dtype in FP8_DTYPES:
        raw = kv.to(kv_cache.dtype).view(torch.uint8)
        kv_cache.view(torch.uint8).view(-1, kv.shape[1], kv.shape[2]).index_copy_(
            0, slot_mapping, raw
        )
        return
    kv_cache.view(-1, kv.shape[1], kv.shape[2]).index_copy_(0, slot_mapping, kv)


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Blocks [*idx] of kv_cache -> [*idx, bs, 2Hkv, hd], one contiguous row per block (in
    ``dtype`` when given: an fp8 cache is widened back to the model's dtype, an int8 one
    dequantized to it, [*idx, bs, 2Hkv, hd] without its scale bytes)."""
    if is_int8_cache(kv_cache):
        raw = kv_cache.view(kv_cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
        raw = raw.view(*block_ids.shape, *kv_cache.shape[1:])
        return dequantize_rows(raw, dtype or torch.float32)
    cache = kv_cache.view(torch.uint8) if kv_cache.dtype in FP8_DTYPES else kv_cache
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    rows = rows.view(kv_cache.dtype) if cache is not kv_cache else rows
    if dtype is not None and rows.dtype != dtype:
        rows = rows.to(dtype)
    return rows.view(*block_ids.shape, *kv_cache.shape[1:])


# ---- decode -------------------------------------------------------------------------------


def decode_mask(meta: AttentionMetadata) -> torch.Tensor | None:
    """[D, 1, 1, L] bool, True where a decode row's key is visible; None without decodes.

    L = the padded table width in tokens; broadcast over heads and the (one) query.
    """
    if not meta.num_decodes:
        return None
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    width = meta.decode_block_tables.shape[1] * meta.block_size
    cols = torch.arange(width, device=meta.decode_context_lens.device)
    return (cols[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode rows q [D, H, hd] -> [D, H, hd], one SDPA call per ``meta.decode_groups`` run."""
    tables = meta.decode_block_tables
    assert tables is not None
    groups = meta.decode_groups
    if len(groups) <= 1:
        return _decode_rows(q, kv_cache, tables, mask, scale)
    out = q.new_empty(q.shape)
    for start, end, num_blocks in groups:
        out[start:end] = _decode_rows(
            q[start:end],
            kv_cache,
            tables[start:end, :num_blocks],
            mask[start:end, ..., : num_blocks * meta.block_size],
            scale,
        )
    return out


def _decode_rows(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention for rows sharing one padded width: q [D, H, hd] -> [D, H, hd]."""
    d, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2] // 2
    # [D, B] blocks -> [D, B, bs, 2Hkv, hd] -> [D, L, 2Hkv, hd]
    ctx = gather_blocks(kv_cache, tables, q.dtype).flatten(1, 2)
    # The padded tail still holds what the blocks' previous owners wrote. The mask gives it
    # weight 0, but 0 * NaN is NaN: a request that failed with non-finite values (an fp16
    # overflow) left NaN keys and values in the blocks it freed, and every later request
    # decoding over them failed too (issue 38). The gathered copy is ours to zero.
    ctx.masked_fill_(~mask[:, 0, 0, :, None, None], 0.0)
    keys = ctx[:, :, :num_kv_heads].transpose(1, 2)  # [D, Hkv, L, hd]
    values = ctx[:, :, num_kv_heads:].transpose(1, 2)  # [D, Hkv, L, hd]
    # [D, H, hd] -> [D, Hkv, G, hd]: the G query heads of a group act as G "queries".
    qg = q.reshape(d, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(d, num_heads, head_dim)  # [D, Hkv, G, hd] -> [D, H, hd]


# ---- prefill ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SdpaPrefill:
    """A prefill chunk attended with SDPA, with its mask built once for the step."""

    chunk: PrefillChunk
    # [n, context_len] bool offset-causal mask (True = visible); None for a chunk at position
    # 0, which attends to its own fresh k/v with ``is_causal`` and reads nothing back.
    mask: torch.Tensor | None


def sdpa_prefills(chunks: Iterable[PrefillChunk], device: torch.device) -> tuple[SdpaPrefill, ...]:
    """The chunks with their masks (see the module docstring for the offset-causal rule)."""
    out = []
    for chunk in chunks:
        mask = None
        if chunk.start_position > 0:
            q_pos = torch.arange(chunk.query_len, device=device) + chunk.start_position
            k_pos = torch.arange(chunk.context_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
        out.append(SdpaPrefill(chunk, mask))
    return tuple(out)


def prefill_attention(
    prefill: SdpaPrefill,
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attend one chunk: reads flat q [T, H, hd] / kv [T, 2Hkv, hd], writes its rows of out."""
    chunk = prefill.chunk
    s, e = chunk.query_start, chunk.query_start + chunk.query_len
    num_kv_heads = kv.shape[1] // 2
    qt = q[s:e].transpose(0, 1).unsqueeze(0)  # [n, H, hd] -> [1, H, n, hd]
    if prefill.mask is None and not is_int8_cache(kv_cache):
        ctx, causal = kv[s:e], True  # [n, 2Hkv, hd]: its own fresh k/v
    else:
        # (an int8 cache: the chunk reads its own k/v back quantized too, as the cpu kernel
        # does and as every later step will)
        # [nb, bs, 2Hkv, hd] -> [nb*bs, 2Hkv, hd] -> [ctx, 2Hkv, hd]
        ctx = gather_blocks(kv_cache, chunk.block_table, q.dtype).flatten(0, 1)
        ctx = ctx[: chunk.context_len]
        causal = prefill.mask is None
    kt = ctx[:, :num_kv_heads].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, hd]
    vt = ctx[:, num_kv_heads:].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, hd]
    o = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=prefill.mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    out[s:e] = o.squeeze(0).transpose(0, 1)  # [1, H, n, hd] -> [n, H, hd]
