"""`poise tune --slo-ttft-p95-ms X`: the seed's tuning procedure against poise, another engine
(command template) or the simulator; wiring only (the work is in poise.lab.tune)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from poise.bench.bench_config import int_list
from poise.cli import lab_options
from poise.cli.options import add_engine_args, engine_kwargs_from_args

TUNED = ("max_num_batched_tokens", "max_num_seqs", "scheduling_policy")
CPU_BUDGETS = (256, 512, 1024, 2048)
CPU_SEQS = (1, 2, 4, 8)


HELP = "Find a throughput-first and a latency-first config for a TTFT SLO."
DESCRIPTION = """
Fixes the request sample and client concurrency, takes a conservative token-budget baseline,
raises the budget one step at a time while TTFT p95 meets the SLO, backs off when the tail
worsens, raises max_num_seqs only while the KV cache keeps headroom, tries the other scheduling
policy, and prints both answers with the evidence and a ready command line. See docs/tuning.md.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    lab_options.add_slo_args(parser, required=True, per_class=False)
    g = parser.add_argument_group("search")
    g.add_argument(
        "--budgets",
        type=int_list,
        default=None,
        help=f"Token-budget ladder, ascending; the first is the baseline (CPU default {','.join(map(str, CPU_BUDGETS))}).",
    )
    g.add_argument(
        "--seqs",
        type=int_list,
        default=None,
        help=f"max_num_seqs ladder, ascending (CPU default {','.join(map(str, CPU_SEQS))}).",
    )
    g.add_argument(
        "--min-gain", type=float, default=0.03, help="Throughput gain that counts (0.03)."
    )
    g.add_argument(
        "--tail-tolerance",
        type=float,
        default=0.10,
        help="TTFT p95 growth that counts as a worse tail (0.10).",
    )
    g.add_argument(
        "--kv-headroom",
        type=float,
        default=0.90,
        help="Peak KV usage at or above this means no headroom (0.90).",
    )
    g.add_argument("--max-probes", type=int, default=30, help="At most this many probes.")
    g.add_argument("--no-policies", action="store_true", help="Do not try the other policy.")
    g.add_argument("--no-trade", action="store_true", help="Do not trade budget for seqs.")
    g.add_argument(
        "--no-slo-scheduling",
        action="store_true",
        help="Do not try policy slo "
        "with traffic classes, their shares and the token budget controller "
        "(poise only; off with --command-template).",
    )
    g.add_argument(
        "--no-latency-search", action="store_true", help="Skip the latency-first descent."
    )
    t = lab_options.add_server_args(parser)
    t.description = "poise by default; or another engine (a command template); or --simulate."
    t.add_argument(
        "--command-template",
        default=None,
        help="Start another engine: e.g. 'vllm serve M --port {port} "
        "--max-num-batched-tokens {max_num_batched_tokens} --max-num-seqs {max_num_seqs}'.",
    )
    t.add_argument(
        "--base-url",
        default="http://127.0.0.1:{port}/v1",
        help="Base URL template (its /v1 is added when the URL has no path).",
    )
    t.add_argument(
        "--ready-path",
        action="append",
        default=None,
        help="Readiness path(s) (default /ready, /health, /v1/models).",
    )
    t.add_argument("--startup-timeout", type=float, default=300.0, help="Seconds to get ready.")
    t.add_argument("--simulate", action="store_true", help="Probe the simulator, not a server.")
    t.add_argument("--profile", help="--simulate: step-cost profile from `poise profile`.")
    t.add_argument("--accelerator", help="--simulate: roofline GPU (a10, l40s, a100, h100, h200).")
    t.add_argument("--model-shape", help="--simulate: roofline model shape.")
    lab_options.add_workload_args(
        parser,
        description="The traffic, as `poise bench`, held fixed while the "
        "knobs move: one cell (the first value of each list).",
    )
    lab_options.add_output_args(parser, "Output folder (default tune-<time>); re-use it to resume.")
    add_engine_args(parser)
    lab_options.deprecate(parser, threads="--omp-num-threads")


def _simulate_defaults() -> argparse.Namespace:
    """`poise simulate`'s own defaults for every cost-model flag (so new ones need no change
    here)."""
    from poise.cli import simulate

    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    return parser.parse_args([])


def _probe(args: argparse.Namespace, fixed: dict[str, Any], workload: Any, out: str) -> Any:
    from poise.lab.live import LiveProbe, SimProbe
    from poise.lab.managed_server import DEFAULT_READY_PATHS, ServerSpec

    cell = workload.cells()[0]
    if args.simulate:
        from poise.cli.simulate import cost_model_from_args, prompt_lengths
        from poise.config import EngineConfig

        ns = _simulate_defaults()
        ns.profile, ns.accelerator, ns.model_shape = (
            args.profile,
            args.accelerator,
            args.model_shape,
        )
        config = EngineConfig.from_kwargs(**fixed)
        cost = cost_model_from_args(ns, config)
        return SimProbe(fixed, workload, cell, cost, prompt_lengths(config.model.tokenizer))
    spec = ServerSpec(
        name="tune",
        model=fixed.get("model"),
        args={k: v for k, v in fixed.items() if k != "model"},
        command=args.command_template,
        base_url=args.base_url,
        ready_paths=tuple(args.ready_path or DEFAULT_READY_PATHS),
        env=lab_options.server_env(args),
        startup_timeout_s=args.startup_timeout,
    )
    return LiveProbe(spec, workload, cell, out)


