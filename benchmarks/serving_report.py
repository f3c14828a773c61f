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

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def ttft_ms(self, cls: str, q: float) -> float | None:
        v = percentile(self.ttft.get(cls, []), q)
        return None if v is None else 1000 * v


def report(cells: list[Cell]) -> str:
    rows = [
        "| conc | mode | req | out tok | s | tok/s | HTTP/offline | TTFT p50/p95 SHORT ms "
        "| TTFT p50/p95 LONG ms | server CPU s (engine / loop / process) |",
        "|---|---|---|---|---|---|---|---|---|---|",
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
        rows.append(
            f"| {cell.concurrency} | {cell.mode} kv={cell.kv_cache_dtype} | {cell.num_requests} | {cell.output_tokens} "
            f"| {cell.seconds:.1f} | {cell.tokens_per_s:.1f} | {ratio} "
            f"| {f(cell.ttft_ms('short', 50))} / {f(cell.ttft_ms('short', 95))} "
            f"| {f(cell.ttft_ms('long', 50))} / {f(cell.ttft_ms('long', 95))} | {cpu_s} |"
        )
    return "\n".join(rows)
