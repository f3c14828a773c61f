"""What a ``--model`` string names, and its description, without loading weights or torch.

``resolve_model`` is the one dispatch over model strings (see ``ModelConfig.model``): the torch
loaders, the simulator's model shapes and the tokenizer loader all start from it, so a string
means the same model everywhere::

    None                      -> the embedded SmolLM2 GGUF (checkpoint/embedded.py)
    "dummy:<dir or config>"   -> random weights for that config.json   (kind "dummy")
    "<file>.gguf"             -> llama.cpp GGUF                        (kind "gguf")
    "<dir>" or "<dir>/config.json" with config.json                    (kind "hf")
    "owner/name[@revision]"   -> that Hub model in the local HF cache  (kind "hf" or "gguf",
                                 checkpoint/hub.py; never downloaded)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from poise.checkpoint.arch import ArchConfig, arch_from_hf_config
from poise.checkpoint.embedded import embedded_gguf_path
from poise.checkpoint.hub import cached_snapshot, looks_like_hub_id

DUMMY_PREFIX = "dummy:"
_QUANT_SUFFIX = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf", "dummy"]
    # The .gguf file, the HF directory, or the dummy's config.json.
    path: Path
    # The Hub id it was resolved from (its name), when it came from the HF cache.
    hub_id: str | None = None

    @property
    def directory(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent

    @property
    def name(self) -> str:
        """The model's name: 'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'."""
        if self.hub_id is not None:
            return self.hub_id
        if self.kind == "gguf":
            return _QUANT_SUFFIX.sub("", self.path.stem)
        if self.kind == "dummy":
            return f"dummy-{self.directory.name}"
        return self.path.name

    def tokenizer_source(self) -> str | None:
        """Where this model's tokenizer can be built from (``text.load_tokenizer``), or None."""
        if self.kind == "gguf":
            from poise.checkpoint.gguf_file import GGUFFile

            return (
                str(self.path) if "tokenizer.ggml.tokens" in GGUFFile(self.path).metadata else None
            )
        if any((self.directory / f).exists() for f in _TOKENIZER_FILES):
            return str(self.directory)
        return None


def resolve_model(model: str | Path | None) -> ModelSource:
    """The source a model string names; ``ValueError`` naming the string when none."""
    if model is None:
        return ModelSource("gguf", embedded_gguf_path())
    text = str(model)
    if text.startswith(DUMMY_PREFIX):
        path = Path(text[len(DUMMY_PREFIX) :]).expanduser()
        config = path / "config.json" if path.is_dir() else path
        if not config.is_file():
            raise ValueError(f"model: dummy config {config} does not exist")
        return ModelSource("dummy", config)
    if looks_like_hub_id(text):
        return _from_snapshot(text, cached_snapshot(text))
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    if path.name == "config.json" and path.is_file():
        path = path.parent
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path)
    raise ValueError(
        f"model: {text!r} is neither a HF directory with config.json, a .gguf file, "
        "nor 'dummy:<config.json>'"
    )


def _from_snapshot(hub_id: str, snapshot: Path) -> ModelSource:
    if (snapshot / "config.json").is_file():
        return ModelSource("hf", snapshot, hub_id)
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], hub_id)
    raise ValueError(
        f"model: the cached snapshot of {hub_id!r} ({snapshot}) has no config.json"
        + (f" and {len(ggufs)} .gguf files; give the file's path" if ggufs else "")
    )


def read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def hf_config(source: ModelSource) -> dict[str, Any]:
    """The config.json dict of a HF or dummy source (GGUF metadata has its own parser)."""
    if source.kind == "gguf":
        raise ValueError(f"model: {source.path} is a GGUF file; it has no config.json")
    return read_json(source.path if source.kind == "dummy" else source.path / "config.json")


def describe(source: ModelSource) -> ArchConfig:
    """The architecture of any source, from config.json or GGUF metadata."""
    if source.kind == "gguf":
        from poise.checkpoint.gguf_config import arch_from_gguf
        from poise.checkpoint.gguf_file import GGUFFile

        return arch_from_gguf(GGUFFile(source.path))
    return arch_from_hf_config(hf_config(source))
