"""Offline throughput: poise's ``LLM`` vs transformers' continuous batching vs static ``generate``.

The seed lab's mix on SmolLM2-135M-Instruct (the embedded GGUF, dequantized by transformers for
the peers, by poise's loader for poise): ``--requests`` chat requests (default 32), 25 % the
LONG prompt and 75 % the SHORT one (evenly spread, ``poise.workload.long_positions``), each a
single user message with the chat template applied, greedy, exactly ``--max-tokens`` output
tokens (default 160; ``ignore_eos`` for poise, EOS disabled / ``min_new_tokens`` for the peers).

Engines:
- ``poise``: ``LLM(model=None, dtype=..., max_num_seqs=...).generate(token_ids, params)``.
- ``poise+penalties`` (``--penalties``): the same, each request sampling with top-p 0.95,
  temperature 0.8 and repetition / frequency / presence penalties (``PENALTIES``), a fresh
  engine; ``poise/poise+penalties`` is the cost of those fields (issue 13: within 10 %).
- ``generate_batch``: transformers ``model.generate_batch`` (its continuous batching; paged
  cache, ``attn_implementation="sdpa"`` on CPU).
- ``static``: transformers ``model.generate`` on left-padded batches of ``--static-batch-size``
  requests in arrival order; each batch runs until its longest request is done.

Prints output tokens/s per engine and dtype and the ratios poise / peer. Each engine's model load
and a tiny warm-up are outside the timed region; the timed region is the whole generate call.
A full fp32 run of the peers takes many minutes on a 2-core CPU (~15 tok/s); use
``--requests 8 --max-tokens 32`` for a quick check.

Quick check, 2026-11-29, shared 2-core CPU (load average ~5-6, so only ratios mean much),
8 requests (2 LONG of 3363 tokens, 6 SHORT of 45), 32 tokens, OMP_WAIT_POLICY=PASSIVE::

    dtype     engine          tok/s   poise/peer   greedy ids equal to poise
    float32   poise            2.06
    float32   generate_batch   1.95   1.06x        8/8
    float32   static (bs 8)    0.70   2.96x        8/8
    bfloat16  poise            6.10
    bfloat16  generate_batch   3.08   1.98x        2/8 (bf16 rounding; outputs diverge late)
    bfloat16  static (bs 8)    1.76   3.47x        0/8
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: with the default active spin-wait, an oversubscribed CPU (this
# 2-core box is shared) makes every small op in the *main* thread ~30x slower (a [8, 576] x
# [576, 960] linear: 11 ms instead of 0.3 ms), while transformers' generate_batch runs its
# loop in a worker thread that escapes most of it, so the comparison would measure OpenMP,
# not the engines. An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from offline_throughput_peers import TORCH_DTYPES, run_peers  # noqa: E402
from offline_throughput_report import RunResult, agreement, log_result, ratios  # noqa: E402

from poise.core.sampling_params import SamplingParams  # noqa: E402
from poise.text import apply_chat_template, load_tokenizer  # noqa: E402
from poise.workload import LONG_PROMPT, SHORT_PROMPT, long_positions  # noqa: E402

ENGINES = ("poise", "generate_batch", "static")


def build_prompts(num_requests: int, long_ratio: float = 0.25) -> list[list[int]]:
    """The seed mix as chat-templated token ids, in arrival order."""
    tok = load_tokenizer()
    short = apply_chat_template(tok, [{"role": "user", "content": SHORT_PROMPT}])
    long = apply_chat_template(tok, [{"role": "user", "content": LONG_PROMPT}])
    return [
        list(long if is_long else short) for is_long in long_positions(num_requests, long_ratio)
    ]


# ``--penalties``: what every request asks in the sampling-cost run (issue 13: penalties + top-p
# on every request, compared with plain greedy in the same run). Seeded so runs repeat.
PENALTIES = {
    "temperature": 0.8,
    "top_p": 0.95,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.2,
    "presence_penalty": 0.2,
}


@contextlib.contextmanager
def _timed_sampler() -> Iterator[list[float]]:
    """Seconds of each ``sample()`` call the runner makes inside the block: the sampler's own
    share of the run, measured in the run itself (the end-to-end ratio is noisy on a shared
    machine). Wraps the name the runner calls; restored on exit."""
    import poise.runner.model_runner as model_runner

    seconds: list[float] = []
    original = model_runner.sample

    def timed(*args: Any, **kwargs: Any) -> list[int]:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    model_runner.sample = timed  # type: ignore[assignment]
    try:
        yield seconds
    finally:
        model_runner.sample = original  # type: ignore[assignment]


def run_poise(
    prompts: list[list[int]],
    max_tokens: int,
    max_num_seqs: int,
    dtype: str,
    sampling: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> RunResult:
    """poise's offline engine on the same token ids: greedy, or ``sampling``'s fields on every
    request (engine name ``poise+penalties``)."""
    from poise.engine.llm import LLM

    # Like the generate_batch run: a KV pool that holds every request at once (no preemption).
    blocks = sum(-(-(len(p) + max_tokens) // 16) for p in prompts) + 16
    engine_kwargs = {"block_size": 16, "num_kv_blocks": blocks} | engine_kwargs
    llm = LLM(model=None, dtype=dtype, max_num_seqs=max_num_seqs, **engine_kwargs)
    kw: dict[str, Any] = {"temperature": 0.0} if sampling is None else sampling
    params = [
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **kw)
        for i in range(len(prompts))
    ]
    batch: list[str | list[int]] = list(prompts)
    warmup: list[str | list[int]] = [prompts[0][:8]]
    llm.generate(warmup, SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    start = time.perf_counter()
    with _timed_sampler() as sampler_s:
        outputs = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    name = "poise" if sampling is None else "poise+penalties"
    steps = len(sampler_s)
    print(
        f"{name}: sampler {sum(sampler_s):.2f} s of {seconds:.1f} s over {steps} sampling "
        f"steps ({1000 * sum(sampler_s) / max(1, steps):.1f} ms per step)",
        flush=True,
    )
    return RunResult(name, dtype, len(prompts), sum(map(len, outputs)), seconds, outputs)


def run_all(args: argparse.Namespace) -> list[RunResult]:
    prompts = build_prompts(args.requests, args.long_ratio)
    print(
        f"{len(prompts)} requests, prompt tokens {sorted(set(map(len, prompts)))}, "
        f"max_tokens {args.max_tokens}, torch threads {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
        flush=True,
    )
    results: list[RunResult] = []
    for dtype in args.dtypes:
        if "poise" in args.engines:
            results.append(run_poise(prompts, args.max_tokens, args.max_num_seqs, dtype))
            log_result(results[-1])
            if args.penalties:
                results.append(
                    run_poise(prompts, args.max_tokens, args.max_num_seqs, dtype, PENALTIES)
                )
                log_result(results[-1])
        results += run_peers(dtype, prompts, args)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--long-ratio", type=float, default=0.25)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=TORCH_DTYPES)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--max-num-seqs", type=int, default=32, help="poise and generate_batch cap")
    p.add_argument("--static-batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--penalties",
        action="store_true",
        help="also run poise with top-p and the three penalties on every request "
        f"({PENALTIES}) and print greedy / that",
    )
    p.add_argument("--json", default=None, help="write results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run_all(args)
    table = ratios(results)
    same = agreement(results)
    for dtype, peers in table.items():
        print(f"{dtype}: " + ", ".join(f"poise/{peer} = {r:.2f}x" for peer, r in peers.items()))
        if same.get(dtype):
            parts = [f"{peer} {frac:.0%}" for peer, frac in same[dtype].items()]
            print(f"{dtype}: greedy outputs identical to poise: " + ", ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            records = [
                {k: v for k, v in vars(r).items() if k != "outputs"}
                | {"tokens_per_s": r.tokens_per_s}
                for r in results
            ]
            json.dump(
                {"args": vars(args), "results": records, "ratios": table, "agreement": same},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
