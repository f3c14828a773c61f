"""KV cache metadata: block pool, per-request block tables, prefix caching. No tensors."""

from __future__ import annotations

from poise.kv.block_pool import BlockPool
from poise.kv.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
