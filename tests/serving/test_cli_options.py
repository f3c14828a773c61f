"""The engine flags generated from config metadata: spelling, grouping, defaults, seed configs."""

from __future__ import annotations

import argparse
import shlex

import pytest

from poise.cli.options import add_engine_args, engine_config_from_args, parse_bytes
from poise.config import EngineConfig


def _parser(positional: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="poise serve")
    add_engine_args(parser, positional_model=positional)
    return parser


def _config(argv: list[str], positional: bool = True) -> EngineConfig:
    return engine_config_from_args(_parser(positional).parse_args(argv))


def test_no_flags_gives_config_defaults() -> None:
    assert _config([]) == EngineConfig()


# The seed lab's three configs, with `vllm serve` replaced by `poise serve`.
SEED_CONFIGS = {
    "A": "--max-num-seqs 16 --max-num-batched-tokens 4096 --max-model-len 4096 "
    "--gpu-memory-utilization 0.85",
    "B": "--max-num-seqs 64 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.90",
    "C": "--max-model-len 8192 --max-num-seqs 64 --max-num-batched-tokens 8192 "
    "--enable-chunked-prefill",
}


@pytest.mark.parametrize("name", sorted(SEED_CONFIGS))
def test_seed_lab_configs_parse(name: str) -> None:
    cfg = _config(["some/model", *shlex.split(SEED_CONFIGS[name])])
    assert cfg.model.model == "some/model"
    if name == "A":
        assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (16, 4096)
        assert cfg.model.max_model_len == 4096
        assert cfg.cache.gpu_memory_utilization == 0.85
    elif name == "B":
        assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (64, 8192)
        assert cfg.cache.gpu_memory_utilization == 0.90
    else:
        assert cfg.model.max_model_len == 8192
        assert cfg.scheduler.enable_chunked_prefill is True


def test_every_knob_has_a_flag() -> None:
    cfg = _config(
        shlex.split(
            "--max-num-seqs 3 --max-num-batched-tokens 100 --max-model-len 64 "
            "--no-enable-chunked-prefill --long-prefill-token-threshold 7 "
            "--scheduling-policy prefill-first --block-size 32 --gpu-memory-utilization 0.5 "
            "--kv-cache-memory-bytes 64MiB --safety-margin 0.1 --max-num-queued-requests 5 "
            "--dtype bfloat16 --seed 9 --num-kv-blocks 11 --enable-prefix-caching "
            "--device cpu --tokenizer tok"
        )
    )
    s, c, m = cfg.scheduler, cfg.cache, cfg.model
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.long_prefill_token_threshold) == (3, 100, 7)
    assert s.enable_chunked_prefill is False
    assert s.scheduling_policy == "prefill_first"
    assert (s.safety_margin, s.max_num_queued_requests) == (0.1, 5)
    assert (c.block_size, c.gpu_memory_utilization, c.num_kv_blocks) == (32, 0.5, 11)
    assert c.kv_cache_memory_bytes == 64 * 2**20
    assert c.enable_prefix_caching is True
    assert (m.dtype, m.seed, m.max_model_len, m.tokenizer) == ("bfloat16", 9, 64, "tok")


def test_aliases_and_model_flag() -> None:
    cfg = _config(["--model", "m", "--max-num-queued-reqs", "4", "--watermark", "0.2"])
    assert cfg.model.model == "m"
    assert cfg.scheduler.max_num_queued_requests == 4
    assert cfg.scheduler.safety_margin == 0.2
    assert _config(["--model", "x"], positional=False).model.model == "x"
    policy = _config(["--scheduler-type", "prefill-first"]).scheduler.scheduling_policy
    assert policy == "prefill_first"


def test_bad_values() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        _config(["--max-num-seqs", "0"])


def test_help_groups_and_trade_offs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for title in ("model:", "cache:", "scheduler:"):
        assert title in text
    assert "TTFT" in text and "(default: 2048)" in text
    assert "{fifo,prefill-first,priority,slo,lpm,static,dynamic}" in text


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1.5g", int(1.5 * 2**30))],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_poise_serve_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    from poise.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "m", "--port", "9000", "--served-model-name", "a", "b", "--max-num-seqs", "16"]
    )
    assert (args.model, args.host, args.port) == ("m", "127.0.0.1", 9000)
    assert args.served_model_name == ["a", "b"]
    assert engine_config_from_args(args).scheduler.max_num_seqs == 16
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    assert "server:" in text and "--shutdown-grace-period" in text and "scheduler:" in text
