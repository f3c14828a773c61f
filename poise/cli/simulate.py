"""`poise simulate`: the `poise bench` matrix run against the simulator instead of a server.

Takes the engine flags of `poise serve` and the workload flags of `poise bench`, runs every cell
through ``poise.sim.simulate_cell`` (the real scheduler on a virtual clock, with a profiled or
roofline cost model) and writes the same YAML experiment record (``kind: simulated``) and plots.

Programmatic use (sweep/tune): ``poise.lab.sim_bridge``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import Any

from poise.cli.options import add_engine_args, engine_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="Run the bench matrix against the simulator (the real scheduler, virtual time).",
        description="Same engine flags as `poise serve`, same workload flags as `poise bench`; "
        "step times come from a profile (`poise profile`) or a roofline model of a named "
        "accelerator. Writes a YAML experiment record marked simulated.",
    )
    g = parser.add_argument_group("cost model")
    g.add_argument("--profile", help="Step-cost profile from `poise profile` (this machine).")
    g.add_argument("--accelerator", help="Roofline model of a GPU: a10, l40s, a100, h100, h200.")
    g.add_argument(
        "--model-shape",
        help="Roofline: a shipped shape (Qwen2.5-7B-Instruct, Llama-3.1-8B-Instruct, "
        "SmolLM2-135M-Instruct), a config.json, a model dir or a .gguf (default: --model's, "
        "else SmolLM2).",
    )
    g.add_argument("--compute-efficiency", type=float, default=None, help="Roofline MFU (0.5).")
    g.add_argument("--bandwidth-efficiency", type=float, default=None, help="Roofline (0.8).")
    g.add_argument(
        "--request-overhead-ms", type=float, default=None,
        help="Per-request time before the engine sees it (HTTP, template, tokenize).",
    )  # fmt: skip
    g.add_argument(
        "--request-overhead-cv", type=float, default=0.0, metavar="CV",
        help="Spread of the request overhead (coefficient of variation; seeded lognormal): "
        "requests sent together reach the engine in a random order. (default: 0)",
    )  # fmt: skip
    g.add_argument(
        "--way-in-workers", type=int, default=0, metavar="N",
        help="Requests prepared at once by the server (poise serve: 1, its tokenizer thread); "
        "others queue in send order. 0 (default): no queue.",
    )  # fmt: skip
    g.add_argument(
        "--way-in-us-per-token", type=float, default=0.0, metavar="US",
        help="How long a request holds a way-in worker, per prompt token, in microseconds (the "
        "serial part of the request overhead: chat template and tokenization). (default: 0)",
    )  # fmt: skip
    g.add_argument(
        "--step-overhead-ms", type=float, default=None,
        help="Per-step engine-loop time outside the forward (default: the profile's).",
    )  # fmt: skip
    g.add_argument(
        "--time-scale", type=float, default=1.0,
        help="Multiply every modelled step time (the machine is busier now than when profiled).",
    )  # fmt: skip
    g.add_argument(
        "--step-jitter", type=float, default=0.0, metavar="CV",
        help="Spread of real step times around the model (coefficient of variation, e.g. 0.15): "
        "each step gets a seeded lognormal factor of mean 1. 0 (default): deterministic steps.",
    )  # fmt: skip
    _add_workload_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The `poise bench` load/workload/record flags that make sense without a server."""
    from poise.cli.bench import _floats, _ints, add_scheduling_args

    g = p.add_argument_group("load (as poise bench)")
    g.add_argument("--concurrency", type=_ints, default=(8,), help="Closed-loop streams, list; with --request-rate: a cap.")  # fmt: skip
    g.add_argument("--request-rate", type=_floats, default=None, help="Open-loop rates (req/s), list; inf = closed loop.")  # fmt: skip
    g.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrival gaps (1 = Poisson).")  # fmt: skip
    g.add_argument("--num-requests", type=int, default=None, help="Measured requests per cell (default 4 x concurrency, >= 16).")  # fmt: skip
    g.add_argument("--duration", type=float, default=None, help="Virtual seconds per cell instead of a count.")  # fmt: skip
    g.add_argument("--warmup", type=int, default=None, help="Warmup requests per cell (default: concurrency).")  # fmt: skip
    g = p.add_argument_group("workload (as poise bench)")
    g.add_argument("--long-ratio", type=_floats, default=(0.0,), help="Fractions of seed LONG prompts, list.")  # fmt: skip
    g.add_argument("--max-tokens", type=int, default=160, help="max_tokens per request (output length, ignore_eos).")  # fmt: skip
    g.add_argument("--class", dest="classes", action="append", default=[], metavar="NAME:W:PLEN:OLEN", help="A request class (repeatable), as poise bench.")  # fmt: skip
    g.add_argument("--jsonl", help="Prompts file, as poise bench.")
    # --seed is the engine flag (ModelConfig.seed); here it also seeds the request sample.
    g.add_argument("--salt", default="auto", help="auto (a fixed simulated salt per cell) | none | TEXT.")  # fmt: skip
    g.add_argument("--salt-scope", choices=("run", "cell", "request"), default="cell")
    add_scheduling_args(g)
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g = p.add_argument_group("record")
    g.add_argument("--label", help="A name for this run (legends).")
    g.add_argument("-o", "--output", help="YAML path (default: sim-results/<time>.yaml).")
    g.add_argument("--plot", action="store_true", help="Also write plots + HTML beside it.")


