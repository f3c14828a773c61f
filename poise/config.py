"""Engine configuration: one frozen dataclass per concern.

Invariants:
- Config objects are never mutated after construction. Values derived later (the number of KV
  blocks, a max_model_len clamped to the checkpoint) are computed by their owner and passed on
  explicitly, never written back here.
- Validation raises ``ValueError`` naming the offending field, so the CLI and the server can
  show it verbatim.
- Each field's ``metadata["help"]`` is the CLI help text; the CLI is generated from it.
- The seed documents and other engines use other names for the same knobs; ``ALIASES`` maps
  them onto ours (vLLM's vocabulary), so ``max_batch_tokens=4096`` works like
  ``max_num_batched_tokens=4096``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

# Re-exported: ModelConfig and its choices live in config_model.py (this file's size).
from poise.config_model import ATTENTION_BACKENDS as ATTENTION_BACKENDS
from poise.config_model import DTYPES as DTYPES
from poise.config_model import INT8_SCALE_BYTES as INT8_SCALE_BYTES
from poise.config_model import QUANTIZATIONS as QUANTIZATIONS
from poise.config_model import ModelConfig as ModelConfig
from poise.config_model import _help as _help
from poise.config_model import _require as _require
from poise.config_model import kv_bytes_per_token as kv_bytes_per_token
from poise.config_spec import SpeculativeConfig as SpeculativeConfig

SchedulingPolicy = Literal["fifo", "prefill_first", "priority", "slo", "lpm", "static", "dynamic"]
SCHEDULING_POLICIES: tuple[str, ...] = (
    "fifo",
    "prefill_first",
    "priority",
    "slo",
    "lpm",
    "static",
    "dynamic",
)
ADMISSION_CONTROLS: tuple[str, ...] = ("none", "predictive")
# vLLM's default share of device memory.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# The byte base of a CPU KV pool (a CPU has no device memory to take a fraction of).
DEFAULT_KV_CACHE_MEMORY_BASE = 1 << 30

# Other engines' / the seed's names -> ours.
ALIASES: dict[str, str] = {
    "max_requests_per_batch": "max_num_seqs",
    "max_running_requests": "max_num_seqs",
    "max_batch_tokens": "max_num_batched_tokens",
    "max_num_scheduled_tokens": "max_num_batched_tokens",
    "max_memory_percent": "gpu_memory_utilization",
    "mem_fraction_static": "gpu_memory_utilization",
    "num_blocks": "num_kv_blocks",
    "page_size": "block_size",
    "watermark": "safety_margin",
    "max_num_queued_reqs": "max_num_queued_requests",
    "max_queued_requests": "max_num_queued_requests",
    "schedule_policy": "scheduling_policy",
    "scheduler_type": "scheduling_policy",
    "torch_threads": "num_threads",
}


# --kv-cache-dtype values (vLLM's names); "fp8" is fp8_e4m3, as in vLLM. "int8" (CPU): int8
# values with a scale per (token, head), model/attention/kv_int8.py.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _help(
        "Tokens per KV block. Smaller blocks waste less memory per request; larger ones mean "
        "fewer, bigger gathers.",
        default=16,
    )
    num_kv_blocks: int | None = _help(
        "KV pool size in blocks. Overrides the memory budget when set.", default=None
    )
    gpu_memory_utilization: float | None = _help(
        "Fraction of memory the engine may use (alias: max_memory_percent). On a GPU: of device "
        "memory, for weights + activations + KV cache (default 0.9). On CPU: the KV pool gets "
        "this fraction of kv_cache_memory_base (default: all of it), so 0.85 and 0.90 build "
        "different pools there too.",
        default=None,
    )
    kv_cache_memory_base: int | None = _help(
        "CPU only: the bytes gpu_memory_utilization takes its fraction of (a CPU has no device "
        "memory to measure). Default: 1 GiB. Refused on a GPU, where the fraction is of device "
        "memory.",
        default=None,
    )
    kv_cache_memory_bytes: int | None = _help(
        "KV pool budget in bytes. On CPU it is the pool (instead of a fraction of "
        "kv_cache_memory_base); on a GPU it caps what gpu_memory_utilization leaves.",
        default=None,
    )
    enable_prefix_caching: bool = _help(
        "Reuse KV blocks of identical prompt prefixes across requests (as vLLM V1 and SGLang "
        "do by default): shared system prompts and repeated documents skip their prefill.",
        default=True,
    )
    kv_cache_dtype: str = _help(
        "KV cache storage dtype (vLLM's flag): auto (the model dtype); fp8 / fp8_e4m3 / "
        "fp8_e5m2 (one byte per value, no scaling: half a bf16 cache), on CUDA with "
        "attention_backend torch; int8 (one byte per value plus a bf16 scale per token and "
        "head: ~1.94x the tokens of a bf16 pool at head_dim 64), on CPU with attention_backend "
        "cpu or torch. Elsewhere each is refused at startup.",
        default="auto",
    )

    def __post_init__(self) -> None:
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            f"must be a positive power of two, got {self.block_size}",
        )
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks > 0,
            "num_kv_blocks",
            f"must be > 0, got {self.num_kv_blocks}",
        )
        _require(
            self.gpu_memory_utilization is None or 0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        for name in ("kv_cache_memory_bytes", "kv_cache_memory_base"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, f"must be > 0, got {value}")
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_base is None,
            "kv_cache_memory_base",
            "give kv_cache_memory_bytes (the pool) or kv_cache_memory_base (what "
            "gpu_memory_utilization takes a fraction of), not both",
        )

    def cpu_kv_budget_bytes(self, default_base: int = DEFAULT_KV_CACHE_MEMORY_BASE) -> int:
        """The KV pool's bytes on CPU: ``kv_cache_memory_bytes``, else ``gpu_memory_utilization``
        (default 1.0) x ``kv_cache_memory_base`` (default ``default_base``).

        The runner and the simulator's CPU cost models both size the pool with this. Giving a
        fraction with an explicit byte budget is refused: on CPU the fraction would be ignored.
        """
        if self.kv_cache_memory_bytes is not None:
            _require(
                self.gpu_memory_utilization is None,
                "gpu_memory_utilization",
                "on CPU it is a fraction of kv_cache_memory_base, but kv_cache_memory_bytes "
                "already sets the pool; give one of them",
            )
            return self.kv_cache_memory_bytes
        fraction = 1.0 if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        return int(fraction * (self.kv_cache_memory_base or default_base))

    def gpu_memory_fraction(self) -> float:
        """``gpu_memory_utilization`` on a GPU (default 0.9); refuses the CPU-only base."""
        _require(
            self.kv_cache_memory_base is None,
            "kv_cache_memory_base",
            "is for a CPU pool; on a GPU gpu_memory_utilization is a fraction of device memory "
            "(cap the pool with kv_cache_memory_bytes)",
        )
        if self.gpu_memory_utilization is None:
            return DEFAULT_GPU_MEMORY_UTILIZATION
        return self.gpu_memory_utilization


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _help(
        "Request cap: most requests in one batch (alias: max_requests_per_batch). Higher means "
        "more throughput and more KV pressure.",
        default=64,
    )
    max_num_batched_tokens: int = _help(
        "Token budget per forward (alias: max_batch_tokens). Bigger: faster prefill, but longer "
        "steps that make running decodes (TPOT) and queued short prompts (TTFT) wait.",
        default=2048,
    )
    enable_chunked_prefill: bool = _help(
        "Split long prompts across steps so they share the budget with decodes. Off: a prompt "
        "must fit the token budget whole.",
        default=True,
    )
    long_prefill_token_threshold: int = _help(
        "Cap on prompt tokens one request may take in a step (0 = off), so one long prompt "
        "cannot starve short ones. Ignored when that request is alone in the batch, and "
        "without chunked prefill (a prompt then goes in whole).",
        default=0,
    )
    scheduling_policy: str = _help(
        "fifo (decode-first: running requests are served before new prefills, steady TPOT), "
        "prefill_first (unfinished chunked prefills before decodes: faster TTFT for long "
        "prompts, decodes stutter), priority (vLLM's: lower request priority first, then "
        "arrival; may preempt a lower priority at the request cap) or slo (prefills ordered by "
        "slack to their TTFT deadline, ties to the longest cached prefix; cost-aware "
        "preemption), lpm (cache-aware: waiting requests by longest cached prefix). Teaching "
        "modes: static (a batch runs to completion before the next is admitted) and dynamic "
        "(static, but an idle engine waits up to max_batch_delay_ms for a full batch). "
        "Default: fifo with the default traffic classes, measured against slo with and without "
        "the controller and predictive admission (docs/scheduling.md, 'The default').",
        default="fifo",
    )
    max_batch_delay_ms: float = _help(
        "dynamic policy: how long an idle engine lets its oldest request wait for the batch "
        "to fill (max_num_seqs requests or the token budget) before starting it.",
        default=100.0,
    )
    priority_aging_s: float = _help(
        "Seconds of waiting worth one priority level (priority and slo policies), so a low "
        "priority cannot starve; 0 = strict priority.",
        default=30.0,
    )
    traffic_classes: str | None = _help(
        "Traffic classes with TTFT/TPOT targets and work-conserving shares of the token budget "
        "and request slots: 'default' (chat: interactive vs long prompts >= 1024 tokens, so a "
        "burst of long prompts cannot take the step from short ones), 'none' (one class, no "
        "shares: plain FIFO), a YAML file, or inline 'NAME:ttft_p95_ms=800,tpot_p50_ms=150,"
        "share=0.7;long:prompt_tokens>=1024,ttft_p95_ms=10000,share=0.3'.",
        default="default",
    )
    token_budget_controller: bool = _help(
        "Move the per-step token budget between min_num_batched_tokens and "
        "max_num_batched_tokens every step so decode TPOT stays at target_tpot_ms.",
        default=False,
    )
    target_tpot_ms: float | None = _help(
        "TPOT the token budget controller holds (default: the tightest class tpot_p50_ms).",
        default=None,
    )
    min_num_batched_tokens: int = _help("Floor of the controlled token budget.", default=64)
    admission_control: str = _help(
        "none (only the queue bound) or predictive (refuse with 429 + Retry-After a request "
        "whose predicted TTFT misses its class target by more than admission_margin).",
        default="none",
    )
    admission_margin: float = _help(
        "Predictive admission holds the accepted requests' TTFT p95 within target x (1 + margin): "
        "it aims at the target and keeps the margin for the forecast's error (refusing when the "
        "TTFT predicted at max(1 + margin, how late first tokens lately came) exceeds "
        "target x (1 + margin)).",
        default=0.25,
    )
    preemption_thrash_limit: int = _help(
        "The slo policy spares requests already preempted this many times while other "
        "victims exist.",
        default=3,
    )
    step_cost_const_s: float | None = _help(
        "Prior for the online step-cost estimate (seconds per step), e.g. a poise profile's "
        "'const' coefficient; the engine refines it from the steps it runs.",
        default=None,
    )
    step_cost_per_token_s: float | None = _help(
        "Prior for the online step-cost estimate (seconds per scheduled token).", default=None
    )
    safety_margin: float = _help(
        "Fraction of KV blocks kept free when admitting new prefills (alias: watermark), so "
        "running decodes can grow without preemption.",
        default=0.05,
    )
    max_num_queued_requests: int | None = _help(
        "Waiting-queue bound: requests waiting beyond the free max_num_seqs slots (those the "
        "next step will start do not count); beyond it new requests get 429 + Retry-After "
        "(None = unbounded).",
        default=None,
    )
    speculative_config: SpeculativeConfig | None = _help(
        'Speculative decoding, vLLM\'s JSON shape: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        'or \'{"method": "draft_model", "model": PATH}\'; "adaptive": false keeps k '
        "fixed instead of the scheduler's per-request depth. Off by default (docs/speculation.md).",
        default=None,
    )

    def __post_init__(self) -> None:
        # JSON text (the flag) or vLLM's dict (LLM(speculative_config={...})), checked here.
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.of(self.speculative_config)
        )
        _require(self.max_num_seqs > 0, "max_num_seqs", f"must be > 0, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens > 0,
            "max_num_batched_tokens",
            f"must be > 0, got {self.max_num_batched_tokens}",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            f"must be >= 0, got {self.long_prefill_token_threshold}",
        )
        _require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            "scheduling_policy",
            f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
        )
        for name in ("priority_aging_s", "max_batch_delay_ms", "admission_margin"):
            _require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _require(
            self.target_tpot_ms is None or self.target_tpot_ms > 0,
            "target_tpot_ms",
            f"must be > 0, got {self.target_tpot_ms}",
        )
        _require(
            self.min_num_batched_tokens > 0,
            "min_num_batched_tokens",
            f"must be > 0, got {self.min_num_batched_tokens}",
        )
        _require(
            self.admission_control in ADMISSION_CONTROLS,
            "admission_control",
            f"must be one of {ADMISSION_CONTROLS}, got {self.admission_control!r}",
        )
        _require(
            self.preemption_thrash_limit >= 1,
            "preemption_thrash_limit",
            f"must be >= 1, got {self.preemption_thrash_limit}",
        )
        for name in ("step_cost_const_s", "step_cost_per_token_s"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, f"must be > 0, got {value}")
        _require(
            0.0 <= self.safety_margin < 1.0,
            "safety_margin",
            f"must be in [0, 1), got {self.safety_margin}",
        )
        _require(
            self.max_num_queued_requests is None or self.max_num_queued_requests >= 0,
            "max_num_queued_requests",
            f"must be >= 0, got {self.max_num_queued_requests}",
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (ours, vLLM's or the seed's names).

        ``scheduling_policy`` (alias: transformers' ``scheduler_type``) also accepts
        ``prefill-first`` and ``fcfs``.
        """
        parts: dict[type, dict[str, Any]] = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
        owner = {f.name: part for part in parts for f in dataclasses.fields(part)}
        for key, value in kwargs.items():
            name = ALIASES.get(key, key)
            if name not in owner:
                raise ValueError(f"{key}: unknown engine option")
            if name == "scheduling_policy" and isinstance(value, str):
                value = normalize_policy(value)
            parts[owner[name]][name] = value
        return cls(
            model=ModelConfig(**parts[ModelConfig]),
            cache=CacheConfig(**parts[CacheConfig]),
            scheduler=SchedulerConfig(**parts[SchedulerConfig]),
        )

    def to_flat_dict(self) -> dict[str, Any]:
        """All knobs in one flat dict (for records and logs)."""
        out: dict[str, Any] = {}
        for part in (self.model, self.cache, self.scheduler):
            out.update(dataclasses.asdict(part))
        return out


def normalize_policy(value: str) -> str:
    value = value.replace("-", "_").lower()
    return {"fcfs": "fifo", "decode_first": "fifo"}.get(value, value)
