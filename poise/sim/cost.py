"""Step-cost models: how long one engine step (one forward over a ``SchedulerOutput``) takes.

A cost model sees a ``StepShape`` (the few numbers of a batch that time depends on) and returns
seconds. It also sizes what the real runner would size: the KV pool in blocks and the longest
sequence, so the simulated scheduler runs under the same limits as the real one.

Models here:
- ``FixedCostModel``: a constant per step plus optional per-token terms (tests, parity).
- ``LinearCostModel``: ``t = sum(coef[f] * feature[f])`` over ``FEATURES``; what
  ``poise profile`` fits from measurements on this machine (see ``poise.sim.fit``).
- ``RooflineCostModel`` (``poise.sim.roofline``): named accelerators, any model shape.

Invariants: ``step_time`` is a pure function of the shape (deterministic, >= 0); cost models are
immutable after construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from poise.config import DEFAULT_KV_CACHE_MEMORY_BASE, EngineConfig
from poise.core.outputs import SchedulerOutput

# The runner's KV byte base on CPU when none is given (see CacheConfig.cpu_kv_budget_bytes).
DEFAULT_CPU_KV_BYTES = DEFAULT_KV_CACHE_MEMORY_BASE

# Linear step-time features, in the order of the fitted coefficients.
FEATURES: tuple[str, ...] = (
    "const",  # fixed per-step cost: Python, input building, kernel launches
    "tokens",  # every scheduled token goes through all dense layers
    "seqs",  # per scheduled request: block tables, metadata, per-sequence attention calls
    "sampled",  # LM head + sampler per sampled position
    "prefill_attn",  # (query, key) pairs of multi-token chunks: causal attention work
    "decode_ctx",  # KV tokens read by single-token (decode) steps: attention arithmetic
    # decode KV tokens counted once however many requests share their blocks (prefix caching):
    # the memory traffic. The CPU kernel reads a shared block once per step for all the rows
    # that share it (from cache), so a batch of identical long prompts costs less than
    # decode_ctx alone says.
    "decode_unique_ctx",
    # decode requests x the longest decode context: what a batched decode attention that pads
    # every request's KV to the longest one (poise's torch reference backend) really reads
    "decode_padded",
    # the part of decode_padded above a knee (fitted): past the caches, a bigger KV gather
    # costs more per token
    "decode_padded_excess",
    # multi-token chunks in the step (a new wave's prefix-cache hits, a long prompt's chunks):
    # each is its own request through the forward (its rows, block table, first sample). On a
    # profile whose bursts of hits did not sample, a fit without it ran ~20 % short on them;
    # with sampling bursts it fits to ~0. Kept: it costs nothing when it is not needed
    "prefill_chunks",
)


# A prefill chunk of at most this many tokens that starts after cached tokens (a prefix-cache
# hit, a recompute's tail) is priced query by query, each query reading the cached context like
# a decode. The CPU kernel attends it in the blocked prefill kernel (for one order of sums cold
# and cached), but with so few rows per walk of the context its work is decode-like, n x
# context, not a long prompt's blocked prefill: counting it in prefill_attn underestimated a
# 15-token hit on a 3.4k-token prefix 4x (when the kernel ran such tails as decode rows).
CACHED_CHUNK_ROWS_MAX = 64


@dataclass(frozen=True)
class StepShape:
    """What the time of one step depends on, computed from a ``SchedulerOutput``."""

    num_tokens: int = 0
    num_seqs: int = 0
    num_sampled: int = 0
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    # Sum over multi-token chunks of n*start + n*(n+1)/2: query/key pairs under a causal mask
    # (chunks attended like decodes, see CACHED_CHUNK_ROWS_MAX, count in decode_ctx_tokens).
    prefill_attn_pairs: int = 0
    # Sum over single-token requests of the context each one attends to (start + 1), plus the
    # query/key pairs of decode-like chunks.
    decode_ctx_tokens: int = 0
    # Sum over all requests of start + n: KV tokens resident for the batch after the step.
    kv_tokens: int = 0
    # The longest context among single-token requests.
    decode_max_ctx: int = 0
    # decode_ctx_tokens scaled by (distinct blocks / blocks) over the decode requests' block
    # tables: their context with blocks shared between requests counted once.
    decode_unique_ctx_tokens: int = 0

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> StepShape:
        tokens = seqs = sampled = pf_tokens = dec_seqs = pairs = dec_ctx = kv = dec_max = 0
        distinct: set[int] = set()
        num_blocks = 0
        for sr in out.scheduled:
            n = len(sr.token_ids)
            start = sr.start_position
            tokens += n
            seqs += 1
            kv += start + n
            if sr.sample:  # a verify row samples at its token and each draft
                sampled += 1 + sr.num_draft_tokens
            chunk_pairs = n * start + n * (n + 1) // 2
            if sr.is_decode:
                dec_seqs += 1
                dec_ctx += start + 1
                dec_max = max(dec_max, start + 1)
                distinct.update(sr.block_ids)
                num_blocks += len(sr.block_ids)
                continue
            pf_tokens += n
            if start > 0 and n <= CACHED_CHUNK_ROWS_MAX:
                # Attended query by query through the cache, like n decodes of one request
                # (see CACHED_CHUNK_ROWS_MAX): decode arithmetic, its blocks read once.
                dec_ctx += chunk_pairs
                distinct.update(sr.block_ids)
                num_blocks += n * len(sr.block_ids)
            else:
                pairs += chunk_pairs
        unique = round(dec_ctx * len(distinct) / num_blocks) if num_blocks else dec_ctx
        return cls(tokens, seqs, sampled, pf_tokens, dec_seqs, pairs, dec_ctx, kv, dec_max, unique)

    def features(self, knee: float | None = None) -> tuple[float, ...]:
        """Values in ``FEATURES`` order; ``decode_padded_excess`` is 0 without a knee."""
        padded = self.num_decode_seqs * self.decode_max_ctx
        return (
            1.0,
            float(self.num_tokens),
            float(self.num_seqs),
            float(self.num_sampled),
            float(self.prefill_attn_pairs),
            float(self.decode_ctx_tokens),
            float(self.decode_unique_ctx_tokens),
            float(padded),
            max(0.0, padded - knee) if knee is not None else 0.0,
            float(self.num_seqs - self.num_decode_seqs),
        )

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepShape:
        shape = cls(**{k: int(d.get(k, 0)) for k in cls.__dataclass_fields__})
        if "decode_unique_ctx_tokens" not in d:  # a profile from before this feature
            shape = dataclasses.replace(shape, decode_unique_ctx_tokens=shape.decode_ctx_tokens)
        return shape


@dataclass(frozen=True)
class CostModel:
    """Base: step time plus what the runner would size. Subclasses override ``step_time``.

    When each request reaches the engine is not the cost model's business but the client
    arrival model's (``poise.sim.arrival.ArrivalModel``).
    ``step_overhead_s`` is added to every step (engine-loop work around the forward that a
    runner-only profile does not see: scheduling, streaming, detokenization).
    ``time_scale`` multiplies every step's modelled time: a machine slower (busier) now than
    when it was profiled, calibrated from one measured load point (``poise.sim.calibrate``).
    ``step_jitter_cv`` is the spread of real step times around the model (coefficient of
    variation; the simulator draws a seeded lognormal factor per step, see SimExecutor). 0
    keeps the simulation deterministic step for step.
    """

    name: str = "cost-model"
    vocab_size: int = 32000
    model_max_len: int = 8192
    eos_token_ids: tuple[int, ...] = ()
    kv_bytes_per_token: int = 0
    # The same with --kv-cache-dtype int8 (values plus a bf16 scale per token and head:
    # poise/config_model.py); 0 where the model does not know it (an int8 config is refused).
    # Capacity only: step times stay those the model was built or profiled with.
    kv_int8_bytes_per_token: int = 0
    step_overhead_s: float = 0.0
    time_scale: float = 1.0
    step_jitter_cv: float = 0.0
    # Speculative decoding: the chance each draft token is kept once those before it were
    # (sim/speculation.py). What a verify step yields, so it travels with what it costs;
    # None: an engine with --speculative-config cannot be simulated.
    spec_acceptance_rate: float | None = None
    # The share of a decoding request's steps its proposer has a draft for (sim/speculation.py).
    spec_draft_rate: float = 1.0
    provenance: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # A negative overhead or spread would move steps back in time; a scale of 0 would
        # make every step free.
        for name in ("step_overhead_s", "step_jitter_cv"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost model: {name} must be >= 0, got {getattr(self, name)}")
        if self.time_scale <= 0:
            raise ValueError(f"cost model: time_scale must be > 0, got {self.time_scale}")
        a = self.spec_acceptance_rate
        if a is not None and not 0.0 <= a <= 1.0:
            raise ValueError(f"cost model: spec_acceptance_rate must be in [0, 1], got {a}")
        if not 0.0 <= self.spec_draft_rate <= 1.0:
            raise ValueError(
                f"cost model: spec_draft_rate must be in [0, 1], got {self.spec_draft_rate}"
            )

    def step_time(self, shape: StepShape) -> float:
        raise NotImplementedError

    def time_for(self, out: SchedulerOutput) -> float:
        t = self.step_time(StepShape.from_output(out))
        return self.time_scale * t + self.step_overhead_s

    def kv_budget_bytes(self, config: EngineConfig) -> int:
        """Bytes the KV pool may take (the runner's rule on CPU: an explicit budget, else the
        memory fraction of the byte base)."""
        return config.cache.cpu_kv_budget_bytes()

    def num_kv_blocks(self, config: EngineConfig) -> int:
        if config.cache.num_kv_blocks is not None:
            return config.cache.num_kv_blocks
        per_block = config.cache.block_size * self.kv_bytes_per_token_for(config)
        return max(0, self.kv_budget_bytes(config) // per_block)

    def kv_bytes_per_token_for(self, config: EngineConfig) -> int:
        """K+V bytes of one token in the pool ``config`` builds (its kv_cache_dtype)."""
        int8 = config.cache.kv_cache_dtype == "int8"
        per_token = self.kv_int8_bytes_per_token if int8 else self.kv_bytes_per_token
        if per_token <= 0:
            what = (
                "int8 KV bytes per token (kv_int8_bytes_per_token)"
                if int8
                else "KV bytes per token"
            )
            raise ValueError(f"num_kv_blocks: this cost model does not know the {what}; set it")
        return per_token

    def max_model_len(self, config: EngineConfig) -> int:
        """The configured limit clamped to the model's context (never raised above it)."""
        limit = config.model.max_model_len
        return self.model_max_len if limit is None else min(limit, self.model_max_len)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": type(self).__name__,
            "name": self.name,
            "step_overhead_s": self.step_overhead_s,
            "time_scale": self.time_scale,
            "step_jitter_cv": self.step_jitter_cv,
            "spec_acceptance_rate": self.spec_acceptance_rate,
            "spec_draft_rate": self.spec_draft_rate,
            "provenance": self.provenance,
        }


