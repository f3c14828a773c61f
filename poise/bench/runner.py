"""Driving load: ``run_cell`` (one load point) and ``run_matrix`` (every cell of a config,
in order) against any OpenAI-compatible server.

Closed loop: ``concurrency`` workers, each sending its next request as soon as its previous
one ends (intended send time = when the slot freed). Open loop: requests leave at their
scheduled arrival times; a concurrency cap, if set, makes late sends visible as sched_lag.
The first ``warmup`` requests of a cell run under the same load but are excluded from the
results. The server is scraped throughout each cell; the event loop's own lag is measured.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from poise import workload as wl
from poise.bench.bench_config import BenchConfig, CellSpec, cell_counts, cell_requests
from poise.bench.client import (
    Endpoint,
    LoopLagMonitor,
    Scraper,
    discover_model,
    discover_version,
    make_session,
    now,
    probe,
    send_one,
)
from poise.bench.record import CellResult, ExperimentRecord, build_cell, cell_load
from poise.bench.server_info import ServerInfo, discover_server_info
from poise.bench.stats import RequestRecord

log = logging.getLogger(__name__)


def _tool_version() -> str:
    try:
        from importlib.metadata import version

        return f"poise-bench {version('poise')}"
    except Exception:  # not installed as a distribution (a copied package)
        return "poise-bench (unknown version)"


def _git_sha() -> str | None:
    """The commit of the checkout this package runs from, when it is one."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


TOOL_VERSION = _tool_version()
Progress = Callable[[int, "int | None"], None]  # (done, total or None) of the current cell
CLOSED_LOOP_SAMPLE = 4096  # distinct requests a duration-bound closed loop cycles through


def _utc() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class _CellRun:
    """State of one running cell."""

    def __init__(
        self,
        cfg: BenchConfig,
        spec: CellSpec,
        session: aiohttp.ClientSession,
        ep: Endpoint,
        salt: str | None,
        progress: Progress | None,
    ) -> None:
        self.cfg, self.spec, self.session, self.ep = cfg, spec, session, ep
        self.salt, self.progress = salt, progress
        self.warmup, measured = cell_counts(cfg, spec)
        # A duration-bound closed loop cycles through a bounded sample (see closed_loop).
        self.cycle = spec.closed_loop and cfg.duration is not None and cfg.num_requests is None
        limit = self.warmup + CLOSED_LOOP_SAMPLE if self.cycle else None
        self.requests = cell_requests(cfg, spec, limit)
        # The clock ends a duration-bound cell: its total is not known in advance.
        self.total: int | None = None if cfg.duration is not None else self.warmup + measured
        self.records: list[RequestRecord] = []
        self.done = 0
        self.t0 = 0.0
        self.deadline = math.inf

    def _prompt(self, req: wl.WorkloadRequest) -> str:
        salt = self.salt
        if salt and self.cfg.salt_scope == "request":
            salt = f"{salt}-{req.index}"
        return wl.salted(req.prompt, salt)

    async def _send(self, req: wl.WorkloadRequest, intended: float) -> RequestRecord:
        rec = RequestRecord(
            req.index,
            req.class_name,
            start=intended,
            intended=intended,
            max_tokens=req.max_tokens,
            warmup=req.index < self.warmup,
        )
        self.records.append(rec)
        await send_one(self.session, self.ep, self._prompt(req), rec, self.cfg.timeout_s)
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
        return rec

    async def closed_loop(self) -> None:
        it: Iterator[wl.WorkloadRequest] = (
            wl.iter_forever(self.requests) if self.cycle else iter(self.requests)
        )

        async def worker() -> None:
            intended = now()
            for req in it:  # shared iterator: each request is taken by exactly one worker
                if now() >= self.deadline and req.index >= self.warmup:
                    break
                rec = await self._send(req, intended)
                intended = rec.end if rec.end is not None else now()

        await asyncio.gather(*(worker() for _ in range(self.spec.concurrency or 1)))

    async def open_loop(self) -> None:
        sem = asyncio.Semaphore(self.spec.concurrency) if self.spec.concurrency else None
        tasks = []

        async def guarded(req: wl.WorkloadRequest, intended: float) -> None:
            assert sem is not None
            async with sem:
                await self._send(req, intended)

        for req in self.requests:
            intended = self.t0 + req.arrival
            if intended >= self.deadline and req.index >= self.warmup:
                break
            delay = intended - now()
            if delay > 0:
                await asyncio.sleep(delay)
            coro = guarded(req, intended) if sem else self._send(req, intended)
            tasks.append(asyncio.create_task(coro))
        await asyncio.gather(*tasks)


