"""The server describes itself: effective engine config, model, dtype, device and hardware.

``describe`` builds one JSON-safe dict at startup; ``GET /server_info`` returns it,
``poise:engine_config_info`` (a gauge of 1, as vLLM's ``cache_config_info``) carries the
engine config as labels, and ``poise bench`` reads it to fill a record's ``server_args``,
``gpu`` and ``version`` without any ``--server-arg``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poise.config import EngineConfig


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_name(device: str | None) -> str | None:
    """The CUDA device's name when the model runs on one (torch is loaded by then)."""
    if not device or not device.startswith("cuda") or "torch" not in sys.modules:
        return None
    torch = sys.modules["torch"]
    try:
        return str(torch.cuda.get_device_name(torch.device(device)))
    except (RuntimeError, AssertionError, ValueError):
        return None


def hardware(device: str | None) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = gpu_name(device)
    # The record's one-line "gpu": the accelerator's name, or the CPU that runs the model.
    summary = gpu or f"cpu: {cpu_model()} ({cores} cores)"
    return {"cpu_model": cpu_model(), "cpu_cores": cores, "gpu_name": gpu, "summary": summary}


def describe(
    config: EngineConfig,
    *,
    model: str,
    version: str,
    max_model_len: int,
    dtype: str | None = None,
    device: str | None = None,
    num_kv_blocks: int | None = None,
    server_args: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The server's self-description. ``config`` is the EngineConfig (``to_flat_dict``);
    ``server_args`` every ``poise serve`` option as given or defaulted (the flag registry,
    poise/cli/serve_flags.py), the API key only as "set"."""
    engine_config = config.to_flat_dict()
    described: dict[str, Any] = json.loads(
        json.dumps(
            {
                "engine": "poise",
                "version": version,
                "model": model,
                "dtype": dtype,
                "device": device,
                "max_model_len": max_model_len,
                "num_kv_blocks": num_kv_blocks,
                "engine_config": engine_config,
                "server_args": dict(server_args or {}),
                "hardware": hardware(device),
                "python": sys.version.split()[0],
            },
            default=str,
        )
    )
    return described


class ConfigInfoCollector(Collector):
    """``poise:engine_config_info``: 1, labelled with the model, dtype, device and each engine
    option (values as strings), so a dashboard or a scraper sees how the server runs."""

    def __init__(self, info: Mapping[str, Any]) -> None:
        labels = {
            "model_name": str(info.get("model")),
            "dtype": str(info.get("dtype")),
            "device": str(info.get("device")),
            "version": str(info.get("version")),
        }
        for key, value in dict(info.get("engine_config") or {}).items():
            labels.setdefault(key, value if isinstance(value, str) else json.dumps(value))
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "poise:engine_config_info",
            "The effective engine configuration, as labels (value 1).",
            labels=list(self._labels),
        )
        gauge.add_metric(list(self._labels.values()), 1.0)
        yield gauge
