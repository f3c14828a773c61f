"""Architecture description of a Llama-family checkpoint, parsed from a HF ``config.json`` dict
(GGUF metadata is first mapped onto config.json keys by ``gguf_config``).

One frozen dataclass covers Llama / SmolLM2 / Mistral / Qwen2 / Qwen3: the differences are
flags (q/k/v bias for Qwen2, per-head q/k RMSNorm for Qwen3, tied embeddings) and the RoPE
parameters. Both the transformers<5 spelling (``rope_theta`` + ``rope_scaling``) and the
transformers>=5 spelling (``rope_parameters``) are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # "default", "linear" or "llama3".
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # GGUF (llama.cpp) stores llama3-style scaling as per-frequency divisors instead.
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    # Qwen2: bias on q/k/v projections (HF: attention_bias; Qwen2 always has it).
    qkv_bias: bool = False
    # Llama/Mistral/Qwen3 ``attention_bias`` also puts a bias on o_proj; Qwen2 does not.
    o_bias: bool = False
    # Qwen3: RMSNorm over head_dim applied to q and k before RoPE.
    qk_norm: bool = False
    # Mistral v0.1 style sliding window; we attend fully, so max_model_len is clamped to it.
    sliding_window: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def context_length(self) -> int:
        """Longest sequence we can run exactly."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(merged.get("rope_type", merged.get("type", "default")))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(int(v) for v in value)


def arch_from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
    """Parse a HF config.json dict; raises ValueError for unsupported architectures."""
    model_type = str(cfg.get("model_type", "llama"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model: architecture {model_type!r} is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: hidden_act {cfg.get('hidden_act')!r} is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError("model: mlp_bias is not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    use_window = cfg.get("use_sliding_window", model_type == "mistral")
    window = cfg.get("sliding_window") if use_window else None
    return ArchConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=_rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=int(window) if window else None,
        eos_token_ids=_ids(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
    )
