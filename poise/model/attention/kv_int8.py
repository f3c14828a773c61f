"""The int8 KV cache (``--kv-cache-dtype int8``): its layout, and quantize / dequantize in torch.

Layout, per layer: ``kv_cache [num_blocks, block_size, 2 * Hkv, head_dim + 2]`` int8. Each
(token slot, head) row is the head's ``head_dim`` values as int8, then the row's scale as the
two bytes of a bfloat16: value = int8 * scale. K heads then V heads per slot, as in the
model-dtype cache (common.py), so one scatter writes a step's K/V and block tables, slots and
``shape[1]`` (block size) / ``shape[2] // 2`` (kv heads) mean what they do there.

Why a scale per (token, head), not one per (block, head): a token written into a partly filled
block then never changes what the block's earlier tokens decode to, and no scale has to be
guessed with headroom before the block's later tokens are seen (K has outlier channels whose
size moves from token to token; a block scale fixed on its first token clips them). Measured on
SmolLM2-135M (benchmarks/RESULTS.md, issue 33): per-token scales keep the teacher-forced
logprobs within ~0.01 of a bf16 cache. The cost is 2 bytes per 64 or 128: the pool holds 1.94x
(head_dim 64) or 1.97x (128) the tokens of a bf16 one.

Quantization (the same bits here and in the C++ writer, cpu_kv_write.cpp; a test checks):
``s = max|x| / 127`` rounded *up* to bf16 (so no value maps past 127), then
``q = round_half_even(x / s)`` clamped to [-127, 127]; a row of zeros keeps scale 0. A row
holding a NaN or an inf gets a non-finite scale, so whatever reads it sees a non-finite value,
as it would have in a bf16 cache (the runner then fails that request, runner/nonfinite.py).
"""

from __future__ import annotations

import torch

from poise.config import INT8_SCALE_BYTES


def int8_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, 2 * num_kv_heads, head_dim + INT8_SCALE_BYTES)


def is_int8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def int8_head_dim(kv_cache: torch.Tensor) -> int:
    return int(kv_cache.shape[-1]) - INT8_SCALE_BYTES


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., hd] (any float dtype) -> [..., hd + 2] int8: the values, then the bf16 scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    # Round the scale up to a bf16 (add just under one bf16 ulp, drop the low 16 bits): |x| /
    # scale <= 127 for every value. inf / NaN scales keep their bits' meaning.
    bits = scale.view(torch.int32)
    scale = ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe).clamp_(-127, 127)
    q = torch.where(scale > 0, q, torch.zeros_like(q)).to(torch.int8)
    scale_bytes = scale.to(torch.bfloat16).view(torch.int8)  # exact: it is a bf16 already
    return torch.cat([q, scale_bytes], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., hd + 2] int8 -> [..., hd] of ``dtype``: int8 * scale, the product exact in
    float32 (8 x 8 significant bits) and rounded once to ``dtype``, as the kernels do."""
    hd = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., hd:].contiguous().view(torch.bfloat16).float()
    return (rows[..., :hd].float() * scale).to(dtype)


def write_kv_int8(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize kv [T, 2Hkv, hd] and scatter it into the int8 cache at flat slots [T]."""
    rows = quantize_rows(kv)
    kv_cache.view(-1, kv_cache.shape[2], kv_cache.shape[3]).index_copy_(0, slot_mapping, rows)


def scrub_nonfinite_int8(rows: torch.Tensor) -> torch.Tensor:
    """Blocks of an int8 cache with every row whose scale is not finite zeroed (its values and
    its scale): the int8 counterpart of ``nan_to_num`` on a float cache (runner/model_runner.py)."""
    hd = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., hd:].contiguous().view(torch.bfloat16)
    return rows.masked_fill(~torch.isfinite(scale), 0)
