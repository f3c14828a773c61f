"""Rotary position embeddings (HF "rotate_half" convention), incl. linear and llama3 scaling.

The cos/sin tables are computed once in float32 exactly as transformers computes them
(``position * inv_freq``), then cast to the model dtype, so fp32 results match bit for bit.
They are indexed by the flat ``positions`` tensor of each step, so prefill chunks and decode
tokens of many requests are rotated in one call.
"""

from __future__ import annotations

import math

import torch

from poise.checkpoint.arch import RopeConfig
from poise.model import elementwise


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds full-width tables [max_positions, head_dim] in the model dtype.

    ``cos`` is cat(cos, cos); ``sin`` is cat(-sin, sin), the sign of rotate_half folded in,
    so a rotation is ``x * cos + swap_halves(x) * sin``: 4 kernels instead of 7, and the
    same products as transformers' ``x * cos + rotate_half(x) * sin`` (negation is exact).
    """

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq = inv_frequencies(rope, head_dim)
        pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, hd/2]
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype=dtype, device=device)  # [P, hd]
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype=dtype, device=device)  # [P, hd]
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a flat step: [T, 1, hd] each (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate x [T, heads, hd] by tables [T, 1, hd] (see RotaryEmbedding); writes into
    ``out`` when given (it may alias x: both products are taken before the write). bf16 on
    CPU: one pass of the fused kernel (model/elementwise.py), the same roundings."""
    if out is not None and elementwise.rope_applies(out, cos, sin) and out.shape == x.shape:
        if out.data_ptr() != x.data_ptr() or out.stride() != x.stride():
            out.copy_(x)
        elementwise.rope(out, cos, sin)
        return out
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1]
    return torch.add(x * cos, swapped * sin, out=out)  # [x1 c - x2 s, x2 c + x1 s]
