"""Model loading entry point: HF directory, GGUF file, ``dummy:`` random weights, or the
embedded default (model=None).

All loaders build the module on the meta device (no memory, no init cost), materialise it
with ``to_empty`` directly in the target dtype/device, then copy each checkpoint tensor into
place exactly once. The rope tables are built later by the runner (``init_rope``), once it
knows max_model_len.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poise.model.arch import ArchConfig
from poise.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DUMMY_PREFIX = "dummy:"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ArchConfig
    name: str
    # Where a tokenizer can be built from: a directory with tokenizer files, a .gguf, or None.
    tokenizer_source: str | None
    # Extra end-of-sequence ids beyond arch.eos_token_ids (generation_config.json).
    extra_eos_token_ids: frozenset[int] = frozenset()


def empty_model(
    arch: ArchConfig, dtype: torch.dtype, device: torch.device, attention_backend: str = "torch"
) -> LlamaForCausalLM:
    """The model with uninitialised parameters, allocated once in dtype on device."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, attention_backend)
    # Materialise each parameter ourselves (what Module.to_empty does, minus its import of
    # sympy: ~1 s of cold start). torch.empty does not touch the pages, so this is free until
    # the loader writes the weights.
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=False))
    return model.eval()


def check_complete(model: LlamaForCausalLM, loaded: set[str], source: str) -> None:
    missing = model.expected_hf_names() - loaded
    if missing:
        raise ValueError(f"model: {source} lacks weights {sorted(missing)[:5]}...")


def read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    attention_backend: str = "torch",
) -> LoadedModel:
    """Dispatch on the model string (see ModelConfig.model)."""
    if model is None:
        from poise.model.registry import default_model_path

        model = str(default_model_path())
    if model.startswith(DUMMY_PREFIX):
        from poise.model.loader_dummy import load_dummy

        return load_dummy(model[len(DUMMY_PREFIX) :], dtype, device, seed, attention_backend)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from poise.model.loader_gguf import load_gguf

        return load_gguf(path, dtype, device, attention_backend)
    if path.is_dir() and (path / "config.json").exists():
        from poise.model.loader_hf import load_hf_dir

        return load_hf_dir(path, dtype, device, attention_backend)
    raise ValueError(
        f"model: {model!r} is neither a HF directory with config.json, a .gguf file, "
        "nor 'dummy:<config.json>'"
    )
