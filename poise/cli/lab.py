"""`poise lab`: run the cells that answer the seed lab's seven questions and write the report;
wiring only (the work is in poise.lab.seven_*)."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from poise.cli import lab_options

GROUPS = ("batching", "batching-open", "mix", "waiting", "prefix", "speculation", "tune")


HELP = "Answer the seed lab's seven questions with this engine's own measurements."
DESCRIPTION = """
Runs the cells each question needs (batching modes; decode-first vs prefill-first on the seed
mix; the limits behind a high `waiting`; prefix cache off / on / cache-aware; a tuning run for a
chat SLO) on live poise servers (scaled down on a CPU) or through the simulator (--simulate),
and writes report.md (one section per question: the answer, this run's numbers, a plot) plus
lab.yaml (the records, and which questions this run answers).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument(
        "--device",
        default="cpu",
        help="Live servers' device: cpu (scaled down) or cuda (the seed's sizes).",
    )
    g.add_argument(
        "--model",
        default=None,
        help="Model for the live servers (default: the embedded SmolLM2-135M-Instruct).",
    )
    lab_options.add_preset_size_args(
        g,
        scale_help="Size divisor (CPU default 8, GPU and simulator 1).",
        kv_help="CPU: KV bytes at memory fraction 1.0 (default 512MiB).",
    )
    g.add_argument(
        "--simulate",
        action="store_true",
        help="Run every cell through the simulator instead of live servers.",
    )
    g.add_argument("--accelerator", help="--simulate: roofline GPU (a10, l40s, a100, h100, h200).")
    g.add_argument(
        "--model-shape", help="--simulate: roofline model shape (e.g. Qwen2.5-7B-Instruct)."
    )
    g.add_argument("--profile", help="--simulate: step-cost profile from `poise profile`.")
    g.add_argument(
        "--only",
        default=None,
        metavar="GROUP[,GROUP...]",
        help=f"Run only these groups ({', '.join(GROUPS)}); the report uses every record in --out.",
    )
    g.add_argument(
        "--report-only",
        action="store_true",
        help="Redraw report.md and plots from --out without running anything.",
    )
    g.add_argument(
        "--max-batch-delay-ms",
        type=float,
        default=None,
        help="The dynamic batching mode's delay (default: 50 on a GPU, 250 on CPU).",
    )
    g.add_argument(
        "--max-probes",
        type=int,
        default=None,
        help="Q7's tuning probes at most (default: 20 on a GPU, 6 on CPU).",
    )
    lab_options.add_slo_args(parser, per_class=False)
    lab_options.add_server_args(parser)
    lab_options.add_output_args(
        parser, "Output folder (default lab-<time>); re-use it to resume a live run.", plots=True
    )


def run(args: argparse.Namespace) -> int:
    from poise.lab.seven_plan import plan
    from poise.lab.seven_report import write_report
    from poise.lab.seven_run import run_lab

    out = args.out or str(lab_options.default_out("lab"))
    if args.report_only:
        if not args.out:
            print("poise lab: --report-only needs --out", file=sys.stderr)
            return 2
        print(f"report: {write_report(out, plots=args.plots)}")
        return 0
    try:
        only = tuple(x.strip() for x in args.only.split(",")) if args.only else None
        if only and not set(only) <= set(GROUPS):
            raise ValueError(f"--only: groups are {', '.join(GROUPS)}")
        slo_ttft, slo_tpot = lab_options.single_slos(args)
        target = "simulated" if args.simulate else args.device
        kv = lab_options.kv_base_bytes(args)
        lab = plan(
            target,
            scale=args.scale,
            out_dir=out,
            kv_base_bytes=kv,
            delay_ms=args.max_batch_delay_ms,
            slo_ttft_p95_ms=slo_ttft,
            slo_tpot_p50_ms=slo_tpot,
            max_probes=args.max_probes,
        )
        sim = _sim_target(args) if args.simulate else None
    except (ValueError, OSError) as exc:
        print(f"poise lab: error: {exc}", file=sys.stderr)
        return 2
    command = "poise " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    run_lab(
        lab,
        out,
        model=args.model,
        env=lab_options.server_env(args),
        sim=sim,
        groups=only,
        command=command,
    )
    print(f"report: {write_report(out, plots=args.plots)}")
    return 0


def _sim_target(args: argparse.Namespace) -> Any:
    from poise.cli.simulate import cost_model_from_args, prompt_lengths
    from poise.cli.tune import _simulate_defaults
    from poise.config import EngineConfig
    from poise.lab.seven_run import SimTarget

    ns = _simulate_defaults()
    ns.profile, ns.accelerator, ns.model_shape = args.profile, args.accelerator, args.model_shape
    config = EngineConfig.from_kwargs()
    return SimTarget(cost_model_from_args(ns, config), prompt_lengths(config.model.tokenizer))
