"""The attention backend protocol (see the package docstring for shapes)."""

from __future__ import annotations

from typing import Protocol

import torch

from poise.model.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
