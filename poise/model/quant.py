"""Weight-only quantized linear layers (``--quantization int8 | int4``).

The decoder layers' projections (qkv_proj, o_proj, gate_up_proj, down_proj) are built as one
of these instead of ``Linear``. Loading stays name-for-name: the weight arrives as a float
tensor under its usual name (``...qkv_proj.weight``, or one shard of it) and ``load_rows``
quantizes those output rows in place. Every scheme here is per output row, so a shard (q, k or
v of a fused qkv_proj) quantizes alone, exactly as the whole matrix would. ``finalize``, once
every row is in, packs the weights for the kernel that will run them.

- int8: symmetric per output channel, ``w ~= q * scale``, q in [-127, 127], scale =
  max|row| / 127.
- int4: groups of ``INT4_GROUP`` = 32 inputs (a GGUF block), asymmetric: ``w ~= q * d + m``,
  q in [0, 15], m = group min, d = (max - min) / 15. A GGUF Q4_1 block is stored as exactly
  that (Q4_0 as d * (q - 8)), and its min and max are the values of q = 0 and 15, so the GGUF's
  4-bit weights come back as they were stored.

Kernels: in bfloat16 on CPUs with AVX512-BF16 and VNNI, ours (linear_kernel.py,
cpu_linear.cpp: weights read once at decode, AMX tiles for more rows). Elsewhere torch's:
``_weight_int8pack_mm`` (scales in the model dtype), ``_weight_int4pack_mm_for_cpu`` (its
zero = m + 8 d; the nibbles packed in tiles of 16 rows).

Embeddings stay in the model dtype. Both quantize the lm_head to int8 (a tied one gets an
int8 copy of the embedding: llama.py); int4 keeps it at 8 bits, as GGUF's Q4 models do.
"""

from __future__ import annotations

import torch
from torch import nn

from poise.model import linear_kernel as lk

INT4_GROUP = 32
# torch's int4 CPU packing works on tiles of 16 output rows.
_INT4_ROW_TILE = 16


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scale [N]), w ~= q * scale per row."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (uint8 q in [0, 15] [N, K], scale d [N, G], min m [N, G]) over groups of
    INT4_GROUP inputs, w ~= q * d + m."""
    n, k = w.shape
    groups = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = (high - low) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: q = 0
    q = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, low


class QuantLinear(nn.Module):
    """A linear layer whose weight is quantized as its rows are loaded."""

    weight: nn.Parameter  # the quantized values; its HF name is the float weight's

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def load_rows(self, start: int, w: torch.Tensor) -> None:
        """Quantize float rows ``w`` [rows, in_features] into rows start.. of the weight."""
        raise NotImplementedError

    def finalize(self) -> None:
        """Called once every row is loaded."""


def _ours(layer: QuantLinear, fmt: str, dtype: torch.dtype) -> bool:
    """Whether our kernel runs this layer (bf16 on CPU, a shape it packs)."""
    return (
        dtype == torch.bfloat16
        and layer.weight.device.type == "cpu"
        and lk.fits(fmt, layer.out_features, layer.in_features)
    )


class Int8Linear(QuantLinear):
    scales: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        # In the model dtype (torch's kernel's requirement), like the bias; ours takes the
        # same rounded values in float32.
        self.register_buffer("scales", torch.empty(out_features))
        self.kernel: lk.PackedWeight | None = None  # set by finalize when ours runs it

    def load_rows(self, start: int, w: torch.Tensor) -> None:
        q, scale = quantize_int8(w)
        self.weight.narrow(0, start, q.shape[0]).copy_(q)
        self.scales.narrow(0, start, q.shape[0]).copy_(scale)

    def finalize(self) -> None:
        if self.kernel is not None:
            return
        if _ours(self, "int8", self.scales.dtype):
            self.kernel = lk.pack_int8(self.weight.data, self.scales)
            self.weight = nn.Parameter(self.kernel.packed, requires_grad=False)
            return
        # torch 2.13's bf16/fp16 _weight_int8pack_mm returns garbage unless K % 16 == 0.
        if self.scales.dtype != torch.float32 and self.in_features % 16:
            raise ValueError(
                f"quantization: int8 in {self.scales.dtype} needs in_features divisible by 16 "
                f"on this CPU; this model has a {self.in_features} -> {self.out_features} layer"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(x)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, self.scales)
        return y if self.bias is None else y + self.bias


class Int4Linear(QuantLinear):
    scales_and_zeros: torch.Tensor
    group_d_m: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        if in_features % INT4_GROUP or out_features % _INT4_ROW_TILE:
            raise ValueError(
                f"quantization: int4 needs in_features divisible by {INT4_GROUP} and "
                f"out_features by {_INT4_ROW_TILE}; this model has a {in_features} -> "
                f"{out_features} layer (use int8)"
            )
        groups = in_features // INT4_GROUP
        # Unpacked nibbles while loading; finalize() packs them for the kernel.
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.uint8), requires_grad=False
        )
        # (d, m) per row and group in float32 while loading: ours takes them as they are,
        # torch's kernel as [groups, out, 2] (scale, zero) in the model dtype.
        self.register_buffer("group_d_m", torch.empty(out_features, groups, 2), persistent=False)
        self.register_buffer("scales_and_zeros", torch.empty(groups, out_features, 2))
        self.kernel: lk.PackedWeight | None = None
        self.packed = False

    def load_rows(self, start: int, w: torch.Tensor) -> None:
        q, scale, low = quantize_int4(w)
        rows = q.shape[0]
        self.weight.narrow(0, start, rows).copy_(q)
        self.group_d_m.narrow(0, start, rows).copy_(torch.stack((scale, low), -1))
        zero = low + 8.0 * scale
        self.scales_and_zeros.narrow(1, start, rows).copy_(
            torch.stack((scale, zero), -1).transpose(0, 1)
        )

    def finalize(self) -> None:
        if self.packed:
            return
        d_m = self.group_d_m.float()
        if _ours(self, "int4", self.scales_and_zeros.dtype):
            self.kernel = lk.pack_int4(self.weight.data, d_m[..., 0], d_m[..., 1])
            packed = self.kernel.packed
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                self.weight.to(torch.int32), 1
            )
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.group_d_m = torch.empty(0)  # only needed to pack
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(x)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.weight, INT4_GROUP, self.scales_and_zeros
            )
        return y if self.bias is None else y + self.bias


QUANT_LINEARS: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def finalize_quantized(model: nn.Module) -> None:
    """Finish every quantized layer once the checkpoint is loaded (packs int4 nibbles)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.finalize()
