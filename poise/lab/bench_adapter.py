"""The one seam between the lab and ``poise.bench``: what a lab cell is, and how to run a
list of cells against a live server with the bench's programmatic API.

A lab workload is the seed lab's: closed-loop concurrency x long-prompt ratio, short and long
chat prompts, a fixed ``max_tokens``. ``long_repeat`` scales the long prompt (the seed repeats
its log line 220 times, ~3.3k tokens with the SmolLM2 tokenizer: minutes of prefill on a
2-core CPU); at 220 the bench's own verbatim seed mix is used.

Invariants: the request sample of a cell depends only on the workload and the cell (seed
fixed), never on the server: every config of a sweep sees the same requests. Each cell gets
its own salt (``<run salt>-<cell label>``), so no prefix cached by an earlier cell or config
is reused.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from poise import workload as wl

SEED_LONG_HEAD = "请阅读以下模拟日志并总结调度瓶颈。"
SEED_LONG_LINE = " waiting=12 running=48 kv=82%; "
SEED_LONG_REPEAT = 220


def long_prompt(repeat: int) -> str:
    return SEED_LONG_HEAD + SEED_LONG_LINE * repeat


@dataclass(frozen=True)
class LabCell:
    concurrency: int
    long_ratio: float = 0.0

    @property
    def label(self) -> str:
        return f"c{self.concurrency}-long{self.long_ratio:g}"


@dataclass(frozen=True)
class LabWorkload:
    concurrency: tuple[int, ...] = (8,)
    long_ratio: tuple[float, ...] = (0.0,)
    max_tokens: int = wl.DEFAULT_MAX_TOKENS
    num_requests: int | None = None  # measured per cell (bench default: 4 x concurrency)
    warmup: int | None = None  # per cell (bench default: one wave)
    long_repeat: int = SEED_LONG_REPEAT
    seed: int = 0
    timeout_s: float = 600.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("workload.concurrency: positive integers")
        if any(not 0.0 <= r <= 1.0 for r in self.long_ratio):
            raise ValueError("workload.long_ratio: values in [0, 1]")
        if self.long_repeat < 1:
            raise ValueError("workload.long_repeat must be >= 1")

    def cells(self) -> list[LabCell]:
        return [LabCell(c, r) for c in self.concurrency for r in self.long_ratio]

    def fingerprint(self) -> dict[str, Any]:
        """What makes a stored cell comparable (the request sample and client settings)."""
        d = asdict(self)
        d.pop("concurrency")
        d.pop("long_ratio")
        return d

    def bench_config(self, base_url: str, cell: LabCell, **extra: Any) -> tuple[Any, Any]:
        """(BenchConfig, CellSpec) for one cell; ``extra`` goes to BenchConfig (model,
        server_args, engine...)."""
        from poise.bench.config import BenchConfig, CellSpec

        common: dict[str, Any] = dict(
            base_url=base_url,
            concurrency=(cell.concurrency,),
            max_tokens=self.max_tokens,
            num_requests=self.num_requests,
            warmup=self.warmup,
            timeout_s=self.timeout_s,
            seed=self.seed,
            temperature=self.temperature,
            **extra,
        )
        if self.long_repeat == SEED_LONG_REPEAT:
            cfg = BenchConfig(long_ratio=(cell.long_ratio,), **common)
            return cfg, CellSpec(cell.concurrency, math.inf, cell.long_ratio)
        out = wl.LengthDist("fixed", self.max_tokens)
        classes = [
            wl.RequestClass("short", prompt=wl.SHORT_PROMPT, output_tokens=out, weight=1 - cell.long_ratio),
            wl.RequestClass("long", prompt=long_prompt(self.long_repeat), output_tokens=out, weight=cell.long_ratio),
        ]  # fmt: skip
        cfg = BenchConfig(classes=tuple(c for c in classes if c.weight > 0), **common)
        return cfg, CellSpec(cell.concurrency, math.inf, None)


CellDone = Callable[[LabCell, Any], None]  # (cell, poise.bench.record.CellResult)


def run_cells(
    base_url: str,
    workload: LabWorkload,
    cells: list[LabCell],
    on_done: CellDone,
    *,
    salt: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Run ``cells`` in order against ``base_url``; ``on_done`` gets each result as soon as it
    exists (so a later failure loses nothing). Returns the server's capabilities probe."""
    return asyncio.run(_run_cells(base_url, workload, cells, on_done, salt, extra))


async def _run_cells(
    base_url: str,
    workload: LabWorkload,
    cells: list[LabCell],
    on_done: CellDone,
    salt: str | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    from poise.bench.client import Endpoint, discover_model, make_session, probe
    from poise.bench.runner import run_cell

    async with make_session() as session:
        ep = Endpoint(base_url, extra.get("model") or "", temperature=workload.temperature)
        if not ep.model:
            ep.model = await discover_model(session, base_url, ep.headers()) or "default"
        caps = await probe(session, ep, workload.timeout_s)
        if not caps["ok"]:
            raise RuntimeError(f"server at {base_url} failed the probe request: {caps['error']}")
        for cell in cells:
            cfg, spec = workload.bench_config(base_url, cell, **extra)
            cell_salt = f"{salt}-{cell.label}" if salt else None
            result = await run_cell(cfg, spec, session, ep, salt=cell_salt)
            # Class mixes carry no ratio of their own: record the lab's.
            result.load["long_prompt_ratio"] = cell.long_ratio
            result.load["label"] = cell.label
            on_done(cell, result)
    return dict(caps)
