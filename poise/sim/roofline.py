"""Roofline step-cost model for a named accelerator and any model shape.

One step's time (assumptions spelled out in docs/simulator.md)::

    compute = (F_tok * tokens + F_head * sampled + F_pair * attention pairs) / (peak * eff_c)
    memory  = (weight bytes + KV bytes per token * KV tokens read) / (bandwidth * eff_m)
    step    = overhead + per_seq * scheduled requests + max(compute, memory)

Prefill-heavy steps land on the compute side (many tokens per weight read), decode steps on the
memory side (all weights and every request's KV read for one token each); a mixed step pays the
larger of the two, as a roofline says.

KV capacity follows the vLLM-style memory budget: ``memory * gpu_memory_utilization`` minus the
weights, the peak activations of a ``max_num_batched_tokens`` forward and a fixed runtime
reserve; what is left, divided by the bytes of one KV block, is the pool.

Invariants: pure arithmetic, deterministic; never returns a negative time or block count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poise.config import EngineConfig
from poise.sim.accelerators import Accelerator, get_accelerator
from poise.sim.cost import CostModel, StepShape
from poise.sim.shapes import DTYPE_BYTES, ModelShape, load_shape

# CUDA context, cuBLAS/attention workspaces, CUDA graphs: memory the KV pool can never have.
RUNTIME_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class RooflineCostModel(CostModel):
    name: str = "roofline"
    shape: ModelShape | None = None
    accelerator: Accelerator | None = None
    dtype_bytes: int = 2
    # Fraction of peak FLOP/s a prefill-sized GEMM reaches (MFU of large-token steps).
    compute_efficiency: float = 0.5
    # Fraction of peak bandwidth reached while streaming weights and KV.
    bandwidth_efficiency: float = 0.8
    # Fixed per-step cost (scheduler, input preparation, launches) and per scheduled request.
    overhead_s: float = 0.002
    per_seq_s: float = 20e-6
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shape is None or self.accelerator is None:
            raise ValueError("roofline: needs a model shape and an accelerator")
        if not 0 < self.compute_efficiency <= 1 or not 0 < self.bandwidth_efficiency <= 1:
            raise ValueError("roofline: efficiency factors must be in (0, 1]")

    @classmethod
    def build(
        cls,
        model: str,
        accelerator: str,
        *,
        dtype: str = "bfloat16",
        **kwargs: Any,
    ) -> RooflineCostModel:
        shape = load_shape(model)
        acc = get_accelerator(accelerator)
        dtype = "bfloat16" if dtype == "auto" else dtype
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        nbytes = DTYPE_BYTES[dtype]
        return cls(
            name=f"roofline:{shape.name}@{acc.name}",
            shape=shape,
            accelerator=acc,
            dtype_bytes=nbytes,
            vocab_size=shape.vocab_size,
            model_max_len=shape.context_length,
            kv_bytes_per_token=shape.kv_bytes_per_token(nbytes),
            kv_int8_bytes_per_token=shape.kv_bytes_per_token(nbytes, "int8"),
            provenance={"source": "roofline", "accelerator": acc.description, "dtype": dtype},
            **kwargs,
        )

    # ---- time ---------------------------------------------------------------------------------
    def _parts(self, s: StepShape) -> tuple[float, float]:
        m, acc = self.shape, self.accelerator
        assert m is not None and acc is not None
        flops = (
            m.flops_per_token * s.num_tokens
            + m.lm_head_flops * s.num_sampled
            + m.attention_flops_per_pair * (s.prefill_attn_pairs + s.decode_ctx_tokens)
        )
        compute = flops / (acc.peak_flops * self.compute_efficiency)
        nbytes = m.weight_bytes(self.dtype_bytes) + self.kv_bytes_per_token * s.kv_tokens
        memory = nbytes / (acc.memory_bandwidth * self.bandwidth_efficiency)
        return compute, memory

    def step_time(self, shape: StepShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        compute, memory = self._parts(shape)
        return self.overhead_s + self.per_seq_s * shape.num_seqs + max(compute, memory)

    # ---- memory -------------------------------------------------------------------------------
    def activation_bytes(self, config: EngineConfig) -> int:
        """Peak activations of the largest forward: the gated MLP's two intermediate tensors and
        a few hidden-sized ones per token, plus fp32 logits for every sampled request."""
        m = self.shape
        assert m is not None
        tokens = config.scheduler.max_num_batched_tokens
        per_token = (2 * m.intermediate_size + 4 * m.hidden_size) * self.dtype_bytes
        logits = config.scheduler.max_num_seqs * m.vocab_size * 4
        return tokens * per_token + logits

    def kv_budget_bytes(self, config: EngineConfig) -> int:
        """As the runner on CUDA: the memory budget, capped by kv_cache_memory_bytes if set."""
        m, acc = self.shape, self.accelerator
        assert m is not None and acc is not None
        fraction = config.cache.gpu_memory_fraction()
        usable = acc.memory_bytes * fraction
        left = (
            usable
            - m.weight_bytes(self.dtype_bytes)
            - self.activation_bytes(config)
            - RUNTIME_RESERVE_BYTES
        )
        if left <= 0:
            raise ValueError(
                f"gpu_memory_utilization: {fraction} of "
                f"{acc.description} leaves no room for a KV cache after the weights of {m.name}"
            )
        cap = config.cache.kv_cache_memory_bytes
        return int(left) if cap is None else min(int(left), cap)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        assert self.shape is not None and self.accelerator is not None
        d.update(
            model=self.shape.name,
            accelerator=self.accelerator.name,
            dtype_bytes=self.dtype_bytes,
            compute_efficiency=self.compute_efficiency,
            bandwidth_efficiency=self.bandwidth_efficiency,
            overhead_s=self.overhead_s,
            per_seq_s=self.per_seq_s,
        )
        return d
