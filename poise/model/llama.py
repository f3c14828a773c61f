"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a flat token batch.

One forward per engine step: ``forward(input_ids[T], positions[T], kv_caches, meta, attention)``
mixes prefill chunks and decode tokens of many requests (layout in attention/metadata.py) and
returns hidden states [T, H]; ``compute_logits`` projects only the rows that are sampled.
``attention`` is the backend instance the runner chose (runner/attention.py): the forward asks
it for the step's state once (``prepare``) and passes that state to every layer.

Weights: q/k/v are fused into one ``qkv_proj`` and gate/up into ``gate_up_proj`` (one matmul
each instead of three/two). Hugging Face names are kept at the loading boundary:
``load_weights`` takes (HF name, tensor) pairs such as ``model.layers.0.self_attn.q_proj.weight``
and copies each into its slice of the fused parameter.

Quantization (``--quantization``, model/quant.py): the decoder layers' projections are built as
quantized linears instead of ``Linear`` (``linear_class``); ``load_weights`` hands each of
their float weights (or shards) to the layer, which quantizes those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from poise.checkpoint.arch import ArchConfig
from poise.model import elementwise
from poise.model.attention import AttentionBackend, AttentionMetadata
from poise.model.linear_kernel import PackedBf16, bf16_linear, bf16_packs, pack_bf16
from poise.model.quant import QUANT_LINEARS, Int8Linear, QuantLinear, finalize_quantized
from poise.model.rope import RotaryEmbedding, apply_rope

