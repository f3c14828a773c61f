"""``dummy:<config.json or dir>``: random weights for a given architecture (for perf work on
shapes we have no checkpoint for). Deterministic for a given seed. Quantized layers draw their
float weights the same way, then quantize them (model/quant.py)."""

from __future__ import annotations

import torch

from poise.checkpoint.source import ModelSource, describe
from poise.model.loader import LoadedModel, empty_model
from poise.model.quant import QuantLinear


def load_dummy(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    quantization: str | None = None,
) -> LoadedModel:
    arch = describe(source)
    model = empty_model(arch, dtype, device, quantization)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            module = model.get_submodule(name.rpartition(".")[0])
            if name.startswith("tied_head."):
                continue  # quantized from the embedding once it is drawn (load_model)
            if isinstance(module, QuantLinear) and param is module.weight:
                shape = (module.out_features, module.in_features)
                module.load_rows(
                    0, torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)
                )
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return LoadedModel(
        model=model, arch=arch, name=source.name, tokenizer_source=source.tokenizer_source()
    )
