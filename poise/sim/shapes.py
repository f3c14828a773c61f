"""Model shapes: the handful of numbers a cost model needs, taken from the shared model
description (``poise.checkpoint``: config.json or GGUF metadata, parsed as the runner parses it).

A ``ModelShape`` is enough to count parameters, FLOPs per token, weight bytes and KV-cache bytes
per token for a Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, SmolLM2): attention with
grouped KV heads, a gated (SwiGLU) MLP, RMSNorm, optional tied embeddings. No weights are read.

Invariants: all counts are exact for that architecture family up to biases and norms (which are
counted but are < 0.1 % of the total); FLOPs count one multiply-add as two FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from poise.checkpoint.arch import ArchConfig, arch_from_hf_config
from poise.checkpoint.source import DUMMY_PREFIX, ModelSource, describe, read_json
from poise.config import kv_bytes_per_token as layout_bytes_per_token

SHAPES_DIR = Path(__file__).parent / "model_shapes"

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class ModelShape(ArchConfig):
    """The runner's own architecture description (``checkpoint.ArchConfig``), named, plus what a
    cost model derives from it."""

    name: str = "model"

    @classmethod
    def from_arch(cls, arch: ArchConfig, name: str = "model") -> ModelShape:
        return cls(**{f.name: getattr(arch, f.name) for f in fields(arch)}, name=name)

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        """Build from a config.json dict (the text-model part of a multimodal one)."""
        return cls.from_arch(arch_from_hf_config(config.get("text_config", config)), name)

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: q/k/v/o projections, gated MLP, two norms."""
        h, d = self.hidden_size, self.head_dim
        q = h * self.num_heads * d
        kv = 2 * h * self.num_kv_heads * d
        o = self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return q + kv + o + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return (
            self.num_layers * self.layer_params + self.embedding_params + lm_head + self.hidden_size
        )

    # ---- per-token work ---------------------------------------------------------------------
    @property
    def flops_per_token(self) -> int:
        """Dense matmul FLOPs for one token through all layers (no attention scores, no head)."""
        return 2 * self.num_layers * self.layer_params

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the vocabulary projection for one sampled position."""
        return 2 * self.hidden_size * self.vocab_size

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs per (query, key) pair over all layers: QK^T and PV, each 2 * head_dim per head."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of weights read by one forward. The input embedding is a gather, so only the
        LM head (or the tied table used as it) counts once."""
        return (self.num_layers * self.layer_params + self.embedding_params) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """K and V for one token over all layers (``int8``: with its scales, config_model.py)."""
        return layout_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, kv_cache_dtype, dtype_bytes
        )


def builtin_shapes() -> dict[str, Path]:
    """Shipped config.json shapes, by name (file stem)."""
    return {p.stem: p for p in sorted(SHAPES_DIR.glob("*.json"))}


def load_shape(spec: str | Path) -> ModelShape:
    """A shipped shape name (``Qwen2.5-7B-Instruct``, case-insensitive, the org prefix ignored),
    a config.json (any ``.json`` file) or a model directory holding one (``dummy:`` allowed), or
    a ``.gguf`` file (described from its metadata)."""
    text = str(spec)
    path = Path(text.removeprefix(DUMMY_PREFIX)).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".gguf":
        source = ModelSource("gguf", path)
        return ModelShape.from_arch(describe(source), name=source.name)
    if not path.is_file():
        known = {name.lower(): p for name, p in builtin_shapes().items()}
        key = text.rsplit("/", 1)[-1].lower()
        if key not in known:
            raise ValueError(
                f"model shape: {spec!r} is neither a config.json, a model directory, a .gguf "
                f"file nor one of {sorted(known)}"
            )
        path = known[key]
    name = path.parent.name if path.name == "config.json" else path.stem
    return ModelShape.from_config(read_json(path), name=name)
