"""`poise bench`: load-test any OpenAI-compatible server over a (load x long-ratio) matrix,
and `poise bench plot RECORD...`; wiring only (the work is in poise.bench)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _slo(text: str) -> tuple[float | None, dict[str, float]]:
    """``500`` | ``500,long=5000`` | ``short=300``: (default, per-class overrides)."""
    default, per_class = None, {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, eq, value = item.partition("=")
        if eq:
            per_class[name] = float(value)
        else:
            default = float(item)
    return default, per_class


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="Load-test an OpenAI-compatible server; write a YAML experiment record.",
        description="Runs every (concurrency or rate) x long-ratio cell against --base-url, "
        "streams chat completions, scrapes /metrics, prints a table and writes a YAML record "
        "plus per-request JSONL. `poise bench plot RECORD...` draws the plots.",
    )
    _add_run_args(parser)
    sub = parser.add_subparsers(dest="bench_command", metavar="{plot}")
    plot = sub.add_parser("plot", help="Plots and an HTML report from experiment records.")
    plot.add_argument("records", nargs="+", help="YAML experiment records.")
    plot.add_argument(
        "--out", default=None, help="Output folder (default: beside the first record)."
    )
    plot.add_argument("--cell", default=None, help="Cell label for CDFs/timeline (default: last).")
    plot.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO line.")
    plot.set_defaults(func=run_plot)
    parser.set_defaults(func=run_bench)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", help="OpenAI API root, e.g. http://127.0.0.1:8000/v1.")
    g.add_argument("--model", help="Model name (default: the first of /v1/models).")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token.")
    g = p.add_argument_group("load")
    g.add_argument(
        "--concurrency",
        type=_ints,
        default=(8,),
        help="Closed-loop streams, list (8,16,32,64); with --request-rate: a cap.",
    )
    g.add_argument(
        "--request-rate",
        type=_floats,
        default=None,
        help="Open-loop rates (req/s), list; inf = closed loop.",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of arrival gaps (1 = Poisson, <1 burstier).",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="Measured requests per cell (default 4 x concurrency, >= 16).",
    )
    g.add_argument(
        "--duration", type=float, default=None, help="Seconds per cell instead of a request count."
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="Warmup requests per cell, excluded (default: concurrency).",
    )
    g.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout, seconds.")
    _add_workload_args(p)
    _add_metrics_args(p)
    _add_record_args(p)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--long-ratio",
        type=_floats,
        default=(0.0,),
        help="Fractions of seed LONG prompts, list (0,0.25,0.5).",
    )
    g.add_argument("--max-tokens", type=int, default=160, help="max_tokens per request.")
    g.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        metavar="NAME:W:PLEN:OLEN",
        help="A request class (repeatable), e.g. chat:3:normal/200/50:128 or short:1:seed-short:160.",
    )
    g.add_argument("--jsonl", help="Prompts file: {prompt|messages, max_tokens?, class?} per line.")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--salt", default="auto", help="Prompt prefix against prefix caches: auto | none | TEXT."
    )
    g.add_argument("--salt-scope", choices=("run", "cell", "request"), default="cell")
    add_scheduling_args(g)
    g.add_argument("--no-ignore-eos", action="store_true", help="Do not send ignore_eos.")
    g.add_argument("--temperature", type=float, default=0.0)


def _add_metrics_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("metrics")
    g.add_argument(
        "--slo-ttft-ms",
        type=_slo,
        default=(None, {}),
        metavar="MS[,CLASS=MS...]",
        help="TTFT target for goodput, optionally per class: 500 or 500,long=5000.",
    )
    g.add_argument(
        "--slo-tpot-ms",
        type=_slo,
        default=(None, {}),
        metavar="MS[,CLASS=MS...]",
        help="TPOT target for goodput, optionally per class.",
    )
    g.add_argument(
        "--include-failures", action="store_true", help="Failures count as +inf in latency tails."
    )
    g.add_argument("--metrics-url", help="Prometheus endpoint (default: <server>/metrics).")
    g.add_argument("--no-scrape", action="store_true", help="Do not scrape /metrics.")
    g.add_argument("--scrape-interval", type=float, default=1.0)
    g.add_argument(
        "--max-lag-ms",
        type=float,
        default=10.0,
        help="Client lag p99 above this marks a cell invalid.",
    )


def _add_record_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("record")
    g.add_argument("--gpu", help="Hardware, for the record.")
    g.add_argument("--engine", help="Engine name (default: detected from /metrics).")
    g.add_argument(
        "--engine-version", dest="engine_version", help="Engine version, for the record."
    )
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Server args for the record (repeatable).",
    )
    g.add_argument("--label", help="A name for this run (legends).")
    g.add_argument("-o", "--output", help="YAML path (default: bench-results/<time>.yaml).")
    g.add_argument("--no-progress", action="store_true")


def _priorities(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, eq, value = item.partition("=")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--priority: {item!r} is not CLASS=INTEGER") from None
        if not eq or not name.strip():
            raise argparse.ArgumentTypeError(f"--priority: {item!r} is not CLASS=INTEGER")
    return out


def add_scheduling_args(g: Any) -> None:
    """Scheduling inputs sent with each request (poise bench and poise simulate alike)."""
    g.add_argument(
        "--send-class", action="store_true",
        help="Send each request's workload class (short / long / --class NAME) as the 'class' "
        "field, for a server with traffic classes of those names (poise --traffic-classes).",
    )  # fmt: skip
    g.add_argument(
        "--priority", type=_priorities, default={}, metavar="CLASS=P[,CLASS=P...]",
        help="Send 'priority' per workload class (vLLM: lower first), e.g. short=0,long=1.",
    )  # fmt: skip


def workload_fields(args: argparse.Namespace, concurrency: Any) -> dict[str, Any]:
    """The BenchConfig fields that describe the load and the workload, from the flags that
    `poise bench` and `poise simulate` share (so both read them the same way)."""
    from poise.bench.config import parse_class

    return {
        "concurrency": concurrency,
        "request_rate": args.request_rate or (math.inf,),
        "burstiness": args.burstiness,
        "long_ratio": args.long_ratio,
        "max_tokens": args.max_tokens,
        "classes": tuple(parse_class(c, args.max_tokens) for c in args.classes),
        "jsonl": args.jsonl,
        "num_requests": args.num_requests,
        "duration": args.duration,
        "warmup": args.warmup,
        "salt": None if args.salt in ("none", "") else args.salt,
        "salt_scope": args.salt_scope,
        "send_class": args.send_class,
        "class_priority": args.priority,
    }


def config_from_args(args: argparse.Namespace) -> Any:
    import yaml

    from poise.bench.config import BenchConfig

    server_args = {}
    for item in args.server_arg:
        key, _, value = item.partition("=")
        server_args[key] = yaml.safe_load(value) if value else None
    rates = args.request_rate or (math.inf,)
    closed = any(math.isinf(r) for r in rates)
    concurrency = args.concurrency if args.concurrency is not None else ((8,) if closed else ())
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        **workload_fields(args, concurrency),
        timeout_s=args.timeout,
        seed=args.seed,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        slo_ttft_ms=args.slo_ttft_ms[0],
        slo_tpot_ms=args.slo_tpot_ms[0],
        class_slo_ttft_ms=args.slo_ttft_ms[1],
        class_slo_tpot_ms=args.slo_tpot_ms[1],
        include_failures=args.include_failures,
        metrics_url=args.metrics_url,
        scrape=not args.no_scrape,
        scrape_interval=args.scrape_interval,
        max_lag_ms=args.max_lag_ms,
        gpu=args.gpu,
        engine=args.engine,
        version=args.engine_version,
        server_args=server_args,
        command=shlex.join(["poise", *sys.argv[1:]]),
    )


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from poise.bench.report import CellProgress, print_record
    from poise.bench.runner import run_matrix

    if not args.base_url:
        print("poise bench: error: --base-url is required", file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"poise bench: error: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    out = Path(args.output or f"bench-results/{dt.datetime.now():%Y%m%d-%H%M%S}.yaml")
    with CellProgress(console) as bar:
        prog = None if args.no_progress else bar
        record = asyncio.run(
            run_matrix(
                cfg,
                on_cell_start=(lambda spec, n: prog.start_cell(spec.label, n)) if prog else None,
                progress=prog.update if prog else None,
                checkpoint=out,  # finished cells survive an interrupted run
            )
        )
    if args.label:
        record.provenance["label"] = args.label
    if not record.capabilities.get("ok"):
        console.print(f"[red]capability probe failed: {record.capabilities.get('error')}[/red]")
    record.save(out)
    print_record(record, Console())
    print(f"record: {out}")
    return 0 if record.capabilities.get("ok") else 1


def run_plot(args: argparse.Namespace) -> int:
    from poise.bench.plot import write_report
    from poise.bench.record import ExperimentRecord

    named = []
    for path in args.records:
        rec = ExperimentRecord.load(path)
        named.append((str(rec.provenance.get("label") or Path(path).stem), rec))
    out = (
        Path(args.out)
        if args.out
        else Path(args.records[0]).with_suffix("").parent / (Path(args.records[0]).stem + "-plots")
    )
    try:
        files = write_report(named, out, args.cell, args.slo_ttft_ms)
    except ValueError as exc:
        print(f"poise bench plot: error: {exc}", file=sys.stderr)
        return 2
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0
