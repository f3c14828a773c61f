"""``create_model_runner(config)``: load weights and tokenizer, size and allocate the KV pool,
and describe the result (``ModelInfo``) for the engine.

Resolved values (dtype, max_model_len, number of KV blocks) are returned in ModelInfo, never
written back to the config.

dtype and device "auto" are resolved in ``runner/platform.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from poise.checkpoint.generation_config import sampling_defaults
from poise.checkpoint.source import resolve_model
from poise.config import EngineConfig
from poise.model.attention import CpuPagedAttentionBackend
from poise.model.loader import LoadedModel, load_model
from poise.runner.attention import create_attention_backend
from poise.runner.graphs import CudaGraphDevice, DecodeGraphs, decode_graphs_for
from poise.runner.kv_pool import allocate_kv_caches, num_kv_blocks
from poise.runner.model_runner import ModelRunner
from poise.runner.platform import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from poise.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    dtype: str
    device: str
    attention_backend: str
    tokenizer: Any  # a transformers tokenizer (chat_template set when known), or None
    # SamplingParams defaults from the generation config (checkpoint/generation_config.py).
    default_sampling: dict[str, Any] = field(default_factory=dict)
    quantization: str | None = None  # ModelConfig.quantization: how the weights are stored


def resolve_max_model_len(requested: int | None, context_length: int) -> int:
    if requested is None:
        return context_length
    if requested > context_length:
        logger.warning(
            "max_model_len %d exceeds the model's context length %d; using %d",
            requested,
            context_length,
            context_length,
        )
    return min(requested, context_length)


def _eos_ids(loaded: LoadedModel, tokenizer: Any) -> frozenset[int]:
    ids = set(loaded.arch.eos_token_ids) | set(loaded.extra_eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def create_model_runner(config: EngineConfig) -> tuple[ModelRunner, ModelInfo]:
    mc, cc = config.model, config.cache
    device = resolve_device(mc.device)
    dtype = resolve_dtype(mc.dtype, device)
    if mc.num_threads is not None:
        torch.set_num_threads(mc.num_threads)
    attention = create_attention_backend(mc.attention_backend, device, dtype)
    if isinstance(attention, CpuPagedAttentionBackend):
        attention.cascade = not mc.disable_cascade_attn
    kv_dtype = resolve_kv_cache_dtype(cc.kv_cache_dtype, device, attention.name, dtype)
    loaded = load_model(mc.model, dtype, device, seed=mc.seed, quantization=mc.quantization)
    arch = loaded.arch
    max_model_len = resolve_max_model_len(mc.max_model_len, arch.context_length)
    loaded.model.init_rope(max_model_len)
    blocks = num_kv_blocks(cc, config.scheduler, arch, dtype, device, kv_dtype)
    # Decode graphs on CUDA unless --enforce-eager, for backends whose prepare captures.
    graphs = (
        device.type == "cuda"
        and not mc.enforce_eager
        and getattr(attention, "decode_capturable", False)
    )
    # With graphs, block ``blocks`` (one past the KV manager's) is the padded rows' own.
    caches = allocate_kv_caches(arch, blocks + graphs, cc.block_size, kv_dtype, device)
    decode_graphs: DecodeGraphs | None = None
    if graphs:
        model = loaded.model

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
            return model(ids, pos, caches, meta, attention)

        decode_graphs = decode_graphs_for(
            forward,
            config.scheduler.max_num_seqs,
            max_model_len,
            cc.block_size,
            blocks,
            device,
            CudaGraphDevice(device),
        )
    tokenizer_source = mc.tokenizer or loaded.tokenizer_source
    tokenizer = load_tokenizer(tokenizer_source) if tokenizer_source else None
    eos_ids = _eos_ids(loaded, tokenizer)
    runner = ModelRunner(
        loaded.model,
        attention,
        caches,
        cc.block_size,
        device,
        seed=mc.seed,
        eos_token_ids=eos_ids,
        decode_graphs=decode_graphs,
    )
    info = ModelInfo(
        model_name=loaded.name,
        vocab_size=arch.vocab_size,
        max_model_len=max_model_len,
        num_kv_blocks=blocks,
        block_size=cc.block_size,
        eos_token_ids=eos_ids,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        attention_backend=attention.name,
        tokenizer=tokenizer,
        default_sampling=_generation_defaults(mc.generation_config, mc.model),
        quantization=mc.quantization,
    )
    return runner, info


def _generation_defaults(setting: str, model: str | None) -> dict[str, Any]:
    defaults = sampling_defaults(setting, resolve_model(model))
    if defaults:
        logger.info("default sampling parameters from the generation config: %s", defaults)
    return defaults
