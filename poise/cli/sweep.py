"""`poise sweep CONFIG... | --preset lab`: server configs x bench cells, resumable, one report;
wiring only (the work is in poise.lab)."""

from __future__ import annotations

import argparse
import sys

from poise.cli import lab_options

HELP = "Run the bench matrix against several server configs; resumable; one report."
DESCRIPTION = """
For each CONFIG (YAML: poise server args, or a command template that starts another engine plus
its base URL) start the server, wait until ready, run every cell, stop it. Cells already stored
in --out are not measured again. Writes report.md, one bench record per config and the plots
comparing configs. `--preset lab` runs the seed lab's configs A, B, C (scaled down on CPU: see
docs/tuning.md).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="*", metavar="CONFIG", help="Config YAML files.")
    g = parser.add_argument_group("configs")
    g.add_argument(
        "--preset",
        choices=("lab", "policy"),
        default=None,
        help="Built-in configs: lab (A, B, C) or policy (C fifo vs prefill-first).",
    )
    g.add_argument(
        "--model",
        default=None,
        help="Model for poise configs without one (default: the embedded SmolLM2-135M-Instruct).",
    )
    g.add_argument("--device", default="cpu", help="Device for presets: cpu or cuda.")
    lab_options.add_preset_size_args(
        g,
        scale_help="Preset size divisor (CPU default 8, GPU 1).",
        kv_help="CPU presets: KV bytes at memory fraction 1.0 (default 512MiB).",
    )
    lab_options.add_server_args(parser)
    lab_options.add_workload_args(
        parser,
        description="The traffic, as `poise bench`; every flag given "
        "overrides the preset's workload.",
    )
    lab_options.add_slo_args(parser, per_class=False)
    lab_options.add_output_args(
        parser, "Output folder (default sweep-<time>); re-use it to resume.", plots=True
    )
    lab_options.deprecate(parser, threads="--omp-num-threads")


def run(args: argparse.Namespace) -> int:
    from poise.bench.bench_config import WorkloadSpec
    from poise.lab import presets
    from poise.lab.sweep import load_specs, run_sweep, spec_from_dict

    if not args.configs and not args.preset:
        print("poise sweep: give CONFIG files or --preset", file=sys.stderr)
        return 2
    env = lab_options.server_env(args)
    try:
        slo_ttft, slo_tpot = lab_options.single_slos(args)
        specs = []
        base = WorkloadSpec()
        if args.preset:
            kv = lab_options.kv_base_bytes(args)
            plan = presets.plan(
                args.preset,
                device=args.device,
                scale=args.scale,
                kv_base_bytes=kv,
                model=args.model,
            )
            specs += [spec_from_dict(d, d["name"], args.model, env) for d in plan.configs]
            base = plan.workload
            for note in plan.notes:
                print(note)
        for path in args.configs:
            specs += load_specs(path, args.model, env)
        workload = lab_options.workload_from_args(args, base)
    except (ValueError, OSError) as exc:
        print(f"poise sweep: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or str(lab_options.default_out("sweep"))
    result = run_sweep(
        specs, workload, out, slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot, plots=args.plots
    )
    for o in result.outcomes:
        state = f"FAILED: {o.error}" if o.error else "ok"
        print(f"{o.name}: measured {len(o.measured)}, reused {len(o.reused)}: {state}")
    print(f"report: {result.report_path}")
    return 1 if any(o.error for o in result.outcomes) else 0
