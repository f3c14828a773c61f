"""Paged attention on PyTorch FlexAttention, compiled: one code path for CPU and CUDA.

Why: FlexAttention turns a ``mask_mod`` into a fused block-sparse attention kernel through
``torch.compile`` (Triton on CUDA, inductor's C++ template on CPU), so the same Python here
is the GPU backend and runs, and is tested, on the CPU. How the paged cache is read (the
whole cache as one key sequence, a mask through the block tables): flex_mask.py.

Per step (``prepare``): the tables and the block mask, once for every layer. Per layer
(``forward``): the K/V write (``common.write_kv``), the flat queries padded to their bucket
and viewed as [1, H, Tp, hd], the cache's K and V halves viewed (no copy) as
[1, Hkv, num_blocks * block_size, hd], one compiled ``flex_attention`` call with
``enable_gqa`` (query head h uses kv head h // (H // Hkv), transformers' ``repeat_kv``), and
the first T rows back as [T, H, hd].

Compile cost: one compile per (query bucket, table-width bucket, cache size, head shape,
dtype), paid the first time a shape is seen; inductor caches the compiled code on disk
(``TORCHINDUCTOR_CACHE_DIR``, default /tmp/torchinductor_$USER), so a restart reloads it in
about a second. Buckets grow 4x (flex_mask.bucket), so a run sees a handful.
Dynamic shapes would need one compile only, but inductor's CPU template does not build with
them in torch 2.13 (a C++ error on ``cur_qSplitSize1``), so shapes stay static.

Known defect, CPUs without AVX-512: inductor's compiled CPU kernel returned NaN for some queries
(torch 2.13, AMD Zen 3: test_flex_under_preemption_and_prefix_caching, rows that had visible
keys, while eager ``flex_attention`` on the same inputs was finite); such a request fails with
the engine's non-finite-logits error and the others go on. The backend logs a warning there.

Sliding windows: ``FlexAttentionBackend(sliding_window=W)`` attends each query to its last W
keys (itself included), transformers' rule; the engine itself still clamps max_model_len to
a model's window (checkpoint/arch.py), where every backend is exact.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from poise.model.attention.common import write_kv
from poise.model.attention.flex_mask import Q_BLOCK, FlexTables, build_tables
from poise.model.attention.metadata import AttentionMetadata
from poise.model.cpu_build import cpu_flags

logger = logging.getLogger(__name__)

# Key slots and queries per block of the block mask on CUDA: FlexAttention's default sparse
# block size. Its Triton kernels skip every tiling whose BLOCK_M / BLOCK_N does not divide
# the sparse sizes (64 or 128 rows), so a 16-query block would leave none. On CPU the cache
# block is the key unit and 16 queries the query unit (decode rows of different requests
# sharing a query block each read the union of their blocks: smaller is less waste).
CUDA_KV_BLOCK = 128
CUDA_Q_BLOCK = 128
# Distinct shapes torch.compile may specialise flex_attention for before it falls back to
# eager (dynamo's default is 8; buckets x models x cache sizes of a test run exceed it).
RECOMPILE_LIMIT = 64


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)``, made once per process (compiling is lazy)."""
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False)


@dataclass(frozen=True)
class FlexAttentionState:
    meta: AttentionMetadata
    # Cache size (num_blocks) -> (tables, BlockMask over [Tp queries, all cache slots]).
    # The cache size is not in the metadata (it is fixed per run), so the first layer's
    # forward builds the entry and every other layer of the step reuses it.
    built: dict[int, tuple[FlexTables, Any]] = field(default_factory=dict, compare=False)


def kv_block_size(device: torch.device, block_size: int) -> int:
    """Key slots per block-mask block: a whole number of cache blocks."""
    if device.type != "cuda":
        return block_size
    return block_size * -(-CUDA_KV_BLOCK // block_size)


def q_block_size(device: torch.device) -> int:
    return CUDA_Q_BLOCK if device.type == "cuda" else Q_BLOCK


class FlexAttentionBackend:
    name = "flex"
    # A decode-only step's tables and block mask are tensor work only (flex_mask.py), so it
    # can be captured into a graph (runner/graphs.py); the one host-read check is skipped
    # while a CUDA graph is being captured.
    decode_capturable = True

    def __init__(self, sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"flex attention: sliding_window must be > 0, got {sliding_window}")
        self.sliding_window = sliding_window
        self._flex = compiled_flex_attention()
        if not torch.cuda.is_available() and "avx512f" not in cpu_flags():
            logger.warning(
                "flex attention on a CPU without AVX-512: torch's compiled kernel has returned "
                "NaN for some queries here (those requests fail); --attention-backend auto "
                "runs poise's own kernels"
            )

    def prepare(self, meta: AttentionMetadata) -> FlexAttentionState:
        return FlexAttentionState(meta)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        state: FlexAttentionState,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, hd], kv [T, 2Hkv, hd] -> out [T, H, hd]."""
        write_kv(kv, kv_cache, state.meta.slot_mapping)
        num_blocks = kv_cache.shape[0]
        if num_blocks not in state.built:
            state.built[num_blocks] = self.build(state.meta, num_blocks)
        tables, block_mask = state.built[num_blocks]
        t, num_heads, head_dim = q.shape
        num_blocks, bs, two_hkv, _ = kv_cache.shape
        hkv = two_hkv // 2
        padded = q.new_zeros(tables.padded_tokens, num_heads, head_dim)
        padded[:t] = q
        qf = padded.permute(1, 0, 2).unsqueeze(0)  # [1, H, Tp, hd]
        slots = kv_cache.view(num_blocks * bs, two_hkv, head_dim)
        kf = slots[:, :hkv].permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, N*bs, hd], a view
        vf = slots[:, hkv:].permute(1, 0, 2).unsqueeze(0)
        out = self._flex(qf, kf, vf, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[0, :, :t].permute(1, 0, 2)  # [1, H, Tp, hd] -> [T, H, hd]

    def build(self, meta: AttentionMetadata, num_blocks: int) -> tuple[FlexTables, Any]:
        """The tables and the BlockMask of one step over a cache of ``num_blocks`` blocks."""
        from torch.nn.attention.flex_attention import BlockMask

        bs = meta.block_size
        kv_block = kv_block_size(meta.slot_mapping.device, bs)
        device = meta.slot_mapping.device
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        q_block = q_block_size(device)
        tables = build_tables(
            meta, num_blocks, kv_block, self.sliding_window, not capturing, q_block
        )
        mask_mod = _mask_mod(tables, bs, self.sliding_window)
        block_mask = BlockMask.from_kv_blocks(
            tables.kv_num_blocks,
            tables.kv_indices,
            BLOCK_SIZE=(q_block, kv_block),
            mask_mod=mask_mod,
            seq_lengths=(tables.padded_tokens, num_blocks * bs),
        )
        return tables, block_mask


def _mask_mod(tables: FlexTables, block_size: int, window: int | None) -> Callable[..., Any]:
    """The visibility rule of flex_mask.py's docstring, over the step's tables."""
    q_row, q_pos = tables.q_row, tables.q_pos
    rows, block_logical = tables.tables, tables.block_logical

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        block = kv_idx // block_size
        logical = block_logical[block]
        held = (logical >= 0) & (rows[q_row[q_idx], logical.clamp(min=0)] == block)
        key_pos = logical * block_size + kv_idx % block_size
        visible = held & (key_pos <= q_pos[q_idx])
        if window is not None:
            visible = visible & (q_pos[q_idx] - key_pos < window)
        return visible

    return mask_mod
