"""The one seam between the lab and ``poise.bench``: run a list of cells of a workload against
a live server with the bench's programmatic API.

A lab workload is a ``poise.bench.bench_config.WorkloadSpec`` (the same traffic `poise bench` sends,
built from the same flags) and a lab cell is one of its ``CellSpec`` s.

Invariants: the request sample of a cell depends only on the workload and the cell (seed
fixed), never on the server: every config of a sweep sees the same requests. Each cell gets
its own salt (``<run salt>-<cell label>``; the workload's ``salt`` and ``salt_scope`` say
otherwise), so no prefix cached by an earlier cell or config is reused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from poise.bench.bench_config import CellSpec, WorkloadSpec
from poise.bench.record import CellResult

CellDone = Callable[[CellSpec, CellResult], None]


def run_cells(
    base_url: str,
    workload: WorkloadSpec,
    cells: list[CellSpec],
    on_done: CellDone,
    *,
    salt: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Run ``cells`` in order against ``base_url`` (``extra``: BenchConfig fields such as
    model, server_args, engine); ``on_done`` gets each result as soon as it exists (so a later
    failure loses nothing). Returns the server's capabilities probe."""
    return asyncio.run(_run_cells(base_url, workload, cells, on_done, salt, extra))


async def _run_cells(
    base_url: str,
    workload: WorkloadSpec,
    cells: list[CellSpec],
    on_done: CellDone,
    salt: str | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    from poise.bench.bench_config import BenchConfig
    from poise.bench.client import make_session
    from poise.bench.runner import open_endpoint, run_cell

    cfg = BenchConfig.for_workload(workload, base_url=base_url, **extra)
    async with make_session() as session:
        ep = await open_endpoint(cfg, session)
        caps = ep.capabilities
        if not caps["ok"]:
            raise RuntimeError(f"server at {base_url} failed the probe request: {caps['error']}")
        for cell in cells:
            cell_salt = f"{salt}-{cell.label}" if salt and cfg.salt_scope != "run" else salt
            on_done(cell, await run_cell(cfg, cell, session, ep, salt=cell_salt))
    return dict(caps)
