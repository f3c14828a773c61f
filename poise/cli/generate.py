"""`poise generate "prompt"`: a quick try of the offline engine (chat template applied)."""

from __future__ import annotations

import argparse
import sys
import time

from poise.cli.options import add_engine_args, engine_kwargs_from_args

HELP = "Generate a reply to a prompt with the offline engine."
DESCRIPTION = """
Generate a reply to one or more prompts (the chat template is applied).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="Prompt text; several prompts run as a batch.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--sampling-seed", type=int, default=None, help="Per-request sampling seed."
    )
    parser.add_argument(
        "--raw", action="store_true", help="Send the prompt as plain text, without chat template."
    )
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from poise.core.sampling_params import SamplingParams
    from poise.engine.llm import LLM

    start = time.monotonic()
    llm = LLM(**engine_kwargs_from_args(args))
    loaded = time.monotonic()
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.sampling_seed,
    )
    if args.raw:
        outputs = llm.generate(list(args.prompt), params, use_tqdm=False)
    else:
        convs = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(convs, params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        print(completion.text.strip())
        m = out.metrics
        if m is not None and m.ttft is not None:
            tpot = f"{m.tpot * 1000:.1f} ms" if m.tpot is not None else "-"
            print(
                f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, "
                f"TTFT {m.ttft * 1000:.0f} ms, TPOT {tpot}, first token "
                f"{(loaded - start) + m.ttft:.1f} s after start]",
                file=sys.stderr,
            )
    return 0
