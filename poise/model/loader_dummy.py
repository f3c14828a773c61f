"""``dummy:<config.json or dir>``: random weights for a given architecture (for perf work on
shapes we have no checkpoint for). Deterministic for a given seed."""

from __future__ import annotations

import torch

from poise.checkpoint.source import ModelSource, describe
from poise.model.loader import LoadedModel, empty_model


def load_dummy(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> LoadedModel:
    arch = describe(source)
    model = empty_model(arch, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return LoadedModel(
        model=model, arch=arch, name=source.name, tokenizer_source=source.tokenizer_source()
    )
