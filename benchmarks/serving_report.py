"""The cells of benchmarks/serving.py (one closed-loop run of one mode at one concurrency)
and their table."""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.core.timing import percentile


@dataclass
class Cell:
    mode: str  # "http" | "offline"
    concurrency: int
    num_requests: int
    output_tokens: int
    seconds: float
    ttft: dict[str, list[float]] = field(default_factory=dict)  # class -> seconds
    server_cpu: dict[str, float] = field(default_factory=dict)
    kv_cache_dtype: str = "auto"
    run: int = 0  # which of --runs (each on freshly started servers)

    @property
    def step_ms(self) -> float | None:
        """The server's mean step over the cell (from /metrics), None offline."""
        n = self.server_cpu.get("step_count", 0.0)
        return 1000 * self.server_cpu.get("steps", 0.0) / n if n else None

    def phase_ms(self, phase: str) -> float | None:
        """The server's mean of one TTFT phase over the cell's requests (from /metrics):
        ``ingress_time``, ``queue_time``, ``prefill_time`` or ``prefill_compute``."""
        n = self.server_cpu.get(f"{phase}_count", 0.0)
        return 1000 * self.server_cpu.get(f"{phase}_sum", 0.0) / n if n else None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def ttft_ms(self, cls: str, q: float) -> float | None:
        v = percentile(self.ttft.get(cls, []), q)
        return None if v is None else 1000 * v


def report(cells: list[Cell]) -> str:
    rows = [
        "| conc | mode | req | out tok | s | tok/s | HTTP/offline | TTFT p50/p95 SHORT ms "
        "| TTFT p50/p95 LONG ms | server CPU s (engine / loop / process) "
        "| server TTFT mean ms (ingress / queue / prefill, of it computing) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    offline = {c.concurrency: c for c in cells if c.mode == "offline"}

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for cell in cells:
        ratio = ""
        if cell.mode.startswith("http") and cell.concurrency in offline:
            ratio = f"{cell.tokens_per_s / offline[cell.concurrency].tokens_per_s:.1%}"
        cpu = cell.server_cpu
        cpu_s = (
            (
                f"{cpu.get('engine_thread', 0):.1f} / {cpu.get('loop_thread', 0):.1f} / "
                f"{cpu.get('process', 0):.1f}"
            )
            if cpu
            else ""
        )
        phases = (
            " / ".join(f(cell.phase_ms(p)) for p in ("ingress_time", "queue_time", "prefill_time"))
            + f" ({f(cell.phase_ms('prefill_compute'))})"
            if cell.phase_ms("queue_time") is not None
            else ""
        )
        rows.append(
            f"| {cell.concurrency} | {cell.mode} kv={cell.kv_cache_dtype}{f' r{cell.run}' if cell.run else ''} "
            f"| {cell.num_requests} | {cell.output_tokens} "
            f"| {cell.seconds:.1f} | {cell.tokens_per_s:.1f} | {ratio} "
            f"| {f(cell.ttft_ms('short', 50))} / {f(cell.ttft_ms('short', 95))} "
            f"| {f(cell.ttft_ms('long', 50))} / {f(cell.ttft_ms('long', 95))} | {cpu_s} | {phases} |"
        )
    return "\n".join(rows)


def spread(cells: list[Cell]) -> str:
    """Across --runs: each (mode, kv, concurrency)'s output tok/s (slowest / median / fastest),
    TTFT p95 of all requests in its worst run, and the slowest and fastest runs' server steps
    (mean step ms, steps per output token), which tell slower steps (the machine, the kernels)
    from more of them (the schedule)."""
    rows = [
        "| conc | mode | runs | tok/s slowest / median / fastest | fastest / slowest "
        "| worst TTFT p95 ms | step ms slowest / fastest run | steps per token slowest / fastest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str, int], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.mode, cell.kv_cache_dtype, cell.concurrency), []).append(cell)

    def steps(c: Cell) -> tuple[str, str]:
        """(mean step ms, steps per output token), "-" offline."""
        ms, n = c.step_ms, c.server_cpu.get("step_count", 0.0)
        return ("-", "-") if ms is None else (f"{ms:.1f}", f"{n / c.output_tokens:.3f}")

    for (mode, kv, conc), runs in groups.items():
        runs = sorted(runs, key=lambda c: c.tokens_per_s)
        tps = [c.tokens_per_s for c in runs]
        worst = max(
            (percentile(c.ttft.get("short", []) + c.ttft.get("long", []), 95) or 0.0) for c in runs
        )
        slow, fast = steps(runs[0]), steps(runs[-1])
        rows.append(
            f"| {conc} | {mode} kv={kv} | {len(runs)} | {tps[0]:.1f} / {tps[len(tps) // 2]:.1f} / "
            f"{tps[-1]:.1f} | {tps[-1] / tps[0]:.2f} | {1000 * worst:.0f} "
            f"| {slow[0]} / {fast[0]} | {slow[1]} / {fast[1]} |"
        )
    return "\n".join(rows)