def _ladders(args: argparse.Namespace, gpu: bool, cell: Any) -> tuple[Any, Any, bool]:
    """(budgets, seqs, try_policies). With at most ``cell.concurrency`` requests in flight
    more slots change nothing, so the seqs ladder stops there; knobs a command template does
    not pass are held at one value."""
    from poise.lab.commands import template_fields
    from poise.lab.tune import DEFAULT_BUDGETS, DEFAULT_SEQS

    budgets = args.budgets or (DEFAULT_BUDGETS if gpu else CPU_BUDGETS)
    seqs = args.seqs or (DEFAULT_SEQS if gpu else CPU_SEQS)
    if cell.concurrency:
        seqs = tuple(s for s in seqs if s <= cell.concurrency) or seqs[:1]
    try_policies = not args.no_policies
    if args.command_template:
        told = set(template_fields(args.command_template))
        if "max_num_batched_tokens" not in told:
            budgets = budgets[:1]
        if "max_num_seqs" not in told:
            seqs = seqs[:1]
        if "scheduling_policy" not in told:
            try_policies = False
        untold = [k for k in TUNED if k not in told]
        if untold:
            print(f"poise tune: the command template does not pass {', '.join(untold)}: not tuned")
    return budgets, seqs, try_policies


def _write(out: str, text: str, record: dict[str, Any]) -> None:
    from pathlib import Path

    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "tune.md").write_text(text + "\n", encoding="utf-8")
    (Path(out) / "tune.json").write_text(
        json.dumps(record, indent=2, default=str), encoding="utf-8"
    )
    print(f"\nrecord: {Path(out) / 'tune.json'}")


def run(args: argparse.Namespace) -> int:
    from poise.bench.bench_config import WorkloadSpec
    from poise.lab.commands import fill_template, poise_serve_command
    from poise.lab.tune import Tuner, TuneSettings
    from poise.lab.tune_report import format_result

    engine = engine_kwargs_from_args(args)
    ignored = [k for k in TUNED if k in engine and k != "scheduling_policy"]
    if ignored:
        print(f"poise tune: {', '.join(ignored)} are tuned (see --budgets/--seqs); flag ignored")
    policy = engine.pop("scheduling_policy", "fifo")
    fixed = {k: v for k, v in engine.items() if k not in TUNED}
    gpu = str(fixed.get("device", "cpu")).startswith("cuda") or bool(args.command_template)
    base_wl = WorkloadSpec(
        concurrency=(32,) if gpu else (4,),
        long_ratio=(0.0,),
        max_tokens=160 if gpu else 32,
        num_requests=None if gpu else 12,
        warmup=None if gpu else 2,
        long_repeat=220 if gpu else 27,
    )
    out = args.out or str(lab_options.default_out("tune"))
    try:
        workload = lab_options.workload_from_args(args, base_wl, single=True)
        budgets, seqs, try_policies = _ladders(args, gpu, workload.cells()[0])
        slo_ttft, slo_tpot = lab_options.single_slos(args)
        if slo_ttft is None:
            raise ValueError("--slo-ttft-p95-ms: give the TTFT p95 target in ms")
        settings = TuneSettings(
            slo_ttft,
            slo_tpot,
            budgets=budgets,
            seqs=seqs,
            policy=policy,
            try_policies=try_policies,
            trade=not args.no_trade,
            slo_scheduling=not (args.no_slo_scheduling or args.command_template),
            latency_search=not args.no_latency_search,
            min_gain=args.min_gain,
            tail_tolerance=args.tail_tolerance,
            kv_headroom=args.kv_headroom,
            max_probes=args.max_probes,
        )
        probe = _probe(args, fixed, workload, out)
    except (ValueError, OSError) as exc:
        print(f"poise tune: error: {exc}", file=sys.stderr)
        return 2
    result = Tuner(probe, settings, fixed).run()

    def command(c: Any) -> str:
        if args.command_template:
            values = {"port": 8000, "model": fixed.get("model") or "", **c.to_args()}
            return fill_template(args.command_template, values)
        return poise_serve_command(fixed.get("model"), c.to_args())

    text = format_result(result, command)
    print(text)
    record = result.to_dict()
    record["workload"] = dataclasses.asdict(workload)
    record["fixed_args"] = fixed
    record["target"] = "simulator" if args.simulate else (args.command_template or "poise serve")
    _write(out, text, record)
    return 0 if result.met else 1
