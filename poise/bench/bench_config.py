"""What a benchmark run is: ``WorkloadSpec`` (the traffic: load points, request mix, client
settings), ``BenchConfig`` (a workload against one server, with SLOs and what the record says),
``CellSpec`` (one load point) and the request sample of a cell.

``WorkloadSpec`` is the one description of traffic in poise: ``poise bench``, ``poise
simulate``, ``poise sweep`` and ``poise tune`` all build it from the same flags, generated from
its fields' metadata by ``poise.cli.lab_options`` (as ``poise.cli.options`` does for the engine).
Adding a workload knob is one field here (with ``metadata["help"]``) and its use in
``cell_requests``; every command gets the flag.

Invariants: a config is never mutated after construction; the same config and seed give the
same request sample in every cell of the same long ratio (change one variable at a time).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from poise import workload as wl

# The flag-value parsers and URL helpers, re-exported: they live in bench/parsing.py.
from poise.bench.parsing import api_root as api_root
from poise.bench.parsing import class_priorities as class_priorities
from poise.bench.parsing import float_list as float_list
from poise.bench.parsing import int_list as int_list
from poise.bench.parsing import server_root as server_root
from poise.bench.stats import SLO

DEFAULT_CONCURRENCY = 8  # closed-loop streams when --concurrency is not given
SALT_SCOPES = ("run", "cell", "request")


def _m(help_text: str, **cli: Any) -> dict[str, Any]:
    """Field metadata: ``help`` plus how the flag is spelled and parsed (``flag``, ``type``,
    ``metavar``, ``choices``, ``axis``: a list that spans the cells of a matrix)."""
    return {"help": help_text, **cli}


@dataclass(frozen=True)
class WorkloadSpec:
    """The traffic of a run: which requests, sent how, for how long, per cell.

    The three ``axis`` fields (concurrency, request_rate, long_ratio) are lists whose product
    is the cell matrix (``cells()``); everything else holds for every cell.
    """

    concurrency: tuple[int, ...] = field(
        default=(),
        metadata=_m(
            "Closed-loop client streams, list (8,16,32,64); with --request-rate: a cap on requests "
            f"in flight (default: {DEFAULT_CONCURRENCY} streams in closed loop, no cap in open loop).",
            type=int_list,
            metavar="N[,N...]",
            axis=True,
        ),
    )
    request_rate: tuple[float, ...] = field(
        default=(math.inf,),
        metadata=_m(
            "Open-loop arrival rates (requests/s), list; inf = closed loop. (default: inf)",
            type=float_list,
            metavar="R[,R...]",
            axis=True,
        ),
    )
    burstiness: float = field(
        default=1.0,
        metadata=_m("Gamma shape of open-loop arrival gaps (1 = Poisson, < 1 burstier)."),
    )
    long_ratio: tuple[float, ...] = field(
        default=(0.0,),
        metadata=_m(
            "Fractions of the seed's LONG prompts among its SHORT ones, list (0,0.25,0.5); ignored "
            "with --class / --jsonl.",
            type=float_list,
            metavar="F[,F...]",
            axis=True,
        ),
    )
    long_repeat: int = field(
        default=wl.SEED_LONG_REPEAT,
        metadata=_m(
            "Repeats of the seed's log line in the LONG prompt (the seed's 220: ~3.3k tokens with "
            "SmolLM2's template; smaller for a CPU)."
        ),
    )
    max_tokens: int = field(
        default=wl.DEFAULT_MAX_TOKENS,
        metadata=_m("max_tokens per request (the output length, with ignore_eos)."),
    )
    classes: tuple[wl.RequestClass, ...] = field(
        default=(),
        metadata=_m(
            "A request class (repeatable) instead of the seed's SHORT/LONG mix: "
            "name:weight:prompt_len:output_len, e.g. chat:3:normal/200/50:128 or "
            "short:1:seed-short:160.",
            flag="--class",
            metavar="NAME:W:PLEN:OLEN",
        ),
    )
    jsonl: str | None = field(
        default=None,
        metadata=_m(
            "Prompts file instead of the seed mix: {prompt|messages, max_tokens?, class?} per line.",
            metavar="FILE",
        ),
    )
    num_requests: int | None = field(
        default=None,
        metadata=_m(
            "Measured requests per cell (default: 4 x concurrency, >= 16; 64 in open loop)."
        ),
    )
    duration: float | None = field(
        default=None,
        metadata=_m(
            "Seconds per cell instead of a request count (virtual seconds in the simulator)."
        ),
    )
    warmup: int | None = field(
        default=None,
        metadata=_m(
            "Warmup requests per cell, run under the same load and excluded (default: one wave = "
            "concurrency; 4 in open loop)."
        ),
    )
    seed: int = field(
        default=0,
        metadata=_m(
            "Seed of the request sample and arrival times (and of the simulator's spreads).",
            flag="--workload-seed",
        ),
    )
    timeout_s: float = field(
        default=600.0,
        metadata=_m(
            "Per-request timeout, seconds (a slower request counts as timed out).",
            flag="--request-timeout",
            metavar="S",
        ),
    )
    salt: str | None = field(
        default="auto",
        metadata=_m(
            "Prompt prefix against prefix caches: auto (random per run) | none | TEXT.",
            metavar="auto|none|TEXT",
        ),
    )
    salt_scope: str = field(
        default="cell",
        metadata=_m("What one salt covers: run | cell | request.", choices=SALT_SCOPES),
    )
    ignore_eos: bool = field(
        default=True, metadata=_m("Send ignore_eos, so every request produces max_tokens tokens.")
    )
    temperature: float = field(default=0.0, metadata=_m("Sampling temperature."))
    # Scheduling inputs sent with each request: its workload class name as ``class`` (for a
    # server with traffic classes of those names) and a priority per workload class.
    send_class: bool = field(
        default=False,
        metadata=_m(
            "Send each request's workload class (short / long / --class NAME) as the 'class' field, "
            "for a server with traffic classes of those names (poise --traffic-classes)."
        ),
    )
    class_priority: dict[str, int] = field(
        default_factory=dict,
        metadata=_m(
            "Send 'priority' per workload class (vLLM: lower first), e.g. short=0,long=1.",
            flag="--priority",
            type=class_priorities,
            metavar="CLASS=P[,CLASS=P...]",
        ),
    )

    def __post_init__(self) -> None:
        if self.salt_scope not in SALT_SCOPES:
            raise ValueError("workload salt_scope: one of run, cell, request")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("workload concurrency: values must be >= 1")
        if not self.request_rate or any(r <= 0 for r in self.request_rate):
            raise ValueError("workload request_rate: values must be > 0 (inf = closed loop)")
        if not self.long_ratio or any(not 0 <= r <= 1 for r in self.long_ratio):
            raise ValueError("workload long_ratio: values must be in [0, 1]")
        if self.max_tokens < 1:
            raise ValueError("workload max_tokens must be >= 1")
        if self.long_repeat < 1:
            raise ValueError("workload long_repeat must be >= 1")
        if self.burstiness <= 0:
            raise ValueError("workload burstiness must be > 0")
        if self.classes and self.jsonl is not None:
            raise ValueError("workload: give --class or --jsonl, not both")

    @property
    def mixes_by_ratio(self) -> bool:
        return not self.classes and self.jsonl is None

    def cells(self) -> list[CellSpec]:
        """Every (rate x concurrency x long ratio) cell, in that nesting order. An open-loop
        rate without a --concurrency has no cap; a closed loop without one has
        ``DEFAULT_CONCURRENCY`` streams."""
        ratios: list[float | None] = list(self.long_ratio) if self.mixes_by_ratio else [None]
        out = []
        for rate in self.request_rate:
            default: int | None = DEFAULT_CONCURRENCY if math.isinf(rate) else None
            for c in self.concurrency or (default,):
                for r in ratios:
                    out.append(CellSpec(c, rate, r))
        return out

    def run_salt(self) -> str | None:
        if self.salt == "auto":
            return secrets.token_hex(4)
        return self.salt or None

    def workload_fields(self) -> dict[str, Any]:
        """This spec's fields as keywords (for ``BenchConfig.for_workload``)."""
        return {f.name: getattr(self, f.name) for f in fields(WorkloadSpec)}

    def fingerprint(self) -> dict[str, Any]:
        """What makes a stored cell comparable: everything but the axes (a cell's label
        carries its own load point)."""
        d = asdict(WorkloadSpec(**self.workload_fields()))
        for f in fields(WorkloadSpec):
            if f.metadata.get("axis"):
                d.pop(f.name)
        d["classes"] = [_class_dict(c) for c in self.classes]
        return d


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

    @property
    def describe(self) -> str:
        """In words: ``concurrency 4, long ratio 0.5`` / ``2 req/s, at most 4 in flight``."""
        if self.closed_loop:
            text = f"concurrency {self.concurrency}"
        else:
            cap = f", at most {self.concurrency} in flight" if self.concurrency else ""
            text = f"{self.request_rate:g} req/s{cap}"
        return text + ("" if self.long_ratio is None else f", long ratio {self.long_ratio:g}")


