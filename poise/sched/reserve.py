"""KV blocks admission leaves free (admission's ``BlockReserve``, ``gates.py``).

While anything runs, an admission must leave ``safety_margin`` of the pool free (so running
requests can grow), and under a policy that reserves prompts (``slo``) also the blocks every
running prefill still needs for the rest of its prompt and the rest of the admitted one's own
prompt: paced prompts prefilled in small chunks otherwise outgrow the pool together and
preempt one another (``ordering.py``'s docstring has the measurement). When nothing runs
nothing is kept back, so a big prompt cannot block the queue for ever.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from poise.core.request import Request
from poise.kv.manager import KVCacheManager
from poise.sched.ordering import is_partial_prefill


def owed_prompt_blocks(running: Iterable[Request], kv: KVCacheManager) -> int:
    """KV blocks the unfinished prefills among ``running`` need beyond those they hold."""
    return sum(
        max(0, kv.blocks_for(r.num_tokens) - len(kv.get_block_ids(r.request_id)))
        for r in running
        if is_partial_prefill(r)
    )


class PromptReserve:
    def __init__(self, kv: KVCacheManager, margin_blocks: int, reserves_prompts: bool) -> None:
        self.kv = kv
        self.margin_blocks = margin_blocks
        self.reserves_prompts = reserves_prompts
        # The running prefills' owed blocks this step (None: not counted yet, or stale).
        self._owed: int | None = None
        self._pending = 0  # what the request last asked about would owe once admitted

    def begin_step(self) -> None:
        self._owed = None

    def recount(self) -> None:
        self._owed = None

    def keep_free(
        self, request: Request, start: int, num_tokens: int, running: Sequence[Request]
    ) -> int:
        self._pending = 0
        if not running:
            return 0
        reserve = self.margin_blocks
        if self.reserves_prompts:
            if self._owed is None:
                self._owed = owed_prompt_blocks(running, self.kv)
            kv = self.kv
            self._pending = kv.blocks_for(request.num_tokens) - kv.blocks_for(start + num_tokens)
            reserve += self._owed + self._pending
        return reserve

    def admitted(self) -> None:
        if self._owed is not None:
            self._owed += self._pending
