"""Fitting a linear step-cost model to measured step times, and the profile file.

The fit is ordinary (optionally relative-error weighted) least squares over ``FEATURES`` by the
normal equations, solved with Gaussian elimination and partial pivoting in plain Python. Columns
are scaled to unit RMS first (features span 1 .. 1e7, which would wreck the conditioning), and
a coefficient that comes out negative is pinned to 0 and the rest refitted (a small active-set
non-negative least squares): a step can never get cheaper by adding work, and extrapolating a
negative slope would predict negative times.

Profile file (JSON): ``kind``, ``version``, the model facts the simulator needs (vocab size,
context length, KV bytes per token, EOS ids, KV byte budget), ``coefficients``, fit quality and
``provenance`` (host, CPU, threads, torch version, dtype, grid, date), and the raw ``samples``
so it can be refitted without measuring again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poise.sim.arrival import ArrivalModel
from poise.sim.cost import DEFAULT_CPU_KV_BYTES, FEATURES, LinearCostModel, StepShape

PROFILE_KIND = "poise-step-profile"
PROFILE_VERSION = 1


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve the square system ``a x = b`` (Gaussian elimination, partial pivoting)."""
    n = len(a)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            raise ValueError("fit: singular system (a feature never varies in the samples)")
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def least_squares(
    rows: Sequence[Sequence[float]], y: Sequence[float], weights: Sequence[float] | None = None
) -> list[float]:
    """Minimise sum(w_i * (rows_i . x - y_i)^2) by the normal equations on RMS-scaled columns."""
    k = len(rows[0])
    w = list(weights) if weights is not None else [1.0] * len(rows)
    scale = [math.sqrt(sum(r[j] ** 2 for r in rows) / len(rows)) or 1.0 for j in range(k)]
    xs = [[r[j] / scale[j] for j in range(k)] for r in rows]
    ata = [
        [sum(wi * r[i] * r[j] for wi, r in zip(w, xs, strict=True)) for j in range(k)]
        for i in range(k)
    ]
    aty = [sum(wi * r[i] * yi for wi, r, yi in zip(w, xs, y, strict=True)) for i in range(k)]
    # A whisker of ridge keeps a feature that is constant-zero in the grid from making it singular.
    for i in range(k):
        ata[i][i] += 1e-12 * (ata[i][i] or 1.0)
    return [c / s for c, s in zip(solve(ata, aty), scale, strict=True)]


def nonneg_least_squares(
    rows: Sequence[Sequence[float]], y: Sequence[float], weights: Sequence[float] | None = None
) -> list[float]:
    """Least squares with coefficients >= 0: drop the most negative one, refit, repeat."""
    k = len(rows[0])
    active = list(range(k))
    while True:
        sub = [[r[j] for j in active] for r in rows]
        coef = least_squares(sub, y, weights)
        worst = min(range(len(active)), key=lambda i: coef[i])
        if coef[worst] >= 0 or len(active) == 1:
            out = [0.0] * k
            for j, c in zip(active, coef, strict=True):
                out[j] = max(c, 0.0)
            return out
        del active[worst]


@dataclass(frozen=True)
class FitQuality:
    n: int
    rmse_s: float
    mape: float  # mean |error| / measured
    max_rel_error: float
    r2: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def fit_step_costs(
    samples: Sequence[tuple[StepShape, float]],
    *,
    relative: bool = True,
    features: Sequence[str] = FEATURES,
    knee: float | None = None,
) -> tuple[dict[str, float], FitQuality]:
    """Fit coefficients for ``features`` to (shape, seconds) samples.

    ``relative`` weights each sample by 1/t^2, i.e. minimises relative error, so short decode
    steps count as much as long prefills. ``knee`` is where ``decode_padded_excess`` starts.
    """
    if len(samples) < len(features):
        raise ValueError(f"fit: need at least {len(features)} samples, got {len(samples)}")
    idx = [FEATURES.index(f) for f in features]
    rows = [[s.features(knee)[i] for i in idx] for s, _ in samples]
    y = [t for _, t in samples]
    weights = [1.0 / max(t, 1e-9) ** 2 for t in y] if relative else None
    coef = nonneg_least_squares(rows, y, weights)
    coefficients = dict(zip(features, coef, strict=True))
    pred = [sum(c * x for c, x in zip(coef, r, strict=True)) for r in rows]
    return coefficients, quality(pred, y)


KNEES: tuple[float | None, ...] = (None, 8192, 16384, 24576, 32768, 49152, 65536)


def fit_with_knee(
    samples: Sequence[tuple[StepShape, float]], knees: Sequence[float | None] = KNEES
) -> tuple[dict[str, float], FitQuality, float | None]:
    """``fit_step_costs`` for each candidate knee; the one with the lowest MAPE wins (a 1-D
    search keeps the model linear in its coefficients)."""
    best: tuple[dict[str, float], FitQuality, float | None] | None = None
    for knee in knees:
        coef, q = fit_step_costs(samples, knee=knee)
        if best is None or q.mape < best[1].mape - 1e-9:
            best = (coef, q, knee)
    assert best is not None
    return best


def quality(pred: Sequence[float], y: Sequence[float]) -> FitQuality:
    n = len(y)
    err = [p - t for p, t in zip(pred, y, strict=True)]
    mean = sum(y) / n
    ss_tot = sum((t - mean) ** 2 for t in y) or 1e-30
    rel = [abs(e) / t if t > 0 else 0.0 for e, t in zip(err, y, strict=True)]
    return FitQuality(
        n=n,
        rmse_s=math.sqrt(sum(e * e for e in err) / n),
        mape=sum(rel) / n,
        max_rel_error=max(rel),
        r2=1.0 - sum(e * e for e in err) / ss_tot,
    )


