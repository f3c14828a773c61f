"""The probe interface: one server configuration in, one measured cell out.

The tuner only ever talks to a ``Probe``; what stands behind it is interchangeable:
- ``FunctionProbe``: a Python function (mocks, tests, what-if models);
- ``LiveProbe`` (lab/live.py): start a server with the config, run the bench cell, stop it;
- ``SimProbe`` (lab/live.py): the simulator's ``simulate_cell`` on a virtual clock.

Invariants: the workload (request sample, client concurrency, max_tokens) is fixed inside the
probe, so every probe of one tuning run differs only in the candidate's knobs (one variable at
a time). A ``Candidate`` is immutable and hashable; ``to_args`` gives poise's flat engine
keyword names (``EngineConfig.from_kwargs``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from poise.lab.metrics import CellMetrics


@dataclass(frozen=True)
class Candidate:
    """The knobs the tuner moves. Everything else is fixed per tuning run (``fixed``)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    scheduling_policy: str = "fifo"
    fixed: tuple[tuple[str, Any], ...] = field(default=(), compare=True)

    def with_(self, **changes: Any) -> Candidate:
        return replace(self, **changes)

    def to_args(self) -> dict[str, Any]:
        """Flat engine arguments: the fixed ones, then the tuned knobs (which win)."""
        out = dict(self.fixed)
        out.update(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            scheduling_policy=self.scheduling_policy,
        )
        return out

    @property
    def label(self) -> str:
        policy = "" if self.scheduling_policy == "fifo" else f" {self.scheduling_policy}"
        return f"budget {self.max_num_batched_tokens} / seqs {self.max_num_seqs}{policy}"

    @property
    def key(self) -> str:
        """Filesystem-safe identity (store keys, server names)."""
        return f"b{self.max_num_batched_tokens}-s{self.max_num_seqs}-{self.scheduling_policy}"


class Probe(Protocol):
    """Measure one candidate under the probe's fixed workload."""

    def measure(self, candidate: Candidate) -> CellMetrics: ...


class FunctionProbe:
    """A probe backed by a function (mock servers at the interface level, what-if models)."""

    def __init__(self, fn: Callable[[Candidate], CellMetrics]) -> None:
        self.fn = fn
        self.calls: list[Candidate] = []

    def measure(self, candidate: Candidate) -> CellMetrics:
        self.calls.append(candidate)
        return self.fn(candidate)


def fixed_args(args: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Freeze a mapping of fixed server arguments (sorted, so equal dicts give equal keys)."""
    return tuple(sorted(args.items()))
