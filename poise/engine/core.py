"""EngineCore: validation, admission and the three-call step around one Scheduler.

One step::

    out = scheduler.schedule(clock.now())
    observers: on_step_start(out)
    result = executor.execute(out)
    observers: on_step_end(out, result)
    deltas, stats = scheduler.update(out, result, clock.now())

No torch and no wall clock here: the executor, the clock and the observers are injected when
the engine is built (nothing replaces them later), so the simulator runs exactly this code with
a SimExecutor and a VirtualClock. A step that raises after scheduling raises StepFailedError
naming the requests it scheduled; a request the executor reports in ``result.failed`` (its
logits were NaN or inf) finishes alone with an error and the step goes on for the others. ``snapshot()`` is the read-only state the server publishes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Protocol

from poise.config import EngineConfig
from poise.core.outputs import ModelRunnerOutput, RequestDelta, StepStats
from poise.core.request import Request, RequestStatus, SloTargets
from poise.core.sampling_params import SamplingParams
from poise.core.structured import GrammarCompiler, GrammarState
from poise.engine.clock import Clock, MonotonicClock
from poise.engine.executor import Executor
from poise.engine.observer import EngineObserver
from poise.engine.state import EngineState
from poise.errors import InvalidRequestError, OverloadedError, StepFailedError
from poise.kv.manager import KVCacheManager
from poise.sched.classes import ClassSet, load_classes
from poise.sched.scheduler import Scheduler
from poise.spec.proposer import Proposer

logger = logging.getLogger(__name__)


class EngineLimits(Protocol):
    """What the engine needs to know of the model it drives (``runner.factory.ModelInfo``)."""

    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        num_kv_blocks: int,
        max_model_len: int,
        vocab_size: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        clock: Clock | None = None,
        observers: Sequence[EngineObserver] = (),
        grammars: GrammarCompiler | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """``proposer``: speculative decoding's, where it is not the config's ngram (the
        draft model's, the simulator's)."""
        self.config = config
        # Compiles structured-output requests (text/grammar.py); None: they are refused.
        self.grammars = grammars
        self._executor = executor
        self._observers = tuple(observers)
        self.clock: Clock = clock or MonotonicClock()
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.kv = KVCacheManager(
            num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len, proposer=proposer)
        self.max_model_len = self.scheduler.max_len
        # Each request's traffic class is resolved once, on arrival, and travels on it.
        self.classes: ClassSet = load_classes(config.scheduler.traffic_classes)

    @classmethod
    def for_model(
        cls,
        config: EngineConfig,
        executor: Executor,
        limits: EngineLimits,
        *,
        clock: Clock | None = None,
        observers: Sequence[EngineObserver] = (),
        grammars: GrammarCompiler | None = None,
        proposer: Proposer | None = None,
    ) -> EngineCore:
        """The engine around an executor whose model load found ``limits`` (its KV blocks,
        context length, vocabulary and EOS ids)."""
        return cls(
            config,
            executor,
            num_kv_blocks=limits.num_kv_blocks,
            max_model_len=limits.max_model_len,
            vocab_size=limits.vocab_size,
            eos_token_ids=limits.eos_token_ids,
            clock=clock,
            observers=observers,
            grammars=grammars,
            proposer=proposer,
        )

    # -- admission ----------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raise InvalidRequestError if this request can never be served."""
        self._resolve(prompt_token_ids, sampling_params)

    def _resolve(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> SloTargets:
        """Raise InvalidRequestError if this request can never be served; else its traffic
        class and targets (an unknown class name is a 400 naming the field)."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        sampling_params.validate(self.vocab_size)
        if self.vocab_size is not None:
            bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                    "prompt",
                )
        reason = self.scheduler.rejection_reason(len(prompt_token_ids))
        if reason is not None:
            raise InvalidRequestError(reason, "prompt", reason="too_long")
        return self._slo(prompt_token_ids, sampling_params)

    def _slo(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> SloTargets:
        return self.classes.targets(
            len(prompt_token_ids),
            sampling_params.traffic_class,
            sampling_params.ttft_slo_ms,
            sampling_params.tpot_slo_ms,
        )

    @property
    def num_queued(self) -> int:
        """Waiting requests beyond the free ``max_num_seqs`` slots: those still waiting after
        the next step admits what the slots take. Requests the next step will start are not
        queued, so a burst into an idle engine fills the batch before it meets the bound."""
        free_slots = max(0, self.config.scheduler.max_num_seqs - self.scheduler.num_running)
        return max(0, self.scheduler.num_waiting - free_slots)

    def queue_is_full(self) -> bool:
        limit = self.config.scheduler.max_num_queued_requests
        return limit is not None and self.num_queued >= limit

    def check_capacity(self) -> None:
        """Raise OverloadedError when the waiting queue is at its bound (``num_queued``)."""
        if self.queue_is_full():
            wait = self.scheduler.queue_wait_s()
            raise OverloadedError(
                f"waiting queue is full ({self.num_queued} requests beyond the "
                f"{self.config.scheduler.max_num_seqs} sequence slots, max_num_queued_requests="
                f"{self.config.scheduler.max_num_queued_requests}); retry in {wait:.1f} s",
                retry_after_s=wait,
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        *,
        prompt_leader: str | None = None,
    ) -> Request:
        """``prompt_leader``: the request that computes this one's prompt (``n`` > 1 siblings,
        ``poise.core.parallel.fan_out``); a request with ``n`` > 1 must be fanned out first."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "id")
        slo = self._resolve(prompt_token_ids, sampling_params)
        if sampling_params.n != 1:
            raise InvalidRequestError(
                "n > 1 reaches the engine as n requests: add poise.core.parallel.fan_out's "
                "children",
                "n",
            )
        self.check_capacity()
        now = self.clock.now()
        request = self._new_request(
            request_id, prompt_token_ids, sampling_params, arrival_time, slo
        )
        request.prompt_leader = prompt_leader
        request.grammar = self.new_grammar(sampling_params)
        request.times.enqueued = now
        self.scheduler.check_admission(request, now)
        self.scheduler.add_request(request)
        return request

    def new_grammar(self, sampling_params: SamplingParams) -> GrammarState | None:
        """The request's structured-output matcher (compiled grammars are cached by spec, so a
        server that compiled the spec on its tokenizer thread only copies it here)."""
        spec = sampling_params.structured_outputs
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError(
                "structured output is not available with this executor", spec.source_field
            )
        return self.grammars.new_state(spec)

    def predict_ttft(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
    ) -> float:
        """Predicted TTFT (s, from arrival) of this request if it were added now."""
        slo = self._slo(prompt_token_ids, sampling_params)
        request = self._new_request(
            request_id, prompt_token_ids, sampling_params, arrival_time, slo
        )
        return self.scheduler.forecast(request, self.clock.now()).ttft_s

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None,
        slo: SloTargets,
    ) -> Request:
        now = self.clock.now()
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            arrival_time=now if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            priority=sampling_params.priority,
            slo=slo,
        )

    def abort(self, request_ids: Iterable[str]) -> list[RequestDelta]:
        return self.scheduler.finish_requests(
            request_ids, RequestStatus.FINISHED_ABORTED, self.clock.now()
        )

    def finish(self, request_id: str) -> RequestDelta | None:
        """Finish a request because a stop string matched (finish_reason "stop")."""
        deltas = self.scheduler.finish_requests(
            [request_id], RequestStatus.FINISHED_STOPPED, self.clock.now()
        )
        return deltas[0] if deltas else None

    def fail(self, request_ids: Iterable[str], message: str) -> list[RequestDelta]:
        """Finish requests with an error (e.g. the step that ran them raised)."""
        for rid in request_ids:
            request = self.scheduler.requests.get(rid)
            if request is not None:
                request.error_message = message
        return self.scheduler.finish_requests(
            request_ids, RequestStatus.FINISHED_ERROR, self.clock.now()
        )

    # -- stepping -----------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def wake_time(self) -> float | None:
        """Engine-clock time at which a policy that holds waiting requests back on purpose (the
        ``dynamic`` batching mode) starts them without new input; None when nothing is held.
        A loop whose step scheduled nothing sleeps until then (or new input) instead of
        spinning."""
        return self.scheduler.wake_time(self.clock.now())

    def ready_in_s(self) -> float | None:
        """Seconds until a step computes something without new input: 0 (now), what is left
        of a batch's wait (``dynamic``), or None when there is nothing to do."""
        if not self.has_unfinished_requests():
            return None
        wake = self.wake_time()
        return 0.0 if wake is None else max(0.0, wake - self.clock.now())

    def step(self) -> tuple[list[RequestDelta], StepStats | None]:
        """Run one engine step. Returns (deltas, None) when there was nothing to compute.

        Raises StepFailedError (with the scheduled request ids) when the executor, an observer
        or applying the result raises; an exception while scheduling propagates as it is.
        """
        output = self.scheduler.schedule(self.clock.now())
        if output.is_empty:
            deltas, _ = self.scheduler.update(output, ModelRunnerOutput(), self.clock.now())
            return deltas, None
        try:
            for observer in self._observers:
                observer.on_step_start(output)
            result = self._executor.execute(output)
            for observer in self._observers:
                observer.on_step_end(output, result)
            # Requests the runner could not produce a token for (non-finite logits) finish
            # with an error first, their blocks freed; update then skips them as aborted.
            failed = [d for rid, why in result.failed.items() for d in self.fail([rid], why)]
            for rid, why in result.failed.items():
                logger.warning("request %s failed: %s", rid, why)
            deltas, stats = self.scheduler.update(output, result, self.clock.now())
            stats.num_finished += len(failed)
            return failed + deltas, stats
        except Exception as exc:
            for observer in self._observers:
                observer.on_step_failed(output, exc)
            ids = [s.request_id for s in output.scheduled]
            raise StepFailedError(output.step_id, ids, exc) from exc

    def snapshot(self) -> EngineState:
        """The engine's state now, as an immutable value another thread may keep and read."""
        sched, prefix = self.scheduler, self.kv.prefix_stats
        return EngineState(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_cache_usage=self.kv.usage,
            token_budget=sched.token_budget,
            paced_prefill_tokens=MappingProxyType(sched.paced_prefill_tokens()),
            num_preemptions=sched.num_preemptions_total,
            preemptions_by_class=MappingProxyType(dict(sched.preemptions_by_class)),
            queue_full=self.queue_is_full(),
            prefix_cache=replace(prefix),  # a copy: the manager's counts go on
            prefix_cache_evictions=self.kv.pool.num_evictions,
            spec_decode=sched.spec.stats.copy() if sched.spec is not None else None,
        )
