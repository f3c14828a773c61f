"""Root test configuration.

OpenMP's default busy-wait makes small torch ops ~30x slower on a shared 2-core machine (see
poise/__init__.py); tests import torch (via transformers) before poise, so set it here first.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
