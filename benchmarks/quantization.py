"""--quantization int8 / int4 against the unquantized model: memory, logits, greedy agreement.

Each setting loads in its own process (so RSS is the model's, not an earlier load's): the
embedded SmolLM2 GGUF by default, a small KV pool (so RSS is the weights plus torch), and

- RSS after the load, and the bytes of the model's parameters and buffers;
- the last-position logits of the seed's SHORT and LONG chat prompts, compared with the
  float32 unquantized model (the GGUF's dequantized weights: the reference);
- greedy tokens for both prompts (``--max-tokens``, the seed's 160 by default), compared with
  the unquantized model in the same dtype and in float32: the common prefix and the share of
  equal positions.

    .venv/bin/python benchmarks/quantization.py [--dtype bfloat16] [--max-tokens 160]

Speed: benchmarks/decode_step.py --quantizations none,int8,int4.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(args: argparse.Namespace) -> None:
    import torch

    from poise.config import EngineConfig
    from poise.core.outputs import ScheduledRequest, SchedulerOutput
    from poise.core.sampling_params import SamplingParams
    from poise.runner.factory import create_model_runner
    from poise.runner.inputs import build_step_inputs
    from poise.text.tokenizer import apply_chat_template
    from poise.workload import LONG_PROMPT, SHORT_PROMPT

    block = 16
    base = rss_mb()
    start = time.perf_counter()
    quantization = None if args.worker == "none" else args.worker
    config = EngineConfig.from_kwargs(
        model=args.model,
        dtype=args.dtype,
        quantization=quantization,
        num_kv_blocks=512,
        block_size=block,
        enable_prefix_caching=False,
    )
    runner, info = create_model_runner(config)
    load_s = time.perf_counter() - start
    # What stays resident: hand the load's freed temporaries (float32 tensors, unpacked int4
    # nibbles) back to the OS first, as a long-running server's allocator eventually does.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after = rss_mb()
    model = runner.model
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    greedy, logits = [], []
    for i, prompt in enumerate((SHORT_PROMPT, LONG_PROMPT)):
        ids = apply_chat_template(info.tokenizer, [{"role": "user", "content": prompt}])
        n_blocks = (len(ids) + args.max_tokens + block) // block
        table = list(range(n_blocks))
        # Last-position logits of the prompt (the first token's distribution), one forward.
        req = ScheduledRequest(f"r{i}", ids, 0, table, True, sp, 0, len(ids))
        inputs = build_step_inputs([req], block, torch.device("cpu"))
        with torch.inference_mode():
            hidden = model(
                inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, runner.attention
            )
            logits.append(model.compute_logits(hidden[-1:])[0])
        # Greedy continuation through the runner (prefill again, then one token a step).
        out: list[int] = []
        step = SchedulerOutput(step_id=0, scheduled=[req])
        for s in range(args.max_tokens):
            out.append(runner.execute(step).sampled_token_ids[f"r{i}"])
            pos = len(ids) + s
            req = ScheduledRequest(f"r{i}", [out[-1]], pos, table, True, sp, s + 1, len(ids))
            step = SchedulerOutput(step_id=s + 1, scheduled=[req])
        greedy.append(out)
    torch.save(torch.stack(logits), args.out + ".pt")
    result = {
        "load_s": load_s,
        "rss_before_mb": base,
        "rss_after_load_mb": after,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "model_bytes_mb": nbytes / 2**20,
        "greedy": greedy,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--quantizations", default="none,int8,int4")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
        return
    import torch

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("none", "float32")] + [(q, args.dtype) for q in args.quantizations.split(",")]
        for q, dtype in runs:
            out = os.path.join(tmp, f"{q}-{dtype}.json")
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                q,
                "--dtype",
                dtype,
                "--out",
                out,
                "--max-tokens",
                str(args.max_tokens),
            ]
            if args.model:
                cmd += ["--model", args.model]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            subprocess.run(cmd, check=True)
            with open(out) as f:
                results[(q, dtype)] = json.load(f)
            results[(q, dtype)]["logits"] = torch.load(out + ".pt")
    ref = results[("none", "float32")]
    same_dtype = results.get(("none", args.dtype))
    print(f"dtype {args.dtype}, {args.max_tokens} greedy tokens per prompt (SHORT / LONG)")
    print(
        f"{'setting':>16} {'load s':>7} {'RSS MB':>7} {'model MB':>9} "
        f"{'max|dlogit| vs fp32':>20} {'argmax=fp32':>11} {'greedy vs ' + args.dtype:>28} "
        f"{'greedy vs float32':>28}"
    )
    for (q, dtype), r in results.items():
        diff = (r["logits"] - ref["logits"]).abs().amax(dim=1).tolist()
        argmax = (r["logits"].argmax(1) == ref["logits"].argmax(1)).tolist()
        vs_dtype = agreement(r, same_dtype) if (q, dtype) != ("none", "float32") else ""
        print(
            f"{q + ' ' + dtype:>16} {r['load_s']:7.1f} {r['rss_after_load_mb']:7.0f} "
            f"{r['model_bytes_mb']:9.1f} {' / '.join(f'{d:.2f}' for d in diff):>20} "
            f"{' / '.join('y' if a else 'n' for a in argmax):>11} {vs_dtype:>28} "
            f"{agreement(r, ref):>28}"
        )


def agreement(got: dict[str, Any], want: dict[str, Any] | None) -> str:
    """Per prompt: common prefix / tokens (share of equal positions)."""
    if want is None:
        return ""
    parts = []
    for a, b in zip(got["greedy"], want["greedy"], strict=True):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        equal = sum(x == y for x, y in zip(a, b, strict=True)) / len(b)
        parts.append(f"{prefix}/{len(b)} ({equal:.0%})")
    return " ".join(parts)


if __name__ == "__main__":
    main()
