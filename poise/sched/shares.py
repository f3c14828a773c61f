"""Work-conserving class shares of one step's prefill budget and of the sequence slots.

Each class reserves ``share x budget`` prefill tokens and ``share x max_num_seqs`` slots, but
only while it has work that wants them: what a class cannot use (nothing waiting, prompts
already done) is not protected and goes to whoever comes next in the policy's order. So a
single busy class gets the whole step, and a burst of long prompts cannot take the tokens or the
slots that queued short ones were promised.

Decode tokens are not rationed (a running request's next token is never held back for a share:
that is what TPOT targets are about); they only shrink the budget everyone shares.

A class may also be capped for the step (``caps``: the slo policy's pacing, ``pacing.py``): it
then takes, and holds reserved, no more than its cap, whatever its share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from poise.core.request import Request
from poise.sched.classes import ClassSet
from poise.sched.predictor import prefill_left


class ClassShares:
    """The classes' shares; ``ledger`` opens a step's bookkeeping (admission's ``ClassLedger``,
    ``gates.py``)."""

    def __init__(self, classes: ClassSet, max_num_seqs: int, chunk_cap: int) -> None:
        self.shares = {c.name: c.share for c in classes.classes} if classes.has_shares else {}
        self.max_num_seqs = max_num_seqs
        self.chunk_cap = chunk_cap  # the long-prefill cap (0: none): a chunk takes no more

    def demand(self, prefill_tokens: int) -> int:
        """A candidate's prefill demand in a step: its tokens left, up to the long-prefill cap."""
        cap = self.chunk_cap
        return min(prefill_tokens, cap) if cap > 0 else prefill_tokens

    def ledger(
        self,
        candidates: Sequence[Request],
        running: Sequence[Request],
        budget: int,
        caps: Mapping[str, int],
    ) -> ShareLedger:
        demand: Counter[str] = Counter()
        slots: Counter[str] = Counter()
        running_ids = {r.request_id for r in running}
        for r in candidates:
            cls = r.slo.class_name
            demand[cls] += self.demand(prefill_left(r))  # 0 for a decode: not rationed
            if r.request_id not in running_ids:
                slots[cls] += 1
        by_class = Counter(r.slo.class_name for r in running)
        return ShareLedger(self.shares, budget, self.max_num_seqs, by_class, demand, slots, caps)


class ShareLedger:
    """Bookkeeping for one step. ``prefill_demand``: tokens each class's candidates still want
    (after the long-prefill cap); ``slot_demand``: waiting requests per class."""

    def __init__(
        self,
        shares: Mapping[str, float],
        budget: int,
        max_num_seqs: int,
        running_by_class: Mapping[str, int],
        prefill_demand: Mapping[str, int],
        slot_demand: Mapping[str, int],
        caps: Mapping[str, int] | None = None,
    ) -> None:
        self._token_reserve = {c: int(s * budget) for c, s in shares.items()}
        self._slot_reserve = {c: int(s * max_num_seqs) for c, s in shares.items()}
        self._tokens_used: Counter[str] = Counter()
        self._running = Counter(running_by_class)
        self._token_demand = Counter(prefill_demand)
        self._slot_demand = Counter(slot_demand)
        self._caps = dict(caps or {})
        self.enabled = len(shares) > 1

    def _cap_left(self, cls: str) -> int | None:
        cap = self._caps.get(cls)
        return None if cap is None else max(0, cap - self._tokens_used[cls])

    def _protected_tokens(self, cls: str) -> int:
        left = self._token_reserve.get(cls, 0) - self._tokens_used[cls]
        cap_left = self._cap_left(cls)
        if cap_left is not None:
            left = min(left, cap_left)
        return max(0, min(left, self._token_demand[cls]))

    def _protected_slots(self, cls: str) -> int:
        left = self._slot_reserve.get(cls, 0) - self._running[cls]
        return max(0, min(left, self._slot_demand[cls]))

    def _others(self, cls: str) -> Iterable[str]:
        return (c for c in self._token_reserve if c != cls)

    def token_allowance(self, cls: str, budget_left: int) -> int:
        """Prefill tokens ``cls`` may take now without eating another class's reservation
        (nor more than its cap)."""
        allowance = budget_left
        if self.enabled:
            allowance -= sum(self._protected_tokens(c) for c in self._others(cls))
        cap_left = self._cap_left(cls)
        if cap_left is not None:
            allowance = min(allowance, cap_left)
        return max(0, allowance)

    def slot_allowed(self, cls: str, free_slots: int) -> bool:
        if not self.enabled:
            return free_slots > 0
        return free_slots - sum(self._protected_slots(c) for c in self._others(cls)) > 0

    def took_prefill(self, cls: str, num_tokens: int) -> None:
        self._tokens_used[cls] += num_tokens
        self._token_demand[cls] = max(0, self._token_demand[cls] - num_tokens)

    def passed(self, cls: str, num_tokens: int) -> None:
        """A candidate of ``cls`` got no (more) tokens this step: its demand is gone."""
        self._token_demand[cls] = max(0, self._token_demand[cls] - num_tokens)

    def admitted(self, cls: str) -> None:
        self._running[cls] += 1
        self._slot_demand[cls] = max(0, self._slot_demand[cls] - 1)

    def left_waiting(self, cls: str) -> None:
        """A waiting request of ``cls`` was passed over this step: its slot demand is gone."""
        self._slot_demand[cls] = max(0, self._slot_demand[cls] - 1)
