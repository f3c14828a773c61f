"""``poise sweep``: every server config x every bench cell, resumable, one combined report.

For each config: if any of its cells is not stored yet, start its server (poise or a command
template), wait until ready, run the missing cells, stop the server (always: ``with``), store
each cell as soon as it is measured. A fresh process per config is the cache reset between
configs; a salt per run and cell keeps cells apart within one. A config whose server fails or
whose cell fails is reported and the sweep goes on with the next config.

Config files (YAML): a poise config ``{name, model?, args: {max_num_seqs: 16, ...}}`` (or the
args as flat keys), another engine ``{name, command: "vllm serve M --port {port} ...",
base_url?, ready_paths?, env?}``, or several of these under ``configs:`` (or a list).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from poise.bench.bench_config import CellSpec, WorkloadSpec
from poise.bench.record import CellResult
from poise.lab.bench_adapter import run_cells
from poise.lab.managed_server import DEFAULT_READY_PATHS, ManagedServer, ServerSpec
from poise.lab.store import CellStore, safe_name

logger = logging.getLogger(__name__)

SPEC_KEYS = {
    "name",
    "model",
    "args",
    "server_args",
    "command",
    "base_url",
    "ready_paths",
    "env",
    "startup_timeout_s",
    "grace_s",
    "description",
}
SERVER_ONLY_ARGS = {"served_model_name", "log_interval", "shutdown_grace_period"}

Runner = Callable[..., dict[str, Any]]  # run_cells' signature


def validate_poise_args(name: str, args: dict[str, Any]) -> None:
    """Raise ValueError naming the config and field for an unknown or out-of-range knob."""
    from poise.config import EngineConfig

    engine = {k: v for k, v in args.items() if k not in SERVER_ONLY_ARGS}
    try:
        EngineConfig.from_kwargs(**engine)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"config {name!r}: {exc}") from exc


def spec_from_dict(
    d: dict[str, Any],
    default_name: str,
    model: str | None = None,
    env: dict[str, str] | None = None,
) -> ServerSpec:
    name = str(d.get("name") or default_name)
    args = d.get("args", d.get("server_args"))
    if args is None:
        args = {k: v for k, v in d.items() if k not in SPEC_KEYS}
    args = {k.replace("-", "_"): v for k, v in dict(args).items()}
    command = d.get("command")
    if command is None:
        validate_poise_args(name, args)
    return ServerSpec(
        name=name,
        model=d.get("model", model),
        args=args,
        command=command,
        base_url=str(d.get("base_url", "http://127.0.0.1:{port}/v1")),
        ready_paths=tuple(d.get("ready_paths", DEFAULT_READY_PATHS)),
        env={**(env or {}), **{str(k): str(v) for k, v in (d.get("env") or {}).items()}},
        startup_timeout_s=float(d.get("startup_timeout_s", 300.0)),
        grace_s=float(d.get("grace_s", 10.0)),
    )


def load_specs(
    path: str | Path, model: str | None = None, env: dict[str, str] | None = None
) -> list[ServerSpec]:
    p = Path(path)
    data = yaml.safe_load(p.read_text(encoding="utf-8"))
    items = data.get("configs") if isinstance(data, dict) and "configs" in data else data
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"{p}: expected a config mapping, a list, or 'configs:'")
    stem = p.stem
    return [
        spec_from_dict(x, stem if len(items) == 1 else f"{stem}-{i}", model, env)
        for i, x in enumerate(items)
    ]


def fingerprint(spec: ServerSpec, workload: WorkloadSpec) -> dict[str, Any]:
    return {
        "model": spec.model,
        "args": spec.args,
        "command": spec.command,
        "workload": workload.fingerprint(),
    }


@dataclass
class ConfigOutcome:
    name: str
    measured: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    error: str | None = None
    server_pid: int | None = None


@dataclass
class SweepResult:
    out_dir: Path
    specs: list[ServerSpec]
    workload: WorkloadSpec
    outcomes: list[ConfigOutcome]
    report_path: Path | None = None
    plots: dict[str, Path] = field(default_factory=dict)


def sweep_config(
    spec: ServerSpec,
    workload: WorkloadSpec,
    store: CellStore,
    salt: str | None,
    out_dir: Path,
    runner: Runner = run_cells,
) -> ConfigOutcome:
    """Measure the cells of one config that the store does not hold yet."""
    outcome = ConfigOutcome(spec.name)
    fp = fingerprint(spec, workload)
    missing: list[CellSpec] = []
    for cell in workload.cells():
        if store.load(spec.name, cell.label, fp) is None:
            missing.append(cell)
        else:
            outcome.reused.append(cell.label)
    if not missing:
        logger.info("%s: all %d cells stored: nothing to measure", spec.name, len(outcome.reused))
        return outcome

    def done(cell: CellSpec, result: CellResult) -> None:
        records = [r.to_dict() for r in result.records]
        store.save(spec.name, cell.label, fp, result.to_dict(), records)
        outcome.measured.append(cell.label)
        logger.info("%s %s: stored", spec.name, cell.label)

    server = ManagedServer(spec, out_dir / "logs" / f"{safe_name(spec.name)}.log")
    try:
        with server:
            outcome.server_pid = server.pid
            extra = {"server_args": dict(spec.args), "engine": spec.engine}
            runner(server.base_url, workload, missing, done, salt=salt, **extra)
    except Exception as exc:  # one config failing must not lose the others
        logger.error("%s failed: %s", spec.name, exc)
        outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.server_pid = server.pid
    return outcome


def run_sweep(
    specs: list[ServerSpec],
    workload: WorkloadSpec,
    out_dir: str | Path,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    runner: Runner = run_cells,
    plots: bool = True,
) -> SweepResult:
    from poise.lab.report import write_sweep_report

    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"config names must be unique, got {names}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = CellStore(out)
    salt = workload.run_salt()
    outcomes = [sweep_config(spec, workload, store, salt, out, runner) for spec in specs]
    result = SweepResult(out, specs, workload, outcomes)
    write_sweep_report(result, store, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, plots=plots)
    return result


def with_overrides(spec: ServerSpec, **changes: Any) -> ServerSpec:
    return dataclasses.replace(spec, **changes)
