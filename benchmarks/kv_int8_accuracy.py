"""The int8 KV cache against the bf16 one on the embedded model (issue 33's accuracy line):
200 greedy tokens from a bf16-KV run, teacher-forced through each cache; prints the mean and
max absolute logprob difference and the top-1 agreement through the decode kernel (each token
fed back as a decode row) and through the prefill kernel (the sequence as one 2048-token
prompt), and, as the noise floor, bf16 against bf16 across the two kernels (the same cache
read by both).

    .venv/bin/python benchmarks/kv_int8_accuracy.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.test_kv_int8_accuracy import (  # noqa: E402
    NEAR_TIE,
    compare,
    generate_bf16,
    prefilled_tail,
    teacher_forced,
    teacher_forced_decode,
)


def main() -> int:
    ids, prompt_len = generate_bf16()
    runs = {}
    for kv in ("auto", "int8"):
        runs[kv, "decode"] = teacher_forced_decode(ids, prompt_len, kv)
        runs[kv, "prefill"] = teacher_forced(ids, prompt_len, kv, 2048)
    print(f"{len(ids) - prompt_len} generated tokens, prompt {prompt_len} tokens")
    print(
        "| compared | positions | mean abs logprob diff | max | top-1 agreement "
        f"| flips beyond a near-tie (margin > {NEAR_TIE}) |"
    )
    print("|---|---|---|---|---|---|")
    pairs = [
        ("int8 vs bf16 KV, decode kernel", runs["int8", "decode"], runs["auto", "decode"]),
        ("int8 vs bf16 KV, prefill kernel", runs["int8", "prefill"], runs["auto", "prefill"]),
        (
            "bf16 KV, decode vs prefill kernel (floor)",
            runs["auto", "decode"],
            prefilled_tail(runs["auto", "prefill"]),
        ),
    ]
    for name, a, b in pairs:
        r = compare(a, b)
        print(
            f"| {name} | {len(a.logprobs)} | {r.mean_abs_logprob_diff:.4f} "
            f"| {r.max_abs_logprob_diff:.3f} | {r.top1_agreement:.1%} | {r.clear_flips} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
