"""The `poise lab` report's plots, one per question where a picture says it better; drawn from
the same cells as the text (``seven_data``). matplotlib, Agg backend, PNG files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from poise.lab.seven_answers_late import diagnose
from poise.lab.seven_data import LabData, percentile


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, xs: list[float], label: str, **kw: Any) -> None:
    s = sorted(xs)
    if s:
        ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=label, **kw)


def plot_batching(d: LabData, path: Path) -> bool:
    modes = [m for m in ("continuous", "static", "dynamic") if d.get("batching", m)]
    if not modes:
        return False
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    cells = [c for c in (d.get("batching", m) for m in modes) if c is not None]
    a1.bar(modes, [c.metrics.output_tokens_per_s or 0 for c in cells], color="tab:blue")
    a1.set_ylabel("output tokens/s")
    a1.set_title("throughput")
    x = range(len(modes))
    a2.bar([i - 0.2 for i in x], [c.metrics.ttft_p50_ms or 0 for c in cells], 0.4, label="p50")
    a2.bar([i + 0.2 for i in x], [c.metrics.ttft_p95_ms or 0 for c in cells], 0.4, label="p95")
    a2.set_xticks(list(x), modes)
    a2.set_ylabel("TTFT (ms)")
    a2.set_title("time to first token")
    a2.legend()
    fig.suptitle("Q1: static vs dynamic vs continuous batching")
    return _save(fig, path)


def plot_averages(d: LabData, path: Path) -> bool:
    c = d.get("mix", "decode-first", last=True)
    if c is None:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, xs in sorted(c.class_ttft_ms.items()):
        bins = 20 if max(xs) - min(xs) > 0.01 else 1  # a simulated cell may be all alike
        ax.hist(xs, bins=bins, alpha=0.6, label=f"{name} ({len(xs)})")
    for q, style in (("p50", ":"), ("mean", "-"), ("p95", "--")):
        v = (
            sum(c.ttft_ms) / len(c.ttft_ms)
            if q == "mean"
            else percentile(c.ttft_ms, 50 if q == "p50" else 95)
        )
        if v is not None:
            ax.axvline(v, color="k", linestyle=style, label=f"{q} {v:.0f} ms")
    _axes(
        ax, "TTFT (ms)", "requests", f"Q2: one cell's TTFT ({c.label}): the mean is nobody's wait"
    )
    return _save(fig, path)


def plot_policies(d: LabData, path: Path) -> bool:
    a, b = d.get("mix", "decode-first", last=True), d.get("mix", "prefill-first", last=True)
    if a is None or b is None:
        return False
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for cell, name, style in ((a, "decode-first", "-"), (b, "prefill-first", "--")):
        _cdf(a1, cell.ttft_ms, name, linestyle=style)
        _cdf(a2, cell.tpot_ms, name, linestyle=style)
    a1.set_xlabel("TTFT (ms)")
    a2.set_xlabel("TPOT (ms)")
    for ax in (a1, a2):
        ax.set_ylabel("fraction of requests")
        ax.legend()
    fig.suptitle(f"Q3: what each policy sacrifices ({a.label})")
    return _save(fig, path)


def plot_long_prompts(d: LabData, path: Path) -> bool:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    drawn = False
    for config, style in (("decode-first", "-"), ("prefill-first", "--")):
        for c in d.cells.get("mix", {}).get(config, []):
            short = c.class_ttft_ms.get("short", [])
            if short:
                _cdf(ax, short, f"{config}, long ratio {c.long_ratio:g}", linestyle=style)
                drawn = True
    if not drawn:
        plt.close(fig)
        return False
    _axes(
        ax,
        "TTFT of SHORT requests (ms)",
        "fraction of requests",
        "Q4: short prompts' TTFT with and without long prompts",
    )
    return _save(fig, path)


def plot_waiting(d: LabData, path: Path) -> bool:
    rows = []
    for name, args in d.configs("waiting").items():
        c = d.get("waiting", name)
        if c is not None:
            why, _ = diagnose(c, int(args.get("max_num_seqs", 0) or 0))
            rows.append((name, c.server_mean("waiting") or 0.0, why))
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar([r[0] for r in rows], [r[1] for r in rows], color="tab:orange")
    for bar, (_, _, why) in zip(bars, rows, strict=True):
        ax.annotate(
            why,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("waiting requests (mean)")
    ax.set_title("Q5: what held `waiting` up, per variant")
    return _save(fig, path)


def plot_prefix(d: LabData, path: Path) -> bool:
    names = [n for n in ("cache-off", "cache-on", "cache-on-lpm") if d.get("prefix", n)]
    if not names:
        return False
    cells = [c for c in (d.get("prefix", n) for n in names) if c is not None]
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(names, [100 * (c.hit_rate or 0) for c in cells], color="tab:green")
    a1.set_ylabel("prompt tokens from the prefix cache (%)")
    a2.bar(names, [c.metrics.ttft_p95_ms or 0 for c in cells], color="tab:red")
    a2.set_ylabel("TTFT p95 (ms)")
    fig.suptitle("Q6: prefix cache off / on / on with cache-aware ordering (lpm)")
    return _save(fig, path)


def plot_tune(d: LabData, path: Path) -> bool:
    t = d.tune or {}
    pts = [(e.get("metrics") or {}, e) for e in t.get("evidence") or []]
    pts = [(m, e) for m, e in pts if m.get("ttft_p95_ms") and m.get("output_tokens_per_s")]
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ok = [(m, e) for m, e in pts if e.get("meets_slo")]
    bad = [(m, e) for m, e in pts if not e.get("meets_slo")]
    for group, color, label in ((ok, "tab:green", "meets SLO"), (bad, "tab:gray", "misses")):
        ax.scatter(
            [m["output_tokens_per_s"] for m, _ in group],
            [m["ttft_p95_ms"] for m, _ in group],
            c=color,
            label=label,
        )
    for key, marker in (("throughput_first", "*"), ("latency_first", "D")):
        pick = t.get(key) or {}
        m = pick.get("metrics") or {}
        if m.get("ttft_p95_ms"):
            ax.scatter(
                [m["output_tokens_per_s"]],
                [m["ttft_p95_ms"]],
                marker=marker,
                s=200,
                facecolors="none",
                edgecolors="k",
                label=key.replace("_", "-"),
            )
    slo = (t.get("slo") or {}).get("ttft_p95_ms")
    if slo:
        ax.axhline(slo, color="r", linestyle="--", label=f"SLO TTFT p95 {slo:g} ms")
    _axes(ax, "output tokens/s", "TTFT p95 (ms)", "Q7: every tuning probe, and the two answers")
    return _save(fig, path)


def _axes(ax: Any, x: str, y: str, title: str) -> None:
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.legend()


def _save(fig: Any, path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return True


PLOTS: dict[str, Callable[[LabData, Path], bool]] = {
    "batching": plot_batching,
    "averages": plot_averages,
    "policies": plot_policies,
    "long_prompts": plot_long_prompts,
    "waiting": plot_waiting,
    "prefix": plot_prefix,
    "tune": plot_tune,
}