# ---- the profile file ---------------------------------------------------------------------------
def profile_record(
    *,
    model: str,
    coefficients: dict[str, float],
    fit: FitQuality,
    samples: Sequence[tuple[StepShape, float]],
    vocab_size: int,
    max_model_len: int,
    kv_bytes_per_token: int,
    eos_token_ids: Sequence[int] = (),
    kv_int8_bytes_per_token: int = 0,
    kv_budget_bytes: int = DEFAULT_CPU_KV_BYTES,
    provenance: dict[str, Any] | None = None,
    decode_padded_knee: float | None = None,
) -> dict[str, Any]:
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        "model": model,
        "vocab_size": vocab_size,
        "max_model_len": max_model_len,
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_int8_bytes_per_token": kv_int8_bytes_per_token,
        "kv_budget_bytes": kv_budget_bytes,
        "eos_token_ids": list(eos_token_ids),
        "features": list(coefficients),
        "coefficients": coefficients,
        "decode_padded_knee": decode_padded_knee,
        "fit": fit.to_dict(),
        "request_overhead_s": 0.0,
        "step_overhead_s": 0.0,
        "provenance": provenance or {},
        "samples": [{**s.to_dict(), "time_s": t} for s, t in samples],
    }


def save_profile(record: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return path


def merge_profiles(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One profile from several measurements of the same grid (e.g. taken before, between and
    after the loads they will be compared with): each sample's time is the median over the
    profiles that measured that shape, then the model is fitted again.

    Why: on a shared machine the speed drifts by tens of percent over minutes; profiles taken
    across a run's whole window describe that window, one taken at its start does not.
    """
    if not records:
        raise ValueError("merge: no profiles given")
    first = records[0]
    for rec in records:
        if rec.get("kind") != PROFILE_KIND:
            raise ValueError("merge: not a profile record")
        for key in ("model", "vocab_size", "kv_bytes_per_token"):
            if rec.get(key) != first.get(key):
                raise ValueError(f"merge: profiles differ in {key!r}")
    times: dict[tuple[tuple[str, int], ...], list[float]] = {}
    for rec in records:
        for d in rec["samples"]:
            shape = StepShape.from_dict(d)
            times.setdefault(tuple(sorted(shape.to_dict().items())), []).append(float(d["time_s"]))
    samples = [(StepShape(**dict(key)), statistics.median(ts)) for key, ts in times.items()]
    coefficients, fit, knee = fit_with_knee(samples)
    merged = dict(first)
    merged.update(
        coefficients=coefficients,
        features=list(coefficients),
        fit=fit.to_dict(),
        decode_padded_knee=knee,
        step_overhead_s=statistics.median([float(r.get("step_overhead_s", 0.0)) for r in records]),
        samples=[{**s.to_dict(), "time_s": t} for s, t in samples],
    )
    merged["provenance"] = {
        **first.get("provenance", {}),
        "merged_from": [r.get("provenance", {}).get("created") for r in records],
    }
    return merged


def _read_profile(path: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    if data.get("kind") != PROFILE_KIND:
        raise ValueError(f"profile: {path} is not a {PROFILE_KIND} file")
    return data


def load_profile(
    path: str | Path,
    *,
    step_overhead_s: float | None = None,
    time_scale: float = 1.0,
    step_jitter_cv: float = 0.0,
) -> LinearCostModel:
    """A ``LinearCostModel`` from a profile file; the step overhead can be overridden."""
    data = _read_profile(path)
    step = data.get("step_overhead_s", 0.0) if step_overhead_s is None else step_overhead_s
    return LinearCostModel(
        name=f"profile:{data['model']}",
        coefficients={k: float(v) for k, v in data["coefficients"].items()},
        decode_padded_knee=data.get("decode_padded_knee"),
        vocab_size=int(data["vocab_size"]),
        model_max_len=int(data["max_model_len"]),
        eos_token_ids=tuple(data.get("eos_token_ids", ())),
        kv_bytes_per_token=int(data["kv_bytes_per_token"]),
        kv_int8_bytes_per_token=int(data.get("kv_int8_bytes_per_token", 0)),
        default_kv_budget_bytes=int(data.get("kv_budget_bytes", DEFAULT_CPU_KV_BYTES)),
        step_overhead_s=float(step),
        time_scale=time_scale,
        step_jitter_cv=step_jitter_cv,
        provenance={**data.get("provenance", {}), "profile_file": str(path), "fit": data["fit"]},
    )


def profile_arrival(
    path: str | Path,
    *,
    request_overhead_s: float | None = None,
    request_overhead_cv: float = 0.0,
    way_in_workers: int = 0,
    way_in_s_per_token: float = 0.0,
) -> ArrivalModel:
    """The client arrival model with the profile's stored request overhead (``poise profile``
    stores 0: a runner-only profile sees no requests) unless ``request_overhead_s`` is given."""
    data = _read_profile(path)
    req = data.get("request_overhead_s", 0.0) if request_overhead_s is None else request_overhead_s
    return ArrivalModel(
        request_overhead_s=float(req),
        request_overhead_cv=request_overhead_cv,
        way_in_workers=way_in_workers,
        way_in_s_per_token=way_in_s_per_token,
    )
