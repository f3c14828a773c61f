"""Server lifecycle for sweeps and live probes: start, wait until ready, stop by PID.

A ``ServerSpec`` is either poise (``python -m poise serve MODEL --port P --flag value ...``) or
a command template for any other engine (``vllm serve M --port {port} ...``) plus its base
URL template. ``ManagedServer`` is a context manager:

- start: the server runs in its own session (process group = its PID), output to a log file;
- ready: GET each of ``ready_paths`` (``/ready``, ``/health``, ``/v1/models``) until one
  answers 200, failing fast with the log tail if the process exits, or after a timeout;
- stop: SIGTERM to the group, SIGKILL after ``grace_s``, then SIGKILL to any straggler left in
  the group. Always, on every exit path (``__exit__``), so a failing cell leaves no process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from poise.bench.bench_config import api_root, server_root
from poise.lab.commands import fill_template, poise_serve_argv

logger = logging.getLogger(__name__)

DEFAULT_READY_PATHS = ("/ready", "/health", "/v1/models")


class ServerStartError(RuntimeError):
    """The server exited or never became ready; the message carries the log tail."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    model: str | None = None
    args: dict[str, Any] = field(default_factory=dict)  # poise engine/server args
    command: str | None = None  # template for another engine: {port} and knob placeholders
    base_url: str = "http://127.0.0.1:{port}/v1"
    ready_paths: tuple[str, ...] = DEFAULT_READY_PATHS
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0
    grace_s: float = 10.0

    @property
    def engine(self) -> str:
        return "poise" if self.command is None else shlex.split(self.command)[0]

    def argv(self, port: int) -> list[str]:
        if self.command is None:
            args = {"shutdown_grace_period": 2.0, **self.args}
            return poise_serve_argv(self.model, args, port=port, python=sys.executable)
        values = {"port": port, "model": self.model or "", **self.args}
        return shlex.split(fill_template(self.command, values))

    def url(self, port: int) -> str:
        """The API root on ``port`` (the template with or without its /v1)."""
        return api_root(self.base_url.format(port=port))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """One server process for the life of a ``with`` block."""

    def __init__(self, spec: ServerSpec, log_path: Path, port: int | None = None) -> None:
        self.spec = spec
        self.port = port or free_port()
        self.base_url = spec.url(self.port)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ManagedServer:
        argv = self.spec.argv(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"$ {shlex.join(argv)}\n".encode())
        self._log.flush()
        env = {**os.environ, **self.spec.env}
        logger.info("starting %s on port %d: %s", self.spec.name, self.port, shlex.join(argv))
        try:
            self.proc = subprocess.Popen(
                argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        except OSError as exc:  # e.g. the engine's executable is not installed
            self._log.close()
            self._log = None
            raise ServerStartError(f"{self.spec.name}: cannot start {argv[0]!r}: {exc}") from exc
        return self

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float | None = None) -> ManagedServer:
        assert self.proc is not None, "start() first"
        timeout = self.spec.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        root = server_root(self.base_url)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.spec.name}: server exited with {self.proc.returncode} before it was "
                    f"ready; log {self.log_path}:\n{self.log_tail()}"
                )
            for path in self.spec.ready_paths:
                if _get_ok(root + path):
                    logger.info("%s ready at %s (%s)", self.spec.name, self.base_url, path)
                    return self
            time.sleep(0.25)
        raise ServerStartError(
            f"{self.spec.name}: not ready after {timeout:.0f} s ({', '.join(self.spec.ready_paths)}"
            f"); log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after the grace period; idempotent. Returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session: the group id is the server's PID
        if proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.spec.grace_s)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s ignored SIGTERM for %.0f s: SIGKILL", self.spec.name, self.spec.grace_s
                )
                _signal_group(pgid, signal.SIGKILL)
                proc.wait()
        # Children that outlived the leader (workers of another engine) go too.
        _signal_group(pgid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        logger.info("%s stopped (pid %d, exit %s)", self.spec.name, pgid, proc.returncode)
        return proc.returncode

    def __enter__(self) -> ManagedServer:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback only
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
