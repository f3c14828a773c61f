"""The Ray Serve application: N ``EngineReplica`` deployments and the ``Ingress`` in front.

Each replica is its own deployment (``engine-0`` ... ``engine-N-1``, one Ray Serve replica
each) so that poise's router, not Ray Serve's, decides where a request goes; Ray Serve starts
them, gives each its CPU share or GPU, health-checks them and restarts one that dies.

On a Ray cluster, without ``poise serve``::

    serve run poise.deploy.app:app_builder replicas=4 model=/models/qwen router=balanced \
        num_gpus=1

(any other key=value is an engine flag, spelled as in ``EngineConfig.from_kwargs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from poise.config import EngineConfig
from poise.deploy.ingress import Ingress
from poise.deploy.replica import EngineReplica
from poise.router import ReplicaState, Router, RouterConfig


@dataclass(frozen=True)
class DeploySpec:
    config: EngineConfig
    replicas: int
    router: RouterConfig
    pools: Sequence[str | None] | None = None
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica
    served_model_names: Sequence[str] = ()


def replica_names(n: int) -> list[str]:
    return [f"engine-{i}" for i in range(n)]


class _IngressDeployment(Ingress):
    """The ingress as Ray Serve builds it: from bound handles and plain settings."""

    def __init__(self, handles: dict[str, Any], spec: DeploySpec) -> None:
        states = [
            ReplicaState(
                name,
                pool=spec.pools[i] if spec.pools else None,
                budget=spec.config.scheduler.max_num_batched_tokens,
                max_num_seqs=spec.config.scheduler.max_num_seqs,
            )
            for i, name in enumerate(replica_names(spec.replicas))
        ]
        model = spec.config.model
        super().__init__(handles, Router(states, spec.router), model.tokenizer or model.model)


def build_app(spec: DeploySpec) -> Any:
    """The Ray Serve application (``serve.run`` it)."""
    from ray import serve

    names = replica_names(spec.replicas)
    served = list(spec.served_model_names)
    handles = {}
    for name in names:
        dep = serve.deployment(
            name=name,
            num_replicas=1,
            ray_actor_options={"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus},
            health_check_period_s=2,
            health_check_timeout_s=30,
            max_ongoing_requests=1000,
        )(EngineReplica)
        handles[name] = dep.bind(spec.config, name, served)
    ingress = serve.deployment(
        name="router",
        num_replicas=1,
        max_ongoing_requests=10000,
        ray_actor_options={"num_cpus": 0},
    )(_IngressDeployment)
    return ingress.bind(handles, spec)


_SPEC_KEYS = ("replicas", "router", "pools", "num_cpus", "num_gpus", "long_prompt_tokens")


def app_builder(args: dict[str, str]) -> Any:
    """``serve run poise.deploy.app:app_builder key=value ...`` (see the module docstring)."""
    engine: dict[str, Any] = {k: v for k, v in args.items() if k not in _SPEC_KEYS}
    for key, value in list(engine.items()):
        engine[key] = int(value) if value.isdigit() else value
    config = EngineConfig.from_kwargs(**engine)
    pools = (
        [None if p == "any" else p for p in args["pools"].split(",")] if "pools" in args else None
    )
    router = RouterConfig(
        policy=args.get("router", "balanced"),
        block_size=config.cache.block_size,
        long_prompt_tokens=int(args.get("long_prompt_tokens", 1024)),
    )
    spec = DeploySpec(
        config,
        int(args.get("replicas", 1)),
        router,
        pools,
        float(args.get("num_cpus", 1)),
        float(args.get("num_gpus", 0)),
    )
    return build_app(spec)
