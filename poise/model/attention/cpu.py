"""Paged attention for CPU through the C++ kernel (cpu_paged_attention.cpp).

Why: the torch backend copies every decoding request's K/V blocks out of the paged cache in
every layer (``index_select``) and pads rows to a common width; at the seed's 3.4k-token
contexts that copy costs as much as the attention. The kernel reads keys and values in place
through the block tables, one (row, partition of keys) work item per OpenMP task.

What runs where, per step:
- decode tokens: one kernel row each (context = its position + 1);
- a prefill chunk that starts after cached tokens (a prefix-cache hit, a later chunk, a
  recompute) with at most ``MAX_KERNEL_CHUNK`` queries: one kernel row per query, query i
  seeing ``start + i + 1`` keys. Cost grows as queries x context, so longer chunks go to
- torch SDPA (gather + offset-causal mask, common.py), as do chunks at position 0 (fresh k/v
  only, no cache read), where SDPA's blocked matmuls beat a per-query loop.

All kernel rows of a step run in ONE call per layer. Same results as the torch backend up to
float rounding (the tests compare both against transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poise.model.attention.common import SdpaPrefill, prefill_attention, sdpa_prefills, write_kv
from poise.model.attention.cpu_kernel import load_cpu_kernel
from poise.model.attention.metadata import AttentionMetadata, PrefillChunk

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
SUPPORTED_DTYPES = tuple(_DTYPE_CODES)


@dataclass(frozen=True)
class KernelRows:
    """The step's kernel rows (see cpu_paged_attention.cpp): one per decode token and per
    query of a kernel-run chunk, all attended in ONE kernel call per layer."""

    # [num_tables, width] int64: decode block tables, then one row per kernel-run chunk.
    tables: torch.Tensor
    # [R] int64 each: the table row, the flat token and the visible keys of each kernel row.
    row_table: torch.Tensor
    row_token: torch.Tensor
    context_lens: torch.Tensor


@dataclass(frozen=True)
class CpuAttentionState:
    meta: AttentionMetadata
    # None when the step has no decode token and no short cached-context chunk.
    rows: KernelRows | None
    # The chunks left to SDPA, with their masks.
    prefills: tuple[SdpaPrefill, ...]


class CpuPagedAttentionBackend:
    name = "cpu"
    # Longest cached-context chunk run as kernel rows (see module docstring).
    MAX_KERNEL_CHUNK = 64
    # Keys per work item: small enough that one long row splits over the threads, large enough
    # that the per-item merge stays negligible.
    PARTITION_SIZE = 256

    def __init__(self) -> None:
        lib = load_cpu_kernel()
        if lib is None:
            raise RuntimeError(
                "attention backend 'cpu': the C++ kernel could not be built (see the log); "
                "use attention_backend='torch'"
            )
        self._kernel = lib.poise_paged_attention

    def prepare(self, meta: AttentionMetadata) -> CpuAttentionState:
        kernel_chunks: list[PrefillChunk] = []
        sdpa_chunks: list[PrefillChunk] = []
        for c in meta.prefills:
            short_after_cache = c.start_position > 0 and c.query_len <= self.MAX_KERNEL_CHUNK
            (kernel_chunks if short_after_cache else sdpa_chunks).append(c)
        device = meta.slot_mapping.device
        prefills = sdpa_prefills(sdpa_chunks, device)
        d = meta.num_decodes
        if d == 0 and not kernel_chunks:
            return CpuAttentionState(meta, None, prefills)
        width = max(
            [meta.decode_block_tables.shape[1] if meta.decode_block_tables is not None else 0]
            + [c.block_table.shape[0] for c in kernel_chunks]
        )
        tables = torch.zeros(d + len(kernel_chunks), width, dtype=torch.int64, device=device)
        row_table = [torch.arange(d, dtype=torch.int64, device=device)]
        row_token = [torch.arange(d, dtype=torch.int64, device=device)]
        context = [torch.empty(0, dtype=torch.int64, device=device)]
        if d:
            assert meta.decode_block_tables is not None
            assert meta.decode_context_lens is not None
            tables[:d, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
            context[0] = meta.decode_context_lens
        for k, chunk in enumerate(kernel_chunks):
            tables[d + k, : chunk.block_table.shape[0]] = chunk.block_table
            queries = torch.arange(chunk.query_len, dtype=torch.int64, device=device)
            row_table.append(torch.full_like(queries, d + k))
            row_token.append(queries + chunk.query_start)
            context.append(queries + chunk.start_position + 1)
        rows = KernelRows(
            tables, torch.cat(row_table), torch.cat(row_token), torch.cat(context).contiguous()
        )
        return CpuAttentionState(meta, rows, prefills)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        state: CpuAttentionState,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, hd], kv [T, 2Hkv, hd] -> out [T, H, hd]."""
        # The kernel walks raw memory: heads contiguous inside a token, cache fully contiguous.
        if q.stride(2) != 1 or q.stride(1) != q.shape[2] or not kv_cache.is_contiguous():
            raise ValueError("cpu attention: q heads or the KV cache are not contiguous")
        write_kv(kv, kv_cache, state.meta.slot_mapping)
        out = q.new_empty(q.shape)
        if state.rows is not None:
            self._attend_rows(q, kv_cache, state.rows, scale, out)
        for prefill in state.prefills:
            prefill_attention(prefill, q, kv, kv_cache, scale, out)
        return out

    def _attend_rows(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: KernelRows,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        _, num_heads, head_dim = q.shape
        rc = self._kernel(
            _DTYPE_CODES[q.dtype],
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            rows.tables.data_ptr(),
            rows.tables.stride(0),
            rows.row_table.data_ptr(),
            rows.row_token.data_ptr(),
            rows.context_lens.data_ptr(),
            rows.row_token.shape[0],
            num_heads,
            kv_cache.shape[2] // 2,
            head_dim,
            kv_cache.shape[1],
            scale,
            out.data_ptr(),
            out.stride(0),
            self.PARTITION_SIZE,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"cpu attention kernel rejected its arguments (code {rc})")
