"""Tiny random Llama / Qwen2 / Qwen3 checkpoints written with transformers (fp32), shared by
test areas: ``build_tiny_checkpoint(kind, path)`` writes config.json + model.safetensors.

Weights are re-drawn with a fixed seed and a larger spread than HF's init (biases and norm
weights included), so q/k/v biases and q/k norms actually matter and logits are not flat.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KINDS = ("llama", "qwen2", "qwen3", "llama3_rope", "tied")
# Also buildable, tested more lightly: "mistral" (sliding window 64 < max positions) and
# "llama_hd64" (head_dim 64: the CPU decode kernel's AMX path, cpu_decode_amx.h, takes only 64
# and 128).

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(kind: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        return LlamaConfig(**_COMMON, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "tied":
        return LlamaConfig(**_COMMON, rope_theta=50000.0, tie_word_embeddings=True)
    if kind == "llama3_rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(**_COMMON, rope_scaling=rope, tie_word_embeddings=False)
    if kind == "llama_hd64":
        wide = {**_COMMON, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2}
        return LlamaConfig(**{**wide, "num_key_value_heads": 1}, tie_word_embeddings=False)
    if kind == "mistral":
        return MistralConfig(**_COMMON, sliding_window=64, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2Config(**_COMMON, rope_theta=1000000.0, tie_word_embeddings=False)
    if kind == "qwen3":
        # head_dim 32 != hidden / heads (16), as in real Qwen3 models.
        return Qwen3Config(**_COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)
    raise ValueError(f"unknown tiny model kind {kind!r}")


def build_tiny_model(kind: str, seed: int = 0) -> Any:
    """A transformers model (fp32, eval) with well-spread random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)
    return model.eval()


def build_tiny_checkpoint(
    kind: str, path: str | Path, seed: int = 0, max_shard_size: str | None = None
) -> Path:
    """Write a tiny checkpoint (config.json + *.safetensors) to path; returns path.
    ``max_shard_size`` (e.g. "100KB") splits it into several safetensors shards."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    build_tiny_model(kind, seed).save_pretrained(path, safe_serialization=True, **kwargs)
    return path
