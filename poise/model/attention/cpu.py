"""Paged attention for CPU through the C++ kernels (cpu_paged_attention.cpp, cpu_prefill_attention.cpp).

Why: the torch backend copies every request's K/V blocks out of the paged cache in every layer
(``index_select``), pads rows to a common width, and attends a later prefill chunk through a
dense offset-causal mask over its whole context. The kernels read keys and values in place
through the block tables.

What runs where, per step (each kernel once per layer for all its work):
- decode tokens, and the generated tokens a chunk feeds (a speculative verify's, a
  recompute's): one *row* each in the decode kernel (cpu_paged_attention.cpp), query i seeing
  ``start + i + 1`` keys, keys split into partitions so one long row uses every thread; rows
  whose tables begin with the same blocks attend to those together (cascade groups,
  cpu_decode_cascade.h);
- every chunk's prompt tokens, fresh or after cached tokens: the blocked prefill kernel
  (cpu_prefill_attention.cpp), flash-attention style over (query block, kv head) items, bf16
  products on AMX tiles where the CPU has AMX (cpu_prefill_amx.h), AVX512-BF16 dot products
  where it has only those. Its cost is the causal pairs, not context^2. Chunks whose tables
  begin with the same blocks (the tails after one cached prefix) pack those keys once and, on
  the vector path, walk them together (cpu_prefill_share.h).

Why the route is by token, not by chunk size: each kernel has its own order of sums (the
decode kernel merges partitions by log-sum-exp, the prefill kernel walks key blocks), and
either gives a query the same bits wherever its chunk starts and whichever rows share its walk.
So every prompt token goes through the prefill kernel, a short tail after a cache hit too, and
answers the same cold, after a prefix-cache hit and following another request's prefill in
flight (a tail as decode rows answered differently from the same prompt cold:
benchmarks/RESULTS.md, cold bursts); every generated token through the decode kernel, so a
verified draft or a recomputed output sums as its decode did.

Same results as the torch backend up to float rounding (the tests compare both against
transformers).

The int8 KV cache (``--kv-cache-dtype int8``, kv_int8.py): the same rows and chunks through
the kernels' int8 entry points (cpu_paged_attention_int8.cpp, and the prefill kernel
dequantizing blocks as it packs them), the step's K/V quantized and written by
cpu_kv_write.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from poise.model.attention.common import write_kv
from poise.model.attention.cpu_kernel import load_cpu_kernel
from poise.model.attention.kv_int8 import is_int8_cache
from poise.model.attention.metadata import AttentionMetadata, PrefillChunk

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
SUPPORTED_DTYPES = tuple(_DTYPE_CODES)


@dataclass(frozen=True)
class KernelRows:
    """The step's kernel rows (see cpu_paged_attention.cpp): one per decode token and per
    generated query of a chunk, all attended in ONE kernel call per layer."""

    # [num_tables, width] int64: decode block tables, then one row per chunk with generated
    # queries.
    tables: torch.Tensor
    # [R] int64 each: the table row, the flat token and the visible keys of each kernel row.
    row_table: torch.Tensor
    row_token: torch.Tensor
    context_lens: torch.Tensor


@dataclass(frozen=True)
class KernelChunks:
    """The step's chunks for the prefill kernel (cpu_prefill_attention.cpp), [C] int64 each."""

    # [C, width] int64: each chunk's block table, padded with block 0 (never read).
    tables: torch.Tensor
    query_start: torch.Tensor
    query_len: torch.Tensor
    start_position: torch.Tensor


@dataclass(frozen=True)
class CpuAttentionState:
    meta: AttentionMetadata
    # None when the step has no decode token and no generated query in a chunk.
    rows: KernelRows | None
    # None when the step has no prompt token.
    chunks: KernelChunks | None


