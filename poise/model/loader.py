"""Model loading entry point: HF directory, GGUF file, ``dummy:`` random weights, or the
embedded default (model=None); what a model string names is ``checkpoint.resolve_model``'s call.

All loaders build the module on the meta device (no memory, no init cost), materialise it
with ``to_empty`` directly in the target dtype/device, then copy each checkpoint tensor into
place exactly once (a quantized layer quantizes it as it arrives: model/quant.py). The rope tables are built later by the runner (``init_rope``), once it
knows max_model_len.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from poise.checkpoint.arch import ArchConfig
from poise.checkpoint.source import ModelSource, resolve_model
from poise.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ArchConfig
    name: str
    # Where a tokenizer can be built from: a directory with tokenizer files, a .gguf, or None.
    tokenizer_source: str | None
    # Extra end-of-sequence ids beyond arch.eos_token_ids (generation_config.json).
    extra_eos_token_ids: frozenset[int] = frozenset()


def empty_model(
    arch: ArchConfig, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> LlamaForCausalLM:
    """The model with uninitialised parameters, allocated once in dtype on device (quantized
    weights keep their integer dtype)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, quantization)
    # Materialise each tensor ourselves (what Module.to_empty does, minus its import of
    # sympy: ~1 s of cold start). torch.empty does not touch the pages, so this is free until
    # the loader writes the weights.
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=_dtype(param, dtype), device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=False))
        for name, buf in module.named_buffers(recurse=False):
            module.register_buffer(
                name, torch.empty(buf.shape, dtype=_dtype(buf, dtype), device=device)
            )
    return model.eval()


def _dtype(t: torch.Tensor, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if t.dtype.is_floating_point else t.dtype


def check_complete(model: LlamaForCausalLM, loaded: set[str], source: str) -> None:
    missing = model.expected_hf_names() - loaded
    if missing:
        raise ValueError(f"model: {source} lacks weights {sorted(missing)[:5]}...")


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    quantization: str | None = None,
) -> LoadedModel:
    """Load what the model string names (see ModelConfig.model), its decoder layers' linear
    weights quantized when ``quantization`` names a scheme (ModelConfig.quantization)."""
    source: ModelSource = resolve_model(model)
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization: {quantization} runs on CPU only (device {device})")
    if quantization is not None and dtype != torch.bfloat16:
        # Correct but slow: torch's int8/int4 CPU kernels are fast in bfloat16 only (~5x
        # slower than a float32 matmul at batch 1), and our int8 kernel is bfloat16 only.
        logger.warning(
            "quantization %s with dtype %s is slow: use --dtype bfloat16",
            quantization,
            str(dtype).removeprefix("torch."),
        )
    if source.kind == "dummy":
        from poise.model.loader_dummy import load_dummy

        loaded = load_dummy(source, dtype, device, seed, quantization)
    elif source.kind == "gguf":
        from poise.model.loader_gguf import load_gguf

        loaded = load_gguf(source, dtype, device, quantization)
    else:
        from poise.model.loader_hf import load_hf_dir

        loaded = load_hf_dir(source, dtype, device, quantization)
    loaded.model.finalize()
    return loaded
