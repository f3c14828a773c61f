"""`poise bench`: load-test any OpenAI-compatible server over a (load x long-ratio) matrix,
and `poise bench plot RECORD...`; wiring only (the work is in poise.bench)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from poise.cli import lab_options

HELP = "Load-test an OpenAI-compatible server; write a YAML experiment record."
DESCRIPTION = """
Runs every (concurrency or rate) x long-ratio cell against --base-url, streams chat completions,
scrapes /metrics, prints a table and writes a YAML record plus per-request JSONL. `poise bench
plot RECORD...` draws the plots.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument(
        "--base-url",
        help="The server, e.g. http://127.0.0.1:8000 (its /v1 is added when the URL has no path).",
    )
    g.add_argument("--model", help="Model name (default: the first of /v1/models).")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token.")
    lab_options.add_workload_args(parser)
    lab_options.add_slo_args(parser)
    _add_metrics_args(parser)
    _add_record_args(parser)
    lab_options.add_output_args(
        parser,
        "YAML record path, or a folder for <time>.yaml (default: bench-results/).",
        label=True,
        plots=False,
    )
    lab_options.deprecate(
        parser,
        seed="--workload-seed",
        timeout="--request-timeout",
        output="--out",
        slo_ttft_ms="--slo-ttft-p95-ms",
        slo_tpot_ms="--slo-tpot-p50-ms",
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="{plot}")
    plot = sub.add_parser("plot", help="Plots and an HTML report from experiment records.")
    plot.add_argument("records", nargs="+", help="YAML experiment records.")
    plot.add_argument("--cell", default=None, help="Cell label for CDFs/timeline (default: last).")
    lab_options.add_slo_args(plot, per_class=False, tpot=False)
    lab_options.add_output_args(plot, "Output folder (default: beside the first record).")
    lab_options.deprecate(plot, slo_ttft_ms="--slo-ttft-p95-ms")
    plot.set_defaults(func=run_plot)


def _add_metrics_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("metrics")
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
    g.add_argument("--no-progress", action="store_true")
    g.add_argument(
        "--live",
        action="store_true",
        help="Show the server's live view in the terminal while the bench runs (a poise "
        "server's /dashboard feed: queue, KV, step composition, TTFT parts, SLO attainment).",
    )


def command_line() -> str:
    return shlex.join(["poise", *sys.argv[1:]])


def config_from_args(args: argparse.Namespace) -> Any:
    import yaml

    from poise.bench.bench_config import BenchConfig

    server_args = {}
    for item in args.server_arg:
        key, _, value = item.partition("=")
        server_args[key] = yaml.safe_load(value) if value else None
    return BenchConfig.for_workload(
        lab_options.workload_from_args(args),
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        **lab_options.slo_fields(args),
        include_failures=args.include_failures,
        metrics_url=args.metrics_url,
        scrape=not args.no_scrape,
        scrape_interval=args.scrape_interval,
        max_lag_ms=args.max_lag_ms,
        gpu=args.gpu,
        engine=args.engine,
        version=args.engine_version,
        server_args=server_args,
        command=command_line(),
    )


def finish_record(record: Any, out: Path, args: argparse.Namespace) -> None:
    """Label, save and print a record (bench or simulated), and its plots if asked."""
    from rich.console import Console

    from poise.bench.terminal import print_record

    if args.label:
        record.provenance["label"] = args.label
    record.save(out)
    print_record(record, Console())
    print(f"record: {out}")
    if args.plots:
        from poise.bench.plot import write_report

        files = write_report([(args.label or out.stem, record)], out.parent / (out.stem + "-plots"))
        for key, path in files.items():
            print(f"{key}: {path}")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from poise.bench.runner import run_matrix
    from poise.bench.terminal import CellProgress

    if not args.base_url:
        print("poise bench: error: --base-url is required", file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"poise bench: error: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    out = lab_options.record_path(args.out, "bench-results")
    bar = CellProgress(console)
    prog = None if args.no_progress else bar

    async def run() -> Any:
        return await run_matrix(
            cfg,
            on_cell_start=(lambda spec, n: prog.start_cell(spec.label, n)) if prog else None,
            progress=prog.update if prog else None,
            checkpoint=out,  # finished cells survive an interrupted run
        )

    async def run_live() -> Any:
        from poise.bench.live_view import LiveView

        # The progress bar is drawn inside the live view (rich runs one live display at once).
        async with LiveView(console, cfg.base_url, cfg.api_key, prog.progress if prog else None):
            return await run()

    if args.live:
        record = asyncio.run(run_live())
    else:
        with bar:
            record = asyncio.run(run())
    if not record.capabilities.get("ok"):
        console.print(f"[red]capability probe failed: {record.capabilities.get('error')}[/red]")
    finish_record(record, out, args)
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
        slo_ttft_ms, _ = lab_options.single_slos(args)
        files = write_report(named, out, args.cell, slo_ttft_ms)
    except ValueError as exc:
        print(f"poise bench plot: error: {exc}", file=sys.stderr)
        return 2
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0
