"""The attention backend contract (model/attention/base.py) and the runner's choice of backend."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from poise.config import ATTENTION_BACKENDS, EngineConfig
from poise.core.outputs import ScheduledRequest
from poise.core.sampling_params import SamplingParams
from poise.model.attention.cpu_kernel import load_cpu_kernel
from poise.runner.attention import BACKENDS, resolve_backend_name
from poise.runner.factory import create_model_runner
from poise.runner.inputs import build_step_inputs


def _usable(name: str) -> bool:
    return BACKENDS[name].available()


def test_config_names_every_registered_backend() -> None:
    # The config validates names without importing torch, so it keeps its own list.
    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_state_is_typed_built_once_and_reused_by_every_layer(name: str) -> None:
    if not _usable(name):
        pytest.skip(f"{name} cannot run here")
    block_size, kv_heads, heads, hd = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams()
    # A decode at position 9, a fresh prompt, and a chunk after 5 cached tokens.
    scheduled = [
        ScheduledRequest("d", [1], 9, [4, 5, 6], True, params, 0, 9),
        ScheduledRequest("p", [1] * 6, 0, [0, 1], True, params, 0, 6),
        ScheduledRequest("c", [1] * 3, 5, [7, 8], True, params, 0, 8),
    ]
    meta = build_step_inputs(scheduled, block_size, torch.device("cpu")).meta
    backend = BACKENDS[name].create()
    state = backend.prepare(meta)
    assert dataclasses.is_dataclass(state) and not isinstance(state, type)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.meta = meta  # type: ignore[misc]
    # Two "layers" with their own caches and inputs share the one state of the step.
    outs = []
    for _layer in range(2):
        cache = torch.randn(10, block_size, 2 * kv_heads, hd, generator=gen)
        q = torch.randn(meta.num_tokens, heads, hd, generator=gen)
        kv = torch.randn(meta.num_tokens, 2 * kv_heads, hd, generator=gen)
        fresh = backend.prepare(meta)
        want = backend.forward(q, kv, cache.clone(), fresh, hd**-0.5)
        got = backend.forward(q, kv, cache, state, hd**-0.5)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        outs.append(got)
    assert not torch.equal(outs[0], outs[1])  # the layers really differed


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_what_a_row_does_not_own_never_reaches_it(name: str) -> None:
    """Slots past a row's context (its last block's tail, the padding of shorter tables) hold
    what earlier owners wrote; NaN there (left by a request that failed with non-finite
    values) must not change the output (issue 38: the torch backend's masked decode made it
    NaN, 0 * NaN, and failed every later request on those blocks)."""
    if not _usable(name):
        pytest.skip(f"{name} cannot run here")
    if name == "flex":
        pytest.skip(
            "flex computes P V over whole blocks (0 * NaN is NaN); the runner scrubs a failed "
            "request's blocks instead (test_runner: test_failed_request_blocks_are_scrubbed)"
        )
    block_size, kv_heads, heads, hd = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams()
    # Decodes of different widths: rows of 2, 5 and 10 tokens (one of them padded).
    scheduled = [
        ScheduledRequest("a", [1], 9, [4, 5, 6], True, params, 0, 9),
        ScheduledRequest("b", [1], 4, [7, 8], True, params, 0, 4),
        ScheduledRequest("c", [1], 1, [2], True, params, 0, 1),
    ]
    meta = build_step_inputs(scheduled, block_size, torch.device("cpu")).meta
    backend = BACKENDS[name].create()
    cache = torch.randn(10, block_size, 2 * kv_heads, hd, generator=gen)
    stale = cache.clone()
    owned = {
        (4, 0),
        (4, 1),
        (4, 2),
        (4, 3),
        (5, 0),
        (5, 1),
        (5, 2),
        (5, 3),
        (6, 0),
        (6, 1),
        (7, 0),
        (7, 1),
        (7, 2),
        (7, 3),
        (8, 0),
        (2, 0),
        (2, 1),
    }
    for block in range(10):
        for slot in range(block_size):
            if (block, slot) not in owned:  # this step writes the last of each row itself
                stale[block, slot] = math.nan
    q = torch.randn(meta.num_tokens, heads, hd, generator=gen)
    kv = torch.randn(meta.num_tokens, 2 * kv_heads, hd, generator=gen)
    want = backend.forward(q, kv, cache, backend.prepare(meta), hd**-0.5)
    got = backend.forward(q, kv, stale, backend.prepare(meta), hd**-0.5)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want)


def test_backend_resolution_is_generic_over_the_registry() -> None:
    cpu = torch.device("cpu")
    # The reference runs anywhere; every registered name resolves to itself where it runs.
    assert resolve_backend_name("torch", torch.device("meta"), torch.float16) == "torch"
    for name, spec in BACKENDS.items():
        if spec.runs_on(cpu, torch.float32):
            assert resolve_backend_name(name, cpu, torch.float32) == name
    with pytest.raises(ValueError, match="'cpu' runs on a cpu device in float32 or bfloat16"):
        resolve_backend_name("cpu", torch.device("meta"), torch.float32)


@pytest.mark.parametrize("requested", ["torch", "auto"])
def test_runner_owns_the_backend_choice(tiny_checkpoints: dict[str, Path], requested: str) -> None:
    config = EngineConfig.from_kwargs(
        model=str(tiny_checkpoints["llama"]),
        attention_backend=requested,
        num_kv_blocks=16,
        block_size=4,
    )
    runner, info = create_model_runner(config)
    want = "torch" if requested == "torch" or load_cpu_kernel() is None else "cpu"
    assert info.attention_backend == runner.attention.name == want
    # The model holds no backend of its own: it is handed one per forward.
    assert not any(hasattr(m, "backend") for m in runner.model.modules())


def test_fp8_kv_cache_is_refused_off_cuda_with_its_reason(
    tiny_checkpoints: dict[str, Path],
) -> None:
    config = EngineConfig.from_kwargs(
        model=str(tiny_checkpoints["llama"]), kv_cache_dtype="fp8", num_kv_blocks=16
    )
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8' runs on a CUDA device only"):
        create_model_runner(config)
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineConfig.from_kwargs(kv_cache_dtype="int3")


def test_torch_backend_reads_an_fp8_cache_as_its_rounded_values() -> None:
    """What the CUDA fp8 path runs, on the CPU: K/V stored as fp8, widened when read."""
    block_size, kv_heads, heads, hd = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams()
    scheduled = [
        ScheduledRequest("d", [1], 9, [4, 5, 6], True, params, 0, 9),
        ScheduledRequest("c", [1] * 3, 5, [7, 8], True, params, 0, 8),
    ]
    meta = build_step_inputs(scheduled, block_size, torch.device("cpu")).meta
    wide = torch.randn(10, block_size, 2 * kv_heads, hd, generator=gen)
    q = torch.randn(meta.num_tokens, heads, hd, generator=gen)
    kv = torch.randn(meta.num_tokens, 2 * kv_heads, hd, generator=gen)
    backend = BACKENDS["torch"].create()
    fp8 = wide.to(torch.float8_e4m3fn)
    got = backend.forward(q, kv, fp8, backend.prepare(meta), hd**-0.5)
    # The same step over a float32 cache holding the fp8-rounded values.
    rounded = fp8.float()
    want = backend.forward(
        q, kv.to(torch.float8_e4m3fn).float(), rounded, backend.prepare(meta), hd**-0.5
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fp8.float(), rounded, atol=0, rtol=0)  # written in place
    assert not torch.equal(fp8.float(), wide.to(torch.float8_e4m3fn).float())
