"""KV pool sizing and allocation.

Sizing (returned explicitly, never written back to the config):
- ``CacheConfig.num_kv_blocks`` when set;
- on CPU: ``CacheConfig.cpu_kv_budget_bytes()`` / bytes per block: ``kv_cache_memory_bytes``, else
  ``gpu_memory_utilization`` x ``kv_cache_memory_base`` (1 GiB unless given), the rule the
  simulator's CPU cost models share;
- on CUDA: ``gpu_memory_utilization`` (0.9 unless given) x total memory, minus what is already
  in use (weights, CUDA context, other processes) and an activation reserve for the largest
  step, capped by ``kv_cache_memory_bytes``.

Layout: one tensor [num_layers, num_blocks, block_size, 2 * num_kv_heads, head_dim]; layer i
gets pool[i] (K heads then V heads per token slot; why in model/attention/common.py), so
a token's K and V for all heads are one contiguous row at ``slot = block * block_size +
offset``. ``--kv-cache-dtype int8``: int8, with the last dim head_dim + 2 (each row's bf16
scale after its values: model/attention/kv_int8.py), so a budget holds ~1.94x the blocks.
Zero-initialised, but a freed block keeps what its owner wrote (NaN, from a request that
failed with non-finite values): the attention backends never let a slot past a row's context
into its output (the torch backend zeroes them in its gathered copy).
"""

from __future__ import annotations

import logging

import torch

from poise.checkpoint.arch import ArchConfig
from poise.config import CacheConfig, SchedulerConfig, kv_bytes_per_token
from poise.model.attention.kv_int8 import int8_cache_shape

logger = logging.getLogger(__name__)

_SLACK_BYTES = 256 << 20


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """``dtype``: the cache's (``torch.int8``: the int8 layout, its scales included)."""
    name = "int8" if dtype == torch.int8 else "auto"
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, name, elem)
    return block_size * per_token


def activation_reserve(arch: ArchConfig, sched: SchedulerConfig, dtype: torch.dtype) -> int:
    """Rough peak of one forward's temporaries: a few [T, width] buffers plus fp32 logits."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = sched.max_num_batched_tokens
    width = 4 * arch.hidden_size + 4 * arch.intermediate_size + arch.q_size + 2 * arch.kv_size
    logits = 3 * sched.max_num_seqs * arch.vocab_size * 4
    return tokens * width * elem + logits + _SLACK_BYTES


def num_kv_blocks(
    cache: CacheConfig,
    sched: SchedulerConfig,
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """``dtype``: the model's (activations); ``kv_dtype``: the cache's, when it differs."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = bytes_per_block(arch, cache.block_size, kv_dtype or dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(cache.gpu_memory_fraction() * total) - (total - free)
        budget -= activation_reserve(arch, sched, dtype)
        if cache.kv_cache_memory_bytes is not None:
            budget = min(budget, cache.kv_cache_memory_bytes)
        knobs = "gpu_memory_utilization"
    else:
        budget = cache.cpu_kv_budget_bytes()
        knobs = "gpu_memory_utilization x kv_cache_memory_base, or kv_cache_memory_bytes"
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization: no memory left for the KV cache ({budget} bytes for "
            f"blocks of {per_block} bytes); raise {knobs} or set num_kv_blocks"
        )
    logger.info(
        "KV pool: %d blocks x %d tokens (%.1f MiB)",
        blocks,
        cache.block_size,
        blocks * per_block / 2**20,
    )
    return int(blocks)


def allocate_kv_caches(
    arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    shape = (arch.num_layers, num_blocks, block_size, 2 * arch.num_kv_heads, arch.head_dim)
    if dtype == torch.int8:  # each head's row: head_dim int8 values, then its scale
        shape = (
            arch.num_layers,
            *int8_cache_shape(num_blocks, block_size, arch.num_kv_heads, arch.head_dim),
        )
    pool = torch.zeros(shape, dtype=dtype, device=device)
    return list(pool.unbind(0))
