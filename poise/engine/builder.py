"""Wires a real EngineCore: the torch model runner (imported lazily) plus the scheduler.

Kept separate from ``core.py`` so that importing the engine never imports torch; only calling
``build_engine`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from poise.config import EngineConfig
from poise.engine.clock import Clock
from poise.engine.core import EngineCore

if TYPE_CHECKING:
    from poise.runner.factory import ModelInfo


def build_engine(config: EngineConfig, clock: Clock | None = None) -> tuple[EngineCore, ModelInfo]:
    from poise.runner.factory import create_model_runner

    runner, info = create_model_runner(config)
    engine = EngineCore(
        config,
        runner,
        num_kv_blocks=info.num_kv_blocks,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        clock=clock,
    )
    return engine, info
