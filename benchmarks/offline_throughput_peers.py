"""The peers of benchmarks/offline_throughput.py: transformers' continuous batching
(``generate_batch``) and static ``generate``, on SmolLM2 loaded from the embedded GGUF.

Imported by offline_throughput.py after it sets OMP_WAIT_POLICY (this module loads torch)."""

from __future__ import annotations

import argparse
import functools
import gc
import time
from typing import Any

import torch
from offline_throughput_report import RunResult, log_result

from poise.checkpoint import embedded_gguf_path

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_hf_model(dtype: str) -> Any:
    """SmolLM2 from the embedded GGUF, dequantized by transformers, SDPA attention, eval mode.

    ``from_pretrained(gguf_file=...)`` needs ``accelerate``, which we do not install, so this
    does its steps by hand: config from the GGUF metadata, an empty model, then transformers'
    own GGUF reader (which maps names and undoes llama.cpp's Q/K row permutation).
    """
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoConfig, AutoModelForCausalLM

    # Its per-tensor progress bar would flood the benchmark's output.
    gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    load_gguf_checkpoint = gguf_utils.load_gguf_checkpoint

    gguf = embedded_gguf_path()
    config = AutoConfig.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_config(
        config, dtype=TORCH_DTYPES[dtype], attn_implementation="sdpa"
    )
    tensors = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=TORCH_DTYPES[dtype]
    )["tensors"]
    missing, unexpected = model.load_state_dict(
        {name: torch.as_tensor(t) for name, t in tensors.items()}, strict=False
    )
    # lm_head is tied to the embeddings (not stored in the GGUF).
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF load: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def _greedy_config(model: Any, max_tokens: int, eos_disabled: bool) -> Any:
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        # ignore_eos: CB stops only at max_new_tokens when EOS is -1; generate() suppresses EOS
        # until min_new_tokens.
        min_new_tokens=None if eos_disabled else max_tokens,
        eos_token_id=-1 if eos_disabled else eos,
        pad_token_id=eos if isinstance(eos, int) else 0,
    )


def run_transformers_generate_batch(
    model: Any, prompts: list[list[int]], max_tokens: int, max_num_seqs: int, dtype: str = ""
) -> RunResult:
    """transformers continuous batching (``generate_batch``); returns output tokens and seconds."""
    from transformers import ContinuousBatchingConfig

    page = 256
    # CPU: no GPU memory to infer sizes from, so size the paged cache for every request at once
    # (no preemption) and give it poise's default token budget per step.
    pages_per_request = -(-(max(map(len, prompts)) + max_tokens) // page)
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=len(prompts) * pages_per_request + 4,
        max_batch_tokens=2048,
        max_requests_per_batch=max_num_seqs,
        allow_block_sharing=False,  # poise runs without prefix caching here too
        auto_switch_to_flash=False,
        use_cuda_graph=False,
    )
    gen_config = _greedy_config(model, max_tokens, eos_disabled=True)
    start = time.perf_counter()
    with torch.inference_mode():
        results = model.generate_batch(
            inputs=prompts,
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            warmup=False,
        )
    seconds = time.perf_counter() - start
    # Results come back in input order.
    outputs = [list(r.generated_tokens) for r in results.values()]
    if len(outputs) != len(prompts) or any(r.error for r in results.values()):
        raise RuntimeError(f"generate_batch returned {len(outputs)}/{len(prompts)} results")
    return RunResult(
        "generate_batch", dtype, len(prompts), sum(map(len, outputs)), seconds, outputs
    )


def _left_padded(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def run_transformers_static_generate(
    model: Any, prompts: list[list[int]], max_tokens: int, batch_size: int, dtype: str = ""
) -> RunResult:
    """transformers static ``generate`` in left-padded batches; returns output tokens, seconds."""
    gen_config = _greedy_config(model, max_tokens, eos_disabled=False)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            ids, mask = _left_padded(prompts[first : first + batch_size], gen_config.pad_token_id)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
            outputs += out[:, ids.shape[1] :].tolist()  # out: [B, width + new]
    seconds = time.perf_counter() - start
    return RunResult("static", dtype, len(prompts), sum(map(len, outputs)), seconds, outputs)


def run_peers(dtype: str, prompts: list[list[int]], args: argparse.Namespace) -> list[RunResult]:
    """Both transformers engines on one model load (generate_batch restores the attention
    implementation it switches to when it stops)."""
    peers = [e for e in args.engines if e != "poise"]
    if not peers:
        return []
    model = load_hf_model(dtype)
    # Warm-up outside the timed region (first-call allocations, lazy inits).
    run_transformers_static_generate(model, [prompts[0][:8]], 2, 1, dtype)
    results = []
    for engine in peers:
        if engine == "generate_batch":
            result = run_transformers_generate_batch(
                model, prompts, args.max_tokens, args.max_num_seqs, dtype
            )
        else:
            result = run_transformers_static_generate(
                model, prompts, args.max_tokens, args.static_batch_size, dtype
            )
        log_result(result)
        results.append(result)
    del model
    gc.collect()
    return results
