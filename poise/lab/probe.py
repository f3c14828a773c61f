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

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from poise.lab.cell_metrics import CellMetrics


@dataclass(frozen=True)
class Candidate:
    """The knobs the tuner moves. Everything else is fixed per tuning run (``fixed``)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    scheduling_policy: str = "fifo"
    fixed: tuple[tuple[str, Any], ...] = field(default=(), compare=True)
    # SLO-aware scheduling knobs (lab/tune_slo.py); None / False: the fixed value holds.
    traffic_classes: str | None = None
    token_budget_controller: bool = False
    target_tpot_ms: float | None = None

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
        if self.traffic_classes is not None:
            out["traffic_classes"] = self.traffic_classes
        if self.token_budget_controller:
            out.update(token_budget_controller=True, target_tpot_ms=self.target_tpot_ms)
        return out

    @property
    def label(self) -> str:
        policy = "" if self.scheduling_policy == "fifo" else f" {self.scheduling_policy}"
        label = f"budget {self.max_num_batched_tokens} / seqs {self.max_num_seqs}{policy}"
        if self.traffic_classes is not None:
            label += f" classes {self.traffic_classes}"
        if self.token_budget_controller:
            label += f" controller {self.target_tpot_ms:g} ms"
        return label

    @property
    def key(self) -> str:
        """Filesystem-safe identity (store keys, server names)."""
        key = f"b{self.max_num_batched_tokens}-s{self.max_num_seqs}-{self.scheduling_policy}"
        if self.traffic_classes is not None:
            digest = hashlib.sha1(self.traffic_classes.encode()).hexdigest()[:8]
            key += f"-c{digest}"
        if self.token_budget_controller:
            key += f"-t{self.target_tpot_ms:g}"
        return key


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
