"""Request workloads: prompt classes, class mixes, arrival processes; standard library only.

Shared by ``poise.bench`` (load against a live server) and ``poise.sim`` (virtual clock), so a
simulated run and a measured run can draw the very same request sample.

Invariants:
- Everything is deterministic given ``seed``: the same arguments give the same requests.
- The seed lab's prompts (``SHORT_PROMPT`` / ``LONG_PROMPT``) are byte-identical to the
  user's document (004): the salt that defeats prefix caching is applied at send time
  (``salted``), never baked into the prompt set.
- ``long_ratio`` mixes are exact and evenly spread: among the first n requests,
  ``floor(n * ratio)`` are long, so a closed loop sees the target mix from its first wave.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The seed lab's prompts, verbatim (004_eaf74e7163df3415.txt): LONG is a head and a log line
# repeated 220 times (~3.3k tokens with SmolLM2's template; a CPU lab repeats it fewer times).
SEED_LONG_HEAD = "请阅读以下模拟日志并总结调度瓶颈。"
SEED_LONG_LINE = " waiting=12 running=48 kv=82%; "
SEED_LONG_REPEAT = 220
SHORT_PROMPT = "用三句话解释 continuous batching。"
LONG_PROMPT = SEED_LONG_HEAD + SEED_LONG_LINE * SEED_LONG_REPEAT
DEFAULT_MAX_TOKENS = 160

# Filler for synthetic prompts of a requested length; about one token per word for most
# tokenizers. The true prompt length always comes from the server's usage.
_FILLER_WORDS = [
    "token",
    "budget",
    "decode",
    "prefill",
    "queue",
    "batch",
    "cache",
    "block",
    "step",
    "stream",
    "latency",
    "throughput",
    "request",
    "schedule",
    "memory",
    "chunk",
]


def filler_text(n: int, rng: random.Random) -> str:
    """``n`` filler words drawn with ``rng``: a synthetic prompt of about ``n`` tokens."""
    return " ".join(rng.choice(_FILLER_WORDS) for _ in range(n))


@dataclass(frozen=True)
class LengthDist:
    """A distribution of lengths (tokens): fixed, uniform, normal or lognormal; clipped to
    ``[low, high]`` and at least 1."""

    kind: str = "fixed"
    mean: float = 128.0
    std: float = 0.0
    low: int = 1
    high: int = 1 << 20

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal", "lognormal"):
            raise ValueError(f"LengthDist.kind: unknown {self.kind!r}")
        if self.mean < 1:
            raise ValueError("LengthDist.mean must be >= 1")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.mean
        elif self.kind == "uniform":
            # mean +- std (std is the half-width here, like vLLM's range ratio * mean).
            value = rng.uniform(self.mean - self.std, self.mean + self.std)
        elif self.kind == "normal":
            value = rng.gauss(self.mean, self.std)
        else:
            # Parameterised by the desired mean and std of the lengths themselves.
            var = math.log(1.0 + (self.std / self.mean) ** 2)
            value = rng.lognormvariate(math.log(self.mean) - var / 2.0, math.sqrt(var))
        return int(min(max(round(value), self.low, 1), self.high))

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``128`` | ``fixed:128`` | ``uniform:128:32`` | ``normal:128:20`` | ``lognormal:m:s``."""
        parts = str(text).split(":")
        if len(parts) == 1:
            return cls("fixed", float(parts[0]))
        kind, mean = parts[0], float(parts[1])
        std = float(parts[2]) if len(parts) > 2 else 0.0
        return cls(kind, mean, std)


@dataclass(frozen=True)
class RequestClass:
    """A named kind of request: a fixed prompt or a synthetic one of sampled length, an output
    length distribution, and a weight in mixes."""

    name: str
    prompt: str | None = None
    prompt_tokens: LengthDist | None = None
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", 160))
    weight: float = 1.0

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise ValueError(
                f"RequestClass {self.name!r}: give exactly one of prompt, prompt_tokens"
            )
        if self.weight < 0:
            raise ValueError(f"RequestClass {self.name!r}: weight must be >= 0")

    def make_prompt(self, rng: random.Random) -> str:
        if self.prompt is not None:
            return self.prompt
        assert self.prompt_tokens is not None
        return filler_text(self.prompt_tokens.sample(rng), rng)


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to send: which class, the (unsalted) prompt, the output cap, and when
    (seconds from the start of the cell; 0.0 for closed loop)."""

    index: int
    class_name: str
    prompt: str
    max_tokens: int
    arrival: float = 0.0


def long_prompt(repeat: int = SEED_LONG_REPEAT) -> str:
    """The seed's LONG prompt with its log line ``repeat`` times (220: ``LONG_PROMPT``)."""
    return SEED_LONG_HEAD + SEED_LONG_LINE * repeat


