"""What one structured-output request costs the others in its batch (issue 13).

SmolLM2-135M-Instruct (the embedded GGUF), offline ``LLM``, ``--batch`` requests (default 32) of
the seed's SHORT prompt, greedy, exactly ``--max-tokens`` output tokens each (``ignore_eos``).
Two batches, run alternately ``--rounds`` times:

- ``plain``: every request unconstrained.
- ``one_json``: the same, but request 0 carries a ``json_schema`` (an array of at least 500
  integers, so its grammar stays open for the whole run and the batch keeps its size).

``mask_logits_ms_per_step`` times the masking alone (fill the row's bitmask, apply it to a
[batch, vocab] float32 logits tensor), the whole per-step price the others pay.

The figure is the mean TPOT of requests 1..N-1 (unconstrained in both batches), the median
over rounds, and the ratio one_json / plain; the acceptance bound is < 1.10. The constrained
request's own TPOT is printed too. Every run also checks that the greedy token ids of requests
1..N-1 are identical in both batches (masking one row must not touch the others).

The machine is shared (2 cores, other jobs running): single rounds swing by tens of percent,
which is why rounds alternate and the median is reported.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see offline_throughput.py

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from poise import LLM, SamplingParams  # noqa: E402
from poise.core.structured import StructuredOutputsParams  # noqa: E402
from poise.workload import SHORT_PROMPT  # noqa: E402

SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 500,
}


def run(llm: LLM, prompt: list[int], batch: int, max_tokens: int, constrained: bool) -> dict:
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = plain
    if constrained:
        first = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        )
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * batch, [first] + [plain] * (batch - 1), use_tqdm=False)
    wall = time.perf_counter() - t0
    tpots = [o.metrics.tpot for o in outs[1:] if o.metrics and o.metrics.tpot is not None]
    own = outs[0].metrics.tpot if outs[0].metrics else None
    return {
        "wall_s": wall,
        "others_tpot_s": statistics.fmean(tpots),
        "first_tpot_s": own,
        "first_text": outs[0].outputs[0].text[:40],
        "others_ids": [o.outputs[0].token_ids for o in outs[1:]],
    }


def mask_cost_ms(llm: LLM, batch: int, reps: int = 200) -> float:
    """Mean ms of ``runner.structured.mask_logits`` for one constrained row among ``batch``: the
    whole per-step price of structured output, measured alone (less noise than TPOT)."""
    import torch

    from poise.runner.structured import mask_logits

    state = llm.engine.grammars.new_state(StructuredOutputsParams(json=SCHEMA))  # type: ignore[union-attr]
    logits = torch.randn(batch, llm.model_info.vocab_size)
    grammars = [state] + [None] * (batch - 1)
    t0 = time.perf_counter()
    for _ in range(reps):
        mask_logits(logits, grammars)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_num_seqs=args.batch)
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": SHORT_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
    run(llm, ids, 4, 4, True)  # warm-up: model, kernel, llguidance's token trie, the schema
    rows: dict[str, list[dict]] = {"plain": [], "one_json": []}
    for _ in range(args.rounds):
        for name in rows:
            rows[name].append(run(llm, ids, args.batch, args.max_tokens, name == "one_json"))
    same = all(a["others_ids"] == b["others_ids"] for a, b in zip(*rows.values(), strict=True))
    med = {k: statistics.median(r["others_tpot_s"] for r in v) for k, v in rows.items()}
    report = {
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "others_tpot_ms": {
            k: [round(r["others_tpot_s"] * 1e3, 2) for r in v] for k, v in rows.items()
        },
        "median_others_tpot_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "ratio_one_json_over_plain": round(med["one_json"] / med["plain"], 3),
        "constrained_tpot_ms": [round((r["first_tpot_s"] or 0) * 1e3, 2) for r in rows["one_json"]],
        "constrained_text": rows["one_json"][0]["first_text"],
        "others_greedy_ids_equal": same,
        "mask_logits_ms_per_step": round(mask_cost_ms(llm, args.batch), 3),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
