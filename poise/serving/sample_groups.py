"""``n > 1``: which engine requests are one client request's samples, for the metrics.

Each sample of a request with ``n > 1`` is its own engine request (core/parallel.py), but it is
one request to the client and to vLLM's metrics: ``request_success_total`` and the SLO series
count it once, the token counters count every sample's tokens. ``SampleGroups`` remembers the
samples of each such request (the event loop adds them before admission) and tells the
metrics, on the engine thread, which delta stands for the request:

- ``first_token(rid)``: True for the first sample of its request to get a first token (the
  request's TTFT, its parts and its prompt are observed once, then);
- ``finished(delta)``: None until the request's last sample finishes, then what to count:
  the reason (an ``error`` or ``abort`` among the samples names the request, else the last
  sample's) and every sample's output tokens. A sample that was never admitted (the request
  was refused part way, all or none) is ``drop``-ped so its siblings' end still counts.

A request with ``n == 1`` is never added, and every call answers for it as for a group of one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from poise.core.outputs import RequestDelta

# A sample's reason that names the whole request, worst first.
_WORST = ("error", "abort", "rejected")


@dataclass
class _Group:
    pending: set[str]
    started: bool = False  # a sample has had its first token
    tokens: int = 0
    reasons: list[str] = field(default_factory=list)
    last: RequestDelta | None = None


@dataclass(frozen=True)
class GroupEnd:
    reason: str
    delta: RequestDelta  # the last sample's finishing delta (its times are the request's end)
    num_output_tokens: int | None  # every sample's; None: a request of one sample


class SampleGroups:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[str, _Group] = {}

    def add(self, request_ids: list[str]) -> None:
        """The engine requests of one client request (call before admitting them)."""
        if len(request_ids) < 2:
            return
        group = _Group(set(request_ids))
        with self._lock:
            for rid in request_ids:
                self._of[rid] = group

    def drop(self, request_ids: list[str]) -> list[GroupEnd]:
        """Samples that were never admitted: their siblings' end is the request's. Returns the
        requests whose every other sample had finished already."""
        ends = []
        with self._lock:
            for rid in request_ids:
                group = self._of.pop(rid, None)
                if group is not None:
                    group.pending.discard(rid)
                    if not group.pending and group.last is not None:
                        ends.append(_end(group, group.last))
        return ends

    def __len__(self) -> int:
        with self._lock:
            return len(self._of)

    def tokens(self, delta: RequestDelta) -> None:
        with self._lock:
            group = self._of.get(delta.request_id)
            if group is not None:
                group.tokens += len(delta.new_token_ids)

    def first_token(self, request_id: str) -> bool:
        with self._lock:
            group = self._of.get(request_id)
            if group is None:
                return True
            first, group.started = not group.started, True
            return first

    def finished(self, delta: RequestDelta) -> GroupEnd | None:
        reason = delta.finish_reason or "unknown"
        with self._lock:
            group = self._of.pop(delta.request_id, None)
            if group is None:
                return GroupEnd(reason, delta, None)
            group.pending.discard(delta.request_id)
            group.reasons.append(reason)
            group.last = delta
            if group.pending:
                return None
        return _end(group, delta)


def _end(group: _Group, last: RequestDelta) -> GroupEnd:
    worst = [r for r in _WORST if r in group.reasons]
    return GroupEnd(worst[0] if worst else group.reasons[-1], last, group.tokens)
