"""The results of benchmarks/offline_throughput.py and their comparison: one run per engine
and dtype, poise's speed over each peer's, and whether their greedy outputs agree."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    engine: str
    dtype: str
    num_requests: int
    output_tokens: int
    seconds: float
    # Generated ids per request, in prompt order (for the greedy agreement check).
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def log_result(r: RunResult) -> None:
    print(
        f"{r.dtype:9s} {r.engine:15s} {r.output_tokens:6d} tok {r.seconds:8.1f} s "
        f"{r.tokens_per_s:8.2f} tok/s",
        flush=True,
    )


def ratios(results: list[RunResult]) -> dict[str, dict[str, float]]:
    """dtype -> {peer: poise tok/s / peer tok/s}; ``poise+penalties`` is a peer too (its ratio
    is greedy's speed over the penalties run's: within 1.1 is the issue's target)."""
    out: dict[str, dict[str, float]] = {}
    for dtype in dict.fromkeys(r.dtype for r in results):
        by_engine = {r.engine: r for r in results if r.dtype == dtype}
        ours = by_engine.get("poise")
        if ours is None:
            continue
        out[dtype] = {
            peer: ours.tokens_per_s / r.tokens_per_s
            for peer, r in by_engine.items()
            if peer != "poise" and r.tokens_per_s > 0
        }
    return out


def agreement(results: list[RunResult]) -> dict[str, dict[str, float]]:
    """dtype -> {peer: fraction of requests whose greedy output equals poise's}.

    A sanity check that the engines did the same work; fp32 should agree almost everywhere,
    bf16 rounding differences may make long greedy continuations diverge.
    """
    out: dict[str, dict[str, float]] = {}
    for r in results:
        ours = next((x for x in results if x.engine == "poise" and x.dtype == r.dtype), None)
        if r.engine.startswith("poise") or ours is None or not r.outputs:
            continue
        same = sum(a == b for a, b in zip(ours.outputs, r.outputs, strict=True))
        out.setdefault(r.dtype, {})[r.engine] = same / len(r.outputs)
    return out
