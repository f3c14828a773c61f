"""Load a GGUF file (llama.cpp format) as a Llama-family model.

- Config: ``checkpoint.gguf_config`` (torch-free: the simulator describes GGUFs too).
- Weights: GGUF names -> HF names (``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.
  q_proj.weight`` ...), dequantised to float32; the model casts them to its dtype, or
  quantizes them (``--quantization``) from those float32 values.
- Q/K rows: llama.cpp's converter reorders the rows of q_proj/k_proj of "llama" models (and
  Mistral, stored as llama) so each head's rotary pairs are interleaved (GPT-J style, pairs
  (2i, 2i+1)) instead of HF's halves (pairs (i, i + hd/2)). We undo it per head::

      gguf row order in one head: [x0 y0 x1 y1 ...]   (view [hd/2, 2])
      HF row order in one head:   [x0 x1 ... y0 y1 ...] (transpose -> [2, hd/2])

  Qwen2/Qwen3 are stored unpermuted (llama.cpp uses NEOX rope for them).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import torch

from poise.checkpoint.arch import ArchConfig
from poise.checkpoint.gguf_config import arch_from_gguf
from poise.checkpoint.gguf_file import GGUFFile
from poise.checkpoint.source import ModelSource
from poise.model.gguf_dequant import load_tensor
from poise.model.loader import LoadedModel, check_complete, empty_model

logger = logging.getLogger(__name__)

_PERMUTED_ARCHES = ("llama", "mistral")

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


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None for tensors we do not load."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of rotary pairs (see module docstring)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    # [rows, ...] -> [heads, hd/2, 2, ...] -> [heads, 2, hd/2, ...] -> [rows, ...]
    w = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
    return w.transpose(1, 2).reshape(rows, *w.shape[3:])


def iter_gguf_weights(gf: GGUFFile, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) pairs."""
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
        yield target, w


def load_gguf(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str | None
) -> LoadedModel:
    path = source.path
    gf = GGUFFile(path)
    arch = arch_from_gguf(gf)
    model = empty_model(arch, dtype, device, quantization)
    # Small tensor ops: extra intra-op threads cost more than they give on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = model.load_weights(iter_gguf_weights(gf, arch))
    finally:
        torch.set_num_threads(threads)
    check_complete(model, loaded, str(path))
    has_vocab = "tokenizer.ggml.tokens" in gf.metadata
    return LoadedModel(
        model=model,
        arch=arch,
        name=source.name,
        tokenizer_source=str(path) if has_vocab else None,
    )
