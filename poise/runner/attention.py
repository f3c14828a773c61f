"""The runner's choice of attention backend: the registry, ``auto``, and the device checks.

The model does not pick its attention: ``create_model_runner`` calls
``create_attention_backend(config.model.attention_backend, device, dtype)`` once and the
runner hands the instance to every forward. A new backend (see the contract in
poise/model/attention/base.py) is one entry in ``BACKENDS`` plus its name in
``config.ATTENTION_BACKENDS`` (a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from poise.model.attention import (
    AttentionBackend,
    CpuPagedAttentionBackend,
    TorchAttentionBackend,
)
from poise.model.attention.cpu import SUPPORTED_DTYPES as CPU_KERNEL_DTYPES
from poise.model.attention.cpu_kernel import load_cpu_kernel
from poise.model.attention.flex import FlexAttentionBackend


def _always() -> bool:
    return True


@dataclass(frozen=True)
class BackendSpec:
    create: Callable[[], AttentionBackend[Any]]
    # Device types (torch.device.type) and dtypes it runs on; None = any.
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    # Whether it can run on this machine at all (a kernel that must build); asked by ``auto``
    # only: an explicit choice that cannot run fails in ``create`` with its own reason.
    available: Callable[[], bool] = _always
    # Device types where ``auto`` may pick it (None = wherever it runs): flex runs on CPU
    # but is auto's choice on CUDA only (on CPU the C++ kernels are faster and compile-free).
    auto_devices: tuple[str, ...] | None = None

    def runs_on(self, device: torch.device, dtype: torch.dtype) -> bool:
        return (self.devices is None or device.type in self.devices) and (
            self.dtypes is None or dtype in self.dtypes
        )


# In ``auto``'s order of preference: the first that runs on the device and dtype and is
# available wins, so faster special-purpose backends come before the ``torch`` reference.
BACKENDS: dict[str, BackendSpec] = {
    "cpu": BackendSpec(
        CpuPagedAttentionBackend,
        devices=("cpu",),
        dtypes=CPU_KERNEL_DTYPES,
        available=lambda: load_cpu_kernel() is not None,
    ),
    "flex": BackendSpec(
        FlexAttentionBackend,
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        auto_devices=("cuda",),
    ),
    "torch": BackendSpec(TorchAttentionBackend),
}


def _names(items: tuple[Any, ...]) -> str:
    return " or ".join(str(i).removeprefix("torch.") for i in items)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> the preferred backend that works here; other names are checked and kept."""
    if name == "auto":
        for candidate, entry in BACKENDS.items():
            auto_here = entry.auto_devices is None or device.type in entry.auto_devices
            if auto_here and entry.runs_on(device, dtype) and entry.available():
                return candidate
        raise ValueError(f"attention_backend: none runs on {device.type} / {dtype}")
    spec = BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"attention_backend: unknown {name!r}; have {sorted(BACKENDS)}")
    if not spec.runs_on(device, dtype):
        where = f"a {_names(spec.devices)} device" if spec.devices else "any device"
        what = f" in {_names(spec.dtypes)}" if spec.dtypes else ""
        raise ValueError(
            f"attention_backend: {name!r} runs on {where}{what}, "
            f"not {device.type} / {str(dtype).removeprefix('torch.')}"
        )
    return name


def create_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype
) -> AttentionBackend[Any]:
    """The backend instance for a configured name (``auto`` resolved for device and dtype)."""
    return BACKENDS[resolve_backend_name(name, device, dtype)].create()
