"""poise's router: which engine replica serves a request (pure Python, torch- and clock-free).

The same code routes for ``poise serve --replicas N`` (Ray Serve replicas) and for
``poise simulate --replicas N`` (copies of the real scheduler in virtual time).
"""

from poise.router.account import Decision, ReplicaState, RouteRequest
from poise.router.router import Router, RouterConfig
from poise.router.routing_policies import POLICIES

__all__ = ["POLICIES", "Decision", "ReplicaState", "RouteRequest", "Router", "RouterConfig"]
