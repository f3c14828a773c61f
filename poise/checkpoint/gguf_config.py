"""GGUF metadata -> the model description: ``{arch}.*`` keys become HF config.json keys, and
``arch_from_hf_config`` does the rest, so a GGUF and a HF directory are described by one parser.

Llama 3.1 style rope scaling is stored as a ``rope_freqs`` tensor of per-frequency divisors; it
is read here with numpy (a few dozen floats), so describing a GGUF needs no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from poise.checkpoint.arch import ArchConfig, arch_from_hf_config
from poise.checkpoint.gguf_file import GGUFFile

# general.architecture -> HF model_type (llama.cpp stores Mistral as llama).
ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# {arch}.<key> -> HF config key.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}


def hf_config_from_gguf(gf: GGUFFile) -> dict[str, Any]:
    arch = str(gf.get("general.architecture"))
    if arch not in ARCH_TO_MODEL_TYPE:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported")
    cfg: dict[str, Any] = {"model_type": ARCH_TO_MODEL_TYPE[arch], "hidden_act": "silu"}
    for key, hf_key in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in gf.metadata:
            cfg[hf_key] = gf.metadata[f"{arch}.{key}"]
    if "vocab_size" not in cfg:
        cfg["vocab_size"] = len(gf.get("tokenizer.ggml.tokens", []))
    scaling = gf.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {
            "rope_type": "linear",
            "factor": gf.get(f"{arch}.rope.scaling.factor", 1.0),
        }
    elif scaling not in (None, "none"):
        raise ValueError(f"model: GGUF rope scaling {scaling!r} is not supported")
    cfg["tie_word_embeddings"] = "output.weight" not in gf.tensors
    cfg["eos_token_id"] = gf.get("tokenizer.ggml.eos_token_id")
    cfg["bos_token_id"] = gf.get("tokenizer.ggml.bos_token_id")
    if arch == "qwen2":
        cfg["attention_bias"] = True
    return cfg


def _floats(gf: GGUFFile, name: str) -> tuple[float, ...]:
    info = gf.tensors[name]
    raw = gf.raw(info)
    if info.qtype == GGMLQuantizationType.F32:
        values = raw.reshape(-1).view(np.float32)
    else:
        values = np.asarray(dequantize(raw, info.qtype), dtype=np.float32).reshape(-1)
    return tuple(float(v) for v in values)


def arch_from_gguf(gf: GGUFFile) -> ArchConfig:
    arch = arch_from_hf_config(hf_config_from_gguf(gf))
    if "rope_freqs.weight" in gf.tensors:
        factors = _floats(gf, "rope_freqs.weight")
        arch = replace(arch, rope=replace(arch.rope, freq_factors=factors))
    return arch
