"""Server lifecycle: ready detection, stop by PID (SIGTERM, then SIGKILL), early-exit errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from poise.lab.commands import args_to_flags, fill_template, poise_serve_command
from poise.lab.managed_server import ManagedServer, ServerSpec, ServerStartError
from tests.lab.conftest import MOCK_TEMPLATE, pid_gone


def spec(**kw: object) -> ServerSpec:
    base = dict(
        name="mock",
        command=MOCK_TEMPLATE,
        args={"max_num_batched_tokens": 512, "max_num_seqs": 4},
        startup_timeout_s=30,
    )
    base.update(kw)
    return ServerSpec(**base)  # type: ignore[arg-type]


def test_start_ready_stop(tmp_path: Path) -> None:
    with ManagedServer(spec(), tmp_path / "log") as srv:
        pid = srv.pid
        assert pid is not None and not pid_gone(pid)
        assert srv.base_url.endswith("/v1")
    assert pid_gone(pid)
    assert "--max-num-batched-tokens 512" in (tmp_path / "log").read_text()


def test_sigterm_ignored_means_sigkill(tmp_path: Path) -> None:
    s = spec(command=MOCK_TEMPLATE + " --ignore-sigterm", grace_s=0.5)
    srv = ManagedServer(s, tmp_path / "log")
    with srv:
        pid = srv.pid
    assert pid is not None and pid_gone(pid)
    assert srv.proc is not None and srv.proc.returncode == -9


def test_exception_inside_block_still_stops(tmp_path: Path) -> None:
    srv = ManagedServer(spec(), tmp_path / "log")
    with pytest.raises(RuntimeError, match="cell failed"), srv:
        raise RuntimeError("cell failed")
    assert srv.pid is not None and pid_gone(srv.pid)


def test_early_exit_is_reported_with_log(tmp_path: Path) -> None:
    bad = spec(command=f"{sys.executable} -c 'import sys; print(\"boom {{port}}\"); sys.exit(3)'")
    srv = ManagedServer(bad, tmp_path / "log")
    with pytest.raises(ServerStartError, match="(?s)exited with 3.*boom"), srv:
        pass
    assert srv.pid is not None and pid_gone(srv.pid)


def test_not_ready_times_out_and_stops(tmp_path: Path) -> None:
    never = spec(
        command=f"{sys.executable} -c 'import time; time.sleep(60)' {{port}}", startup_timeout_s=1.0
    )
    srv = ManagedServer(never, tmp_path / "log")
    with pytest.raises(ServerStartError, match="not ready"), srv:
        pass
    assert srv.pid is not None and pid_gone(srv.pid)


def test_command_lines() -> None:
    args = {
        "max_num_seqs": 16,
        "enable_chunked_prefill": False,
        "scheduling_policy": "prefill_first",
        "kv_cache_memory_bytes": None,
    }
    assert args_to_flags(args) == [
        "--max-num-seqs",
        "16",
        "--no-enable-chunked-prefill",
        "--scheduling-policy",
        "prefill-first",
    ]
    assert (
        poise_serve_command("m.gguf", {"max_num_seqs": 4}) == "poise serve m.gguf --max-num-seqs 4"
    )
    assert (
        fill_template("x --p {port} --b {max_num_seqs}", {"port": 1, "max_num_seqs": 2})
        == "x --p 1 --b 2"
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        fill_template("x {max_num_batched_tokens}", {"port": 1})


def test_missing_executable_is_a_start_error(tmp_path: Path) -> None:
    srv = ManagedServer(spec(command="no-such-engine-binary serve --port {port}"), tmp_path / "log")
    with pytest.raises(ServerStartError, match="cannot start 'no-such-engine-binary'"), srv:
        pass
    assert srv.pid is None
