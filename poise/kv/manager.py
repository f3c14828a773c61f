"""Per-request block tables on top of the block pool, and prefix caching.

A request's block table covers its first ``num_computed_tokens + num_new_tokens`` tokens::

    tokens:  [0 .. 15][16 .. 31][32 .. 40      ]      block_size = 16
    blocks:  [   7   ][   2    ][   9 (partial)]      block table = [7, 2, 9]
    slot of token t = block_table[t // block_size] * block_size + t % block_size

With prefix caching on, every *full* block of a request is registered under a key chained
from its parent's, so a later request whose prompt starts with the same tokens takes those
blocks (reference-counted) instead of recomputing them. At least the last prompt token is
always recomputed, so the runner has a position to sample from.

The scheduler's calls, in this order (each step, per request)::

    find_cached_prefix(request)                    admission only: blocks to reuse
      (lookup_prefix: the same, and who computes the next block now: wait for it)
    allocate_slots(id, num_computed_tokens=start,  table covers start + n tokens, or None
                   num_new_tokens=n, ...)          (nothing changed: preempt or wait)
    ... the executor writes KV for [start, start + n) ...
    expect_prefill(request, start)                 admission: the blocks it will fill
    cache_full_blocks(request, start + n)          after update advanced num_computed_tokens
    free(request)                                  on finish or preemption

In-flight sharing (``kv/inflight.py``): the keys of the full blocks an admitted request will
compute are known at admission; ``lookup_prefix`` tells a waiting request whose first uncached
block is one of them which running request computes it, so it can wait instead of computing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from poise.core.request import Request
from poise.kv.block_pool import BlockKey, BlockPool, block_key
from poise.kv.inflight import PendingBlocks


@dataclass
class PrefixCacheStats:
    """Totals since start, counted when a request is admitted (a lookup that led nowhere
    because the request had to wait again is not a query)."""

    queries: int = 0  # admissions that looked the prefix up
    hits: int = 0  # ... that found at least one cached block
    query_tokens: int = 0  # tokens of those requests (vLLM's prefix_cache_queries)
    hit_tokens: int = 0  # tokens taken from the cache (vLLM's prefix_cache_hits)
    # Of those: admissions that waited for another request's running prefill, and the tokens
    # they took that it computed meanwhile (in-flight sharing; part of hits / hit_tokens).
    inflight_hits: int = 0
    inflight_hit_tokens: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        # Per request: prefix keys of its full blocks so far (index i = block i).
        self._keys: dict[str, list[BlockKey]] = {}
        self.prefix_stats = PrefixCacheStats()
        # Full blocks running prefills will compute, by prefix key (in-flight sharing).
        self.pending = PendingBlocks()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (free-but-cached blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    # -- prefix caching -------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens (not yet taken).

        Stops one token short of the end, so at least one token is left to compute. None for
        a request that still needs prompt logprobs: every prompt position must be fed to get
        the logits it predicts (vLLM does the same).
        """
        return self.lookup_prefix(request)[0]

    def lookup_prefix(self, request: Request) -> tuple[list[int], str | None]:
        """``find_cached_prefix``, and the request whose running prefill is computing the first
        block past it now (None: nobody; that block is this request's to compute)."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [], None
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        blocks: list[int] = []
        key: BlockKey | None = None
        for i in range(max_blocks):
            key = block_key(key, tuple(request.token_ids_slice(i * bs, (i + 1) * bs)))
            block = self.pool.lookup(key)
            if block is None:
                return blocks, self.pending.owner(key)
            blocks.append(block)
        return blocks, None

    def expect_prefill(self, request: Request, num_computed_tokens: int) -> None:
        """Register the full blocks the admitted ``request`` will compute past
        ``num_computed_tokens`` (its cached prefix) as pending: theirs to wait for."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        keys: list[BlockKey] = []
        key: BlockKey | None = None
        for i in range(request.num_tokens // bs):
            key = block_key(key, tuple(request.token_ids_slice(i * bs, (i + 1) * bs)))
            if i >= num_computed_tokens // bs:
                keys.append(key)
        self.pending.expect(request.request_id, keys)

    def record_admission(
        self, num_tokens: int, num_cached_tokens: int, num_inflight_tokens: int = 0
    ) -> None:
        """Count one admitted request's prefix lookup (with prefix caching on);
        ``num_inflight_tokens`` of its cached tokens were computed while it waited for them."""
        if not self.enable_prefix_caching:
            return
        st = self.prefix_stats
        st.queries += 1
        st.query_tokens += num_tokens
        if num_cached_tokens:
            st.hits += 1
            st.hit_tokens += num_cached_tokens
        if num_inflight_tokens:
            st.inflight_hits += 1
            st.inflight_hit_tokens += num_inflight_tokens

    # -- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self,
        request_id: str,
        *,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        reserve_blocks: int = 0,
    ) -> list[int] | None:
        """Make the table cover ``num_computed_tokens + num_new_tokens`` tokens; None if it can't.

        Returns the newly allocated block ids; None means nothing changed. The caller passes
        where the request stands (``num_computed_tokens``, counting an admission's cached
        prefix) rather than this reading it off the request, because the scheduler only moves
        ``num_computed_tokens`` after a successful allocation. ``cached_blocks`` (from
        ``find_cached_prefix``, on admission) are taken before any new block.
        ``reserve_blocks`` must stay free afterwards (the admission safety margin).
        """
        table = self._tables.get(request_id, [])
        cached = cached_blocks or []
        total_tokens = num_computed_tokens + num_new_tokens
        if not cached and table and total_tokens <= len(table) * self.block_size:
            return []  # fast path (most decode steps): the new tokens fit in the last block
        need = self.blocks_for(total_tokens) - len(table) - len(cached)
        # Cached blocks sitting in the free queue stop being free when taken.
        revived = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
        if need + revived + reserve_blocks > self.pool.num_free_blocks:
            return None
        if cached:
            self.pool.touch(cached)
        new_blocks = self.pool.allocate(max(need, 0))
        self._tables[request_id] = table + cached + new_blocks
        return new_blocks

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the full blocks among the first ``num_computed_tokens`` tokens for reuse.

        Called after a step computed them (``update`` advanced ``num_computed_tokens``), never
        before: a registered block must hold the tokens its key names.
        """
        if not self.enable_prefix_caching or request.request_id not in self._tables:
            return
        table = self._tables[request.request_id]
        keys = self._keys.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(keys), num_computed_tokens // bs):
            key = block_key(
                keys[-1] if keys else None, tuple(request.token_ids_slice(i * bs, (i + 1) * bs))
            )
            keys.append(key)
            self.pool.cache(table[i], key)
            self.pending.computed(request.request_id, key)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past the first ``num_tokens`` tokens (tail first): speculative
        decoding allocated slots for drafts the target rejected. Those blocks were taken this
        step for positions never computed, so none is shared or registered in the cache."""
        table = self._tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        if table is None or len(table) <= keep:
            return
        self.pool.free(table[keep:][::-1])
        del table[keep:]

    def free(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        self.pending.release(request.request_id)
        if table:
            # Tail first: the end of a sequence is the least likely to be shared.
            self.pool.free(table[::-1])

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"{rid} holds a block twice"
            for block in table:
                refs[block] += 1
        assert refs == self.pool.ref_counts, "ref counts differ from block tables"
        self.pending.check(self._tables.keys())
