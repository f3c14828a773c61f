"""In-flight prefix sharing: a waiting request follows a running prefill that computes its
prefix instead of computing the same blocks beside it.

Without it, requests that arrive together with one opening (a system prompt, a RAG document,
an agent's fan-out) each compute the opening: the prefix cache only helps those admitted after
the blocks are written. With it, a waiting request whose first uncached full block is pending
in another request's prefill (``kv/inflight.py``) is deferred for the step: it takes no slot,
no budget and no blocks, and admission goes on past it (it never blocks the queue). Once the
leader has written those blocks they are ordinary prefix-cache hits, so the follower is
admitted after them and prefills only the rest. The ``n > 1`` samples of one request share the
same way through ``siblings.py``; this is the same thing for any two requests.

- Partial overlap: the follower waits only while its *next* block is pending; once the shared
  opening is written, its own suffix is its own to compute (8 questions about one document
  compute the document once).
- Take-over: a leader that is cancelled, fails or is preempted releases its pending blocks
  (``KVCacheManager.free``), so the follower's next lookup finds them nobody's and it is
  admitted from whatever the leader had cached, becoming the leader for the rest.
- Deadlines: when a follower's turn comes in the policy's order before its leader's (``slo``
  orders prefills and waiting requests together by slack), the scheduler runs the leader's
  next chunk at the follower's place (``Scheduler._admit``): the follower's deadline moves the
  work it waits on, so waiting is never slower than computing the blocks itself.

The counts: a request that was deferred and then admitted reports, among its cached tokens,
those computed while it waited (``inflight_tokens``), for the metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

from poise.core.request import Request
from poise.kv.manager import KVCacheManager
from poise.sched.gates import Deferral

# A request waits for blocks another's running prefill is writing (``StepPlan.refused``).
WAITING_FOR_INFLIGHT_PREFIX = "waiting_for_inflight_prefix"


class InflightSharing:
    """Per scheduler: who is following whom, and what each follower found cached first."""

    def __init__(self, kv: KVCacheManager, requests: Mapping[str, Request]) -> None:
        self.kv = kv
        self._requests = requests  # the scheduler's live requests, by id
        # Deferred requests -> cached blocks at their first deferral (for the in-flight count).
        self._first_cached: dict[str, int] = {}
        self.num_deferrals = 0  # steps x requests deferred, since start (for tests)

    @property
    def followers(self) -> int:
        """Requests waiting on another's prefill now (or until they are admitted)."""
        return len(self._first_cached)

    def lookup(self, request: Request) -> tuple[list[int], Request | None]:
        """The cached prefix ``request`` would start after, and the running request it should
        wait for instead of being admitted now (None: admit it)."""
        cached, owner = self.kv.lookup_prefix(request)
        # An owner holds blocks, so it is running (KVCacheManager.check_invariants).
        leader = self._requests.get(owner) if owner is not None else None
        if leader is None or leader is request:
            return cached, None
        self._first_cached.setdefault(request.request_id, len(cached))
        self.num_deferrals += 1
        return cached, leader

    def defer(self, request: Request) -> Deferral | None:
        """Admission's ``DeferGate``: wait (and run the leader at this turn) while the next
        block is pending in another request's prefill."""
        if request.prompt_leader is not None:
            return None  # an n > 1 sibling: siblings.py
        _, leader = self.lookup(request)
        return None if leader is None else Deferral(WAITING_FOR_INFLIGHT_PREFIX, run=leader)

    def admitted(self, request: Request, cached_blocks: list[int]) -> None:
        """``request`` is admitted after ``cached_blocks``: count its prefix lookup (with the
        tokens of those blocks written while it waited, if it did) and register the blocks its
        prefill will fill as pending, for others to follow."""
        first = self._first_cached.pop(request.request_id, None)
        waited = 0 if first is None else max(0, len(cached_blocks) - first)
        start = len(cached_blocks) * self.kv.block_size
        self.kv.record_admission(request.num_tokens, start, waited * self.kv.block_size)
        self.kv.expect_prefill(request, start)

    def forget(self, request_id: str) -> None:
        """A follower finished (aborted) before it was admitted."""
        self._first_cached.pop(request_id, None)
