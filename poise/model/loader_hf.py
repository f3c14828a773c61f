"""Load a Hugging Face checkpoint directory: config.json + *.safetensors (sharded or not).

Tensors are read with ``safetensors.safe_open`` (memory-mapped) one at a time and copied into
the pre-allocated model, so peak memory is about one model plus one tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from poise.checkpoint.source import ModelSource, describe, read_json
from poise.model.loader import LoadedModel, check_complete, empty_model


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors in {path}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in the checkpoint's dtype: the model casts (or quantizes) each."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _eos_from_generation_config(path: Path) -> frozenset[int]:
    gen = path / "generation_config.json"
    if not gen.exists():
        return frozenset()
    value = read_json(gen).get("eos_token_id")
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)


def load_hf_dir(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str | None
) -> LoadedModel:
    path = source.path
    arch = describe(source)
    model = empty_model(arch, dtype, device, quantization)
    loaded = model.load_weights(iter_safetensors(safetensors_files(path)))
    check_complete(model, loaded, str(path))
    return LoadedModel(
        model=model,
        arch=arch,
        name=source.name,
        tokenizer_source=source.tokenizer_source(),
        extra_eos_token_ids=_eos_from_generation_config(path),
    )
