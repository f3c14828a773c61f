"""What a benchmark run is: ``BenchConfig`` (the whole matrix), ``CellSpec`` (one load point)
and the request sample of a cell.

Invariants: a config is never mutated after construction; the same config and seed give the
same request sample in every cell of the same long ratio (change one variable at a time).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

from poise import workload as wl
from poise.bench.metrics import SLO


@dataclass(frozen=True)
class CellSpec:
    """One load point. ``request_rate`` inf is closed loop with ``concurrency`` streams;
    a finite rate is open loop (Poisson/gamma) with ``concurrency`` as an optional cap."""

    concurrency: int | None
    request_rate: float = math.inf
    long_ratio: float | None = None  # None when the workload is a class mix or a file

    @property
    def closed_loop(self) -> bool:
        return math.isinf(self.request_rate)

    @property
    def label(self) -> str:
        load = f"c{self.concurrency}" if self.closed_loop else f"r{self.request_rate:g}"
        if not self.closed_loop and self.concurrency:
            load += f"-cap{self.concurrency}"
        return load + ("" if self.long_ratio is None else f"-long{self.long_ratio:g}")


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    concurrency: tuple[int, ...] = (8,)
    request_rate: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    long_ratio: tuple[float, ...] = (0.0,)
    max_tokens: int = wl.DEFAULT_MAX_TOKENS
    classes: tuple[wl.RequestClass, ...] = ()  # named mix; empty -> the seed's short/long
    jsonl: str | None = None
    num_requests: int | None = None  # per cell, measured (default: 4 x concurrency, >= 16)
    duration: float | None = None  # per cell, seconds; bounds the cell instead
    warmup: int | None = None  # per cell (default: one wave = concurrency; 4 in open loop)
    timeout_s: float = 600.0
    seed: int = 0
    salt: str | None = "auto"  # "auto": random per run; None/"": no salt
    salt_scope: str = "cell"  # run | cell | request
    ignore_eos: bool = True
    temperature: float = 0.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Per-class overrides, e.g. {"long": 5000.0}: a relaxed TTFT target for long prompts.
    class_slo_ttft_ms: dict[str, float] = field(default_factory=dict)
    class_slo_tpot_ms: dict[str, float] = field(default_factory=dict)
    # Scheduling inputs sent with each request: its workload class name as ``class`` (for a
    # server with traffic classes of those names) and a priority per workload class.
    send_class: bool = False
    class_priority: dict[str, int] = field(default_factory=dict)
    include_failures: bool = False
    metrics_url: str | None = None  # default: <server root>/metrics
    scrape: bool = True
    scrape_interval: float = 1.0
    max_lag_ms: float = 10.0
    # Descriptive fields for the record (the template's experiment block).
    gpu: str | None = None
    engine: str | None = None
    version: str | None = None
    server_args: dict[str, Any] = field(default_factory=dict)
    command: str | None = None

    def __post_init__(self) -> None:
        if self.salt_scope not in ("run", "cell", "request"):
            raise ValueError("BenchConfig.salt_scope: one of run, cell, request")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("BenchConfig.concurrency: values must be >= 1")
        if any(r <= 0 for r in self.request_rate):
            raise ValueError("BenchConfig.request_rate: values must be > 0 (inf = closed loop)")
        if any(not 0 <= r <= 1 for r in self.long_ratio):
            raise ValueError("BenchConfig.long_ratio: values must be in [0, 1]")
        if self.max_tokens < 1:
            raise ValueError("BenchConfig.max_tokens must be >= 1")
        if all(math.isinf(r) for r in self.request_rate) and not self.concurrency:
            raise ValueError("BenchConfig.concurrency: closed loop needs a concurrency")

    def slo(self) -> SLO:
        names = set(self.class_slo_ttft_ms) | set(self.class_slo_tpot_ms)
        per_class = {
            n: (self.class_slo_ttft_ms.get(n), self.class_slo_tpot_ms.get(n)) for n in names
        }
        return SLO(self.slo_ttft_ms, self.slo_tpot_ms, per_class)

    @property
    def mixes_by_ratio(self) -> bool:
        return not self.classes and self.jsonl is None

    def cells(self) -> list[CellSpec]:
        ratios: list[float | None] = list(self.long_ratio) if self.mixes_by_ratio else [None]
        out = []
        for rate in self.request_rate:
            caps: list[int | None] = list(self.concurrency) or [None]
            for c in caps:
                for r in ratios:
                    out.append(CellSpec(c, rate, r))
        return out

    def run_salt(self) -> str | None:
        if self.salt == "auto":
            return secrets.token_hex(4)
        return self.salt or None

    @property
    def server_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    def metrics_endpoint(self) -> str:
        return self.metrics_url or self.server_root + "/metrics"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["classes"] = [_class_dict(c) for c in self.classes]
        d.pop("api_key")  # never write secrets into a record
        return d


def _class_dict(c: wl.RequestClass) -> dict[str, Any]:
    d: dict[str, Any] = {"name": c.name, "weight": c.weight}
    d["output_tokens"] = asdict(c.output_tokens)
    if c.prompt_tokens is not None:
        d["prompt_tokens"] = asdict(c.prompt_tokens)
    else:
        d["prompt_chars"] = len(c.prompt or "")
    return d


def cell_counts(cfg: BenchConfig, spec: CellSpec) -> tuple[int, int]:
    """(warmup, measured) request counts of a cell."""
    c = spec.concurrency or 0
    warmup = cfg.warmup if cfg.warmup is not None else (c if spec.closed_loop else 4)
    if cfg.num_requests is not None:
        return warmup, cfg.num_requests
    if cfg.duration is not None:
        # Enough for the duration at any plausible pace; the clock stops the cell first.
        rate = spec.request_rate if not spec.closed_loop else 1000.0
        return warmup, int(min(max(rate * cfg.duration * 1.5, 64), 100_000))
    return warmup, max(4 * c, 16) if spec.closed_loop else 64


def cell_requests(
    cfg: BenchConfig, spec: CellSpec, limit: int | None = None
) -> list[wl.WorkloadRequest]:
    """The cell's request sample (warmup first), with open-loop arrival offsets; at most
    ``limit`` requests (a duration-bound closed loop cycles through a bounded sample instead
    of materialising every prompt it might send)."""
    warmup, measured = cell_counts(cfg, spec)
    n = warmup + measured if limit is None else min(warmup + measured, limit)
    if cfg.jsonl is not None:
        reqs = wl.cycle_jsonl(n, wl.load_jsonl(cfg.jsonl, cfg.max_tokens), cfg.seed)
    elif cfg.classes:
        reqs = wl.weighted_mix(n, cfg.classes, cfg.seed)
    else:
        short, long = wl.seed_classes(cfg.max_tokens)
        reqs = wl.ratio_mix(n, spec.long_ratio or 0.0, short, long, cfg.seed)
    if not spec.closed_loop:
        reqs = wl.with_arrivals(reqs, spec.request_rate, cfg.burstiness, cfg.seed)
    return reqs


def parse_class(text: str, max_tokens: int) -> wl.RequestClass:
    """``name:weight:prompt_len:output_len`` where lengths use ``LengthDist.parse`` syntax with
    ``/`` instead of ``:`` (e.g. ``chat:3:normal/200/50:128``); ``seed-short``/``seed-long``
    use the lab's fixed prompts: ``short:3:seed-short:160``."""
    parts = text.split(":")
    if len(parts) != 4:
        raise ValueError(f"--class {text!r}: expected name:weight:prompt_len:output_len")
    name, weight, plen, olen = parts
    out = (
        wl.LengthDist.parse(olen.replace("/", ":")) if olen else wl.LengthDist("fixed", max_tokens)
    )
    seeds = {"seed-short": wl.SHORT_PROMPT, "seed-long": wl.LONG_PROMPT}
    if plen in seeds:
        return wl.RequestClass(name, prompt=seeds[plen], output_tokens=out, weight=float(weight))
    dist = wl.LengthDist.parse(plen.replace("/", ":"))
    return wl.RequestClass(name, prompt_tokens=dist, output_tokens=out, weight=float(weight))
