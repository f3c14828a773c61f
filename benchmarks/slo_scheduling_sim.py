"""The simulated side of benchmarks/slo_scheduling.py (``--simulate``): the same cells through
``poise.sim`` (the engine's scheduler in virtual time) with a roofline or a profile of this
machine; and the per-request record both sides produce (``Done``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Done:
    index: int  # the request's position in the sample (the first ``warmup`` are not counted)
    cls: str
    ttft: float | None
    tpot: float | None
    output_tokens: int
    rejected: bool = False


def sim_cell(
    engine_config: Any,
    cost: Any,
    reqs: list[Any],
    max_tokens: int,
    *,
    concurrency: int | None,
    arrivals: list[float] | None,
    use_priority: bool = False,
) -> tuple[list[Done], float]:
    from poise.sim.simulator import SimCell, SimRequest, simulate_cell

    sims = [
        SimRequest(
            i,
            len(ids),
            max_tokens,
            arrival=arrivals[i] if arrivals else 0.0,
            class_name=cls,
            prompt_key=f"p{i}",
            priority=prio if use_priority else 0,
        )
        for i, (cls, ids, prio) in enumerate(reqs)
    ]
    cell = SimCell(sims, concurrency=concurrency, open_loop=arrivals is not None)
    res = simulate_cell(engine_config, cost, cell)
    done = []
    for r in res.requests:
        n = len(r.token_times)
        tpot = (r.token_times[-1] - r.token_times[0]) / (n - 1) if n > 1 else None
        done.append(Done(r.index, r.class_name, r.ttft, tpot, n, rejected=not r.ok))
    return done, res.duration_s


def cost_model(spec: str, dtype: str) -> Any:
    kind, _, rest = spec.partition(":")
    if kind == "profile":
        from poise.sim.fit import load_profile

        return load_profile(rest)
    from poise.sim.roofline import RooflineCostModel

    return RooflineCostModel.build(rest, kind, dtype=dtype)
