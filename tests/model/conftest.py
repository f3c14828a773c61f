"""Session-scoped tiny checkpoints (see tests/model/tiny_models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model.tiny_models import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> directory, built lazily on first use of each kind."""
    return _LazyCheckpoints(tmp_path_factory)  # type: ignore[return-value]


class _LazyCheckpoints(dict):  # type: ignore[type-arg]
    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self._factory = factory

    def __missing__(self, kind: str) -> Path:
        path = build_tiny_checkpoint(kind, self._factory.mktemp(f"tiny_{kind}"))
        self[kind] = path
        return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["qwen2"]


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["qwen3"]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    # The machine's 2 cores are shared by several test runs: a second intra-op thread mostly
    # spins, and on tiny tensors makes torch several times slower.
    import torch

    torch.set_num_threads(1)
