"""``poise serve --replicas N`` on this machine: a local Ray instance, the application, and a
clean shutdown (Serve, then Ray) on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from poise.deploy.app import DeploySpec, build_app

logger = logging.getLogger(__name__)

# A small object store: replicas exchange only request bodies and response chunks.
OBJECT_STORE_BYTES = 200 * 1024 * 1024

# Ray Serve kills an HTTP proxy that is not ready 5 s after it starts (or misses 10 s health
# checks) and starts another: on a small or busy machine (2 cores shared with test suites) the
# proxy died that way inside serve.start. Generous defaults for the local instance; a value
# already in the environment wins. Ray's workers read them from the environment they inherit.
RAY_START_ATTEMPTS = 3

RAY_SERVE_PATIENCE = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def _init_ray(cpus: int) -> None:
    """``ray.init`` of a local instance. Ray gives its raylet a fixed 30 s to register with the
    GCS; on a busy small machine it missed that (``The current node timed out during
    startup``): the instance is shut down and started again, ``RAY_START_ATTEMPTS`` in all."""
    import ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(
                num_cpus=cpus,
                object_store_memory=OBJECT_STORE_BYTES,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            if "timed out during startup" not in str(exc) or attempt == RAY_START_ATTEMPTS:
                raise
            logger.warning("Ray's local node did not start in time (attempt %d): again", attempt)
            ray.shutdown()


def start_local(
    spec: DeploySpec,
    host: str,
    port: int,
    num_cpus: int | None = None,
    on_signal: Callable[[int, Any], None] | None = None,
) -> None:
    """Start Ray (if not yet) and Serve on host:port, and deploy ``spec``; returns when ready.
    ``on_signal`` handles SIGINT/SIGTERM from Ray's start on."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        for key, value in RAY_SERVE_PATIENCE.items():
            os.environ.setdefault(key, value)
        cpus = num_cpus if num_cpus is not None else max(1, int(spec.num_cpus * spec.replicas))
        _init_ray(cpus)
    if on_signal is not None:
        # ray.init puts its own SIGTERM handler in place (exit at once), under which a stopped
        # server died before Serve and Ray were shut down and left Ray's agents running.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(spec), name="poise", route_prefix="/")


def stop_local() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def serve_replicas(spec: DeploySpec, host: str, port: int) -> int:
    done = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        done.set()

    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        start_local(spec, host, port, on_signal=_stop)
        print(
            f"poise: {spec.replicas} replicas behind the {spec.router.policy} router on "
            f"http://{host}:{port}",
            flush=True,
        )
        done.wait()
    finally:
        stop_local()
        for s, h in old.items():
            signal.signal(s, h)
    return 0
