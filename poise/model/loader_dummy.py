"""``dummy:<config.json or dir>``: random weights for a given architecture (for perf work on
shapes we have no checkpoint for). Deterministic for a given seed."""

from __future__ import annotations

from pathlib import Path

import torch

from poise.model.arch import arch_from_hf_config
from poise.model.loader import LoadedModel, empty_model, read_json


def load_dummy(
    spec: str, dtype: torch.dtype, device: torch.device, seed: int, attention_backend: str = "torch"
) -> LoadedModel:
    path = Path(spec).expanduser()
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.exists():
        raise ValueError(f"model: dummy config {config_path} does not exist")
    arch = arch_from_hf_config(read_json(config_path))
    model = empty_model(arch, dtype, device, attention_backend)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
    directory = config_path.parent
    tokenizer = str(directory) if (directory / "tokenizer.json").exists() else None
    return LoadedModel(
        model=model, arch=arch, name=f"dummy-{directory.name}", tokenizer_source=tokenizer
    )