async def run_cell(
    cfg: BenchConfig,
    spec: CellSpec,
    session: aiohttp.ClientSession | None = None,
    ep: Endpoint | None = None,
    *,
    salt: str | None = None,
    progress: Progress | None = None,
) -> CellResult:
    """Run one load point and summarise it (records re-based to the cell start). Without a
    session/endpoint (a one-off call from a sweep or tuner), opens and probes its own."""
    if session is None or ep is None:
        async with make_session() as own:
            ep = await open_endpoint(cfg, own)
            return await run_cell(cfg, spec, own, ep, salt=salt, progress=progress)
    run = _CellRun(cfg, spec, session, ep, salt, progress)
    scraper = (
        Scraper(cfg.metrics_endpoint(), cfg.scrape_interval, cfg.engine) if cfg.scrape else None
    )
    monitor = LoopLagMonitor()
    started_at = _utc()
    if scraper is not None:
        await scraper.start()
    monitor.start()
    cpu0 = time.process_time()
    run.t0 = now()
    if cfg.duration is not None:
        run.deadline = run.t0 + cfg.duration
    try:
        await (run.closed_loop() if spec.closed_loop else run.open_loop())
    finally:
        wall = now() - run.t0
        cpu_util = (time.process_time() - cpu0) / wall if wall > 0 else None
        lags = await monitor.stop()
        if scraper is not None:
            await scraper.stop()
    return build_cell(
        cell_load(cfg, spec, salt),
        run.records,
        slo=cfg.slo(),
        include_failures=cfg.include_failures,
        scrapes=scraper.scrapes if scraper else (),
        loop_lags=lags,
        max_lag_ms=cfg.max_lag_ms,
        cpu_util=cpu_util,
        t0=run.t0,
        started_at=started_at,
    )


def experiment_block(
    cfg: BenchConfig,
    model: str,
    engine: str | None,
    version: str | None = None,
    described: ServerInfo | None = None,
) -> dict[str, Any]:
    """The template's experiment fields (metrics are added per cell by the record).

    ``described``: what the server said about itself; the user's ``--gpu``, ``--version``
    and ``--server-arg`` values take priority over it."""
    described = described or ServerInfo()
    workload: dict[str, Any] = {
        # As run: a closed loop's default streams, None for an open loop without a cap.
        "concurrency": list(dict.fromkeys(c.concurrency for c in cfg.cells())),
        "long_prompt_ratio": list(cfg.long_ratio) if cfg.mixes_by_ratio else None,
        "long_repeat": cfg.long_repeat if cfg.mixes_by_ratio else None,
        "max_tokens": cfg.max_tokens,
        "request_rate": [None if math.isinf(r) else r for r in cfg.request_rate],
        "burstiness": cfg.burstiness,
        "num_requests": cfg.num_requests,
        "duration_s": cfg.duration,
        "warmup": cfg.warmup,
        "classes": cfg.to_dict()["classes"] or ["short (seed)", "long (seed)"],
        "jsonl": cfg.jsonl,
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "salt_scope": cfg.salt_scope,
        "timeout_s": cfg.timeout_s,
        "slo_ttft_ms": cfg.slo_ttft_ms,
        "slo_tpot_ms": cfg.slo_tpot_ms,
        "class_slo_ttft_ms": dict(cfg.class_slo_ttft_ms) or None,
        "class_slo_tpot_ms": dict(cfg.class_slo_tpot_ms) or None,
    }
    return {
        "model": model,
        "gpu": cfg.gpu or described.gpu or "unknown",
        "engine": engine or "unknown",
        "version": version or cfg.version or described.version or "unknown",
        "workload": workload,
        "server_args": {**described.server_args, **cfg.server_args},
        "server_info_source": described.source,
    }


