"""The attention backend contract: what a new backend (a GPU one, say) implements."""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from poise.model.attention.metadata import AttentionMetadata

StateT = TypeVar("StateT")


class AttentionBackend(Protocol[StateT]):
    """Paged attention over one layer's KV cache, in two calls per step.

    ``prepare(meta) -> state``: once per step, before the first layer. ``meta``
    (metadata.py) describes the flat batch: decode tokens first, then prefill chunks, the
    slot each token's K/V goes to, block tables and context lengths. Derive here everything
    that depends on the step but not on the layer (masks, kernel row lists, device copies of
    tables, a flash-attn ``cu_seqlens``) and return it as the backend's own frozen dataclass,
    which must keep whatever ``forward`` needs from ``meta`` (its ``meta`` field, usually).
    ``meta`` is read-only: nothing is stashed on it.

    ``forward(q, kv, kv_cache, state, scale) -> out``: once per layer, with the state that
    ``prepare`` returned for this step. It must

    1. write this step's k/v into the cache at ``state.meta.slot_mapping``
       (``common.write_kv``), before reading it: a chunk's queries see its own keys;
    2. attend each query to its request's keys at positions ``0 .. position`` (causal), read
       through the request's block table, with the given softmax ``scale``;
    3. return ``out`` [T, H, hd] in the flat order of ``q``.

    Shapes: q [T, H, hd] (a strided view of the fused qkv output: heads contiguous within a
    token); kv [T, 2Hkv, hd] (k heads then v heads, k already rotated); kv_cache
    [num_blocks, block_size, 2Hkv, hd] (layout in common.py; ``key_view`` / ``value_view``
    give [num_blocks, block_size, Hkv, hd] views). GQA: query head h uses kv head
    h // (H // Hkv), as transformers' ``repeat_kv``. Padded block-table entries point at
    block 0, whose contents are arbitrary: mask them out.

    A backend keeps no per-step or per-request state on itself: all of a step is in its
    state, so one instance serves every layer and every step.
    Helpers shared between backends are plain functions in common.py, not inherited methods.

    Adding one: write ``<name>.py`` here with the state dataclass and the class, register it
    in ``poise/runner/attention.py`` (devices, dtypes, and its place in the ``auto`` order),
    add the name to ``config.ATTENTION_BACKENDS``, and add it to the backend tests
    (tests/model/test_attention.py runs every registered backend against dense attention).
    """

    name: str

    def prepare(self, meta: AttentionMetadata) -> StateT: ...

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        state: StateT,
        scale: float,
    ) -> torch.Tensor: ...
