"""Paged attention backends behind a registry.

A backend reads and writes the paged KV cache of one layer. Interface (see ``base.py``):

- ``prepare(meta, block_size)``: once per step, derive what every layer reuses (masks, gather
  indices) into ``meta.backend_state``.
- ``forward(q, kv, kv_cache, meta, scale) -> out``: write this step's k/v at
  ``meta.slot_mapping``, then attend. q [T, H, hd]; kv [T, 2Hkv, hd] (k heads then v heads,
  k already rotated); kv_cache [num_blocks, block_size, 2Hkv, hd] (layout and its reasons in
  torch_ref.py; ``key_view``/``value_view`` give [num_blocks, block_size, Hkv, hd] views);
  out [T, H, hd].

Registered: ``torch`` (reference; CPU and GPU). A GPU backend (flash-attn varlen, SDPA
varlen) registers itself with ``register_backend(name, cls)`` and is chosen by name.
"""

from __future__ import annotations

from poise.model.attention.base import AttentionBackend
from poise.model.attention.metadata import AttentionMetadata, PrefillChunk
from poise.model.attention.torch_ref import TorchAttentionBackend, key_view, value_view

_REGISTRY: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    _REGISTRY[name] = cls


def get_backend(name: str = "torch") -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"attention backend {name!r} unknown; have {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "PrefillChunk",
    "TorchAttentionBackend",
    "available_backends",
    "get_backend",
    "key_view",
    "register_backend",
    "value_view",
]
