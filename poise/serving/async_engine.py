"""AsyncEngine: runs an EngineCore on its own thread and streams deltas to asyncio handlers.

    event loop (HTTP)                          engine thread
    add_request() --inbox + notify--------->   drain adds/aborts/finishes (between steps)
       awaits admission future  <----------    core.add_request -> ok | Overloaded | Invalid
    stream.queue  <--call_soon_threadsafe--    core.step() -> deltas, stats (+ metrics)

Invariants:
- Only the engine thread touches the EngineCore (no locks around steps): requests, aborts and
  stop-string finishes are posted to an inbox under a short lock and applied between steps,
  so an abort frees its KV blocks before the next step is scheduled.
- Only the event loop touches ``_streams`` and the asyncio queues; the engine thread hands
  results over with ``loop.call_soon_threadsafe``, once per step for all deltas.
- An exception in a step fails the requests that step scheduled (``StepFailedError`` names
  them; ``EngineCore.fail``: blocks freed, finishing delta with ``finish_reason="error"``), is
  logged with the step number and kept in ``last_error`` for /health; the engine goes on. After ``max_consecutive_failures``
  failing steps in a row (or a failure outside a step) the engine is dead: every live request
  fails, later ones get EngineDeadError, and ``error`` says why.
- Other threads read the engine through ``state``, the ``EngineState`` snapshot the engine
  thread publishes after every step and drain (gauges, counters, readiness), never the core.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from poise.core.outputs import RequestDelta, StepStats
from poise.core.sampling_params import SamplingParams
from poise.engine.state import EngineState
from poise.errors import EngineDeadError, ShuttingDownError, StepFailedError
from poise.serving.metrics import ServingMetrics

if TYPE_CHECKING:  # the engine is imported lazily (serving/server.py builds it)
    from poise.engine.core import EngineCore

logger = logging.getLogger(__name__)


@dataclass
class RequestStream:
    """One request's output: deltas in order, the last one has ``finished=True``."""

    request_id: str
    num_prompt_tokens: int
    queue: asyncio.Queue[RequestDelta] = field(default_factory=asyncio.Queue)

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        while True:
            delta = await self.queue.get()
            yield delta
            if delta.finished:
                return


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    admitted: asyncio.Future[None]
    prompt_leader: str | None = None  # an n > 1 sibling's leader (core/parallel.py)


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        metrics: ServingMetrics,
        *,
        log_interval_s: float = 10.0,
        max_consecutive_failures: int = 3,
    ) -> None:
        self.core = core
        self.metrics = metrics
        self.log_interval_s = log_interval_s
        self.error: str | None = None  # set when the engine died
        self.last_error: str | None = None  # the latest failed step, for /health
        self.num_failed_steps = 0
        self.max_consecutive_failures = max_consecutive_failures
        self._consecutive_failures = 0
        # The latest snapshot, replaced (never mutated) by the engine thread.
        self.state: EngineState = core.snapshot()
        metrics.track_engine_state(lambda: self.state)
        self.accepting = True
        # What readers of requests aborted by the server (only shutdown does) are told.
        self.shutdown_message = "the server is shutting down and stopped this request"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._cv = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._finishes: list[str] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        # Engine-thread state: prompt lengths of live requests that have no token yet.
        self._awaiting_first: dict[str, int] = {}
        self._live: set[str] = set()
        self._step_no = 0
        self._log = _ThroughputLog(log_interval_s)

    # ---- lifecycle (event loop) ---------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="poise-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is left and join the engine thread."""
        self.accepting = False
        with self._cv:
            self._aborts.extend(self._streams)
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)

    def cut(self, message: str) -> None:
        """Shutting down: abort every request in flight; their readers get ShuttingDownError."""
        self.accepting = False
        self.shutdown_message = message
        with self._cv:
            self._aborts.extend(self._streams)
            self._cv.notify()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def can_accept(self) -> bool:
        """Ready: alive, not stopping, and the waiting queue has room (as of the last step)."""
        return self.alive and self.accepting and not self.state.queue_full

    # ---- requests (event loop) ----------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        *,
        prompt_leader: str | None = None,
    ) -> RequestStream:
        """Admit a request; raises InvalidRequestError, OverloadedError or EngineDeadError.
        ``prompt_leader``: as ``EngineCore.add_request`` (n > 1 siblings)."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        if not self.accepting:  # 503, not 429: this server will not take it later either
            raise ShuttingDownError("server is shutting down")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, len(prompt_token_ids))
        self._streams[request_id] = stream
        add = _Add(
            request_id, prompt_token_ids, params, arrival_time, loop.create_future(), prompt_leader
        )
        with self._cv:
            self._adds.append(add)
            self._cv.notify()
        try:
            await add.admitted
        except BaseException:
            # Refused, or the client left while waiting: make sure nothing lingers.
            self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort (client disconnect); a no-op for finished or unknown requests."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def finish(self, request_id: str) -> None:
        """A stop string matched: end the request as ``stop`` on the next drain."""
        with self._cv:
            self._finishes.append(request_id)
            self._cv.notify()

    def _route(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished:
                del self._streams[delta.request_id]
            stream.queue.put_nowait(delta)

    def _resolve(self, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._adds or self._aborts or self._finishes or self._stop):
                    ready = self.core.ready_in_s()  # > 0: a dynamic batch still filling
                    if ready == 0.0:
                        break
                    self._cv.wait(timeout=1.0 if ready is None else ready)
                    self._log.reset()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                finishes, self._finishes = self._finishes, []
                stop = self._stop
            if stop:  # shutting down: admit nothing more
                for add in adds:
                    exc = ShuttingDownError("server is shutting down")
                    self._loop.call_soon_threadsafe(self._resolve, add.admitted, exc)  # type: ignore[union-attr]
                adds = []
            try:
                self._drain(adds, aborts, finishes)
                if stop:
                    return
                if self.core.has_unfinished_requests():
                    self._guarded_step()
            except BaseException as exc:  # noqa: BLE001 - any engine failure must reach clients
                # Not only Exception: a SystemExit or the like ending this thread would
                # otherwise leave every request in flight waiting for ever.
                self._die(exc)
                if not isinstance(exc, Exception):
                    raise
                return

    def _guarded_step(self) -> None:
        try:
            self._step()
        except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving
            self._consecutive_failures += 1
            self.num_failed_steps += 1
            # A failure after scheduling names its requests; one while scheduling fails all.
            ids = exc.request_ids if isinstance(exc, StepFailedError) else list(self._live)
            self.last_error = f"engine step {self._step_no} failed: {_describe(exc)}"
            logger.exception("engine step %d failed", self._step_no)
            self.metrics.engine_errors.inc()
            if self._consecutive_failures >= self.max_consecutive_failures:
                raise
            self._publish(self.core.fail(ids, self.last_error))
            self._refresh_state()
        else:
            self._consecutive_failures = 0

    def _drain(self, adds: list[_Add], aborts: list[str], finishes: list[str]) -> None:
        if not (adds or aborts or finishes):
            return
        loop = self._loop
        assert loop is not None
        for add in adds:
            exc: BaseException | None = None
            try:
                self.core.add_request(
                    add.request_id,
                    add.prompt_token_ids,
                    add.params,
                    add.arrival_time,
                    prompt_leader=add.prompt_leader,
                )
                self._live.add(add.request_id)
                self._awaiting_first[add.request_id] = len(add.prompt_token_ids)
            except Exception as e:  # noqa: BLE001 - InvalidRequest/Overloaded go to the client
                exc = e
            loop.call_soon_threadsafe(self._resolve, add.admitted, exc)
        deltas: list[RequestDelta] = []
        live_aborts = [rid for rid in aborts if rid in self._live]
        if live_aborts:
            deltas += self.core.abort(live_aborts)
        for rid in finishes:
            if rid in self._live:
                delta = self.core.finish(rid)
                if delta is not None:
                    deltas.append(delta)
        self._publish(deltas)
        self._refresh_state()

    def _step(self) -> None:
        self._step_no += 1
        deltas, stats = self.core.step()
        if stats is not None:
            self.metrics.observe_step(stats)
            self._log.add_step(stats)
        self._publish(deltas)
        self._refresh_state()
        self.metrics.engine_thread_cpu.set(time.thread_time())
        self._log.maybe_log(self.state)

    def _publish(self, deltas: list[RequestDelta]) -> None:
        if not deltas:
            return
        for delta in deltas:
            self._log.generation_tokens += len(delta.new_token_ids)
            first = (
                self._awaiting_first.pop(delta.request_id, None) if delta.new_token_ids else None
            )
            self.metrics.observe_delta(delta, first)
            if delta.finished:
                self._live.discard(delta.request_id)
                self._awaiting_first.pop(delta.request_id, None)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._route, deltas)

    def _refresh_state(self) -> None:
        self.state = self.core.snapshot()

    def _die(self, exc: BaseException) -> None:
        self.error = f"engine dead after step {self._step_no}: {_describe(exc)}"
        self.last_error = self.last_error or self.error
        logger.exception("engine died after step %d", self._step_no)
        failed = [
            RequestDelta(rid, [], finished=True, finish_reason="error", error_message=self.error)
            for rid in self._live
        ]
        self._live.clear()
        for d in failed:
            self.metrics.observe_delta(d, None)
        loop = self._loop
        assert loop is not None
        loop.call_soon_threadsafe(self._route, failed)
        # Requests still in the inbox, and any that arrive later, fail at admission.
        with self._cv:
            pending, self._adds = self._adds, []
        for add in pending:
            loop.call_soon_threadsafe(self._resolve, add.admitted, EngineDeadError(self.error))


def _describe(exc: BaseException) -> str:
    """``Type: message`` of what went wrong (a StepFailedError's original exception)."""
    if isinstance(exc, StepFailedError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


class _ThroughputLog:
    """The periodic 'engine busy' log line: tokens/s since the last line, queue and KV state."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.last = time.monotonic()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def add_step(self, stats: StepStats) -> None:
        self.prompt_tokens += stats.num_prefill_tokens

    def reset(self) -> None:
        """Called when the engine goes idle, so a line never averages over idle time."""
        self.last, self.prompt_tokens, self.generation_tokens = time.monotonic(), 0, 0

    def maybe_log(self, state: EngineState) -> None:
        now = time.monotonic()
        elapsed = now - self.last
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return
        queried = state.prefix_cache.query_tokens  # since start, as the Prometheus counters
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV %.1f%%, "
            "prefix cache hits %.1f%%, token budget %d, preemptions %d",
            self.prompt_tokens / elapsed,
            self.generation_tokens / elapsed,
            state.num_running,
            state.num_waiting,
            100.0 * state.kv_cache_usage,
            100.0 * state.prefix_cache.hit_tokens / queried if queried else 0.0,
            state.token_budget,
            state.num_preemptions,
        )
        self.last, self.prompt_tokens, self.generation_tokens = now, 0, 0
