"""Reference paged attention in plain torch: runs on CPU (and on GPU, slowly but correctly).

Everything goes through the SDPA paths of common.py: all decode rows in one batched call per
length group (K/V gathered through padded block tables, padding masked out), one call per
prefill chunk (fresh chunks ``is_causal``; chunks after cached tokens read their context back
with an offset-causal mask). The masks are built once per step in ``prepare``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poise.model.attention.common import (
    SdpaPrefill,
    decode_attention,
    decode_mask,
    prefill_attention,
    sdpa_prefills,
    write_kv,
)
from poise.model.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class TorchAttentionState:
    meta: AttentionMetadata
    # [D, 1, 1, L] visible-key mask of the decode rows; None when the step has no decodes.
    decode_mask: torch.Tensor | None
    # Every prefill chunk of the step, in meta.prefills order, with its mask.
    prefills: tuple[SdpaPrefill, ...]


class TorchAttentionBackend:
    name = "torch"
    # A decode-only ``prepare`` is tensor work on its inputs only (no host reads), so a decode
    # step can be captured into a graph (runner/graphs.py).
    decode_capturable = True

    def prepare(self, meta: AttentionMetadata) -> TorchAttentionState:
        return TorchAttentionState(
            meta=meta,
            decode_mask=decode_mask(meta),
            prefills=sdpa_prefills(meta.prefills, meta.slot_mapping.device),
        )

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        state: TorchAttentionState,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, hd], kv [T, 2Hkv, hd] -> out [T, H, hd]."""
        meta = state.meta
        write_kv(kv, kv_cache, meta.slot_mapping)
        mask = state.decode_mask
        if not state.prefills:  # pure decode step: no output buffer to assemble
            assert mask is not None
            return decode_attention(q, kv_cache, meta, mask, scale)
        out = q.new_empty(q.shape)
        if mask is not None:
            d = meta.num_decodes
            out[:d] = decode_attention(q[:d], kv_cache, meta, mask, scale)
        for prefill in state.prefills:
            prefill_attention(prefill, q, kv, kv_cache, scale, out)
        return out
