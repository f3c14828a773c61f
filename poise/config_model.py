"""ModelConfig: what to load and how (the ``model`` group of every engine command's flags),
and the two helpers every config dataclass is written with (here, config.py,
serving/settings.py): a field carrying its CLI help text, and a check naming the field.

A module of its own for config.py's size; config.py re-exports all of it. Torch-free: the
simulator and the lab describe models too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {message}")


DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "auto")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "flex")
# --quantization values (vLLM's flag; its method names are checkpoint formats, ours are what
# the weights become at load). None: the weights stay in dtype.
QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _help(
        "Hugging Face directory (config.json + *.safetensors), a Hub id in the local HF cache "
        "(never downloaded), a .gguf file, or 'dummy:<dir or config.json>' for random weights. "
        "Default: the embedded SmolLM2-135M-Instruct GGUF.",
        default=None,
    )
    tokenizer: str | None = _help(
        "Tokenizer directory, when it differs from the model's.", default=None
    )
    dtype: str = _help(
        "Weights and activations dtype: float32, bfloat16, float16 or auto (bfloat16 on CUDA "
        "and on CPUs with native bf16 matmul, AVX512-BF16 or AMX, or with AVX2 + FMA and "
        "poise's kernels built; float32 on other CPUs). float32 matches the fp32 "
        "transformers reference exactly; bfloat16 halves weight and KV memory and is about "
        "twice as fast on those CPUs.",
        default="auto",
    )
    device: str = _help(
        "torch device: auto (cuda when a CUDA device is present, else cpu), cpu, cuda, cuda:1...",
        default="auto",
    )
    seed: int = _help("Seed for dummy weights and for unseeded sampling.", default=0)
    generation_config: str = _help(
        "Where default sampling parameters come from: auto (the model's generation_config.json: "
        "temperature, top_p, top_k, min_p, max_new_tokens, as vLLM), vllm (none: poise's "
        "defaults) or a directory holding a generation_config.json. A request's values win.",
        default="auto",
    )
    max_model_len: int | None = _help(
        "Longest sequence (prompt + output) a request may reach. Default: the model's context "
        "length. Longer prompts are rejected with a 400, never truncated.",
        default=None,
    )
    attention_backend: str = _help(
        "Paged attention implementation: auto, torch, cpu or flex. 'cpu' is a C++ kernel "
        "(built once with the system compiler, cached) that reads K/V in place through the "
        "block tables; 'flex' is PyTorch FlexAttention compiled through torch.compile (Triton "
        "on CUDA, inductor's C++ on CPU; compiled once per shape bucket, cached on disk); "
        "'torch' gathers blocks and calls SDPA. auto = cpu on a CPU device when the kernel "
        "builds (float32/bfloat16), flex on CUDA, else torch.",
        default="auto",
    )
    enforce_eager: bool = _help(
        "Run every step eagerly (vLLM's flag). Without it, on CUDA, decode-only steps are "
        "padded to batch-size buckets and replayed from CUDA graphs (attention backends flex "
        "and torch, whose per-step preparation can be captured). No effect on CPU.",
        default=False,
    )
    disable_cascade_attn: bool = _help(
        "Attend every decode row alone (vLLM's flag). By default the 'cpu' backend's decode "
        "kernel finds, each step, the rows whose block tables begin with the same blocks "
        "(prefix-cache hits, n > 1 siblings) and attends each group's shared keys in one pass "
        "for all its rows (cascade attention), merged with the rows' own keys by log-sum-exp; "
        "the same results up to float rounding. Other backends attend rows alone either way.",
        default=False,
    )
    num_threads: int | None = _help(
        "torch intra-op threads for the model (torch.set_num_threads). Default: torch's choice "
        "(the number of cores). Fewer threads than cores helps when other processes compete "
        "for the CPU.",
        default=None,
    )

    quantization: str | None = _help(
        "Weight quantization of the decoder layers' linear layers (vLLM's flag): int8 "
        "(per-output-channel symmetric int8) or int4 (groups of 32 along the input, a scale and "
        "a zero point each: a GGUF's Q4_1 weights fit exactly). int8 also quantizes the "
        "lm_head. Activations, norms and embeddings stay in dtype. CPU only. Default: none "
        "(weights in dtype).",
        default=None,
    )
    allow_additional_properties: bool = _help(
        "Let a JSON schema's objects (json_schema response formats, structured_outputs.json, "
        "tool parameters) hold properties they do not declare where they do not say "
        "additionalProperties (the JSON Schema default). Off: only declared properties, at "
        "every level, as vLLM's default backend; a model offered extra keys can keep adding "
        "them until max_tokens. A request's structured_outputs.disable_additional_properties "
        "wins.",
        default=False,
    )

    def __post_init__(self) -> None:
        choices = {
            "dtype": DTYPES,
            "attention_backend": ATTENTION_BACKENDS,
            "quantization": (None, *QUANTIZATIONS),
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            _require(value in allowed, name, f"must be one of {allowed}, got {value!r}")
        for name in ("num_threads", "max_model_len"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, f"must be > 0, got {value}")


# Bytes a token's K and V take in the KV pool, per --kv-cache-dtype: the runner sizes its pool
# with it and the simulator's capacity model shares the rule. auto / fp8: 2 * layers * kv_heads *
# head_dim values of the cache dtype. int8: each (token, head) row of K or V is head_dim int8
# values followed by its bf16 scale (model/attention/kv_int8.py), head_dim + 2 bytes: 1.94x the
# tokens of a bf16 pool at head_dim 64, 1.97x at 128.

# Bytes of the per-(token, head) scale stored after each int8 row (a bf16).
INT8_SCALE_BYTES = 2


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, value_bytes: int
) -> int:
    """K + V bytes of one token over all layers. ``value_bytes``: the element size of the
    cache dtype where it is not int8 (the model dtype's for ``auto``)."""
    rows = 2 * num_layers * num_kv_heads
    if kv_cache_dtype == "int8":
        return rows * (head_dim + INT8_SCALE_BYTES)
    return rows * head_dim * value_bytes
