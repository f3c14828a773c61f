"""One Prometheus view of many replicas: each replica's samples with a ``replica`` label, and
the router's own counters."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from poise.router import Router


def relabelled(texts: Mapping[str, str]) -> list[Metric]:
    """Replica name -> its /metrics text, merged into families whose samples carry ``replica``."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp)
    return list(families.values())


def router_metrics(router: Router) -> list[Metric]:
    decisions = CounterMetricFamily(
        "poise_router_decisions",
        "Requests routed, by the reason for the replica chosen.",
        labels=["policy", "reason"],
    )
    for reason, n in sorted(router.decisions.items()):
        decisions.add_metric([router.config.policy, reason], n)
    retries = CounterMetricFamily(
        "poise_router_retries",
        "Requests sent again after their replica failed before they started.",
    )
    retries.add_metric([], router.retries)
    hit = GaugeMetricFamily(
        "poise_router_prefix_affinity_hit_rate",
        "Share of routed prompts sent to a replica expected to hold their opening KV blocks.",
    )
    hit.add_metric([], router.affinity_hit_rate)
    healthy = GaugeMetricFamily(
        "poise_router_replica_healthy", "1 while in the rotation.", labels=["replica"]
    )
    inflight = GaugeMetricFamily(
        "poise_router_in_flight", "Requests the router has on a replica.", labels=["replica"]
    )
    for name, r in router.replicas.items():
        healthy.add_metric([name], 1.0 if r.healthy else 0.0)
        inflight.add_metric([name], r.load)
    return [decisions, retries, hit, healthy, inflight]


class _Static:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


def exposition(replica_texts: Mapping[str, str], router: Router) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static(relabelled(replica_texts) + router_metrics(router)))
    return generate_latest(registry)