# Per layer: [num_blocks, block_size, 2 * Hkv, hd], K heads then V heads per token slot.
KVCache = torch.Tensor
# (in_features, out_features, bias) -> the module: Linear, or a quantized one.
LinearClass = Callable[[int, int, bool], nn.Module]


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b): bf16 on CPU through linear_kernel.bf16_linear (ours at every row count
    without AMX; with AMX, for the layers that do not pack, ours at 1-2 rows and torch's AMX
    GEMM beyond), torch otherwise."""
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu":
        return bf16_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x W^T (+ b). Like nn.Linear without its random init: weights always come from a
    checkpoint (or the dummy loader), and skipping init keeps meta-device construction free
    (nn.Linear's init on meta tensors drags sympy in, ~1 s of cold start).

    bf16 on a CPU with AMX: ``finalize`` packs the weight for the AMX kernel, which then runs
    every row count, so a row's output does not depend on the batch (linear_kernel.PackedBf16);
    ``weight`` then holds the packed values (held once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: PackedBf16 | None = None

    def dense_weight(self) -> torch.Tensor:
        """The weight as [out_features, in_features] (a copy when packed)."""
        return self.weight if self.packed is None else self.packed.unpack()

    def finalize(self) -> None:
        """Once loaded: pack for the AMX kernel where it runs this layer."""
        if self.packed is None and bf16_packs(self.weight):
            self.packed = pack_bf16(self.weight.data)
            self.weight = nn.Parameter(self.packed.packed, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return project(x, self.weight, self.bias)
        y = self.packed(x)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, via torch's fused kernel, with transformers' roundings.

    float32: one fused call, bit-identical to transformers' RMSNorm on the shapes we test.
    bfloat16 / float16: normalise in float32, round to the model dtype, THEN multiply by the
    weight in the model dtype, as transformers does. Why not one fused call: it rounds once,
    after the weight, which is at most one ulp away per element but drifts over 60 norms; on
    SmolLM2 in bf16 the last logits moved by up to 1.25 and "What is the capital of France?"
    turned from "The capital of France is Paris." into a tie broken the other way. With
    transformers' order the bf16 logits are bit-identical to transformers' (4 chat prompts).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if elementwise.applies(x, self.weight):  # one pass, same roundings (model/elementwise.py)
            return elementwise.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return normed.to(x.dtype) * self.weight

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add, then the norm: (x + delta, norm(x + delta)). The bf16 kernel adds
        into ``x`` in place (the residual stream is the forward's own tensor)."""
        if elementwise.applies(x, delta, self.weight):
            return x, elementwise.rms_norm(x, self.weight, self.eps, delta)
        x = x + delta
        return x, self(x)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, linear: LinearClass) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias)
        self.o_proj = linear(self.q_size, arch.hidden_size, arch.o_bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attention: AttentionBackend[Any],
        state: Any,
    ) -> torch.Tensor:
        t, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        # [T, (H + 2 Hkv) * hd] -> [T, H + 2 Hkv, hd]: heads of q, then k, then v.
        heads = qkv.view(t, h + 2 * hkv, self.head_dim)
        qk = heads[:, : h + hkv]  # [T, H + Hkv, hd]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        # Rotate q and k heads in one call and write them back into the qkv buffer, so that
        # k (rotated) and v sit side by side: heads[:, H:] is the [T, 2Hkv, hd] the cache takes.
        apply_rope(qk, cos, sin, out=heads[:, : h + hkv])
        # [T, H, hd]
        o = attention.forward(heads[:, :h], heads[:, h:], kv_cache, state, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))  # [T, H * hd] -> [T, hidden]


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig, linear: LinearClass) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = linear(arch.hidden_size, 2 * arch.intermediate_size, False)
        self.down_proj = linear(arch.intermediate_size, arch.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]: gate, then up
        if elementwise.applies(gate_up):  # one pass, same roundings (model/elementwise.py)
            return self.down_proj(elementwise.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, linear: LinearClass) -> None:
        super().__init__()
        self.self_attn = Attention(arch, linear)
        self.mlp = MLP(arch, linear)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attention: AttentionBackend[Any],
        state: Any,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream x, input_layernorm(x)) -> (x after this layer, next_norm of it):
        each residual add is fused with the norm after it (RMSNorm.add_and_norm)."""
        attn = self.self_attn(normed, cos, sin, kv_cache, attention, state)
        x, normed = self.post_attention_layernorm.add_and_norm(x, attn)
        return next_norm.add_and_norm(x, self.mlp(normed))


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, linear: LinearClass) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, linear) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


# HF per-projection names -> (fused parameter, shard index in the fused output dim).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, quantization: str | None = None) -> None:
        """``quantization``: None (every Linear in the model dtype) or a QUANT_LINEARS key."""
        super().__init__()
        self.arch = arch
        linear: LinearClass = Linear if quantization is None else QUANT_LINEARS[quantization]
        self.model = LlamaModel(arch, linear)
        # Both quantizations run the lm_head in int8 (~20 % of SmolLM2's decode reads, 13 %
        # of SmolLM2-1.7B's in int4); int4 keeps it at 8 bits, as GGUF's Q4 models ship their
        # head (Q8_0 / Q6_K): 4-bit heads cost more quality than they save.
        head: LinearClass = Linear if quantization is None else Int8Linear
        # Tied: compute_logits reuses embed_tokens.weight (no second Parameter to keep tied),
        # or a quantized or AMX-packed copy made from it once loaded (finalize); the
        # embedding lookup keeps the dtype weights.
        tied = arch.tie_word_embeddings
        self.lm_head = None if tied else head(arch.hidden_size, arch.vocab_size, False)
        self.tied_head = (
            head(arch.hidden_size, arch.vocab_size, False) if tied and head is not Linear else None
        )
        self.rotary: RotaryEmbedding | None = None

    def init_rope(self, max_positions: int) -> None:
        """Build the cos/sin tables (after weights are materialised on their device)."""
        weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            self.arch.rope, self.arch.head_dim, max_positions, weight.dtype, weight.device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        attention: AttentionBackend[Any],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden_size] (after the final norm)."""
        assert self.rotary is not None, "call init_rope() after loading"
        state = attention.prepare(meta)  # once per step, shared by every layer
        cos, sin = self.rotary.tables(positions)  # [T, 1, hd] each
        x = self.model.embed_tokens(input_ids)  # [T, hidden]: the residual stream
        layers = cast(list[DecoderLayer], list(self.model.layers))
        normed = layers[0].input_layernorm(x)
        norms_after = [*(layer.input_layernorm for layer in layers[1:]), self.model.norm]
        for layer, kv_cache, next_norm in zip(layers, kv_caches, norms_after, strict=True):
            x, normed = layer(x, normed, cos, sin, kv_cache, attention, state, next_norm)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden_size] -> float32 logits [S, vocab]."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is not None:
            return head(hidden).float()
        return project(hidden, self.model.embed_tokens.weight, None).float()

    def finalize(self) -> None:
        """Once the checkpoint is in: the tied head quantized (or, bf16 on AMX, packed) from
        the loaded embedding, quantized layers packed, bf16 layers packed for AMX."""
        embedding = self.model.embed_tokens.weight
        if isinstance(self.tied_head, QuantLinear):
            with torch.no_grad():
                self.tied_head.load_rows(0, embedding)
        elif self.arch.tie_word_embeddings and bf16_packs(embedding):
            # A packed copy for the head (the lookup keeps the rows): the head's rows are then
            # batch-invariant like every other layer's.
            head = Linear(self.arch.hidden_size, self.arch.vocab_size, False)
            head.weight = nn.Parameter(embedding.data, requires_grad=False)
            head.finalize()
            self.tied_head = head
        finalize_quantized(self)
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (possibly fused) parameters; returns HF names used."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoint that also stores the head
            if "rotary_emb" in name:
                continue
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"model: unexpected weight {name!r}")
            param = params[target]
            module_name, _, leaf = target.rpartition(".")
            module = self.get_submodule(module_name)
            with torch.no_grad():
                if isinstance(module, QuantLinear) and leaf == "weight":
                    start = 0 if shard is None else self._shard_range(target, shard)[0]
                    module.load_rows(start, tensor)
                elif shard is None:
                    param.copy_(tensor.view_as(param))
                else:
                    start, size = self._shard_range(target, shard)
                    param.narrow(0, start, size).copy_(tensor)
            loaded.add(name)
        return loaded

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _FUSED:
                fused, shard = _FUSED[part]
                return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
        return name, None

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        a = self.arch
        if ".qkv_proj." in target:
            sizes = [a.q_size, a.kv_size, a.kv_size]
        else:
            sizes = [a.intermediate_size, a.intermediate_size]
        return sum(sizes[:shard]), sizes[shard]

    def expected_hf_names(self) -> set[str]:
        """The HF weight names a complete checkpoint provides for this architecture."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            if name.startswith("tied_head."):
                continue  # made from the embedding, not read from the checkpoint
            hf_names = [
                name.replace(f".{fused}.", f".{hf}.")
                for hf, (fused, _shard) in _FUSED.items()
                if f".{fused}." in name
            ]
            names.update(hf_names or [name])
        return names
