"""Paged attention backends.

The contract a backend implements is ``AttentionBackend`` (base.py): ``prepare(meta) -> state``
once per step, ``forward(q, kv, kv_cache, state, scale) -> out`` once per layer; the step's
metadata is in metadata.py, helpers every backend may reuse (cache layout, K/V write, SDPA
decode and prefill) are plain functions in common.py.

Written: ``torch`` (torch_ref.py: the reference, CPU and GPU), ``cpu`` (cpu.py: a C++
kernel that reads the paged cache in place, built on first use by cpu_kernel.py) and ``flex``
(flex.py: PyTorch FlexAttention through torch.compile, the same code on CPU and CUDA). Which one a
run uses is the runner's choice (poise/runner/attention.py: the registry and ``auto``); the
model receives the backend instance from the runner with each forward.
"""

from __future__ import annotations

from poise.model.attention.base import AttentionBackend
from poise.model.attention.common import key_view, value_view
from poise.model.attention.cpu import CpuAttentionState, CpuPagedAttentionBackend
from poise.model.attention.flex import FlexAttentionBackend, FlexAttentionState
from poise.model.attention.metadata import AttentionMetadata, PrefillChunk
from poise.model.attention.torch_ref import TorchAttentionBackend, TorchAttentionState

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttentionState",
    "CpuPagedAttentionBackend",
    "FlexAttentionBackend",
    "FlexAttentionState",
    "PrefillChunk",
    "TorchAttentionBackend",
    "TorchAttentionState",
    "key_view",
    "value_view",
]
