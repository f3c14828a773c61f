"""Traffic classes: what a request was promised, and which share of each step it may claim.

A class has latency targets (TTFT and TPOT, in ms; the spec names them after the percentile the
operator states them for, ``ttft_p95_ms`` / ``tpot_p50_ms``, and the scheduler uses them as
each request's own deadline), a ``share`` of the per-step prefill budget and of the sequence
slots (reserved while the class has work, lent to the others when it has none), and an optional
prompt-length rule that assigns requests to it.

Spec forms (``--traffic-classes``):
- ``none``: one class, no targets, no shares (plain FIFO as before);
- ``default``: ``DEFAULT_CHAT_CLASSES`` below, short vs long chat prompts;
- a YAML file (``*.yaml`` / ``*.yml``): a mapping ``name -> {key: value}``;
- inline: ``interactive:ttft_p95_ms=800,tpot_p50_ms=150,share=0.7;long:prompt_tokens>=1024,
  ttft_p95_ms=10000,share=0.3``.
Keys: ``ttft_p95_ms``, ``tpot_p50_ms``, ``share``, ``min_prompt_tokens``, ``max_prompt_tokens``
(rule ``prompt_tokens>=N`` / ``prompt_tokens<N`` inline). A request names its class explicitly
(request field / header), else the first class whose prompt rule matches, else the first class
without a rule.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poise.core.request import SloTargets
from poise.errors import InvalidRequestError

DEFAULT_CLASS = "default"
# Short chat turns want a quick first token; long documents want throughput. 1024 prompt
# tokens is where a CPU prefill takes long enough (seconds) to hold up the short ones.
DEFAULT_CHAT_CLASSES = (
    "interactive:ttft_p95_ms=1000,tpot_p50_ms=200,share=0.7;"
    "long:prompt_tokens>=1024,ttft_p95_ms=15000,tpot_p50_ms=400,share=0.3"
)
_KEYS = ("ttft_p95_ms", "tpot_p50_ms", "share", "min_prompt_tokens", "max_prompt_tokens")
_RULE = re.compile(r"^prompt_tokens\s*(>=|<)\s*(\d+)$")


@dataclass(frozen=True)
class TrafficClass:
    name: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    share: float = 0.0
    min_prompt_tokens: int = 0
    max_prompt_tokens: int | None = None  # exclusive

    @property
    def has_rule(self) -> bool:
        return self.min_prompt_tokens > 0 or self.max_prompt_tokens is not None

    def matches(self, num_prompt_tokens: int) -> bool:
        if num_prompt_tokens < self.min_prompt_tokens:
            return False
        return self.max_prompt_tokens is None or num_prompt_tokens < self.max_prompt_tokens


@dataclass(frozen=True)
class ClassSet:
    classes: tuple[TrafficClass, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names:
            raise ValueError("traffic_classes: at least one class is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"traffic_classes: duplicate class names in {names}")
        total = sum(c.share for c in self.classes)
        if total > 1.0 + 1e-9:
            raise ValueError(f"traffic_classes: shares add up to {total:g}, more than 1")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.classes]

    @property
    def has_shares(self) -> bool:
        return len(self.classes) > 1 and any(c.share > 0 for c in self.classes)

    def get(self, name: str) -> TrafficClass | None:
        return next((c for c in self.classes if c.name == name), None)

    def assign(self, num_prompt_tokens: int, requested: str | None = None) -> TrafficClass:
        """The class of a request: the one it names, else the first matching rule."""
        if requested is not None:
            found = self.get(requested)
            if found is None:
                raise InvalidRequestError(
                    f"unknown traffic class {requested!r}; configured: {', '.join(self.names)}",
                    "class",
                )
            return found
        for c in self.classes:
            if c.has_rule and c.matches(num_prompt_tokens):
                return c
        return next((c for c in self.classes if not c.has_rule), self.classes[0])

    def targets(
        self,
        num_prompt_tokens: int,
        requested: str | None = None,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
    ) -> SloTargets:
        """The request's class and targets (per-request values override the class's)."""
        c = self.assign(num_prompt_tokens, requested)
        ttft = ttft_ms if ttft_ms is not None else c.ttft_ms
        tpot = tpot_ms if tpot_ms is not None else c.tpot_ms
        return SloTargets(
            class_name=c.name,
            ttft_s=None if ttft is None else ttft / 1000.0,
            tpot_s=None if tpot is None else tpot / 1000.0,
        )

    def share(self, name: str) -> float:
        c = self.get(name)
        return c.share if c is not None else 0.0

    def tightest_tpot_s(self) -> float | None:
        values = [c.tpot_ms for c in self.classes if c.tpot_ms is not None]
        return min(values) / 1000.0 if values else None


NO_CLASSES = ClassSet((TrafficClass(DEFAULT_CLASS, share=1.0),))


def _number(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"traffic_classes: {key} must be a number, got {value!r}") from None


def make_class(name: str, fields: Mapping[str, Any]) -> TrafficClass:
    """One class from its key/value fields; unknown keys and bad values name themselves."""
    unknown = sorted(set(fields) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"traffic_classes: class {name!r}: unknown key(s) {unknown}; known: {list(_KEYS)}"
        )
    ttft = fields.get("ttft_p95_ms")
    tpot = fields.get("tpot_p50_ms")
    share = _number("share", fields.get("share", 0.0))
    min_tokens = int(_number("min_prompt_tokens", fields.get("min_prompt_tokens", 0)))
    max_tokens = fields.get("max_prompt_tokens")
    tc = TrafficClass(
        name=name,
        ttft_ms=None if ttft is None else _number("ttft_p95_ms", ttft),
        tpot_ms=None if tpot is None else _number("tpot_p50_ms", tpot),
        share=share,
        min_prompt_tokens=min_tokens,
        max_prompt_tokens=None
        if max_tokens is None
        else int(_number("max_prompt_tokens", max_tokens)),
    )
    if not 0.0 <= tc.share <= 1.0:
        raise ValueError(f"traffic_classes: class {name!r}: share must be in [0, 1], got {share}")
    for key, v in (("ttft_p95_ms", tc.ttft_ms), ("tpot_p50_ms", tc.tpot_ms)):
        if v is not None and v <= 0:
            raise ValueError(f"traffic_classes: class {name!r}: {key} must be > 0, got {v}")
    if not name or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"traffic_classes: bad class name {name!r} (letters, digits, _ . -)")
    return tc


def parse_inline(spec: str) -> ClassSet:
    classes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, body = part.partition(":")  # a bare name: a class without targets
        fields: dict[str, Any] = {}
        for item in filter(None, (i.strip() for i in body.split(","))):
            rule = _RULE.match(item.replace(" ", ""))
            if rule:
                op, n = rule.groups()
                fields["min_prompt_tokens" if op == ">=" else "max_prompt_tokens"] = int(n)
                continue
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"traffic_classes: {item!r} in class {name!r} is not key=value")
            fields[key.strip()] = value.strip()
        classes.append(make_class(name.strip(), fields))
    return ClassSet(tuple(classes))


def to_inline(classes: ClassSet) -> str:
    """The inline spec that ``parse_inline`` reads back as ``classes`` (for flags and records)."""

    def one(c: TrafficClass) -> str:
        fields = [
            f"{k}={v:g}"
            for k, v in (("ttft_p95_ms", c.ttft_ms), ("tpot_p50_ms", c.tpot_ms))
            if v is not None
        ]
        fields.append(f"share={c.share:g}")
        if c.min_prompt_tokens:
            fields.append(f"prompt_tokens>={c.min_prompt_tokens}")
        if c.max_prompt_tokens is not None:
            fields.append(f"prompt_tokens<{c.max_prompt_tokens}")
        return f"{c.name}:{','.join(fields)}"

    return ";".join(one(c) for c in classes.classes)


def from_mapping(data: Any) -> ClassSet:
    """A parsed YAML document: ``{name: {key: value}}`` (or ``{classes: {...}}``)."""
    if isinstance(data, Mapping) and set(data) == {"classes"}:
        data = data["classes"]
    if not isinstance(data, Mapping):
        raise ValueError("traffic_classes: the YAML file must map class names to their fields")
    items: Iterable[tuple[str, Any]] = data.items()
    return ClassSet(tuple(make_class(str(n), f or {}) for n, f in items))


@functools.lru_cache(maxsize=32)
def load_classes(spec: str | None) -> ClassSet:
    """The class set a ``traffic_classes`` value names (see the module docstring)."""
    if spec is None or spec.strip().lower() in ("", "none", "off"):
        return NO_CLASSES
    if spec.strip().lower() == "default":
        return parse_inline(DEFAULT_CHAT_CLASSES)
    if spec.endswith((".yaml", ".yml")):
        import yaml  # only a file spec needs it

        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"traffic_classes: no such file {spec!r}")
        return from_mapping(yaml.safe_load(path.read_text()))
    return parse_inline(spec)
