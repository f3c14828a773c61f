"""`poise simulate`: the `poise bench` matrix run against the simulator instead of a server.

Takes the engine flags of `poise serve` and the workload flags of `poise bench`, runs every cell
through ``poise.sim.simulate_cell`` (the real scheduler on a virtual clock, with a profiled or
roofline cost model) and writes the same YAML experiment record (``kind: simulated``) and plots.

Programmatic use (sweep/tune): ``poise.lab.sim_bridge``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from poise.cli import lab_options
from poise.cli.options import add_engine_args, engine_config_from_args
from poise.cli.router_options import add_router_args, router_from_args

HELP = "Run the bench matrix against the simulator (the real scheduler, virtual time)."
DESCRIPTION = """
Same engine flags as `poise serve`, same workload flags as `poise bench`; step times come from a
profile (`poise profile`) or a roofline model of a named accelerator. Writes a YAML experiment
record marked simulated.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cost model")
    g.add_argument("--profile", help="Step-cost profile from `poise profile` (this machine).")
    g.add_argument("--accelerator", help="Roofline model of a GPU: a10, l40s, a100, h100, h200.")
    g.add_argument(
        "--model-shape",
        help="Roofline: a shipped shape (Qwen2.5-7B-Instruct, Llama-3.1-8B-Instruct, "
        "SmolLM2-135M-Instruct), a config.json, a model dir or a .gguf (default: --model's, "
        "else SmolLM2).",
    )
    g.add_argument(
        "--spec-acceptance-rate",
        type=float,
        default=None,
        metavar="A",
        help="With --speculative-config: the chance each draft token is kept once those "
        "before it were (0..1; a measured run's from its spec_decode counters, "
        "docs/speculation.md).",
    )
    g.add_argument(
        "--spec-draft-rate",
        type=float,
        default=None,
        metavar="R",
        help="With --speculative-config: the share of decode steps the proposer has a draft "
        "for (0..1, default 1; prompt lookup finds none where the text is new).",
    )
    g.add_argument("--compute-efficiency", type=float, default=None, help="Roofline MFU (0.5).")
    g.add_argument("--bandwidth-efficiency", type=float, default=None, help="Roofline (0.8).")
    g.add_argument(
        "--request-overhead-ms",
        type=float,
        default=None,
        help="Per-request time before the engine sees it (HTTP, template, tokenize).",
    )
    g.add_argument(
        "--request-overhead-cv",
        type=float,
        default=0.0,
        metavar="CV",
        help="Spread of the request overhead (coefficient of variation; seeded lognormal): "
        "requests sent together reach the engine in a random order. (default: 0)",
    )
    g.add_argument(
        "--way-in-workers",
        type=int,
        default=0,
        metavar="N",
        help="Requests prepared at once by the server (poise serve: 1, its tokenizer thread); "
        "others queue in send order. 0 (default): no queue.",
    )
    g.add_argument(
        "--way-in-us-per-token",
        type=float,
        default=0.0,
        metavar="US",
        help="How long a request holds a way-in worker, per prompt token, in microseconds (the "
        "serial part of the request overhead: chat template and tokenization). (default: 0)",
    )
    g.add_argument(
        "--step-overhead-ms",
        type=float,
        default=None,
        help="Per-step engine-loop time outside the forward (default: the profile's).",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="Multiply every modelled step time (the machine is busier now than when profiled).",
    )
    g.add_argument(
        "--step-jitter",
        type=float,
        default=0.0,
        metavar="CV",
        help="Spread of real step times around the model (coefficient of variation, e.g. 0.15): "
        "each step gets a seeded lognormal factor of mean 1. 0 (default): deterministic steps.",
    )
    g.add_argument(
        "--calibrate-from",
        nargs="+",
        default=None,
        metavar="RECORD",
        help="Bench records (YAML, with their step traces where linked) whose concurrency-1 "
        "cells set the request overhead (and its spread without way-in workers), the way in "
        "per token (when prompt lengths vary), the time scale and the step jitter; a term "
        "set by a flag is kept (docs/simulator.md, Calibration).",
    )
    lab_options.add_workload_args(
        parser,
        description="The traffic, as `poise bench` (the simulator ends "
        "every request at max_tokens and does not sample: --no-ignore-eos and a "
        "temperature are refused).",
    )
    lab_options.add_slo_args(parser)
    lab_options.add_output_args(
        parser,
        "YAML record path, or a folder for <time>.yaml (default: sim-results/).",
        label=True,
        plots=False,
    )
    add_engine_args(parser)
    add_router_args(parser)
    lab_options.deprecate(
        parser,
        output="--out",
        plot="--plots",
        slo_ttft_ms="--slo-ttft-p95-ms",
        slo_tpot_ms="--slo-tpot-p50-ms",
    )


# ---- cost model -----------------------------------------------------------------------------
def cost_model_from_args(args: argparse.Namespace, config: Any) -> Any:
    model = _step_cost_model(args, config)
    rate = getattr(args, "spec_acceptance_rate", None)
    if rate is not None:
        model = dataclasses.replace(model, spec_acceptance_rate=rate)
    drafts = getattr(args, "spec_draft_rate", None)
    return model if drafts is None else dataclasses.replace(model, spec_draft_rate=drafts)


