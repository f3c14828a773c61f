"""Flat model inputs for one step, built from the scheduler's ``ScheduledRequest`` list.

Layout (see poise/model/attention/metadata.py): decode requests (one token each) first, then
prefill chunks, so decode attention is one batched call over flat[0:D]::

    flat:       [d0 d1 ... d(D-1) | p0 p0 p0 p0 | p1 p1 ...]
    positions:  [s0 s1 ...        | s  s+1 ...  | ...     ]
    sampled:    last flat index of each request with sample=True, in scheduler order

slot of a token at position p = block_ids[p // block_size] * block_size + p % block_size.
Built with numpy (cheap per-element work) and moved to the device once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from poise.core.outputs import ScheduledRequest
from poise.model.attention import AttentionMetadata, PrefillChunk


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # Flat indices whose hidden state is projected to logits, aligned with sampled_requests.
    logits_indices: torch.Tensor  # [S] int64
    sampled_requests: list[ScheduledRequest]
    # request id -> flat index of its first token this step (the layout is ours to choose).
    flat_starts: dict[str, int]


def _slots(block_ids: list[int], start: int, n: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, start + n, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)[pos // block_size]
    return blocks * block_size + pos % block_size


def _decode_part(
    decodes: list[ScheduledRequest], block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """ids, positions, slots, block tables [D, B], context lens for the decode tokens."""
    d = len(decodes)
    ids = np.fromiter((r.token_ids[0] for r in decodes), dtype=np.int64, count=d)
    pos = np.fromiter((r.start_position for r in decodes), dtype=np.int64, count=d)
    nblocks = pos // block_size + 1
    width = int(nblocks.max()) if d else 0
    tables = np.zeros((d, width), dtype=np.int64)
    for i, r in enumerate(decodes):
        n = int(nblocks[i])
        tables[i, :n] = r.block_ids[:n]
    slots = tables[np.arange(d), pos // block_size] * block_size + pos % block_size
    return ids, pos, slots, tables, pos + 1


def decode_groups(num_blocks: np.ndarray) -> list[tuple[int, int, int]]:
    """Split decode rows (sorted by block count, descending) into runs padded to their first.

    Why: one long context among short ones would otherwise pad every row's K/V gather to the
    long one (the seed mix: 3k-token LONG prompts beside 30-token SHORT ones). A new group
    starts where a row needs at most half the current group's blocks, so padding at most
    doubles the work, and there are at most log2(longest) groups.
    """
    groups: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(num_blocks) + 1):
        if i == len(num_blocks) or num_blocks[i] * 2 <= num_blocks[start]:
            groups.append((start, i, int(num_blocks[start])))
            start = i
    return groups


def build_step_inputs(
    scheduled: list[ScheduledRequest], block_size: int, device: torch.device
) -> StepInputs:
    # Longest context first, so decode_groups are contiguous runs (see decode_groups).
    decodes = sorted(
        (r for r in scheduled if r.is_decode), key=lambda r: r.start_position, reverse=True
    )
    prefills = [r for r in scheduled if not r.is_decode]
    ids_d, pos_d, slots_d, tables, ctx = _decode_part(decodes, block_size)
    ids_parts, pos_parts, slot_parts = [ids_d], [pos_d], [slots_d]
    chunks: list[PrefillChunk] = []
    flat_starts: dict[str, int] = {r.request_id: i for i, r in enumerate(decodes)}
    last_index = dict(flat_starts)
    offset = len(decodes)
    for r in prefills:
        n, start = r.num_tokens, r.start_position
        ids_parts.append(np.asarray(r.token_ids, dtype=np.int64))
        pos_parts.append(np.arange(start, start + n, dtype=np.int64))
        slot_parts.append(_slots(r.block_ids, start, n, block_size))
        used = (start + n + block_size - 1) // block_size
        table = torch.tensor(r.block_ids[:used], dtype=torch.int64, device=device)
        generated = min(n, max(0, start + n - r.num_prompt_tokens))
        chunks.append(PrefillChunk(offset, n, start, table, generated))
        flat_starts[r.request_id] = offset
        offset += n
        last_index[r.request_id] = offset - 1
    sampled = [r for r in scheduled if r.sample]
    logits_idx = np.fromiter(
        (last_index[r.request_id] for r in sampled), dtype=np.int64, count=len(sampled)
    )

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to_dev(np.concatenate(slot_parts)),
        block_size=block_size,
        num_decodes=len(decodes),
        decode_block_tables=to_dev(tables) if decodes else None,
        decode_context_lens=to_dev(ctx) if decodes else None,
        decode_groups=decode_groups(pos_d // block_size + 1),
        prefills=chunks,
    )
    return StepInputs(
        input_ids=to_dev(np.concatenate(ids_parts)),
        positions=to_dev(np.concatenate(pos_parts)),
        meta=meta,
        logits_indices=to_dev(logits_idx),
        sampled_requests=sampled,
        flat_starts=flat_starts,
    )