@dataclass(frozen=True, kw_only=True)
class BenchConfig(WorkloadSpec):
    """A workload against one server (``base_url``, with or without its ``/v1``), the SLOs
    goodput counts against, what is scraped, and what the record says about the run."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Per-class overrides, e.g. {"long": 5000.0}: a relaxed TTFT target for long prompts.
    class_slo_ttft_ms: dict[str, float] = field(default_factory=dict)
    class_slo_tpot_ms: dict[str, float] = field(default_factory=dict)
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
        super().__post_init__()
        if self.base_url.startswith(("http://", "https://")):
            object.__setattr__(self, "base_url", api_root(self.base_url))

    @classmethod
    def for_workload(cls, workload: WorkloadSpec, **kw: Any) -> BenchConfig:
        """``workload`` against a server; ``kw`` are the other BenchConfig fields."""
        return cls(**{**workload.workload_fields(), **kw})

    def slo(self) -> SLO:
        names = set(self.class_slo_ttft_ms) | set(self.class_slo_tpot_ms)
        per_class = {
            n: (self.class_slo_ttft_ms.get(n), self.class_slo_tpot_ms.get(n)) for n in names
        }
        return SLO(self.slo_ttft_ms, self.slo_tpot_ms, per_class)

    @property
    def server_root(self) -> str:
        return server_root(self.base_url)

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


def cell_counts(cfg: WorkloadSpec, spec: CellSpec) -> tuple[int, int]:
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
    cfg: WorkloadSpec, spec: CellSpec, limit: int | None = None
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
        short, long = wl.seed_classes(cfg.max_tokens, cfg.long_repeat)
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
