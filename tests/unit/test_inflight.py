"""In-flight prefix sharing (sched/inflight.py, kv/inflight.py), through EngineCore with the
deterministic fake model: followers wait for a running prefill's blocks instead of computing
them, admission goes on past them, they take over when the leader goes, and their outputs are
the model's."""

from __future__ import annotations

import pytest

from poise.config import EngineConfig
from poise.core import SamplingParams
from poise.engine import EngineCore, VirtualClock
from poise.errors import StepFailedError
from tests.unit.fake_executor import FakeExecutor

BLOCK = 4
DOC = list(range(100, 164))  # 64 tokens = 16 blocks


def make(
    budget: int = 32, caching: bool = True, **kwargs: object
) -> tuple[EngineCore, FakeExecutor]:
    # The long-prefill cap keeps the leader from taking the whole step: without it a prompt
    # longer than the budget serializes the others behind it anyway (nothing to share).
    config = EngineConfig.from_kwargs(
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=8,
        enable_prefix_caching=caching,
        **kwargs,
    )
    executor = FakeExecutor(1000, BLOCK)
    engine = EngineCore(
        config,
        executor,
        num_kv_blocks=128,
        max_model_len=256,
        vocab_size=1000,
        clock=VirtualClock(),
    )
    return engine, executor


def greedy(n: int = 3, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kwargs)  # type: ignore[arg-type]


def drain(engine: EngineCore, out: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    out = {} if out is None else out
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        deltas, _ = engine.step()
        engine.kv.check_invariants()
        for d in deltas:
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_used_blocks == 0 and len(engine.kv.pending) == 0
    return out


def expected(executor: FakeExecutor, prompt: list[int], n: int = 3) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(executor.next_token(seq))
    return seq[len(prompt) :]


def computed_tokens(executor: FakeExecutor) -> int:
    return sum(s.num_tokens for step in executor.steps for s in step.scheduled)


def test_identical_prompts_sent_together_compute_the_prompt_once() -> None:
    engine, executor = make()
    prompt = DOC + [1, 2]  # 66 tokens: 16 full blocks, the last token short of a 17th
    for i in range(4):
        engine.add_request(f"r{i}", prompt, greedy())
    out = drain(engine)
    assert all(out[f"r{i}"] == expected(executor, prompt) for i in range(4))
    # The leader computes 66 prompt tokens; each follower its last 2 (then 3 decodes each).
    prefill = computed_tokens(executor) - 4 * 2
    assert prefill == 66 + 3 * 2, prefill
    stats = engine.kv.prefix_stats
    assert stats.inflight_hits == 3 and stats.inflight_hit_tokens == 3 * 64
    assert stats.hit_tokens == 3 * 64
    assert engine.scheduler.inflight.followers == 0


def test_partial_overlap_computes_the_shared_document_once() -> None:
    engine, executor = make()
    prompts = {f"q{i}": DOC + [500 + i] * 6 for i in range(4)}  # one document, four questions
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy())
    out = drain(engine)
    assert all(out[rid] == expected(executor, p) for rid, p in prompts.items())
    # 70-token prompts: the document's 16 blocks once, then each request its own 6 tokens.
    prefill = computed_tokens(executor) - 4 * 2
    assert prefill == 70 + 3 * 6, prefill
    assert engine.kv.prefix_stats.inflight_hit_tokens == 3 * 64


def test_a_follower_never_blocks_admission_behind_it() -> None:
    engine, executor = make(budget=32)
    engine.add_request("lead", DOC + [1], greedy())
    engine.add_request("follow", DOC + [2], greedy())
    engine.add_request("other", [7, 8, 9], greedy())  # shares nothing: goes in at once
    engine.step()
    first = {s.request_id: s for s in executor.steps[0].scheduled}
    assert set(first) == {"lead", "other"}
    assert engine.scheduler.inflight.followers == 1
    drain(engine)


def test_without_the_prefix_cache_nobody_waits() -> None:
    engine, executor = make(caching=False)
    for i in range(2):
        engine.add_request(f"r{i}", DOC + [1], greedy())
    engine.step()
    assert [s.request_id for s in executor.steps[0].scheduled] == ["r0", "r1"]
    assert engine.scheduler.inflight.num_deferrals == 0


@pytest.mark.parametrize("how", ["abort", "fail"])
def test_a_follower_takes_over_when_its_leader_goes_mid_prefill(how: str) -> None:
    engine, executor = make()
    prompt = DOC + [1, 2]
    engine.add_request("lead", prompt, greedy())
    engine.add_request("follow", prompt, greedy())
    engine.step()  # lead computes its first 16 tokens; follow waits for the rest
    engine.step()
    sched = engine.scheduler
    lead = sched.requests["lead"]
    assert lead.num_computed_tokens == 16 and sched.inflight.followers == 1
    if how == "abort":
        engine.abort(["lead"])
    else:
        executor_execute = executor.execute

        def boom(output: object) -> object:
            raise RuntimeError("injected step failure")

        executor.execute = boom  # type: ignore[assignment,method-assign]
        with pytest.raises(StepFailedError) as exc:
            engine.step()
        engine.fail(exc.value.request_ids, "failed")
        executor.execute = executor_execute  # type: ignore[method-assign]
    assert len(engine.kv.pending) == 0  # the leader's pending blocks are nobody's now
    out = drain(engine)
    assert out["follow"] == expected(executor, prompt)
    # The follower started from what the leader had written before it went (4 blocks).
    first_follow = next(
        s for st in executor.steps for s in st.scheduled if s.request_id == "follow"
    )
    assert first_follow.start_position >= 16
    follow_done = sched.requests.get("follow")
    assert follow_done is None  # finished and forgotten


def test_cached_tokens_of_a_follower_are_reported() -> None:
    engine, executor = make()
    engine.add_request("a", DOC + [1, 2], greedy())
    engine.add_request("b", DOC + [1, 2], greedy())
    cached: dict[str, int] = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        deltas, _ = engine.step()
        for d in deltas:
            if d.finished:
                cached[d.request_id] = d.num_cached_tokens
    assert cached == {"a": 0, "b": 64}


def test_under_slo_a_follower_runs_its_leader_at_its_own_turn() -> None:
    """A tight-deadline follower waits on a loose-class leader; the slo order puts the
    follower before requests that would take the step's budget, and its turn runs the
    leader's chunk: without that, the leader (last by slack) got nothing this step."""
    classes = "chat:ttft_p95_ms=50;bulk:prompt_tokens>=60,ttft_p95_ms=100000"
    engine, executor = make(budget=16, scheduling_policy="slo", traffic_classes=classes)
    engine.add_request("lead", DOC + [1], greedy())  # 65 tokens: bulk
    engine.step()
    engine.add_request("follow", DOC[:48] + [2], greedy())  # 49 tokens: chat
    for i in range(3):
        engine.add_request(f"other{i}", [900 + i] * 16, greedy())
    engine.step()
    sched = engine.scheduler
    assert sched.requests["follow"].slo.class_name == "chat"
    assert sched.requests["lead"].slo.class_name == "bulk"
    assert sched.inflight.followers == 1
    step2 = {s.request_id: s.num_tokens for s in executor.steps[1].scheduled}
    assert step2.get("lead", 0) > 0, step2
    out = drain(engine)
    assert out["follow"] == expected(executor, DOC[:48] + [2])
