"""The KV block pool: which physical blocks are in use, free, or free-but-still-cached.

Only metadata lives here; the tensors are the runner's. Invariants (see ``check_invariants``):
- every block is either referenced (ref_count > 0, not in the free queue) or free
  (ref_count == 0, in the free queue exactly once);
- a free block may still carry a prefix-cache key, so a later request with the same prefix can
  take it back (a cache hit) until it is handed out for something else (an eviction);
- the free queue is LRU: blocks are handed out from its front, and freed blocks go to its back.
"""

from __future__ import annotations

from collections import OrderedDict

# A block's prefix-cache key: (parent block's key hash, the block's token ids). Chaining the
# parent makes a key identify the whole prefix, not just the block's own tokens.
BlockKey = tuple[int | None, tuple[int, ...]]


def block_key(parent: BlockKey | None, tokens: tuple[int, ...]) -> BlockKey:
    """The key of a block holding ``tokens`` after the block keyed ``parent`` (None: first)."""
    return (None if parent is None else hash(parent), tokens)


def prefix_keys(token_ids: list[int], block_size: int, max_blocks: int) -> list[BlockKey]:
    """Keys of the first ``max_blocks`` full blocks of ``token_ids``, each chained to the last.

    The router hashes a prompt's opening blocks with this so that its idea of "same prefix" is
    the KV cache's own (python's hash of int tuples is the same in every process).
    """
    keys: list[BlockKey] = []
    for i in range(min(max_blocks, len(token_ids) // block_size)):
        keys.append(
            block_key(
                keys[-1] if keys else None, tuple(token_ids[i * block_size : (i + 1) * block_size])
            )
        )
    return keys


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # OrderedDict as an O(1) LRU set: front = least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        # Cached blocks handed out for something else since start (prefix-cache evictions).
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the LRU front, evicting their cache keys. Caller checked space."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._block_key[block]
            if key is not None:
                del self._cached[key]
                self.num_evictions += 1
                self._block_key[block] = None
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block. Pass tail blocks first: they are evicted first."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def lookup(self, key: BlockKey) -> int | None:
        return self._cached.get(key)

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit), reviving free ones."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def cache(self, block: int, key: BlockKey) -> None:
        """Register a full block under its prefix key (first writer wins)."""
        if self._block_key[block] is None and key not in self._cached:
            self._cached[key] = block
            self._block_key[block] = key

    def check_invariants(self) -> None:
        assert len(self._free) == sum(1 for r in self.ref_counts if r == 0), "free queue size"
        for block, ref in enumerate(self.ref_counts):
            assert ref >= 0, f"block {block} has ref_count {ref}"
            assert (ref == 0) == (block in self._free), f"block {block} free-queue mismatch"
        for key, block in self._cached.items():
            assert self._block_key[block] == key, f"cache key mismatch on block {block}"
