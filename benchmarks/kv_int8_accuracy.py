"""The int8 KV cache against the bf16 one on the embedded model (issue 33's accuracy line):
200 greedy tokens from a bf16-KV run, teacher-forced through each cache; prints the mean and
max absolute logprob difference and the top-1 agreement, for chunks of 32 (decode-kernel rows)
and 2048 (the prefill kernel), and, as the noise floor, bf16 against bf16 across the two chunk
sizes (the same cache read by different kernels).

    .venv/bin/python benchmarks/kv_int8_accuracy.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.test_kv_int8_accuracy import compare, generate_bf16, teacher_forced  # noqa: E402


def main() -> int:
    ids, prompt_len = generate_bf16()
    runs = {
        (kv, chunk): teacher_forced(ids, prompt_len, kv, chunk)
        for kv in ("auto", "int8")
        for chunk in (32, 2048)
    }
    print(f"{len(ids) - prompt_len} generated tokens, prompt {prompt_len} tokens")
    print("| compared | mean abs logprob diff | max | top-1 agreement |")
    print("|---|---|---|---|")
    pairs = [
        ("int8 vs bf16 KV, chunk 32 (decode kernel)", ("int8", 32), ("auto", 32)),
        ("int8 vs bf16 KV, chunk 2048 (prefill kernel)", ("int8", 2048), ("auto", 2048)),
        ("bf16 chunk 32 vs bf16 chunk 2048 (floor)", ("auto", 32), ("auto", 2048)),
    ]
    for name, a, b in pairs:
        r = compare(runs[a], runs[b])
        print(
            f"| {name} | {r.mean_abs_logprob_diff:.4f} | {r.max_abs_logprob_diff:.3f} "
            f"| {r.top1_agreement:.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
