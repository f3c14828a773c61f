"""Per-step attention metadata: where each flat token's K/V goes and what each query sees.

The flat batch of one step puts all decode tokens first, then the prefill chunks::

    flat index:  0 .. D-1 (one token per decoding request) | D .. T-1 (prefill chunks)
                 [d0 d1 d2 ... d(D-1)]                      [p0 p0 p0 | p1 p1 | p2 ...]

Slot mapping (one int per flat token) says where its K/V is written in the paged cache::

    slot = block_ids[position // block_size] * block_size + position % block_size
    kv_cache.view(num_blocks * block_size, 2 * kv_heads, head_dim)[slot] = (k heads, v heads)

A query at position p of a request attends to that request's tokens 0..p (causal), read back
through its block table. Metadata is built once per step (by the runner, runner/inputs.py); the
backend turns it into its own typed state once (``AttentionBackend.prepare``) and every layer
gets that state as an argument: there is no global context, and the metadata is never written
to after it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """One request's chunk of query tokens: flat[query_start : query_start + query_len]."""

    query_start: int
    query_len: int
    # Position of the chunk's first token = tokens of this request already in the cache.
    start_position: int
    # The request's block ids covering positions 0 .. start_position + query_len - 1.
    block_table: torch.Tensor  # [num_blocks_used] int64
    # The last this many queries are generated tokens, not the prompt's (a speculative verify's
    # drafts and the token before them, a recompute's output after preemption): a backend that
    # gives decodes and prefills different orders of sums attends them as it does decodes, so
    # they sum as they did (or would) one by one.
    num_generated: int = 0

    @property
    def context_len(self) -> int:
        return self.start_position + self.query_len


@dataclass(frozen=True)
class AttentionMetadata:
    # [T] int64: cache slot of each flat token (see module docstring).
    slot_mapping: torch.Tensor
    # Tokens per KV block (the cache's dim 1); block tables index blocks of this size.
    block_size: int
    # Decode part: the first num_decodes flat tokens, one per request.
    num_decodes: int = 0
    # [D, max_blocks] int64, padded with block 0 (masked out by context_lens).
    decode_block_tables: torch.Tensor | None = None
    # [D] int64: tokens visible to each decode query (its position + 1).
    decode_context_lens: torch.Tensor | None = None
    # (start, end, num_blocks): runs of decode rows whose contexts are within 2x of each
    # other, each attended with its own padded width (rows sorted longest first). Empty means
    # one group over all decodes at full width.
    decode_groups: list[tuple[int, int, int]] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
