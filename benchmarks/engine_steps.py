"""Helpers shared by the step benchmarks (decode_step.py, floor.py): a timer, the model's
linear layers as it runs them, and a batch of requests driven through ``ModelRunner.execute``
with hand-built ``SchedulerOutput`` objects (no scheduler, no engine loop).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from poise.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from poise.core.sampling_params import SamplingParams
from poise.model.llama import Linear, LlamaForCausalLM
from poise.model.quant import QuantLinear
from poise.runner.model_runner import ModelRunner


class Timer:
    """Wall and process-CPU seconds of a block. On a shared machine CPU time is the steadier
    measure of work (wall time includes waiting for a core); with one thread they agree when
    the machine is idle."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def best_pair(timers: list[Timer]) -> tuple[float, float]:
    return min(t.wall for t in timers), min(t.cpu for t in timers)


def is_linear(m: nn.Module) -> bool:
    return isinstance(m, (Linear, QuantLinear))


def projections(model: LlamaForCausalLM) -> list[tuple[str, nn.Module]]:
    """The decoder's linear layers (q/k/v, o, gate/up, down of every layer), in the order a
    forward runs them, by name. Whatever class the model builds them as; a linear nested in
    another one (a wrapper) is part of it, not a layer of its own."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in model.model.named_modules():
        if is_linear(m) and not any(name.startswith(f"{outer}.") for outer, _ in out):
            out.append((name, m))
    return out


def in_features(m: nn.Module) -> int:
    value = getattr(m, "in_features", None)
    return int(value) if value is not None else int(m.weight.shape[1])  # type: ignore[index]


def out_features(m: nn.Module) -> int:
    value = getattr(m, "out_features", None)
    return int(value) if value is not None else int(m.weight.shape[0])  # type: ignore[index]


def tensor_bytes(m: nn.Module) -> int:
    """Bytes of every tensor the module holds (weight, scales and zeros, bias): what a
    forward must read from memory at least once."""
    seen: dict[int, int] = {}
    for t in (*m.parameters(), *m.buffers()):
        if t.device.type != "meta":
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def head_bytes(model: LlamaForCausalLM) -> int:
    """Bytes the lm_head reads: its own module's, or the tied embedding's."""
    head = model.lm_head if model.lm_head is not None else model.tied_head
    return tensor_bytes(head) if head is not None else tensor_bytes(model.model.embed_tokens)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


class DecodeBatch:
    """``batch`` requests of ``prompt_len`` tokens prefilled together in one step, then
    decoding together, one token each per ``step()``, for up to ``steps`` steps. Block
    tables are disjoint, from block ``first_block`` on (``blocks_needed`` of them)."""

    def __init__(
        self,
        runner: ModelRunner,
        batch: int,
        prompt_len: int,
        steps: int,
        first_block: int = 0,
        params: SamplingParams | None = None,
    ) -> None:
        self.runner, self.batch, self.prompt_len = runner, batch, prompt_len
        self.params = params or greedy(steps + 1)
        per = self.blocks_per(prompt_len, steps, runner.block_size)
        self.tables = [
            list(range(first_block + i * per, first_block + (i + 1) * per)) for i in range(batch)
        ]
        # Distinct prompts (no two requests alike), inside any vocabulary.
        span = min(1000, runner.model.arch.vocab_size - 10)
        self.prompts = [[(7 * i + j) % span + 10 for j in range(prompt_len)] for i in range(batch)]
        self.last: dict[str, int] = {}
        self.done = 0  # decode steps run

    @staticmethod
    def blocks_per(prompt_len: int, steps: int, block_size: int) -> int:
        return (prompt_len + steps + block_size - 1) // block_size

    @classmethod
    def blocks_needed(cls, batch: int, prompt_len: int, steps: int, block_size: int) -> int:
        return batch * cls.blocks_per(prompt_len, steps, block_size)

    def prefill(self) -> ModelRunnerOutput:
        reqs = [
            ScheduledRequest(
                f"r{i}", self.prompts[i], 0, self.tables[i], True, self.params, 0, self.prompt_len
            )
            for i in range(self.batch)
        ]
        out = self.runner.execute(SchedulerOutput(step_id=0, scheduled=reqs))
        self.last = out.sampled_token_ids
        return out

    def assume_prefilled(self) -> None:
        """Decode from position ``prompt_len`` without running the prefill: the runner keeps
        no per-request state, so a decode there reads whatever the pool holds (zeros), at the
        cost of a real context of that length. Each request's first input is its last prompt
        token."""
        self.last = {f"r{i}": p[-1] for i, p in enumerate(self.prompts)}

    def step(self) -> ModelRunnerOutput:
        s = self.done
        pos = self.prompt_len + s
        reqs = [
            ScheduledRequest(
                f"r{i}",
                [self.last[f"r{i}"]],
                pos,
                self.tables[i],
                True,
                self.params,
                s + 1,
                self.prompt_len,
            )
            for i in range(self.batch)
        ]
        out = self.runner.execute(SchedulerOutput(step_id=s + 1, scheduled=reqs))
        self.last = out.sampled_token_ids
        self.done += 1
        return out


def random_inputs(sizes: set[int], rows: int, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(rows, k, generator=gen).to(dtype) for k in sizes}
