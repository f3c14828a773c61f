"""The replica and router flags, the same in `poise serve` and `poise simulate`."""

from __future__ import annotations

import argparse
from typing import Any

from poise.cli.flags import Flag, add_flags
from poise.router.router import RouterConfig
from poise.router.routing_policies import POLICIES

_ROUTER = RouterConfig()

# The replica and router options, the same in `poise serve` and `poise simulate`.
SCALE_OUT_FLAGS: tuple[Flag, ...] = (
    Flag(
        "replicas",
        "scale-out",
        "Engine replicas behind the router.",
        1,
        type=int,
        metavar="N",
        default_text="1: no router",
    ),
    Flag(
        "router",
        "scale-out",
        "How a request picks its replica.",
        _ROUTER.policy,
        choices=sorted(POLICIES),
    ),
    Flag(
        "router_pools",
        "scale-out",
        "Class pool of each replica, comma-separated: 'long', 'interactive' or 'any' (e.g. "
        "long,interactive,interactive). A request goes to its class's pool, idle replicas of "
        "another pool take spill-over.",
        metavar="POOL,POOL,...",
        default_text="every replica serves all",
    ),
    Flag(
        "long_prompt_tokens",
        "scale-out",
        "With pools: a prompt this long is long traffic unless its request names a class.",
        _ROUTER.long_prompt_tokens,
        type=int,
        metavar="N",
    ),
    Flag(
        "router_prefix_blocks",
        "scale-out",
        "Opening KV blocks of a prompt the prefix table follows.",
        _ROUTER.prefix_blocks,
        type=int,
        metavar="N",
    ),
    Flag(
        "router_max_imbalance",
        "scale-out",
        "prefix_affinity: in-flight requests the affine replica may lead the least loaded one "
        "by before the request goes by load.",
        _ROUTER.max_imbalance,
        type=int,
        metavar="N",
    ),
)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SCALE_OUT_FLAGS)


def router_from_args(args: argparse.Namespace, block_size: int) -> dict[str, Any]:
    """{replicas, router_config, pools} from the flags; ValueError names the bad one."""
    if args.replicas < 1:
        raise ValueError(f"--replicas: must be >= 1, got {args.replicas}")
    pools = None
    if args.router_pools:
        names = [p.strip() for p in args.router_pools.split(",")]
        if len(names) != args.replicas:
            raise ValueError(
                f"--router-pools: one pool per replica ({args.replicas}), got {len(names)}"
            )
        bad = [p for p in names if p not in ("long", "interactive", "any")]
        if bad:
            raise ValueError(f"--router-pools: 'long', 'interactive' or 'any', got {bad[0]!r}")
        pools = [None if p == "any" else p for p in names]
    config = RouterConfig(
        policy=args.router,
        block_size=block_size,
        prefix_blocks=args.router_prefix_blocks,
        max_imbalance=args.router_max_imbalance,
        long_prompt_tokens=args.long_prompt_tokens,
    )
    return {"replicas": args.replicas, "router_config": config, "pools": pools}
