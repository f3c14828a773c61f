"""Probes that measure: ``LiveProbe`` starts a server with the candidate's knobs, runs one
bench cell and stops the server (always); ``SimProbe`` runs the cell in the simulator.

Invariants: every live probe is a fresh server process (nothing cached from the previous
candidate) and its result is stored under ``<out>/probes/`` like a sweep cell, so a re-run of
the same tuning resumes without re-measuring candidates it already measured.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from poise.bench.bench_config import BenchConfig, CellSpec, WorkloadSpec
from poise.bench.record import CellResult
from poise.lab.bench_adapter import run_cells
from poise.lab.cell_metrics import CellMetrics
from poise.lab.managed_server import ManagedServer, ServerSpec
from poise.lab.probe import Candidate
from poise.lab.store import CellStore

logger = logging.getLogger(__name__)


class LiveProbe:
    """``base`` holds the fixed server arguments (poise) or the command template (another
    engine, with ``{max_num_batched_tokens}``, ``{max_num_seqs}``... placeholders)."""

    def __init__(
        self,
        base: ServerSpec,
        workload: WorkloadSpec,
        cell: CellSpec,
        out_dir: str | Path,
        runner: Any = run_cells,
    ) -> None:
        self.base = base
        self.workload = workload
        self.cell = cell
        self.out = Path(out_dir)
        self.store = CellStore(self.out / "probes")
        self.salt = workload.run_salt()
        self.runner = runner
        self.pids: list[int] = []

    def spec_for(self, cand: Candidate) -> ServerSpec:
        args = {**self.base.args, **cand.to_args()}
        return dataclasses.replace(self.base, name=cand.key, args=args)

    def fingerprint(self, spec: ServerSpec) -> dict[str, Any]:
        return {
            "model": spec.model,
            "args": spec.args,
            "command": spec.command,
            "workload": self.workload.fingerprint(),
            "cell": self.cell.label,
        }

    def measure(self, candidate: Candidate) -> CellMetrics:
        spec = self.spec_for(candidate)
        fp = self.fingerprint(spec)
        stored = self.store.load(spec.name, self.cell.label, fp)
        if stored is not None:
            logger.info("%s: stored result reused", candidate.label)
            return CellMetrics.from_bench(stored["result"])
        got: list[Any] = []

        def done(cell: CellSpec, result: CellResult) -> None:
            records = [r.to_dict() for r in result.records]
            self.store.save(spec.name, cell.label, fp, result.to_dict(), records)
            got.append(result)

        server = ManagedServer(spec, self.out / "logs" / f"{spec.name}.log")
        try:
            with server:
                extra = {"server_args": dict(spec.args), "engine": spec.engine}
                self.runner(
                    server.base_url, self.workload, [self.cell], done, salt=self.salt, **extra
                )
        finally:
            if server.pid is not None:
                self.pids.append(server.pid)
        if not got:
            raise RuntimeError(f"{candidate.label}: the bench returned no cell")
        return CellMetrics.from_bench(got[0].to_dict())


class SimProbe:
    """The candidate through the simulator (``poise simulate``'s bench bridge): the real
    scheduler in virtual time, step costs from a profile or a roofline model."""

    def __init__(
        self,
        base_args: dict[str, Any],
        workload: WorkloadSpec,
        cell: CellSpec,
        cost_model: Any,
        lengths: Any,
    ) -> None:
        from poise.lab.sim_bridge import check_simulable

        check_simulable(workload)  # at once, not as every probe's failure
        self.base_args = base_args
        self.workload = workload
        self.cell = cell
        self.cost_model = cost_model
        self.lengths = lengths

    def measure(self, candidate: Candidate) -> CellMetrics:
        from poise.config import EngineConfig
        from poise.lab.sim_bridge import simulate_bench_cell

        config = EngineConfig.from_kwargs(**{**self.base_args, **candidate.to_args()})
        cfg = BenchConfig.for_workload(self.workload, base_url="simulated://")
        result, _ = simulate_bench_cell(
            cfg, self.cell, config, self.cost_model, self.lengths, "sim"
        )
        return dataclasses.replace(CellMetrics.from_bench(result.to_dict()), note="simulated")
