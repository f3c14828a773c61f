"""Speculative decoding, the scheduler's part: how many draft tokens each decoding request
verifies this step, and the counters of what was accepted.

Per step, for a request one token behind (a decode), ``Speculation.drafts`` asks the proposer
for up to ``num_speculative_tokens`` tokens and keeps the first ``k`` of them, ``k`` chosen by
the depth rule (``fixed_depth`` or ``balanced_depth``, the small interface ``DepthRule``). The
row then feeds ``1 + k`` tokens (its last token and the drafts) in the same forward as every
other row, counted against the step's token budget. ``update`` hands back how many drafts the
target accepted (``accepted``); the rejected ones' KV slots are rolled back by the scheduler.

Pure Python and clock-free, like the rest of sched/: the simulator runs this code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from poise.config import SpeculativeConfig
from poise.core.outputs import ModelRunnerOutput, ScheduledRequest
from poise.core.request import Request
from poise.kv.manager import KVCacheManager
from poise.sched.estimator import StepCostEstimator
from poise.sched.ordering import is_partial_prefill
from poise.sched.step import StepPlan
from poise.spec.ngram import NgramProposer
from poise.spec.proposer import Proposer

# Prior of a request's per-token acceptance rate: PRIOR_TRIALS pseudo-trials at the rate of
# every request so far (itself from Beta(1, 1) before any verify), so a request's first few
# verifies move it quickly but a new request does not start at 1/2 where drafts mostly fail:
# on short requests those first verifies were most of what a Beta(1, 1) prior spent (the
# simulator at concurrency 48, acceptance 0.3: 0.97x the throughput without speculation).
PRIOR_ACCEPTED = 1.0
PRIOR_TRIALS = 2.0


@dataclass
class SpecDecodeStats:
    """Totals since start, vLLM's counters (``spec_decode_num_drafts`` ...)."""

    num_drafts: int = 0  # rows that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Index i: drafts whose token at position i was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodeStats:
        """A copy another thread may keep (the engine's snapshot for /metrics)."""
        return replace(self, accepted_per_pos=list(self.accepted_per_pos))


@dataclass(frozen=True)
class DepthInputs:
    """What a depth rule may know about one request in one step."""

    max_k: int  # the most drafts it may verify (proposed, budget, length and config allow)
    acceptance: float  # its estimated per-token acceptance rate so far
    num_rows: int  # requests in this step's batch (running)
    step_tokens: int  # tokens the step computes without this request's drafts (estimate)
    step_time: Callable[[int], float]  # predicted seconds of a step of so many tokens
    # Its class's TPOT target (seconds) and its TPOT so far; None where unknown.
    tpot_target_s: float | None
    tpot_s: float | None


DepthRule = Callable[[DepthInputs], int]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a row emits when verifying ``k`` drafts, each accepted with probability
    ``acceptance`` while its predecessors were: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance**i for i in range(k + 1))


def fixed_depth(inp: DepthInputs) -> int:
    """``"adaptive": false``: always as many as allowed."""
    return inp.max_k


def balanced_depth(inp: DepthInputs) -> int:
    """The depth that pays: the one giving the most tokens per second of the whole step.

    Without drafts the step emits ``num_rows`` tokens in ``step_time(step_tokens)``; with k it
    emits ``expected_tokens(a, k) - 1`` more in ``step_time(step_tokens + k)``. When the
    request is behind its class's TPOT target, its own time per token decides instead (it may
    cost the batch a little throughput to catch up). 0 where no k gains, which is where the
    step is compute-bound: every extra token then costs about what a decode earns.
    """
    base_t = inp.step_time(inp.step_tokens)
    base_rate = inp.num_rows / base_t
    behind = (
        inp.tpot_target_s is not None and inp.tpot_s is not None and inp.tpot_s > inp.tpot_target_s
    )
    best_k, best = 0, base_t if behind else base_rate
    for k in range(1, inp.max_k + 1):
        t = inp.step_time(inp.step_tokens + k)
        gain = expected_tokens(inp.acceptance, k)
        if behind:
            own = t / gain  # this request's seconds per token
            if own < best:
                best_k, best = k, own
        else:
            rate = (inp.num_rows - 1 + gain) / t
            if rate > best:
                best_k, best = k, rate
    return best_k


