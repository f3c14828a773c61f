"""What a simulated cell is and what it gives back: requests in, per-request results, the
server's view per step and the cell's totals out. Plain data, no behaviour beyond derived
properties; ``simulator`` and ``driver`` fill them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from poise.core.outputs import StepStats


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated cell. Requests with the same ``prompt_key`` get the same
    synthetic token ids (so prefix caching sees identical prompts as identical); a request
    with ``token_ids`` (a measured workload replayed) keeps its real ids, so prompts that
    share only an opening part (a system prompt, the chat template's) share it here too."""

    index: int
    prompt_len: int
    max_tokens: int
    arrival: float = 0.0  # open loop: send time (s from the cell start); ignored closed loop
    class_name: str = "default"
    prompt_key: str = ""
    warmup: bool = False
    ignore_eos: bool = True
    # Scheduling inputs, as a bench client sends them (``--priority``, ``--send-class``).
    priority: int = 0
    traffic_class: str | None = None
    token_ids: tuple[int, ...] | None = None  # the prompt's real ids (len == prompt_len)

    def __post_init__(self) -> None:
        if self.token_ids is not None and len(self.token_ids) != self.prompt_len:
            raise ValueError(
                f"SimRequest {self.index}: {len(self.token_ids)} token_ids for prompt_len "
                f"{self.prompt_len}"
            )


@dataclass(frozen=True)
class SimCell:
    requests: Sequence[SimRequest]
    # Closed loop with this many streams when ``open_loop`` is False; a cap on in-flight
    # requests in open loop (None = no cap).
    concurrency: int | None = None
    open_loop: bool = False
    # Stop sending new requests after this much virtual time (in-flight ones finish).
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if not self.open_loop and not self.concurrency:
            raise ValueError("SimCell.concurrency: a closed loop needs concurrency >= 1")


@dataclass
class SimRequestResult:
    index: int
    request_id: str
    class_name: str
    warmup: bool
    sent: float  # when the client sent it
    intended: float  # when the schedule wanted it sent
    num_prompt_tokens: int
    max_tokens: int
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("length", "stop")

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None


# The server's view after one engine step (what Prometheus would show): the engine's own
# StepStats, as the simulated engine returned it (start_time, end_time, prefill / decode
# tokens, running, waiting, KV usage, preemptions, finished).
SimStep = StepStats


@dataclass
class SimResult:
    requests: list[SimRequestResult]
    timeline: list[SimStep]
    duration_s: float  # virtual time from the first send to the last finish
    wall_s: float
    num_steps: int
    busy_s: float  # virtual time spent in steps
    num_kv_blocks: int
    max_model_len: int
    cost_model: dict[str, Any] = field(default_factory=dict)
    arrival_model: dict[str, Any] = field(default_factory=dict)
    decisions: list[Any] = field(default_factory=list)

    @property
    def requests_per_wall_s(self) -> float:
        """Simulation speed: simulated requests per wall-clock second."""
        return len(self.requests) / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.timeline)
