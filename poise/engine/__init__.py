"""The engine: EngineCore (validate, step, abort) around the scheduler; clocks; the offline API.

Torch-free: the model runner is reached only through ``builder.build_engine``, lazily.
"""

from __future__ import annotations

from poise.engine.clock import Clock, MonotonicClock, VirtualClock
from poise.engine.core import EngineCore
from poise.engine.executor import Executor

__all__ = ["Clock", "EngineCore", "Executor", "MonotonicClock", "VirtualClock"]
