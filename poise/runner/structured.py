"""Structured output in the batched sampler step: one token bitmask for the constrained rows.

``mask_logits(logits, grammars)`` runs before sampling. Row ``i`` of ``logits`` is constrained
when ``grammars[i]`` is a matcher (``text.grammar.LLGuidanceGrammar``). The constrained rows'
bitmasks are filled by llguidance in one call (its executor spreads rows over threads), then
applied as one tensor op over those rows: a forbidden token's logit becomes ``-inf``, so greedy
(argmax) and random sampling (its probability is 0) both only pick allowed tokens. Rows
without a grammar are not touched, and a batch without any costs one Python scan.

Matchers advance in the stop rules (sched/stopping.py) after the token is accepted; the mask
only reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from poise.core.structured import GrammarState
from poise.text.grammar import LLGuidanceGrammar

_EXECUTOR: Any = None


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def mask_logits(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
    """Set ``logits[i, t] = -inf`` for every token ``t`` that ``grammars[i]`` forbids (in place)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)  # 0 = forbidden
    # The engine's compiler is text.grammar's (engine/builder.py), so each state is its kind.
    matchers = [(cast(LLGuidanceGrammar, grammars[i]).matcher, j) for j, i in enumerate(rows)]
    # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module
    # (it applies torch.compile at import, which loads the whole compiler stack).
    _executor().unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
    allowed = unpack_bitmask(bitmask.to(logits.device), vocab)  # [R, V] bool
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, ceil(V/32)] int32 (bit ``t % 32`` of word ``t // 32`` set = token allowed) ->
    [R, V] bool."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(
            32, dtype=torch.int32, device=bitmask.device
        )
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
