"""The torch executor: flat inputs from a SchedulerOutput, model forward, sampling, KV pool.

Importing this package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it, when torch
is not loaded yet (OpenMP reads it once, at load). Why: with the default (active) policy an
idle OpenMP worker spins for its next task; on a machine whose cores are shared with other
processes the spinning thread steals the core the working one needs. Measured here (2 cores,
load ~6, 32-request decode step of SmolLM2): bfloat16 760-3800 ms active vs 181 ms passive
(1 thread: 167 ms); float32 566 ms vs 326 ms. On an idle machine passive costs a thread
wake-up per parallel region instead. The CLI imports this package before torch, so the
default applies to ``poise serve`` and ``poise generate``.
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
