"""The narrow interfaces through which each concern plugs into admission (``admission.py``).

One small Protocol per concern; admission calls nothing else of them:

- ``StepBudget``: the step's token budget (``controller.py``: fixed, or the TPOT controller's,
  lifted for a TTFT deadline);
- ``PrefillCaps``: per-class prefill caps of the step (``pacing.py``, the ``slo`` policy);
- ``ClassLedger``: class shares of the prefill budget and the slots, one step's bookkeeping
  (``shares.py``);
- ``BlockReserve``: KV blocks admission must leave free (``reserve.py``: the safety margin,
  and the prompt blocks running prefills still owe);
- ``DeferGate``: a waiting request that must wait although it would fit; admission goes on
  past it (``siblings.py``: an ``n`` > 1 sibling whose leader has not computed the prompt);
- ``DraftSource``: speculation's drafts for a decode, out of the budget left
  (``speculation.py``).

Priority displacement, the preemption victim and whether a refused request blocks the queue
are the policy's (``ordering.Policy``). Predictive admission acts at arrival, not per step
(``forecasts.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from poise.core.request import Request
from poise.kv.manager import KVCacheManager
from poise.sched.step import StepPlan
from poise.sched.view import PolicyView

# Requests in a queue (running in admission order, waiting in arrival order).
Queue = Sequence[Request]


class StepBudget(Protocol):
    # The budget of this step (of the last one between steps: what forecasts use) ...
    budget: int
    # ... and before a TTFT deadline lifted it (the budget the queue was ordered by).
    planned: int

    def for_step(self, running: Queue, waiting: Queue, view: PolicyView) -> int: ...

    def observe(self, num_tokens: int, duration_s: float, had_decodes: bool) -> None: ...


# Prefill tokens per capped class this step (empty: none is capped).
Caps = Mapping[str, int]


class PrefillCaps(Protocol):
    def caps(self, running: Queue, waiting: Queue, budget: int, view: PolicyView) -> Caps: ...


class ClassLedger(Protocol):
    def token_allowance(self, cls: str, budget_left: int) -> int: ...

    def slot_allowed(self, cls: str, free_slots: int) -> bool: ...

    def took_prefill(self, cls: str, num_tokens: int) -> None: ...

    def passed(self, cls: str, num_tokens: int) -> None: ...

    def admitted(self, cls: str) -> None: ...

    def left_waiting(self, cls: str) -> None: ...


class BlockReserve(Protocol):
    def begin_step(self) -> None: ...

    def recount(self) -> None:
        """The running prefills' needs changed (one took tokens, one was preempted)."""
        ...

    def keep_free(self, request: Request, start: int, num_tokens: int, running: Queue) -> int:
        """Blocks that must stay free when ``request`` takes ``[start, start + num_tokens)``."""
        ...

    def admitted(self) -> None:
        """The request ``keep_free`` was last asked about went in."""
        ...


@dataclass(frozen=True)
class Deferral:
    reason: str  # recorded in ``StepPlan.refused``
    # A running request whose progress the deferred one waits for: admission gives it its turn
    # now, at the deferred request's place in the policy's order (None: it runs in its own).
    run: Request | None = None


class DeferGate(Protocol):
    def defer(self, request: Request) -> Deferral | None:
        """Why ``request`` must wait this step although it may fit (None: it need not)."""
        ...

    def admitted(self, request: Request, cached_blocks: list[int]) -> None:
        """``request`` went in after ``cached_blocks`` (the last gate counts the lookup)."""
        ...


class DraftSource(Protocol):
    def begin_step(self, running: Queue, waiting: Queue, budget: int, max_seqs: int) -> None: ...

    def schedule(self, request: Request, plan: StepPlan, kv: KVCacheManager, max_len: int) -> bool:
        """Schedule decoding ``request`` with drafts; False: schedule it as a plain decode."""
        ...
