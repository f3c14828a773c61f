"""Load a GGUF file (llama.cpp format) as a Llama-family model.

- Config: ``{arch}.*`` metadata -> HF config keys (``arch_from_hf_config`` does the rest).
- Weights: GGUF names -> HF names (``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.
  q_proj.weight`` ...), dequantised to float32 then cast to the model dtype.
- Q/K rows: llama.cpp's converter reorders the rows of q_proj/k_proj of "llama" models (and
  Mistral, stored as llama) so each head's rotary pairs are interleaved (GPT-J style, pairs
  (2i, 2i+1)) instead of HF's halves (pairs (i, i + hd/2)). We undo it per head::

      gguf row order in one head: [x0 y0 x1 y1 ...]   (view [hd/2, 2])
      HF row order in one head:   [x0 x1 ... y0 y1 ...] (transpose -> [2, hd/2])

  Qwen2/Qwen3 are stored unpermuted (llama.cpp uses NEOX rope for them).
- Llama 3.1 style rope scaling is stored as a ``rope_freqs`` tensor of per-frequency divisors.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from poise.model.arch import ArchConfig, arch_from_hf_config
from poise.model.gguf_dequant import load_tensor
from poise.model.gguf_file import GGUFFile
from poise.model.loader import LoadedModel, check_complete, empty_model

logger = logging.getLogger(__name__)

_ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED_ARCHES = ("llama", "mistral")

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

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_QUANT_SUFFIX = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None for tensors we do not load."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def hf_config_from_gguf(gf: GGUFFile) -> dict[str, Any]:
    arch = str(gf.get("general.architecture"))
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported")
    cfg: dict[str, Any] = {"model_type": _ARCH_TO_MODEL_TYPE[arch], "hidden_act": "silu"}
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


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of rotary pairs (see module docstring)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    # [rows, ...] -> [heads, hd/2, 2, ...] -> [heads, 2, hd/2, ...] -> [rows, ...]
    w = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
    return w.transpose(1, 2).reshape(rows, *w.shape[3:])


def iter_gguf_weights(
    gf: GGUFFile, arch: ArchConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    permuted = gf.get("general.architecture") in _PERMUTED_ARCHES
    for name, info in gf.tensors.items():
        target = hf_name(name)
        if target is None:
            if name != "rope_freqs.weight":
                logger.info("GGUF tensor %s ignored", name)
            continue
        w = load_tensor(gf, info)
        if permuted and target.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, arch.num_heads)
        elif permuted and target.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, arch.num_kv_heads)
        yield target, w.to(dtype)


def model_name(path: Path) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'."""
    return _QUANT_SUFFIX.sub("", path.stem)


def arch_from_gguf(gf: GGUFFile) -> ArchConfig:
    arch = arch_from_hf_config(hf_config_from_gguf(gf))
    if "rope_freqs.weight" in gf.tensors:
        factors = load_tensor(gf, gf.tensors["rope_freqs.weight"]).tolist()
        arch = replace(arch, rope=replace(arch.rope, freq_factors=tuple(factors)))
    return arch


def load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, attention_backend: str = "torch"
) -> LoadedModel:
    gf = GGUFFile(path)
    arch = arch_from_gguf(gf)
    model = empty_model(arch, dtype, device, attention_backend)
    # Small tensor ops: extra intra-op threads cost more than they give on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = model.load_weights(iter_gguf_weights(gf, arch, dtype))
    finally:
        torch.set_num_threads(threads)
    check_complete(model, loaded, str(path))
    has_vocab = "tokenizer.ggml.tokens" in gf.metadata
    return LoadedModel(
        model=model,
        arch=arch,
        name=model_name(path),
        tokenizer_source=str(path) if has_vocab else None,
    )