class CpuPagedAttentionBackend:
    name = "cpu"
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
        self._prefill_kernel = lib.poise_paged_prefill
        self._kernel_int8 = lib.poise_paged_attention_int8
        self._prefill_kernel_int8 = lib.poise_paged_prefill_int8
        self._write_int8 = lib.poise_write_kv_int8
        self._write_plain = lib.poise_write_kv
        self._use_cascade = lib.poise_decode_use_cascade
        # Shared-prefix groups in the decode kernel (cpu_decode_cascade.h; off:
        # --disable-cascade-attn). The kernel's switch is per process, so it is set before
        # every call: two engines in one process may differ.
        self.cascade = True

    def prepare(self, meta: AttentionMetadata) -> CpuAttentionState:
        prompts: list[PrefillChunk] = []
        generated: list[PrefillChunk] = []  # each chunk's generated queries, as a chunk
        for c in meta.prefills:
            n = c.query_len - c.num_generated
            if c.num_generated == 0:
                prompts.append(c)
            elif n > 0:
                prompts.append(PrefillChunk(c.query_start, n, c.start_position, c.block_table))
            if c.num_generated > 0:
                generated.append(
                    PrefillChunk(
                        c.query_start + n, c.num_generated, c.start_position + n, c.block_table
                    )
                )
        device = meta.slot_mapping.device
        return CpuAttentionState(meta, _rows(meta, generated), _chunks(prompts, device))

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
        int8 = is_int8_cache(kv_cache)
        if int8:
            self._write_kv_native(self._write_int8, kv, kv_cache, state.meta.slot_mapping)
        elif kv_cache.dtype == kv.dtype and kv.dtype in _DTYPE_CODES:
            self._write_kv_native(self._write_plain, kv, kv_cache, state.meta.slot_mapping)
        else:  # fp8 caches: torch's conversion and copy
            write_kv(kv, kv_cache, state.meta.slot_mapping)
        out = q.new_empty(q.shape)
        if state.rows is not None:
            self._attend_rows(q, kv_cache, state.rows, scale, out, int8)
        if state.chunks is not None:
            self._attend_chunks(q, kv_cache, state.chunks, scale, out, int8)
        return out

    def _write_kv_native(
        self, writer: Any, kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """kv [T, 2Hkv, hd] into the cache at the slots, one C++ call (cpu_kv_write.cpp):
        ``writer`` quantizes into the int8 cache or copies into one in kv's dtype."""
        if kv.stride(2) != 1 or kv.stride(1) != kv.shape[2]:
            raise ValueError("cpu attention: the step's k/v heads are not contiguous")
        slots = slot_mapping.contiguous()
        rc = writer(
            _DTYPE_CODES[kv.dtype],
            kv.data_ptr(),
            kv.stride(0),
            slots.data_ptr(),
            kv.shape[0],
            kv.shape[1],
            kv.shape[2],
            kv_cache.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"cpu attention: the K/V writer rejected its arguments ({rc})")

    def _attend_rows(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: KernelRows,
        scale: float,
        out: torch.Tensor,
        int8: bool = False,
    ) -> None:
        work = (rows.row_table, rows.row_token, rows.context_lens)
        if int8:  # the int8 kernel attends row by row (no cascade over int8 keys yet)
            _call(
                self._kernel_int8, q, kv_cache, rows.tables, work, scale, out, self.PARTITION_SIZE
            )
            return
        # Cascade reads the shared keys as the model dtype; a cache in another dtype goes row
        # by row.
        self._use_cascade(int(self.cascade and kv_cache.dtype == q.dtype))
        _call(self._kernel, q, kv_cache, rows.tables, work, scale, out, self.PARTITION_SIZE)

    def _attend_chunks(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        chunks: KernelChunks,
        scale: float,
        out: torch.Tensor,
        int8: bool = False,
    ) -> None:
        work = (chunks.query_start, chunks.query_len, chunks.start_position)
        kernel = self._prefill_kernel_int8 if int8 else self._prefill_kernel
        _call(kernel, q, kv_cache, chunks.tables, work, scale, out)


def _call(
    kernel: Any,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    work: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    out: torch.Tensor,
    *extra: int,
) -> None:
    """One kernel call (argument order in cpu_kernel.py): ``work`` is the three [N] int64
    arrays that say what to attend (rows, or chunks)."""
    _, num_heads, head_dim = q.shape
    rc = kernel(
        _DTYPE_CODES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        kv_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        *(t.data_ptr() for t in work),
        work[0].shape[0],
        num_heads,
        kv_cache.shape[2] // 2,
        head_dim,
        kv_cache.shape[1],
        scale,
        out.data_ptr(),
        out.stride(0),
        *extra,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"cpu attention kernel rejected its arguments (code {rc})")


def _rows(meta: AttentionMetadata, generated: list[PrefillChunk]) -> KernelRows | None:
    """The decode rows: one per decoding request, then one per generated query of a chunk,
    each with its table row."""
    device = meta.slot_mapping.device
    d = meta.num_decodes
    if d == 0 and not generated:
        return None
    width = max(
        [meta.decode_block_tables.shape[1] if meta.decode_block_tables is not None else 0]
        + [c.block_table.shape[0] for c in generated]
    )
    tables = torch.zeros(d + len(generated), width, dtype=torch.int64, device=device)
    row_table = [torch.arange(d, dtype=torch.int64, device=device)]
    row_token = [torch.arange(d, dtype=torch.int64, device=device)]
    context = [torch.empty(0, dtype=torch.int64, device=device)]
    if d:
        assert meta.decode_block_tables is not None
        assert meta.decode_context_lens is not None
        tables[:d, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
        context[0] = meta.decode_context_lens
    for k, chunk in enumerate(generated):
        tables[d + k, : chunk.block_table.shape[0]] = chunk.block_table
        queries = torch.arange(chunk.query_len, dtype=torch.int64, device=device)
        row_table.append(torch.full_like(queries, d + k))
        row_token.append(queries + chunk.query_start)
        context.append(queries + chunk.start_position + 1)
    return KernelRows(
        tables, torch.cat(row_table), torch.cat(row_token), torch.cat(context).contiguous()
    )


def _chunks(chunks: list[PrefillChunk], device: torch.device) -> KernelChunks | None:
    if not chunks:
        return None
    width = max(c.block_table.shape[0] for c in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64, device=device)
    for i, c in enumerate(chunks):
        tables[i, : c.block_table.shape[0]] = c.block_table
    fields = [[c.query_start, c.query_len, c.start_position] for c in chunks]
    columns = torch.tensor(fields, dtype=torch.int64, device=device).T.contiguous()
    return KernelChunks(tables, columns[0], columns[1], columns[2])
