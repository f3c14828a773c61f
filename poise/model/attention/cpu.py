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
- torch SDPA (gather + offset-causal mask), as do chunks at position 0 (fresh k/v only, no
  cache read), where SDPA's blocked matmuls beat a per-query loop.

All kernel rows of a step run in ONE call per layer. Same results as the torch backend up to
float rounding (the tests compare both against transformers).
"""

from __future__ import annotations

import torch

from poise.model.attention.cpu_kernel import load_cpu_kernel
from poise.model.attention.metadata import AttentionMetadata
from poise.model.attention.torch_ref import TorchAttentionBackend, write_kv

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
SUPPORTED_DTYPES = tuple(_DTYPE_CODES)


class CpuPagedAttentionBackend(TorchAttentionBackend):
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

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        state = meta.backend_state
        kernel_chunks = [
            i
            for i, c in enumerate(meta.prefills)
            if c.start_position > 0 and c.query_len <= self.MAX_KERNEL_CHUNK
        ]
        state["sdpa_chunks"] = [i for i in range(len(meta.prefills)) if i not in kernel_chunks]
        self._prepare_prefill_masks(meta, state["sdpa_chunks"])
        d = meta.num_decodes
        if d == 0 and not kernel_chunks:
            return
        device = meta.slot_mapping.device
        chunk_tables = [meta.prefills[i].block_table for i in kernel_chunks]
        width = max(
            [meta.decode_block_tables.shape[1] if meta.decode_block_tables is not None else 0]
            + [t.shape[0] for t in chunk_tables]
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
        for k, (i, table) in enumerate(zip(kernel_chunks, chunk_tables, strict=True)):
            chunk = meta.prefills[i]
            tables[d + k, : table.shape[0]] = table
            queries = torch.arange(chunk.query_len, dtype=torch.int64, device=device)
            row_table.append(torch.full_like(queries, d + k))
            row_token.append(queries + chunk.query_start)
            context.append(queries + chunk.start_position + 1)
        state["cpu_rows"] = (
            tables,
            torch.cat(row_table),
            torch.cat(row_token),
            torch.cat(context).contiguous(),
        )

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, hd], kv [T, 2Hkv, hd] -> out [T, H, hd]."""
        # The kernel walks raw memory: heads contiguous inside a token, cache fully contiguous.
        if q.stride(2) != 1 or q.stride(1) != q.shape[2] or not kv_cache.is_contiguous():
            raise ValueError("cpu attention: q heads or the KV cache are not contiguous")
        write_kv(kv, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        rows = meta.backend_state.get("cpu_rows")
        if rows is not None:
            self._attend_rows(q, kv_cache, rows, scale, out)
        for i in meta.backend_state["sdpa_chunks"]:
            chunk = meta.prefills[i]
            s, e = chunk.query_start, chunk.query_start + chunk.query_len
            out[s:e] = self._prefill(i, chunk, q[s:e], kv[s:e], kv_cache, meta, scale)
        return out

    def _attend_rows(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        tables, row_table, row_token, context = rows
        _, num_heads, head_dim = q.shape
        rc = self._kernel(
            _DTYPE_CODES[q.dtype],
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            row_table.data_ptr(),
            row_token.data_ptr(),
            context.data_ptr(),
            row_token.shape[0],
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
