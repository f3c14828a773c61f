"""Drive our model through the paged cache by hand (no scheduler): requests get shuffled,
non-contiguous blocks, and each step's chunks go through ``build_step_inputs``."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from poise.core.outputs import ScheduledRequest
from poise.core.sampling_params import SamplingParams
from poise.model.attention import AttentionBackend, TorchAttentionBackend
from poise.model.llama import LlamaForCausalLM
from poise.model.loader import load_model
from poise.runner.inputs import build_step_inputs


@dataclass
class PagedHarness:
    model: LlamaForCausalLM
    block_size: int = 4
    num_blocks: int = 64
    seed: int = 0
    # The runner's choice in production (runner/attention.py); the reference one by default.
    attention: AttentionBackend[Any] = field(default_factory=TorchAttentionBackend)
    caches: list[torch.Tensor] = field(init=False)
    device: torch.device = field(init=False)
    tables: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        a = self.model.arch
        dtype = self.model.model.embed_tokens.weight.dtype
        self.device = self.model.model.embed_tokens.weight.device
        shape = (self.num_blocks, self.block_size, 2 * a.num_kv_heads, a.head_dim)
        # Filled with large finite garbage: a read of an unwritten slot inside a context would
        # wreck the logits, while masked-out padding contributes exactly 0 (NaN would not).
        self.caches = [
            torch.full(shape, 1e4, dtype=dtype, device=self.device) for _ in range(a.num_layers)
        ]
        self._free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self._free)

    def _blocks(self, rid: str, length: int) -> list[int]:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.block_size < length:
            table.append(self._free.pop())
        return table

    def step(self, chunks: list[tuple[str, list[int], int]]) -> dict[str, torch.Tensor]:
        """chunks: (request id, token ids, start position). Returns rid -> logits [n, V]."""
        scheduled = [
            ScheduledRequest(
                request_id=rid,
                token_ids=ids,
                start_position=start,
                block_ids=list(self._blocks(rid, start + len(ids))),
                sample=True,
                sampling_params=SamplingParams(temperature=0.0),
                output_index=0,
                num_prompt_tokens=start + len(ids),
            )
            for rid, ids, start in chunks
        ]
        inputs = build_step_inputs(scheduled, self.block_size, self.device)
        with torch.inference_mode():
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.caches, inputs.meta, self.attention
            )
            logits = self.model.compute_logits(hidden)
        starts = inputs.flat_starts
        return {rid: logits[starts[rid] : starts[rid] + len(ids)] for rid, ids, _ in chunks}


def load_ours(path: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    loaded = load_model(str(path), dtype, torch.device("cpu"))
    loaded.model.init_rope(loaded.arch.context_length)
    return loaded.model
