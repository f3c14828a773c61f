"""What a server says about itself, for a record's ``server_args``, ``gpu`` and ``version``.

Tried in this order (the first that answers wins; what the user typed always takes priority):

- poise: ``GET /server_info`` (``engine_config``, ``hardware.summary``, ``version``);
- SGLang: ``GET /get_server_info`` (its server args, flat, with ``version``);
- TGI: ``GET /info`` (``model_dtype``, ``model_device_type``, ``max_*`` limits, ``version``);
- vLLM: the ``vllm:cache_config_info`` gauge (and other ``*_config_info`` gauges) in
  ``/metrics``, whose labels are the config (vLLM's version comes from ``/version``).

None of the peers names its GPU: ``gpu`` stays as given (or "unknown") for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class ServerInfo:
    source: str | None = None  # which endpoint answered
    version: str | None = None
    gpu: str | None = None
    server_args: dict[str, Any] = field(default_factory=dict)


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
            return data if isinstance(data, dict) else None
    except (aiohttp.ClientError, OSError, ValueError, TimeoutError):
        return None


def from_poise(data: dict[str, Any]) -> ServerInfo | None:
    if data.get("engine") != "poise" or not isinstance(data.get("engine_config"), dict):
        return None
    # Every server option (the flag registry), then the engine config over it.
    server_args = data.get("server_args")
    args = {**(server_args if isinstance(server_args, dict) else {}), **data["engine_config"]}
    # The effective values (the config may say "auto") replace the configured ones.
    for key in ("dtype", "device", "num_kv_blocks", "max_model_len"):
        if data.get(key) is not None:
            args[key] = data[key]
    hw = data.get("hardware") or {}
    return ServerInfo("poise /server_info", data.get("version"), hw.get("summary"), args)


def from_sglang(data: dict[str, Any]) -> ServerInfo | None:
    if "model_path" not in data and "tp_size" not in data:
        return None
    args = {k: v for k, v in data.items() if isinstance(v, str | int | float | bool) or v is None}
    version = args.pop("version", None)
    return ServerInfo("sglang /get_server_info", str(version) if version else None, None, args)


def from_tgi(data: dict[str, Any]) -> ServerInfo | None:
    if "model_id" not in data:
        return None
    args = {k: v for k, v in data.items() if k != "version" and not isinstance(v, dict | list)}
    version = data.get("version")
    return ServerInfo("tgi /info", str(version) if version else None, None, args)


def from_metrics(text: str) -> ServerInfo | None:
    """vLLM's ``*config_info`` gauges: the labels of every one, merged."""
    args: dict[str, Any] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name.endswith("config_info") and not family.name.startswith("poise:"):
                for sample in family.samples:
                    args.update(sample.labels)
    except ValueError:
        return None
    args.pop("model_name", None)
    return ServerInfo("metrics *config_info", None, None, args) if args else None


async def discover_server_info(
    session: aiohttp.ClientSession, root_url: str, metrics_url: str | None
) -> ServerInfo:
    root = root_url.rstrip("/")
    for path, parse in (
        ("/server_info", from_poise),
        ("/get_server_info", from_sglang),
        ("/info", from_tgi),
    ):
        data = await _get_json(session, root + path)
        found = parse(data) if data is not None else None
        if found is not None:
            return found
    if metrics_url:
        try:
            async with session.get(metrics_url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    found = from_metrics(await resp.text())
                    if found is not None:
                        return found
        except (aiohttp.ClientError, OSError, TimeoutError):
            pass
    return ServerInfo()
