"""What a `poise lab` run measured, read back from its folder: the manifest, one bench record
per config and group, the tuning record. Every number the report prints comes from here.

``Cell`` is one measured cell of one config: the record's summary (``CellMetrics``), the raw
server block (gauges and counters) and the measured requests' own TTFT / TPOT (warmup and
failed requests left out), so the report can show distributions and not only percentiles.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from poise.lab.cell_metrics import CellMetrics
from poise.lab.seven_run import MANIFEST

# Below this many measured requests a cell's p95 is its maximum or close to it: the report says
# so next to the numbers.
FEW_REQUESTS = 20
# Below this, a cell answers nothing.
MIN_REQUESTS = 4


@dataclass
class Cell:
    config: str
    label: str
    long_ratio: float | None
    metrics: CellMetrics
    server: dict[str, Any]
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    class_ttft_ms: dict[str, list[float]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.ttft_ms)

    def server_mean(self, key: str) -> float | None:
        """A gauge's mean over the cell (live scrapes; the simulator's exact step means)."""
        sim = self.server.get("sim") or {}
        if sim.get(f"{key}_mean") is not None:
            return float(sim[f"{key}_mean"])
        v = (self.server.get(key) or {}).get("mean")
        return None if v is None else float(v)

    @property
    def hit_rate(self) -> float | None:
        v = self.server.get("prefix_cache_hit_rate")
        return None if v is None else float(v)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank on the sorted values (the bench's own definition is the same family)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _cell(config: str, c: Any) -> Cell:
    from poise.bench.stats import derive

    cell = Cell(
        config,
        c.label,
        c.load.get("long_prompt_ratio"),
        CellMetrics.from_bench(c.to_dict()),
        dict(c.server or {}),
    )
    for r in c.records:
        if r.warmup or not r.ok:
            continue
        st = derive(r)
        if st.ttft is None:
            continue
        cell.ttft_ms.append(st.ttft * 1000)
        cell.class_ttft_ms.setdefault(r.class_name, []).append(st.ttft * 1000)
        if st.tpot is not None:
            cell.tpot_ms.append(st.tpot * 1000)
    return cell


@dataclass
class LabData:
    out: Path
    manifest: dict[str, Any]
    cells: dict[str, dict[str, list[Cell]]]  # group -> config -> cells in record order
    tune: dict[str, Any] | None
    missing: list[str] = field(default_factory=list)  # records the manifest names but lacks

    def group(self, name: str) -> dict[str, Any]:
        return dict(self.manifest.get("groups", {}).get(name) or {})

    def configs(self, group: str) -> dict[str, dict[str, Any]]:
        return dict(self.group(group).get("configs") or {})

    def get(
        self, group: str, config: str, long_ratio: float | None = None, last: bool = False
    ) -> Cell | None:
        """A config's cell: the one of that long ratio, else the first (``last``: the last)."""
        cells = self.cells.get(group, {}).get(config, [])
        if long_ratio is not None:
            cells = [c for c in cells if c.long_ratio == long_ratio]
        if not cells:
            return None
        cell = cells[-1] if last else cells[0]
        return cell if cell.n >= MIN_REQUESTS else None

    @property
    def simulated(self) -> bool:
        return bool(self.manifest.get("simulated"))


def load(out_dir: str | Path) -> LabData:
    from poise.bench.record import ExperimentRecord

    out = Path(out_dir)
    manifest = yaml.safe_load((out / MANIFEST).read_text(encoding="utf-8")) or {}
    cells: dict[str, dict[str, list[Cell]]] = {}
    missing = []
    for gname, g in (manifest.get("groups") or {}).items():
        for config, rel in (g.get("records") or {}).items():
            path = out / rel
            if not path.exists():
                missing.append(f"{gname}/{config}")
                continue
            rec = ExperimentRecord.load(path)
            cells.setdefault(gname, {})[config] = [_cell(config, c) for c in rec.cells]
    tune_path = out / (manifest.get("tune") or {}).get("record", "tune/tune.json")
    tune = json.loads(tune_path.read_text(encoding="utf-8")) if tune_path.exists() else None
    return LabData(out, manifest, cells, tune, missing)
