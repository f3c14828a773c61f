"""Where a decode step's time goes, through the real ``ModelRunner.execute``.

The runner's parts are wrapped, for the measured steps only, in timers that add each call's
wall time to one category (the outermost timed call wins, so the lm_head's linear inside
``compute_logits`` counts as lm_head, and a norm inside another norm once):

- ``linears``: the decoder's projections (every module ``engine_steps.projections`` finds,
  whatever kernel it runs);
- ``attention``: the backend's ``prepare`` (once per step) and ``forward`` (K/V write and
  attention, per layer);
- ``norms/rope/act``: every RMSNorm (with the residual add fused before it), the rotary
  tables and rotation, SiLU x up (the fused kernel), the embedding lookup;
- ``lm_head``: ``compute_logits`` on the sampled rows;
- ``sampling``: the sampler and what the runner does around it with the logits (non-finite
  rows, logprobs, structured-output mask);
- ``inputs``: building the step's flat input tensors and attention metadata (host work);
- ``host``: the rest of the step's wall time, inside no timed part: Python between the
  kernels, module calls, the runner's bookkeeping.

No prefill is run: the runner keeps no per-request state, so decoding at position
``prompt_len`` reads the (zeroed) pool there at the cost of a real context of that length.
The timers cost ~1 us per call (a few hundred calls per step); the same steps are also run
without them and both totals are reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from engine_steps import DecodeBatch, projections

from poise.model import elementwise
from poise.model import llama as llama_module
from poise.runner import model_runner as runner_module
from poise.runner.model_runner import ModelRunner

PARTS = ("linears", "attention", "norms/rope/act", "lm_head", "sampling", "inputs", "host")
_SAMPLING = (
    "sample",
    "nonfinite_rows",
    "raw_logprobs",
    "mask_logits",
    "sampled_logprobs",
    "prompt_logprobs",
)


class Ranges:
    """Seconds per category of the wrapped calls; nested wrapped calls count once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._inside = False

    def wrap(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[category] = self.seconds.get(category, 0.0) + elapsed
                self._inside = False

        return call

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


@contextmanager
def instrumented(runner: ModelRunner) -> Iterator[Ranges]:
    """The runner with its parts timed into a Ranges (everything restored on exit)."""
    ranges = Ranges()
    model = runner.model
    instances: list[tuple[object, str]] = []  # (object, attribute) set on the instance
    globals_: list[tuple[object, str, Any]] = []  # (module, name, original)

    def on_instance(obj: object, attr: str, category: str) -> None:
        setattr(obj, attr, ranges.wrap(getattr(obj, attr), category))
        instances.append((obj, attr))

    def on_module(module: object, name: str, category: str) -> None:
        original = getattr(module, name)
        setattr(module, name, ranges.wrap(original, category))
        globals_.append((module, name, original))

    for _, m in projections(model):
        on_instance(m, "forward", "linears")
    on_instance(runner.attention, "forward", "attention")
    on_instance(runner.attention, "prepare", "attention")
    for m in model.modules():
        if isinstance(m, llama_module.RMSNorm):
            on_instance(m, "forward", "norms/rope/act")
            on_instance(m, "add_and_norm", "norms/rope/act")
    on_instance(model.model.embed_tokens, "forward", "norms/rope/act")
    if model.rotary is not None:
        on_instance(model.rotary, "tables", "norms/rope/act")
    on_module(llama_module, "apply_rope", "norms/rope/act")
    on_module(elementwise, "silu_mul", "norms/rope/act")
    on_instance(model, "compute_logits", "lm_head")
    for name in _SAMPLING:
        on_module(runner_module, name, "sampling")
    on_module(runner_module, "build_step_inputs", "inputs")
    try:
        yield ranges
    finally:
        for obj, attr in instances:
            delattr(obj, attr)  # back to the class's method
        for module, name, original in reversed(globals_):
            setattr(module, name, original)


@dataclass
class Breakdown:
    batch: int
    step: float  # seconds: the median step, timed parts
    plain_step: float  # the median step without the timers
    parts: dict[str, float] = field(default_factory=dict)  # of that median step; sum = step

    def rest_over_linears(self) -> float:
        return (self.step - self.parts["linears"]) / self.parts["linears"]


def steps_needed(steps: int) -> int:
    """Decode steps a ``breakdown`` of ``steps`` runs (the KV blocks it needs follow)."""
    return 2 + 2 * steps


def breakdown(
    runner: ModelRunner, batch: int, prompt_len: int, steps: int, first_block: int = 0
) -> Breakdown:
    """``steps`` decode steps of ``batch`` requests at context ~``prompt_len`` without the
    timers, then ``steps`` with them (after 2 unmeasured ones): the median of each."""
    decode = DecodeBatch(runner, batch, prompt_len, steps_needed(steps), first_block)
    decode.assume_prefilled()
    for _ in range(2):
        decode.step()
    plain = []
    for _ in range(steps):
        start = time.perf_counter()
        decode.step()
        plain.append(time.perf_counter() - start)
    timed: list[tuple[float, dict[str, float]]] = []
    with instrumented(runner) as ranges:
        for _ in range(steps):
            start = time.perf_counter()
            decode.step()
            total = time.perf_counter() - start
            parts = ranges.take()
            parts["host"] = total - sum(parts.values())
            timed.append((total, parts))
    timed.sort(key=lambda item: item[0])
    total, parts = timed[len(timed) // 2]
    return Breakdown(batch, total, statistics.median(plain), {p: parts.get(p, 0.0) for p in PARTS})
