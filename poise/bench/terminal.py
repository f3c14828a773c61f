"""Terminal output: the results table (one row per cell, indented rows per class) and the
progress bar, with rich. Presentation only; numbers come from the record."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from poise.bench.record import CellResult, ExperimentRecord


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _row(name: str, g: dict[str, Any], cell: CellResult | None) -> list[str]:
    row = [
        name,
        f"{g['num_ok']}/{g['num_requests']}",
        _ms(g["ttft_ms"]["p50"]),
        _ms(g["ttft_ms"]["p95"]),
        _ms(g["tpot_ms"]["p50"]),
        _ms(g["itl_ms"]["p95"]),
        _ms(g["e2e_ms"]["p95"]),
        _ms(g["max_stall_ms"]["p95"]),
        _num(g["output_tokens_per_s"]),
        _num(g["requests_per_s"], "{:.2f}"),
        _num((g.get("goodput") or {}).get("slo_attainment"), "{:.0%}"),
    ]
    if cell is None:
        return row + ["", "", "", ""]
    srv = cell.server
    kv = (srv.get("kv_usage") or {}).get("peak")
    run = (srv.get("running") or {}).get("max")
    wait = (srv.get("waiting") or {}).get("max")
    health = cell.client_health
    row += [
        _num(kv, "{:.0%}"),
        f"{_num(run, '{:.0f}')}/{_num(wait, '{:.0f}')}",
        _num(srv.get("preemptions"), "{:.0f}"),
        "ok" if health.get("valid", True) else "[red]INVALID[/red]",
    ]
    return row


def results_table(record: ExperimentRecord) -> Table:
    exp = record.experiment
    title = (
        f"{exp.get('engine')} · {exp.get('model')} · max_tokens {exp['workload'].get('max_tokens')}"
    )
    table = Table(title=title, show_lines=False)
    cols = [
        "cell",
        "ok/n",
        "TTFT p50",
        "TTFT p95",
        "TPOT p50",
        "ITL p95",
        "E2E p95",
        "stall p95",
        "out tok/s",
        "req/s",
        "SLO ok",
        "KV peak",
        "run/wait max",
        "preempt",
        "client",
    ]
    for c in cols:
        table.add_column(c, justify="left" if c == "cell" else "right")
    for cell in record.cells:
        table.add_row(*_row(cell.label, cell.metrics["overall"], cell))
        classes = cell.metrics.get("classes") or {}
        if len(classes) > 1:
            for name, g in classes.items():
                table.add_row(*_row(f"  {name}", g, None), style="dim")
    return table


def print_record(record: ExperimentRecord, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 180)  # files and pipes: do not squeeze columns
    console.print(results_table(record))
    for cell in record.cells:
        reasons = cell.client_health.get("invalid_reasons", [])
        if reasons:
            console.print(f"[red]{cell.label}: INVALID (client lag): {'; '.join(reasons)}[/red]")
        short = cell.metrics["overall"]["shortfall"]
        if short["num_short"]:
            console.print(
                f"[yellow]{cell.label}: {short['num_short']}/{short['of']} requests "
                "returned fewer tokens than max_tokens[/yellow]"
            )
        hol = cell.metrics.get("interference")
        if hol and hol["ttft_ms_overlapping_long_prefill"]["n"]:
            hit, clear = hol["ttft_ms_overlapping_long_prefill"], hol["ttft_ms_clear"]
            console.print(
                f"{cell.label}: other requests' TTFT p50 {_ms(hit['p50'])} ms behind a long "
                f"prefill (n={hit['n']}) vs {_ms(clear['p50'])} ms clear (n={clear['n']}); "
                f"P(stall) {_num(hol['p_stall_during_long_prefill'], '{:.0%}')} during long "
                f"prefills vs {_num(hol['p_stall_otherwise'], '{:.0%}')} otherwise"
            )
        errors = cell.metrics["overall"]["errors"]
        if errors:
            console.print(f"[yellow]{cell.label}: errors {errors}[/yellow]")
    console.print("times in ms; ITL per token; stall = largest gap between token events")


class CellProgress:
    """A rich progress bar, one task per cell."""

    def __init__(self, console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task: Any = None

    def __enter__(self) -> CellProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start_cell(self, label: str, total: int | None) -> None:
        self._task = self.progress.add_task(label, total=total)

    def update(self, done: int, total: int | None) -> None:
        if self._task is not None:
            self.progress.update(self._task, completed=done, total=total)
