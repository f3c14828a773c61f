"""Blocks that running prefills are computing now: the KV side of in-flight prefix sharing.

The prefix cache only knows blocks whose tokens are computed (``cache_full_blocks`` registers a
block after the step that wrote it). A request admitted with a long prompt will fill many more
full blocks over its next chunks; their prefix keys are known the moment it is admitted (they
are chained hashes of its tokens). This registry holds those keys, each with the request that
will compute it, so that a waiting request whose first uncached block is one of them can wait
for it (``sched/inflight.py``) instead of computing the same tokens a second time.

Invariants (``check``): a key has exactly one owner, and its owner holds a block table (it is
running); a key leaves the registry when its owner computes it (then it is in the prefix
cache) or when its owner's blocks are freed (finish, abort, failure, preemption), which is what
lets a waiting follower take over.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from poise.kv.block_pool import BlockKey


class PendingBlocks:
    def __init__(self) -> None:
        self._owner: dict[BlockKey, str] = {}
        self._by_request: dict[str, set[BlockKey]] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, key: BlockKey) -> str | None:
        """The request computing the block keyed ``key`` now, or None."""
        return self._owner.get(key)

    def expect(self, request_id: str, keys: Iterable[BlockKey]) -> None:
        """``request_id`` will compute these blocks. A key another request already computes
        stays that one's (first writer wins, as in the prefix cache)."""
        mine = self._by_request.setdefault(request_id, set())
        for key in keys:
            if key not in self._owner:
                self._owner[key] = request_id
                mine.add(key)

    def computed(self, request_id: str, key: BlockKey) -> None:
        """The block is written and registered in the prefix cache: nobody waits on it now."""
        mine = self._by_request.get(request_id)
        if mine is not None and key in mine:
            mine.discard(key)
            del self._owner[key]

    def release(self, request_id: str) -> None:
        """The request lost its blocks: the keys it would have computed are nobody's now."""
        for key in self._by_request.pop(request_id, ()):
            del self._owner[key]

    def check(self, holders: Collection[str]) -> None:
        total = 0
        for rid, keys in self._by_request.items():
            assert not keys or rid in holders, f"{rid} owns pending blocks but holds no table"
            for key in keys:
                assert self._owner.get(key) == rid, f"pending key of {rid} owned by another"
            total += len(keys)
        assert total == len(self._owner), "pending keys without an owner's record"
