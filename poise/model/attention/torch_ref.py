"""Reference paged attention in plain torch: runs on CPU (and on GPU, slowly but correctly).

- Decode: all decoding requests (one query each) in ONE batched SDPA call. Their K/V are
  gathered through the padded block tables into [D, L, Hkv, hd] and positions >= context_len
  are masked out, so no Python loop over requests runs per layer for decode.
- Prefill: one SDPA call per chunk. A chunk at offset 0 attends to its own fresh k/v with
  ``is_causal``; a later chunk (chunked prefill, or recompute after preemption) reads its
  request's whole context back from the cache with an offset-causal mask::

      query i (position start+i) sees keys j <= start + i      (j in 0 .. start+n-1)

GQA: the H query heads are viewed as [Hkv, G] so each group shares its kv head, matching
transformers' ``repeat_kv`` order (query head h uses kv head h // G).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from poise.model.attention.metadata import AttentionMetadata, PrefillChunk


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v [T, Hkv, hd] into caches [N, bs, Hkv, hd] at flat slots [T]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        state = meta.backend_state
        if meta.num_decodes:
            assert meta.decode_block_tables is not None
            assert meta.decode_context_lens is not None
            width = meta.decode_block_tables.shape[1] * block_size
            device = meta.decode_context_lens.device
            cols = torch.arange(width, device=device)
            # [D, 1, 1, L]: True where the key is visible (broadcast over heads and queries).
            state["decode_mask"] = (cols[None, :] < meta.decode_context_lens[:, None])[
                :, None, None, :
            ]
        for i, chunk in enumerate(meta.prefills):
            if chunk.start_position == 0:
                continue
            device = meta.slot_mapping.device
            q_pos = torch.arange(chunk.query_len, device=device) + chunk.start_position
            k_pos = torch.arange(chunk.context_len, device=device)
            state[f"prefill_mask_{i}"] = k_pos[None, :] <= q_pos[:, None]  # [n, ctx]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(q[:d], key_cache, value_cache, meta, scale)
        for i, chunk in enumerate(meta.prefills):
            s, e = chunk.query_start, chunk.query_start + chunk.query_len
            out[s:e] = self._prefill(
                i, chunk, q[s:e], k[s:e], v[s:e], key_cache, value_cache, meta, scale
            )
        return out

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        d, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        tables = meta.decode_block_tables
        assert tables is not None
        # [D, B, bs, Hkv, hd] -> [D, L, Hkv, hd] -> [D, Hkv, L, hd]
        keys = key_cache[tables].flatten(1, 2).transpose(1, 2)
        values = value_cache[tables].flatten(1, 2).transpose(1, 2)
        # [D, H, hd] -> [D, Hkv, G, hd]: the G query heads of a group act as G "queries".
        qg = q.reshape(d, num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = meta.backend_state["decode_mask"]
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return o.reshape(d, num_heads, head_dim)  # [D, Hkv, G, hd] -> [D, H, hd]

    def _prefill(
        self,
        index: int,
        chunk: PrefillChunk,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        qt = q.transpose(0, 1).unsqueeze(0)  # [n, H, hd] -> [1, H, n, hd]
        if chunk.start_position == 0:
            kt = k.transpose(0, 1).unsqueeze(0)  # [n, Hkv, hd] -> [1, Hkv, n, hd]
            vt = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            ctx = chunk.context_len
            # [nb, bs, Hkv, hd] -> [nb*bs, Hkv, hd] -> [ctx, Hkv, hd] -> [1, Hkv, ctx, hd]
            kt = key_cache[chunk.block_table].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
            vt = value_cache[chunk.block_table].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
            mask = meta.backend_state[f"prefill_mask_{index}"]
            o = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return o.squeeze(0).transpose(0, 1)  # [1, H, n, hd] -> [n, H, hd]
