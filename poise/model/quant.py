"""Weight-only quantized linear layers (``--quantization int8 | int4``), on torch's CPU kernels.

The decoder layers' projections (qkv_proj, o_proj, gate_up_proj, down_proj) are built as one
of these instead of ``Linear``; activations stay in the model dtype and the kernels
dequantise the weights inside the matmul. Loading stays name-for-name: the weight arrives as a
float tensor under its usual name (``...qkv_proj.weight``, or one shard of it) and
``load_rows`` quantizes those output rows in place. Every scheme here is per output row, so a
shard (q, k or v of a fused qkv_proj) quantizes alone, exactly as the whole matrix would.

- int8: symmetric per output channel, ``w ~= q * scale``, q in [-127, 127], scale =
  max|row| / 127. In bfloat16 on AVX512-BF16 CPUs: our kernel (cpu_int8_linear.cpp, weights
  repacked by ``finalize``), faster than bf16 at every batch; else
  ``torch.ops.aten._weight_int8pack_mm`` (fast at batch 1, 2x slower than bf16 at batch 32).
- int4: groups of ``INT4_GROUP`` = 32 inputs (a GGUF block), asymmetric: ``w ~= q * d + m``,
  q in [0, 15], m = group min, d = (max - min) / 15. A GGUF Q4_1 block is stored as exactly
  that (Q4_0 as d * (q - 8)), and its min and max are the values of q = 0 and 15, so the GGUF's
  4-bit weights come back as they were stored. torch's kernel takes (q - 8) * scale + zero:
  zero = m + 8 d. ``torch.ops.aten._weight_int4pack_mm_for_cpu``; the nibbles are packed once
  every row is loaded (``finalize``), since the packed layout needs the whole matrix.

Embeddings stay in the model dtype. int8 also quantizes the lm_head (a tied one gets an int8
copy of the embedding: llama.py); int4 keeps it in dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from poise.model.quant_kernel import fits, int8_linear, load_int8_kernel, pack_int8

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


class Int8Linear(QuantLinear):
    scales: torch.Tensor
    kernel_scales: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        # In the model dtype (torch's kernel's requirement), like the bias.
        self.register_buffer("scales", torch.empty(out_features))
        self.packed = False  # weight in cpu_int8_linear.cpp's layout (finalize)

    def load_rows(self, start: int, w: torch.Tensor) -> None:
        q, scale = quantize_int8(w)
        self.weight.narrow(0, start, q.shape[0]).copy_(q)
        self.scales.narrow(0, start, q.shape[0]).copy_(scale)

    def finalize(self) -> None:
        use_kernel = (
            self.scales.dtype == torch.bfloat16
            and self.weight.device.type == "cpu"
            and fits(self.out_features, self.in_features)
            and load_int8_kernel() is not None
        )
        if self.packed:
            return
        if not use_kernel:
            # torch 2.13's bf16/fp16 _weight_int8pack_mm returns garbage unless K % 16 == 0.
            if self.scales.dtype != torch.float32 and self.in_features % 16:
                raise ValueError(
                    f"quantization: int8 in {self.scales.dtype} needs in_features divisible by "
                    f"16 without the AVX512-BF16 kernel; this model has a {self.in_features} -> "
                    f"{self.out_features} layer"
                )
            return
        self.weight = nn.Parameter(pack_int8(self.weight), requires_grad=False)
        # The same (bf16-rounded) scales torch's kernel would use, as the kernel's float32.
        self.register_buffer("kernel_scales", self.scales.float(), persistent=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            y = int8_linear(x.contiguous(), self.weight, self.kernel_scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, self.scales)
        return y if self.bias is None else y + self.bias


class Int4Linear(QuantLinear):
    scales_and_zeros: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        if in_features % INT4_GROUP or out_features % _INT4_ROW_TILE:
            raise ValueError(
                f"quantization: int4 needs in_features divisible by {INT4_GROUP} and "
                f"out_features by {_INT4_ROW_TILE}; this model has a {in_features} -> "
                f"{out_features} layer (use int8)"
            )
        groups = in_features // INT4_GROUP
        # Unpacked nibbles while loading; finalize() packs them to [out, in / 2].
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.uint8), requires_grad=False
        )
        # [groups, out, 2]: (scale, zero) per group and row, in the model dtype (torch's layout).
        self.register_buffer("scales_and_zeros", torch.empty(groups, out_features, 2))
        self.packed = False

    def load_rows(self, start: int, w: torch.Tensor) -> None:
        q, scale, low = quantize_int4(w)
        rows = q.shape[0]
        self.weight.narrow(0, start, rows).copy_(q)
        zero = low + 8.0 * scale
        self.scales_and_zeros.narrow(1, start, rows).copy_(
            torch.stack((scale, zero), -1).transpose(0, 1)
        )

    def finalize(self) -> None:
        if self.packed:
            return
        q = self.weight.to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.weight, INT4_GROUP, self.scales_and_zeros
        )
        return y if self.bias is None else y + self.bias


QUANT_LINEARS: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def finalize(model: nn.Module) -> None:
    """Finish every quantized layer once the checkpoint is loaded (packs int4 nibbles)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.finalize()
