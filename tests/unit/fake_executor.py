"""A deterministic stand-in for the model, for scheduler tests.

Like a KV cache, it writes each fed token into the slot its block table names, and reads a
request's earlier context back through its block table (so prefix-cache hits and block tables
are exercised for real). It "samples" a token that is a pure function of the whole context:
outputs are identical across any correct schedule, and a wrong token, position or block at any
point changes them.
"""

from __future__ import annotations

import zlib

from poise.core.outputs import ModelRunnerOutput, SchedulerOutput
from poise.engine.clock import VirtualClock


class FakeExecutor:
    def __init__(self, vocab_size: int = 1000, block_size: int = 4) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.slots: dict[int, int] = {}  # slot -> token id written there
        self.steps: list[SchedulerOutput] = []

    def next_token(self, context: list[int]) -> int:
        return zlib.crc32(repr(context).encode()) % self.vocab_size

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        sampled = {}
        accepted: dict[str, list[int]] = {}
        for sched in scheduler_output.scheduled:
            end = sched.start_position + sched.num_tokens
            assert len(sched.block_ids) * self.block_size >= end, "block table too short"
            context = [
                self.slots[self._slot(sched.block_ids, p)] for p in range(sched.start_position)
            ]
            for offset, token in enumerate(sched.token_ids):
                self.slots[self._slot(sched.block_ids, sched.start_position + offset)] = token
            context += sched.token_ids
            k = sched.num_draft_tokens
            if sched.sample and k:  # verify drafts: keep them while each is the model's token
                known = len(context) - k
                drafts = context[known:]
                kept = 0
                while kept < k and self.next_token(context[: known + kept]) == drafts[kept]:
                    kept += 1
                accepted[sched.request_id] = drafts[:kept]
                sampled[sched.request_id] = self.next_token(context[: known + kept])
            elif sched.sample:
                sampled[sched.request_id] = self.next_token(context)
        return ModelRunnerOutput(sampled_token_ids=sampled, accepted_draft_ids=accepted)


class TimedFakeExecutor(FakeExecutor):
    """The same outputs, on a virtual clock that each step moves by ``a + b x tokens``: the
    synthetic step cost the policy tests measure TTFT, TPOT and predictions against."""

    def __init__(self, clock: VirtualClock, a: float, b: float, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.clock, self.a, self.b = clock, a, b

    def step_time(self, num_tokens: int) -> float:
        return self.a + self.b * num_tokens

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(scheduler_output)
        self.clock.advance(self.step_time(scheduler_output.total_num_scheduled_tokens))
        return out
