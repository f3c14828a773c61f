"""What the stateful test of the engine core (test_core_stateful.py) found, each as a plain
regression test: the real EngineCore around the deterministic fake executor on a virtual
clock, with the machine's block size, vocabulary and traffic classes."""

from __future__ import annotations

from typing import Any

from poise.config import EngineConfig
from poise.core import SamplingParams
from poise.engine import EngineCore, VirtualClock
from tests.unit.fake_executor import FakeExecutor
from tests.unit.test_core_stateful import BLOCK, CLASSES, VOCAB


def _engine(num_kv_blocks: int, **config: Any) -> EngineCore:
    """The setting both programs were found in: the machine's blocks and classes, one running
    request at a time, no chunked prefill; ``config`` on top."""
    config = {
        "block_size": BLOCK,
        "traffic_classes": CLASSES,
        "max_num_seqs": 1,
        "enable_chunked_prefill": False,
    } | config
    return EngineCore(
        EngineConfig.from_kwargs(**config),
        FakeExecutor(VOCAB, BLOCK),
        num_kv_blocks=num_kv_blocks,
        max_model_len=64,
        vocab_size=VOCAB,
        clock=VirtualClock(),
    )


def _drain(engine: EngineCore, max_steps: int = 500) -> dict[str, str]:
    finished: dict[str, str] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        deltas, _ = engine.step()
        engine.kv.check_invariants()
        finished |= {d.request_id: str(d.finish_reason) for d in deltas if d.finished}
    return finished


def test_a_prompt_that_fits_the_step_but_not_its_class_allowance_does_not_block_the_queue() -> None:
    """Without chunked prefill, a 17-token bulk prompt at the queue's head fits the 31-token
    step but not the 13 tokens chat's reservation leaves it; FIFO blocked the queue behind it,
    so the chat requests never used their reservation and nothing ever ran."""
    engine = _engine(22, max_num_batched_tokens=31)
    engine.add_request(
        "bulk",
        list(range(1, 18)),
        SamplingParams(max_tokens=2, temperature=0.0, traffic_class="bulk"),
    )
    for i in range(3):
        params = SamplingParams(max_tokens=2, temperature=0.0, traffic_class="chat")
        engine.add_request(f"chat{i}", [5, 6, 7, 8, 9, 10, 11, i], params)
    finished = _drain(engine)
    assert finished == {"bulk": "length", **{f"chat{i}": "length" for i in range(3)}}


def test_a_request_that_cannot_go_in_displaces_nobody() -> None:
    """At the request cap, a waiting chat prompt of higher priority displaced the running bulk
    request, then did not fit what bulk's reservation leaves it; the bulk request, readmitted,
    was displaced again the next step. Here that cost 4 preemptions for nothing; in the
    stateful run's program, two requests displaced each other for ever and none finished."""
    engine = _engine(21, max_num_batched_tokens=13, scheduling_policy="priority")

    def params(priority: int, cls: str, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.0, priority=priority, traffic_class=cls
        )

    engine.add_request("bulk", [1, 2, 3, 4], params(1, "bulk", 8))
    engine.step()
    engine.add_request("chat", list(range(10, 22)), params(0, "chat", 2))
    engine.add_request("bulk2", [5, 6, 7], params(2, "bulk", 2))
    finished = _drain(engine)
    assert finished == {"bulk": "length", "chat": "length", "bulk2": "length"}
    assert engine.scheduler.num_preemptions_total <= 1  # a displacement that let chat in
