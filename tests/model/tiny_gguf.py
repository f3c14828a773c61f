"""Write a tiny transformers checkpoint as a llama.cpp-style GGUF (quantised, Q/K permuted for
llama), so the GGUF loader can be checked against transformers' own GGUF reader in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# A mix of the types the torch dequantiser handles, per GGUF tensor kind.
_QTYPES = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "ffn_gate": Q.Q4_1}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, kind = hf.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for llama q/k rows: rotary halves -> interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(hf_model: Any, path: Path, arch: str) -> Path:
    cfg = hf_model.config
    w = GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ints = {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "vocab_size": cfg.vocab_size,
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    for hf, tensor in hf_model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(hf)
        data = tensor.float().numpy()
        kind = name.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        qtype = _QTYPES.get(kind, Q.F32) if data.ndim == 2 else Q.F32
        if name == "token_embd.weight":
            qtype = Q.Q8_0
        if qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":
        # llama.cpp stores llama3 scaling as per-frequency divisors of the plain inv_freq.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, None)
        plain = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
        w.add_tensor("rope_freqs.weight", (plain / scaled.double().numpy()).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
