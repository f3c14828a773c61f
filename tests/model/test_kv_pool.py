"""KV pool sizing on CPU: the memory fraction means a fraction of a stated byte base, so the
seed lab's configs A (0.85) and B (0.90) build different pools; the simulator sizes the same
pool; contradictory knobs are refused with a message naming them."""

from __future__ import annotations

import argparse
import shlex

import pytest
import torch

from poise.checkpoint import describe, resolve_model
from poise.cli.options import add_engine_args, engine_config_from_args
from poise.config import DEFAULT_KV_CACHE_MEMORY_BASE, EngineConfig
from poise.runner.kv_pool import bytes_per_block, num_kv_blocks
from poise.sim.cost import FixedCostModel

CPU = torch.device("cpu")
ARCH = describe(resolve_model(None))  # the embedded SmolLM2: 30 layers, 3 KV heads of 64
SEED_A = "--max-num-seqs 16 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.85"
SEED_B = "--max-num-seqs 64 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.90"


def _config(flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, positional_model=True)
    return engine_config_from_args(parser.parse_args(shlex.split(flags)))


def _blocks(config: EngineConfig) -> int:
    return num_kv_blocks(config.cache, config.scheduler, ARCH, torch.float32, CPU)


def test_seed_configs_a_and_b_build_different_pools_on_cpu() -> None:
    per_block = bytes_per_block(ARCH, 16, torch.float32)
    a, b = _blocks(_config(SEED_A)), _blocks(_config(SEED_B))
    assert a == int(0.85 * DEFAULT_KV_CACHE_MEMORY_BASE) // per_block
    assert b == int(0.90 * DEFAULT_KV_CACHE_MEMORY_BASE) // per_block
    assert a < b
    # No fraction: the whole base, as before the fraction meant anything on CPU.
    assert _blocks(_config("")) == DEFAULT_KV_CACHE_MEMORY_BASE // per_block


def test_fraction_of_a_stated_base() -> None:
    per_block = bytes_per_block(ARCH, 16, torch.float32)
    half = _config("--gpu-memory-utilization 0.5 --kv-cache-memory-base 64MiB")
    assert _blocks(half) == (32 << 20) // per_block
    # An explicit byte budget is the pool itself.
    assert _blocks(_config("--kv-cache-memory-bytes 16MiB")) == (16 << 20) // per_block


def test_simulator_sizes_the_same_cpu_pool() -> None:
    per_token = bytes_per_block(ARCH, 1, torch.float32)
    model = FixedCostModel(kv_bytes_per_token=per_token)
    for flags in (SEED_A, SEED_B, "", "--gpu-memory-utilization 0.3 --kv-cache-memory-base 1GiB"):
        config = _config(flags)
        assert model.num_kv_blocks(config) == _blocks(config), flags


def test_contradictions_are_refused_clearly() -> None:
    both = _config("--gpu-memory-utilization 0.85 --kv-cache-memory-bytes 64MiB")
    with pytest.raises(ValueError, match="gpu_memory_utilization: on CPU .* give one of them"):
        _blocks(both)
    with pytest.raises(ValueError, match="kv_cache_memory_base: give kv_cache_memory_bytes"):
        _config("--kv-cache-memory-base 1GiB --kv-cache-memory-bytes 64MiB")
    # On a GPU the fraction is of device memory: a CPU byte base there would be ignored.
    gpu_base = _config("--kv-cache-memory-base 1GiB").cache
    with pytest.raises(ValueError, match="kv_cache_memory_base: is for a CPU pool"):
        gpu_base.gpu_memory_fraction()
    assert _config("").cache.gpu_memory_fraction() == 0.9


def test_help_says_what_the_fraction_means_on_cpu() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = " ".join(parser.format_help().split())
    assert "On CPU: the KV pool gets this fraction of kv_cache_memory_base" in text
    assert "--kv-cache-memory-base BYTES" in text
