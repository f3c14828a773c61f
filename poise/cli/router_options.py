"""The replica and router flags, the same in `poise serve` and `poise simulate`."""

from __future__ import annotations

import argparse
from typing import Any

from poise.router.policies import POLICIES
from poise.router.router import RouterConfig

_DEFAULTS = RouterConfig()


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "replicas and router",
        "N engine replicas behind poise's router (docs/scale-out.md: which policy when).",
    )
    g.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="Engine replicas behind the router. (default: 1: no router)")  # fmt: skip
    g.add_argument(
        "--router", choices=sorted(POLICIES), default=_DEFAULTS.policy,
        help=f"How a request picks its replica. (default: {_DEFAULTS.policy})",
    )  # fmt: skip
    g.add_argument(
        "--router-pools", default=None, metavar="POOL,POOL,...",
        help="Class pool of each replica, comma-separated: 'long', 'interactive' or 'any' "
        "(e.g. long,interactive,interactive). A request goes to its class's pool, idle "
        "replicas of another pool take spill-over. (default: every replica serves all)",
    )  # fmt: skip
    g.add_argument(
        "--long-prompt-tokens", type=int, default=_DEFAULTS.long_prompt_tokens, metavar="N",
        help="With pools: a prompt this long is long traffic unless its request names a class. "
        f"(default: {_DEFAULTS.long_prompt_tokens})",
    )  # fmt: skip
    g.add_argument(
        "--router-prefix-blocks", type=int, default=_DEFAULTS.prefix_blocks, metavar="N",
        help="Opening KV blocks of a prompt the prefix table follows. "
        f"(default: {_DEFAULTS.prefix_blocks})",
    )  # fmt: skip
    g.add_argument(
        "--router-max-imbalance", type=int, default=_DEFAULTS.max_imbalance, metavar="N",
        help="prefix_affinity: in-flight requests the affine replica may lead the least loaded "
        f"one by before the request goes by load. (default: {_DEFAULTS.max_imbalance})",
    )  # fmt: skip


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
