"""Admission (sched/admission.py): refusal reasons, the deferral gate, classes resolved once."""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.core.request import Request
from poise.sched.classes import ClassSet, TrafficClass
from poise.sched.gates import Deferral
from poise.sched.step import NO_SLOT, QUEUE_BLOCKED
from tests.unit.test_scheduler import greedy, make_engine, run_all


def test_each_refusal_names_its_reason() -> None:
    """One slot under fifo: the second request has no slot and blocks the queue behind it."""
    engine, _ = make_engine(max_num_seqs=1, scheduling_policy="fifo")
    for i in range(3):
        engine.add_request(str(i), [1, 2, 3, 4, 5], greedy(2))
    engine.step()
    assert engine.scheduler.last_refusals == {"1": NO_SLOT, "2": QUEUE_BLOCKED}
    run_all(engine)


@dataclass
class HoldBack:
    """A deferral gate holding named requests back (what in-flight prefix sharing plugs in)."""

    held: set[str] = field(default_factory=set)
    went_in: list[str] = field(default_factory=list)

    def defer(self, request: Request) -> Deferral | None:
        return Deferral("held") if request.request_id in self.held else None

    def admitted(self, request: Request, cached_blocks: list[int]) -> None:
        self.went_in.append(request.request_id)


def test_a_deferred_request_waits_and_admission_goes_on_past_it() -> None:
    engine, _ = make_engine()
    gate = HoldBack({"a"})
    engine.scheduler.admission.defer.append(gate)
    engine.add_request("a", [1, 2, 3, 4, 5], greedy(3))
    engine.add_request("b", [6, 7, 8], greedy(3))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["b"]
    assert engine.scheduler.last_refusals == {"a": "held"}
    gate.held.clear()
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"a", "b"}
    assert gate.went_in == ["b", "a"]  # every gate hears of each admission, in order
    assert run_all(engine).keys() == {"a", "b"}


def test_a_request_class_is_resolved_once_on_arrival() -> None:
    engine, _ = make_engine(num_kv_blocks=1024, traffic_classes="default")
    calls: list[int] = []

    class Counting(ClassSet):
        def assign(self, num_prompt_tokens: int, requested: str | None = None) -> TrafficClass:
            calls.append(num_prompt_tokens)
            return super().assign(num_prompt_tokens, requested)

    engine.classes = Counting(engine.classes.classes)
    request = engine.add_request("r", [1 + i % 999 for i in range(1099)], greedy(2))
    assert calls == [1099]
    assert request.slo.class_name == "long"  # the default classes' prompt rule
    run_all(engine)
    assert calls == [1099]


def test_what_a_deferred_request_waits_for_runs_once_at_its_turn() -> None:
    """prefill_first walks the waiting queue before decodes: the decode a deferred request
    waits for runs at that request's turn, and not again at its own."""
    engine, executor = make_engine(scheduling_policy="prefill_first")
    engine.add_request("a", [1, 2, 3, 4, 5], greedy(4))
    engine.step()  # a's prompt; it decodes from now on
    a = engine.scheduler.requests["a"]

    class WaitForA:
        def defer(self, request: Request) -> Deferral | None:
            return Deferral("waits_for_a", run=a) if request.request_id == "b" else None

    engine.scheduler.admission.defer.append(WaitForA())
    engine.add_request("b", [6, 7, 8], greedy(2))
    output = engine.scheduler.schedule(engine.clock.now())
    assert [s.request_id for s in output.scheduled] == ["a"]
    assert engine.scheduler.last_refusals == {"b": "waits_for_a"}
