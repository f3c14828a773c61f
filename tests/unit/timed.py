"""A timed driver for policy tests: arrivals on a virtual clock, steps that cost ``a + b x tokens``."""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.config import EngineConfig
from poise.core import SamplingParams
from poise.core.request import RequestTimes
from poise.core.timing import RequestMetrics, derive
from poise.engine import EngineCore, VirtualClock
from poise.errors import OverloadedError
from tests.unit.fake_executor import TimedFakeExecutor


@dataclass
class Arrival:
    t: float
    rid: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    times: RequestTimes | None = None
    num_preemptions: int = 0
    retry_after_s: float | None = None  # refused with 429

    @property
    def metrics(self) -> RequestMetrics:
        assert self.times is not None
        return derive(self.times)


def make_engine(
    a: float = 0.01, b: float = 0.001, num_kv_blocks: int = 1024, **kwargs: object
) -> tuple[EngineCore, TimedFakeExecutor, VirtualClock]:
    kwargs.setdefault("block_size", 4)
    clock = VirtualClock()
    executor = TimedFakeExecutor(clock, a, b)
    engine = EngineCore(
        EngineConfig.from_kwargs(**kwargs),
        executor,
        num_kv_blocks=num_kv_blocks,
        max_model_len=8192,
        vocab_size=1000,
        clock=clock,
    )
    return engine, executor, clock


def params(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def drive(engine: EngineCore, arrivals: list[Arrival]) -> dict[str, Result]:
    """Add each arrival when the clock reaches it, step until everything finished."""
    clock = engine.clock
    assert isinstance(clock, VirtualClock)
    todo = sorted(arrivals, key=lambda a: a.t)
    todo.reverse()
    results: dict[str, Result] = {}
    while todo or engine.has_unfinished_requests():
        while todo and todo[-1].t <= clock.now():
            a = todo.pop()
            res = results.setdefault(a.rid, Result())
            try:
                engine.add_request(a.rid, a.prompt, a.params, arrival_time=a.t)
            except OverloadedError as exc:
                res.retry_after_s = exc.retry_after_s
        if not engine.has_unfinished_requests():
            clock.advance_to(todo[-1].t)
            continue
        deltas, stats = engine.step()
        engine.kv.check_invariants()
        if stats is None:  # nothing to compute: on to the next arrival or the policy's wake
            due = [t for t in (todo[-1].t if todo else None, engine.wake_time()) if t is not None]
            if due:
                clock.advance_to(max(clock.now(), min(due)))
        for d in deltas:
            res = results.setdefault(d.request_id, Result())
            res.tokens.extend(d.new_token_ids)
            if d.finished:
                res.times = d.times
                res.num_preemptions = d.num_preemptions
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # no leak
    return results
