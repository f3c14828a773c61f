"""poise: an LLM serving engine built around the TTFT/throughput balance of continuous batching.

The offline API has vLLM's shape: ``from poise import LLM, SamplingParams``. ``LLM`` (and the
output classes) are imported on first use, so ``import poise`` stays light; torch loads when a
model does.

Importing poise sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it, when torch is not
loaded yet (OpenMP reads it once, at load). Why: with the default (active) policy an idle
OpenMP worker spins for its next task; on a machine whose cores are shared with other
processes the spinning thread steals the core the working one needs. Measured here (2 cores,
load ~6, 32-request decode step of SmolLM2): bfloat16 760-3800 ms active vs 181 ms passive
(1 thread: 167 ms); float32 566 ms vs 326 ms. On an idle machine passive costs a thread
wake-up per parallel region instead.
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import TYPE_CHECKING, Any

from poise.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # not LLM: type checkers would follow it into the torch model code
    from poise.engine.request_output import CompletionOutput, RequestOutput

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "poise.engine.llm",
    "RequestOutput": "poise.engine.request_output",
    "CompletionOutput": "poise.engine.request_output",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'poise' has no attribute {name!r}")
