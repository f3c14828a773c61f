"""Bytes a token's K and V take in the KV pool, per ``--kv-cache-dtype`` (pure Python: the
runner sizes its pool with it and the simulator's capacity model shares the rule).

``auto`` / fp8: ``2 * layers * kv_heads * head_dim`` values of the cache dtype. ``int8``: each
(token, head) row of K or V is ``head_dim`` int8 values followed by its bf16 scale
(model/attention/kv_int8.py), ``head_dim + 2`` bytes: 1.94x the tokens of a bf16 pool at
head_dim 64, 1.97x at 128.
"""

from __future__ import annotations

# Bytes of the per-(token, head) scale stored after each int8 row (a bf16).
INT8_SCALE_BYTES = 2


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, value_bytes: int
) -> int:
    """K + V bytes of one token over all layers. ``value_bytes``: the element size of the
    cache dtype where it is not int8 (the model dtype's for ``auto``)."""
    rows = 2 * num_layers * num_kv_heads
    if kv_cache_dtype == "int8":
        return rows * (head_dim + INT8_SCALE_BYTES)
    return rows * head_dim * value_bytes
