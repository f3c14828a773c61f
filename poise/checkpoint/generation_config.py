"""Default sampling parameters from a model's ``generation_config.json``, as vLLM applies them.

``--generation-config``: ``auto`` (the default, as in vLLM) reads the model directory's file,
``vllm`` ignores it (poise's own defaults), a directory reads that directory's file. The keys
taken are vLLM's: repetition_penalty, temperature, top_p, top_k, min_p and max_new_tokens (as
max_tokens); a value a request gives wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from poise.checkpoint.source import ModelSource

# generation_config.json key -> SamplingParams field.
SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def generation_config(setting: str, source: ModelSource) -> dict[str, Any]:
    """The generation_config.json dict ``setting`` names ({} for ``vllm`` or no file)."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if source.kind == "gguf":
            return {}
        path = source.directory / "generation_config.json"
    else:
        directory = Path(setting).expanduser()
        path = directory / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config: {path} does not exist")
    if not path.is_file():
        return {}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return data


def sampling_defaults(setting: str, source: ModelSource) -> dict[str, Any]:
    """SamplingParams keyword defaults from the generation config ``setting`` names."""
    config = generation_config(setting, source)
    return {
        field: config[key] for key, field in SAMPLING_KEYS.items() if config.get(key) is not None
    }