async def open_endpoint(cfg: BenchConfig, session: aiohttp.ClientSession) -> Endpoint:
    """The endpoint for ``cfg``: model discovered when not given, options probed."""
    ep = Endpoint(cfg.base_url, cfg.model or "", cfg.api_key, temperature=cfg.temperature)
    ep.ignore_eos = cfg.ignore_eos
    ep.send_class, ep.class_priority = cfg.send_class, dict(cfg.class_priority)
    if not ep.model:
        ep.model = await discover_model(session, cfg.base_url, ep.headers()) or "default"
    ep.capabilities = await probe(session, ep, cfg.timeout_s)
    if not ep.capabilities["ok"]:
        log.warning("capability probe failed: %s", ep.capabilities["error"])
    return ep


async def run_matrix(
    cfg: BenchConfig,
    *,
    on_cell_start: Callable[[CellSpec, int | None], None] | None = None,
    progress: Progress | None = None,
    on_cell_done: Callable[[CellResult], None] | None = None,
    checkpoint: str | Path | None = None,
) -> ExperimentRecord:
    """Probe the server, then run every cell of ``cfg`` in order. With ``checkpoint``, the
    record so far is saved there after every cell (``provenance.complete`` false until the
    end), so an interrupted matrix keeps its finished cells."""
    t_start = time.time()
    async with make_session() as session:
        ep = await open_endpoint(cfg, session)
        engine = cfg.engine
        # Replicas behind a poise router, from its metrics (1: a plain server; None: not scraped).
        replicas: int | None = None
        if engine is None and cfg.scrape:
            scraper = Scraper(cfg.metrics_endpoint())
            await scraper.start()
            await scraper.stop()
            engine = scraper.engine if scraper.scrapes else None
            if scraper.scrapes:
                replicas = int(scraper.scrapes[-1].replicas or 1)
        version = cfg.version or await discover_version(session, cfg.server_root)
        metrics_url = cfg.metrics_endpoint() if cfg.scrape else None
        described = await discover_server_info(session, cfg.server_root, metrics_url)
        record = ExperimentRecord(
            experiment={
                **experiment_block(cfg, ep.model, engine, version, described),
                "replicas": replicas,
            },
            cells=[],
            capabilities={**ep.capabilities, "ignore_eos_requested": cfg.ignore_eos},
            provenance=_provenance(cfg),
        )
        run_salt = cfg.run_salt()
        for i, spec in enumerate(cfg.cells()):
            if on_cell_start is not None:
                total = None if cfg.duration is not None else sum(cell_counts(cfg, spec))
                on_cell_start(spec, total)
            salt = f"{run_salt}-{i}" if run_salt and cfg.salt_scope != "run" else run_salt
            cell = await run_cell(cfg, spec, session, ep, salt=salt, progress=progress)
            record.cells.append(cell)
            if on_cell_done is not None:
                on_cell_done(cell)
            if checkpoint is not None:
                _stamp(record, t_start, complete=False).save(checkpoint)
    return _stamp(record, t_start, complete=True)


def _provenance(cfg: BenchConfig) -> dict[str, Any]:
    return {
        "command": cfg.command,
        "tool_version": TOOL_VERSION,
        "git_sha": _git_sha(),
        "started_at": _utc(),
        "finished_at": None,
        "wall_s": None,
        "complete": False,
        "base_url": cfg.base_url,
        "python": sys.version.split()[0],
        "host": platform.node(),
        "metrics_url": cfg.metrics_endpoint() if cfg.scrape else None,
        "config": cfg.to_dict(),
    }


def _stamp(record: ExperimentRecord, t_start: float, complete: bool) -> ExperimentRecord:
    record.provenance.update(
        finished_at=_utc(), wall_s=round(time.time() - t_start, 3), complete=complete
    )
    return record