def seed_classes(
    max_tokens: int = DEFAULT_MAX_TOKENS, long_repeat: int = SEED_LONG_REPEAT
) -> tuple[RequestClass, RequestClass]:
    """The lab's two classes: (short, long), both capped at ``max_tokens``."""
    out = LengthDist("fixed", max_tokens)
    return (
        RequestClass("short", prompt=SHORT_PROMPT, output_tokens=out),
        RequestClass("long", prompt=long_prompt(long_repeat), output_tokens=out),
    )


def long_positions(n: int, long_ratio: float) -> list[bool]:
    """Which of n requests are long: exactly floor(n*r) of every prefix, evenly spread."""
    if not 0.0 <= long_ratio <= 1.0:
        raise ValueError("long_ratio must be in [0, 1]")
    return [math.floor((i + 1) * long_ratio) > math.floor(i * long_ratio) for i in range(n)]


def ratio_mix(
    n: int, long_ratio: float, short: RequestClass, long: RequestClass, seed: int = 0
) -> list[WorkloadRequest]:
    """n requests, a fraction ``long_ratio`` of them from ``long`` (exact, evenly spread)."""
    rng = random.Random(seed)
    out = []
    for i, is_long in enumerate(long_positions(n, long_ratio)):
        cls = long if is_long else short
        out.append(
            WorkloadRequest(i, cls.name, cls.make_prompt(rng), cls.output_tokens.sample(rng))
        )
    return out


def weighted_mix(n: int, classes: Sequence[RequestClass], seed: int = 0) -> list[WorkloadRequest]:
    """n requests whose classes are drawn by weight (smooth weighted round-robin, so every
    prefix is as close to the weights as integers allow; deterministic)."""
    total = sum(c.weight for c in classes)
    if not classes or total <= 0:
        raise ValueError("weighted_mix needs at least one class with positive weight")
    rng = random.Random(seed)
    credit = [0.0] * len(classes)
    out = []
    for i in range(n):
        credit = [c + cls.weight / total for c, cls in zip(credit, classes, strict=True)]
        k = max(range(len(classes)), key=lambda j: credit[j])
        credit[k] -= 1.0
        cls = classes[k]
        out.append(
            WorkloadRequest(i, cls.name, cls.make_prompt(rng), cls.output_tokens.sample(rng))
        )
    return out


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Open-loop arrival offsets (seconds) of n requests at ``rate`` per second.

    Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate; burstiness 1 is
    Poisson, < 1 burstier, large values approach a constant rate. ``rate=inf`` sends all at 0.
    Unlike vLLM we do not rescale the schedule to end at n/rate: that conditions on the total.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def with_arrivals(
    requests: Sequence[WorkloadRequest], rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[WorkloadRequest]:
    times = arrival_times(len(requests), rate, burstiness, seed)
    return [
        WorkloadRequest(r.index, r.class_name, r.prompt, r.max_tokens, t)
        for r, t in zip(requests, times, strict=True)
    ]


def load_jsonl(
    path: str | Path, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> list[RequestClass]:
    """Prompts from a JSONL file, one class per line.

    Each line: ``{"prompt": str}`` or ``{"messages": [{"role": "user", "content": str}, ...]}``
    (the last user message is used), optional ``"max_tokens"``, ``"class"`` (name; default
    ``"jsonl"``) and ``"weight"``. Lines of the same class name are kept as separate entries;
    ``cycle_jsonl`` walks them in file order.
    """
    out = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        prompt = obj.get("prompt")
        if prompt is None and "messages" in obj:
            users = [m["content"] for m in obj["messages"] if m.get("role") == "user"]
            prompt = users[-1] if users else None
        if not isinstance(prompt, str):
            raise ValueError(f"{path}:{lineno}: no 'prompt' or user message")
        out_len = LengthDist("fixed", int(obj.get("max_tokens", default_max_tokens)))
        out.append(
            RequestClass(
                str(obj.get("class", "jsonl")),
                prompt=prompt,
                output_tokens=out_len,
                weight=float(obj.get("weight", 1.0)),
            )
        )
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def cycle_jsonl(n: int, entries: Sequence[RequestClass], seed: int = 0) -> list[WorkloadRequest]:
    """n requests walking the file's entries in order (wrapping around)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cls = entries[i % len(entries)]
        out.append(
            WorkloadRequest(i, cls.name, cls.make_prompt(rng), cls.output_tokens.sample(rng))
        )
    return out


def salted(prompt: str, salt: str | None) -> str:
    """The prompt as sent: the salt goes first, so no cached prefix from an earlier run (or
    cell) matches. An empty or None salt leaves the prompt untouched."""
    return f"[{salt}] {prompt}" if salt else prompt


def iter_forever(requests: Sequence[WorkloadRequest]) -> Iterator[WorkloadRequest]:
    """Cycle through a request sample (duration-bounded closed loops), renumbering."""
    i = 0
    while True:
        for r in requests:
            yield WorkloadRequest(i, r.class_name, r.prompt, r.max_tokens, r.arrival)
            i += 1