def _step_cost_model(args: argparse.Namespace, config: Any) -> Any:
    from poise.sim.fit import load_profile
    from poise.sim.roofline import RooflineCostModel

    step = None if args.step_overhead_ms is None else args.step_overhead_ms / 1000
    quantization = config.model.quantization
    if args.profile:
        model = load_profile(
            args.profile,
            step_overhead_s=step,
            time_scale=args.time_scale,
            step_jitter_cv=args.step_jitter,
        )
        measured = model.provenance.get("quantization")
        if quantization is not None and quantization != measured:
            raise ValueError(
                f"quantization: the profile measured {measured or 'unquantized'} weights; "
                f"profile the engine with --quantization {quantization} to simulate it"
            )
        return model
    if quantization is not None:
        raise ValueError(
            "quantization: the roofline cost model prices weights in dtype; simulate a "
            "quantized engine from its profile (poise profile --quantization ...; --profile)"
        )
    if not args.accelerator:
        raise ValueError("cost model: give --profile FILE (see `poise profile`) or --accelerator")
    # The embedded model's shape ships as a config.json; any other model string is described
    # from its own files (checkpoint.resolve_model), never silently replaced.
    shape = args.model_shape or config.model.model or "SmolLM2-135M-Instruct"
    kw: dict[str, Any] = {
        "step_overhead_s": step or 0.0,
        "time_scale": args.time_scale,
        "step_jitter_cv": args.step_jitter,
    }
    if args.compute_efficiency is not None:
        kw["compute_efficiency"] = args.compute_efficiency
    if args.bandwidth_efficiency is not None:
        kw["bandwidth_efficiency"] = args.bandwidth_efficiency
    dtype = config.model.dtype if config.model.dtype != "auto" else "bfloat16"
    return RooflineCostModel.build(shape, args.accelerator, dtype=dtype, **kw)


def arrival_model_from_args(args: argparse.Namespace) -> Any:
    """The client arrival model of the request-overhead and way-in flags."""
    from poise.sim.arrival import ArrivalModel
    from poise.sim.fit import profile_arrival

    req = None if args.request_overhead_ms is None else args.request_overhead_ms / 1000
    kw: dict[str, Any] = {
        "request_overhead_cv": args.request_overhead_cv,
        "way_in_workers": args.way_in_workers,
        "way_in_s_per_token": args.way_in_us_per_token * 1e-6,
    }
    if args.profile:
        return profile_arrival(args.profile, request_overhead_s=req, **kw)
    return ArrivalModel(request_overhead_s=req or 0.0, **kw)


def prompt_lengths(tokenizer: str | None) -> Any:
    from poise.sim.tokens import PromptLengths

    if not tokenizer:
        return PromptLengths()
    from poise.text.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(tokenizer)

    def count(text: str) -> int:  # what the server feeds the engine for a chat request
        return len(apply_chat_template(tok, [{"role": "user", "content": text}]))

    return PromptLengths(count=count)


def _workload(args: argparse.Namespace) -> Any:
    """The workload flags; until the next release a bare engine ``--seed`` also seeds the
    request sample, as it did before ``--workload-seed`` existed."""
    spec = lab_options.workload_from_args(args)
    if getattr(args, "seed", None) is not None and "seed" not in lab_options.given_workload(args):
        print(
            "poise simulate: --seed seeds the request sample only until the next release; "
            "use --workload-seed",
            file=sys.stderr,
        )
        spec = dataclasses.replace(spec, seed=args.seed)
    return spec


def run(args: argparse.Namespace) -> int:
    from poise.bench.bench_config import BenchConfig
    from poise.cli.bench import command_line, finish_record
    from poise.lab.sim_bridge import simulate_matrix

    try:
        engine_config = engine_config_from_args(args)
        cost_model = cost_model_from_args(args, engine_config)
        arrival = arrival_model_from_args(args)
        calibration = None
        if args.calibrate_from:
            from poise.lab.calibration import calibrated_models

            cost_model, arrival, calibration = calibrated_models(
                args.calibrate_from, cost_model, arrival
            )
        cfg = BenchConfig.for_workload(
            _workload(args),
            base_url="simulated://",
            model=cost_model.name,
            **lab_options.slo_fields(args),
            scrape=False,
            command=command_line(),
        )
        cluster = router_from_args(args, engine_config.cache.block_size)
        record = simulate_matrix(
            cfg,
            engine_config,
            cost_model,
            prompt_lengths(engine_config.model.tokenizer),
            arrival,
            cluster=cluster if cluster["replicas"] > 1 else None,
        )
    except ValueError as exc:
        print(f"poise simulate: error: {exc}", file=sys.stderr)
        return 2
    if calibration is not None:
        record.provenance["calibration"] = {
            "records": args.calibrate_from,
            **calibration.to_dict(),
        }
    out = lab_options.record_path(args.out, "sim-results")
    finish_record(record, out, args)
    prov = record.provenance
    print(
        f"simulated {prov['simulated_requests']} requests in {prov['simulation_wall_s']:.2f} s "
        f"wall ({prov['simulated_requests_per_wall_s']} requests/s; {prov['wall_s']:.2f} s with "
        f"records and metrics); cost model {cost_model.name}"
    )
    return 0
