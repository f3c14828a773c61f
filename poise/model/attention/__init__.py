"""Paged attention backends behind a registry.

A backend reads and writes the paged KV cache of one layer. Interface (see ``base.py``):

- ``prepare(meta, block_size)``: once per step, derive what every layer reuses (masks, gather
  indices) into ``meta.backend_state``.
- ``forward(q, kv, kv_cache, meta, scale) -> out``: write this step's k/v at
  ``meta.slot_mapping``, then attend. q [T, H, hd]; kv [T, 2Hkv, hd] (k heads then v heads,
  k already rotated); kv_cache [num_blocks, block_size, 2Hkv, hd] (layout and its reasons in
  torch_ref.py; ``key_view``/``value_view`` give [num_blocks, block_size, Hkv, hd] views);
  out [T, H, hd].

Registered: ``torch`` (reference; CPU and GPU) and ``cpu`` (a C++ kernel that reads the paged
cache in place, built on first use; see cpu.py). ``auto`` picks ``cpu`` on a CPU device when the
kernel builds and the dtype is float32 or bfloat16, else ``torch``. A GPU backend (flash-attn
varlen, SDPA varlen) registers itself with ``register_backend(name, cls)`` and is chosen by name.
"""

from __future__ import annotations

import torch

from poise.model.attention.base import AttentionBackend
from poise.model.attention.cpu import SUPPORTED_DTYPES as CPU_KERNEL_DTYPES
from poise.model.attention.cpu import CpuPagedAttentionBackend
from poise.model.attention.cpu_kernel import load_cpu_kernel
from poise.model.attention.metadata import AttentionMetadata, PrefillChunk
from poise.model.attention.torch_ref import TorchAttentionBackend, key_view, value_view

_REGISTRY: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "cpu": CpuPagedAttentionBackend,
}


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    _REGISTRY[name] = cls


def get_backend(name: str = "torch") -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"attention backend {name!r} unknown; have {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> the fastest backend that works here; other names are checked and kept."""
    if name == "auto":
        usable = device.type == "cpu" and dtype in CPU_KERNEL_DTYPES
        return "cpu" if usable and load_cpu_kernel() is not None else "torch"
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend: unknown {name!r}; have {sorted(_REGISTRY)}")
    if name == "cpu" and (device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES):
        raise ValueError(
            f"attention_backend: 'cpu' runs on a CPU device in float32 or bfloat16, "
            f"not {device.type} / {str(dtype).removeprefix('torch.')}"
        )
    return name


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuPagedAttentionBackend",
    "PrefillChunk",
    "TorchAttentionBackend",
    "available_backends",
    "get_backend",
    "key_view",
    "register_backend",
    "resolve_backend_name",
    "value_view",
]
