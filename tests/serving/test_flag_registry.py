"""The flag registry (poise/cli/serve_flags.py): every `poise serve` option is one record, and
the CLI, ServerSettings, /server_info's server_args and docs/flags.md follow from it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from poise.bench.server_info import from_poise
from poise.cli import flags as flags_module
from poise.cli.flags import (
    GROUP_TITLES,
    Flag,
    add_flags,
    markdown_table,
    refused_with_replicas,
    server_args,
    settings_kwargs,
)
from poise.cli.serve_flags import ADDING_A_FLAG, add_serve_flags, flags_page, serve_flags
from poise.config import EngineConfig
from poise.serving.info import describe
from poise.serving.settings import ServerSettings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser


def test_docs_page_is_generated_from_the_registry() -> None:
    assert DOCS.read_text() == flags_page(), (
        "docs/flags.md is stale: python -m poise.cli.serve_flags > docs/flags.md"
    )


def test_the_docs_example_flag_is_one_working_declaration() -> None:
    # The "Adding a flag" note's code, evaluated: argparse, the settings keyword, server_args
    # and the docs row all come from that one record.
    start = ADDING_A_FLAG.index("```python") + 1
    code = "\n".join(ADDING_A_FLAG[start : ADDING_A_FLAG.index("```", start)])
    flag = eval(code.rstrip().rstrip(","), vars(flags_module))  # our own docs text
    assert isinstance(flag, Flag) and flag.dest == "max_log_len"
    parser = argparse.ArgumentParser()
    add_flags(parser, [*serve_flags(), flag])
    args = parser.parse_args(["--max-log-len", "40"])
    assert settings_kwargs([flag], args) == {"max_log_len": 40}
    assert server_args([*serve_flags(), flag], args)["max_log_len"] == 40
    assert "`--max-log-len`" in markdown_table([flag]) and "`--max-log-len`" not in flags_page()


def test_every_option_is_a_registry_record_in_its_group_order() -> None:
    parser = _parser()
    dests = {f.dest for f in serve_flags()}
    for action in parser._actions:
        if action.dest not in ("help", "model_flag"):
            assert action.dest in dests, f"{action.option_strings}: not in the registry"
    titles = [g.title for g in parser._action_groups if g._group_actions]
    expected = [t for t in GROUP_TITLES if t in titles]
    assert titles[-len(expected) :] == expected
    assert len({f.spelling for f in serve_flags()}) == len(serve_flags())


def test_registry_defaults_are_the_settings_defaults() -> None:
    args = _parser().parse_args([])
    built = ServerSettings(**settings_kwargs(serve_flags(), args))
    assert dataclasses.replace(built, api_key=None) == ServerSettings()


def test_given_flags_reach_the_settings() -> None:
    args = _parser().parse_args(
        ["--port", "8123", "--served-model-name", "a", "b", "--timeout-keep-alive", "7"]
    )
    built = ServerSettings(**settings_kwargs(serve_flags(), args))
    assert (built.port, built.served_model_names, built.keep_alive_timeout_s) == (
        8123,
        ["a", "b"],
        7,
    )


def test_server_info_reports_every_option_and_hides_the_key() -> None:
    args = _parser().parse_args(["--api-key", "sekret", "--max-num-seqs", "8"])
    reported = server_args(serve_flags(), args)
    assert reported["api_key"] == "set" and reported["port"] == 8000
    assert set(reported) == {f.dest for f in serve_flags()}
    config = EngineConfig.from_kwargs(max_num_seqs=8)
    info = describe(config, model="m", version="v", max_model_len=64, server_args=reported)
    assert "sekret" not in str(info)
    record = from_poise(info)
    assert record is not None
    assert record.server_args["port"] == 8000 and record.server_args["max_num_seqs"] == 8


def test_replicas_refuse_options_they_ignore(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POISE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert refused_with_replicas(serve_flags(), _parser().parse_args([])) == []
    monkeypatch.setenv("POISE_API_KEY", "k")  # from the environment counts too
    args = _parser().parse_args(["--max-n", "4"])
    assert refused_with_replicas(serve_flags(), args) == ["--api-key", "--max-n"]