# ---- cost model -----------------------------------------------------------------------------
def cost_model_from_args(args: argparse.Namespace, config: Any) -> Any:
    from poise.sim.fit import load_profile
    from poise.sim.roofline import RooflineCostModel

    req = None if args.request_overhead_ms is None else args.request_overhead_ms / 1000
    step = None if args.step_overhead_ms is None else args.step_overhead_ms / 1000
    if args.profile:
        return load_profile(
            args.profile,
            request_overhead_s=req,
            step_overhead_s=step,
            time_scale=args.time_scale,
            request_overhead_cv=args.request_overhead_cv,
            way_in_workers=args.way_in_workers,
            way_in_s_per_token=args.way_in_us_per_token * 1e-6,
            step_jitter_cv=args.step_jitter,
        )
    if not args.accelerator:
        raise ValueError("cost model: give --profile FILE (see `poise profile`) or --accelerator")
    # The embedded model's shape ships as a config.json; any other model string is described
    # from its own files (checkpoint.resolve_model), never silently replaced.
    shape = args.model_shape or config.model.model or "SmolLM2-135M-Instruct"
    kw: dict[str, Any] = {
        "request_overhead_s": req or 0.0,
        "step_overhead_s": step or 0.0,
        "time_scale": args.time_scale,
        "request_overhead_cv": args.request_overhead_cv,
        "way_in_workers": args.way_in_workers,
        "way_in_s_per_token": args.way_in_us_per_token * 1e-6,
        "step_jitter_cv": args.step_jitter,
    }
    if args.compute_efficiency is not None:
        kw["compute_efficiency"] = args.compute_efficiency
    if args.bandwidth_efficiency is not None:
        kw["bandwidth_efficiency"] = args.bandwidth_efficiency
    dtype = config.model.dtype if config.model.dtype != "auto" else "bfloat16"
    return RooflineCostModel.build(shape, args.accelerator, dtype=dtype, **kw)


def prompt_lengths(tokenizer: str | None) -> Any:
    from poise.sim.tokens import PromptLengths

    if not tokenizer:
        return PromptLengths()
    from poise.text.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(tokenizer)

    def count(text: str) -> int:  # what the server feeds the engine for a chat request
        return len(apply_chat_template(tok, [{"role": "user", "content": text}]))

    return PromptLengths(count=count)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from poise.bench.config import BenchConfig
    from poise.bench.report import print_record
    from poise.cli.bench import workload_fields
    from poise.lab.sim_bridge import simulate_matrix

    try:
        engine_config = engine_config_from_args(args)
        cost_model = cost_model_from_args(args, engine_config)
        cfg = BenchConfig(
            base_url="simulated://",
            model=cost_model.name,
            **workload_fields(args, args.concurrency),
            seed=engine_config.model.seed,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            scrape=False,
            command=shlex.join(["poise", *sys.argv[1:]]),
        )
    except ValueError as exc:
        print(f"poise simulate: error: {exc}", file=sys.stderr)
        return 2
    record = simulate_matrix(
        cfg, engine_config, cost_model, prompt_lengths(engine_config.model.tokenizer)
    )
    if args.label:
        record.provenance["label"] = args.label
    out = Path(args.output or f"sim-results/{dt.datetime.now():%Y%m%d-%H%M%S}.yaml")
    record.save(out)
    print_record(record, Console())
    prov = record.provenance
    print(
        f"simulated {prov['simulated_requests']} requests in {prov['simulation_wall_s']:.2f} s "
        f"wall ({prov['simulated_requests_per_wall_s']} requests/s; {prov['wall_s']:.2f} s with "
        f"records and metrics); cost model {cost_model.name}"
    )
    print(f"record: {out}")
    if args.plot:
        from poise.bench.plot import write_report

        name = args.label or out.stem
        files = write_report([(name, record)], out.with_suffix("").parent / (out.stem + "-plots"))
        for key, path in files.items():
            print(f"{key}: {path}")
    return 0
