"""Per-cell results on disk, keyed by config name + cell label: what makes sweeps resumable.

Layout under the output dir: ``cells/<config>/<cell>.json`` holding the bench cell result
(``CellResult.to_dict()``), its per-request records, and a fingerprint of what produced it
(server args or command, model, workload). A stored cell is reused only when its fingerprint
matches the current one: renaming nothing but changing a flag re-measures, never mixes.

Invariants: a file is written whole (temp file + rename), so an interrupted run never leaves
a half cell that a resume would trust.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def safe_name(name: str) -> str:
    return _SAFE.sub("_", name).strip("_") or "config"


class CellStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, config: str, cell: str) -> Path:
        return self.root / "cells" / safe_name(config) / f"{safe_name(cell)}.json"

    def load(self, config: str, cell: str, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
        """The stored entry if present and produced by the same fingerprint, else None."""
        p = self.path(config, cell)
        if not p.is_file():
            return None
        try:
            entry = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", p, exc)
            return None
        if _norm(entry.get("fingerprint")) != _norm(fingerprint):
            logger.warning("%s/%s was measured with other settings: measuring again", config, cell)
            return None
        return dict(entry)

    def save(
        self,
        config: str,
        cell: str,
        fingerprint: dict[str, Any],
        result: dict[str, Any],
        records: list[dict[str, Any]] | None = None,
    ) -> Path:
        p = self.path(config, cell)
        p.parent.mkdir(parents=True, exist_ok=True)
        entry = {
            "config": config,
            "cell": cell,
            "fingerprint": fingerprint,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "result": result,
            "records": records or [],
        }
        tmp = p.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(entry, default=_jsonable, allow_nan=True), encoding="utf-8")
        os.replace(tmp, p)
        return p


def _jsonable(x: Any) -> Any:
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def _norm(x: Any) -> Any:
    """JSON round trip, so tuples and lists compare equal."""
    return json.loads(json.dumps(x, default=_jsonable, sort_keys=True))