@dataclass(frozen=True)
class FixedCostModel(CostModel):
    """``step_s`` per step, plus ``per_token_s`` per scheduled token and ``per_seq_s`` per
    scheduled request. With both per-item terms 0 every step costs the same."""

    name: str = "fixed"
    step_s: float = 0.01
    per_token_s: float = 0.0
    per_seq_s: float = 0.0
    kv_bytes_per_token: int = 1024

    def step_time(self, shape: StepShape) -> float:
        return self.step_s + self.per_token_s * shape.num_tokens + self.per_seq_s * shape.num_seqs


@dataclass(frozen=True)
class LinearCostModel(CostModel):
    """``t = sum(coefficients[f] * feature[f])`` over ``FEATURES`` (missing ones count 0)."""

    name: str = "linear"
    coefficients: dict[str, float] = field(default_factory=dict)
    # Where ``decode_padded_excess`` starts (None: that feature is 0).
    decode_padded_knee: float | None = None
    # The profiled machine's KV byte budget when the config gives none (CPU runner: 1 GiB).
    default_kv_budget_bytes: int = DEFAULT_CPU_KV_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"coefficients: unknown features {sorted(unknown)}")
        # A tuple in FEATURES order makes step_time a dot product.
        object.__setattr__(
            self, "_coef", tuple(float(self.coefficients.get(f, 0.0)) for f in FEATURES)
        )

    def step_time(self, shape: StepShape) -> float:
        coef: tuple[float, ...] = self._coef  # type: ignore[attr-defined]
        feats = shape.features(self.decode_padded_knee)
        t = sum(c * x for c, x in zip(coef, feats, strict=True))
        return max(t, 0.0)

    def kv_budget_bytes(self, config: EngineConfig) -> int:
        # The profiled machine's default takes the place of the runner's default base.
        return config.cache.cpu_kv_budget_bytes(default_base=self.default_kv_budget_bytes)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["coefficients"] = dict(self.coefficients)
        d["decode_padded_knee"] = self.decode_padded_knee
        return d