class Speculation:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, estimator: StepCostEstimator
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.estimator = estimator
        self.rule: DepthRule = balanced_depth if config.adaptive else fixed_depth
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        # Per request: (accepted, trials) for its acceptance estimate.
        self._history: dict[str, tuple[float, float]] = {}
        self._overall = (0.0, 0.0)  # the same, summed over every request ever
        self._rows = 0
        self._step_tokens = 0
        self._spare = 0

    def begin_step(
        self, running: Sequence[Request], waiting: Sequence[Request], budget: int, max_seqs: int
    ) -> None:
        """Before the walk: the batch this step will be, and the budget drafts may take.

        Adaptive, drafts only take budget no prefill is waiting for (the running prefills' and
        the prompts of the waiting requests the free slots can admit come first), so speculation
        never delays a first token by taking its budget; with ``"adaptive": false`` they take
        whatever the walk leaves, as a fixed k does.
        """
        decodes = sum(1 for r in running if not is_partial_prefill(r))
        prefill = sum(
            r.num_tokens - r.num_computed_tokens for r in running if is_partial_prefill(r)
        )
        slots = max(0, max_seqs - len(running))
        prefill += sum(r.num_tokens for _, r in zip(range(slots), waiting, strict=False))
        self._rows = max(1, decodes)
        self._step_tokens = min(budget, decodes + prefill)
        self._spare = budget if not self.config.adaptive else max(0, budget - decodes - prefill)

    def drafts(self, request: Request, budget_left: int, max_len: int) -> list[int]:
        """The draft tokens ``request`` (decoding) verifies this step; [] for none.

        Bounded by the budget left (less its own token), the request's remaining length (a
        draft past ``max_tokens`` or ``max_model_len`` could never be kept) and, adaptive, the
        spare budget and the depth rule. Requests with a structured-output grammar do not
        speculate (verifying needs the matcher advanced along the drafts; not done yet).
        """
        params = request.sampling_params
        if request.grammar is not None:
            return []
        room = min(
            self.config.num_speculative_tokens,
            budget_left - 1,
            self._spare,
            params.max_tokens - request.num_output_tokens - 1,
            max_len - request.num_tokens,
        )
        if room <= 0:
            return []
        inputs = DepthInputs(
            max_k=room,
            acceptance=self.acceptance(request.request_id),
            num_rows=self._rows,
            step_tokens=self._step_tokens,
            step_time=self.estimator.step_time,
            tpot_target_s=request.slo.tpot_s,
            tpot_s=current_tpot(request),
        )
        # No depth up to ``room`` pays, so none up to what the proposer finds would: skip the
        # proposal (a prompt lookup scans the whole context; a draft model runs forwards).
        if self.rule(inputs) <= 0:
            return []
        proposed = self.proposer.propose(request, room)[:room]
        if not proposed:
            return []
        k = self.rule(replace(inputs, max_k=len(proposed)))
        k = max(0, min(k, len(proposed)))
        self._spare -= k
        self._step_tokens += k
        return proposed[:k]

    def schedule(self, request: Request, plan: StepPlan, kv: KVCacheManager, max_len: int) -> bool:
        """Schedule decoding ``request`` with drafts if it gets any and their KV slots are free
        without preempting anyone (speculation is never worth a recompute); False: schedule it
        as a plain decode."""
        drafts = self.drafts(request, plan.budget, max_len)
        if not drafts:
            return False
        n = 1 + len(drafts)
        start = request.num_computed_tokens
        if (
            kv.allocate_slots(request.request_id, num_computed_tokens=start, num_new_tokens=n)
            is None
        ):
            self._spare += len(drafts)
            self._step_tokens -= len(drafts)
            return False
        plan.add(request, n)
        plan.drafts[request.request_id] = drafts
        return True

    def acceptance(self, request_id: str) -> float:
        accepted, trials = self._history.get(request_id, (0.0, 0.0))
        all_accepted, all_trials = self._overall
        prior = (all_accepted + PRIOR_ACCEPTED) / (all_trials + PRIOR_TRIALS)
        return (accepted + PRIOR_TRIALS * prior) / (trials + PRIOR_TRIALS)

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verify step of ``num_drafts`` drafts kept ``num_accepted`` of them (a prefix)."""
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            st.accepted_per_pos[i] += 1
        # Each draft position is a trial once all before it were accepted.
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        accepted, seen = self._history.get(request_id, (0.0, 0.0))
        self._history[request_id] = (accepted + num_accepted, seen + trials)
        self._overall = (self._overall[0] + num_accepted, self._overall[1] + trials)

    def forget(self, request_id: str) -> None:
        self._history.pop(request_id, None)
        self.proposer.forget(request_id)


def current_tpot(request: Request) -> float | None:
    """Seconds per output token after the first, so far; None before the second token."""
    times = request.times.token_times
    if len(times) < 2:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


def build_speculation(
    config: SpeculativeConfig | None, proposer: Proposer | None, estimator: StepCostEstimator
) -> Speculation | None:
    """The scheduler's speculation (None when off): prompt lookup unless a proposer is given
    (the draft model's is built with the model runner, engine/draft.py)."""
    if config is None:
        return None
    if proposer is None:
        if config.method != "ngram":
            raise ValueError(
                f"speculative_config.method: {config.method} needs its proposer built with "
                "the model (build_engine); this engine has none"
            )
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return Speculation(config, proposer, estimator)


def emitted_tokens(
    sched: ScheduledRequest, result: ModelRunnerOutput, spec: Speculation | None
) -> list[int]:
    """The tokens a sampled row emits this step, in order: the accepted drafts, then the
    target's own token; the acceptance is counted."""
    token = result.sampled_token_ids[sched.request_id]
    if not sched.num_draft_tokens or spec is None:
        return [token]
    accepted = result.accepted_draft_ids.get(sched.request_id, [])
    spec.accepted(sched.request_id, sched.num_draft_tokens, len(accepted))
    return [*accepted, token]
