"""ModelRunner: the torch executor. ``execute(SchedulerOutput) -> ModelRunnerOutput``.

Per step: build flat inputs (runner/inputs.py), one model forward over all scheduled tokens
with the attention backend the runner was built with (runner/attention.py chooses it),
logits only at the sampled positions (the last token of each request with ``sample=True``),
then the structured-output mask of constrained rows (runner/structured.py), then
``sampler.sample``. A row verifying speculative drafts is sampled at each of its positions and
keeps the drafts the target agrees with (runner/verify.py). The runner keeps no per-request state: everything it needs is in the
``ScheduledRequest`` (tokens, start position, block table), so finished or preempted requests
need no cleanup here.
"""

from __future__ import annotations

from typing import Any

import torch

from poise.core.outputs import ModelRunnerOutput, SchedulerOutput
from poise.model.attention import AttentionBackend
from poise.model.attention.kv_int8 import is_int8_cache, scrub_nonfinite_int8
from poise.model.llama import KVCache, LlamaForCausalLM
from poise.runner.graphs import DecodeGraphs
from poise.runner.inputs import build_step_inputs
from poise.runner.logprobs import prompt_logprobs, raw_logprobs, sampled_logprobs
from poise.runner.nonfinite import NONFINITE_MESSAGE, nonfinite_rows
from poise.runner.sampler import sample
from poise.runner.structured import mask_logits
from poise.runner.verify import collapse, expand, has_drafts, owner


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: AttentionBackend[Any],
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # What min_tokens holds back besides a request's own stop_token_ids.
        self.eos_token_ids = eos_token_ids
        # Unseeded sampling draws from here, so a run with a given engine seed is reproducible.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # Decode-only steps replayed from captured graphs (runner/graphs.py); None: eager.
        # With graphs the pool holds one extra block, the padded rows' (never handed out).
        self.decode_graphs = decode_graphs

    @property
    def num_kv_blocks(self) -> int:
        return int(self.kv_caches[0].shape[0]) - (self.decode_graphs is not None)

    def _scrub_blocks(self, tables: list[list[int]]) -> None:
        """Non-finite K/V values in a failed request's blocks become zeros before the engine
        frees them: a backend that reads masked slots of a block (0 * NaN is NaN: flex reads
        whole blocks) would otherwise fail every later request given them. Finite values are
        left as they are, so blocks shared through the prefix cache keep their contents."""
        blocks = torch.tensor(sorted({b for table in tables for b in table}), dtype=torch.long)
        for cache in self.kv_caches:
            rows = cache.index_select(0, blocks.to(cache.device))
            if rows.is_floating_point():
                cache.index_copy_(0, blocks.to(cache.device), torch.nan_to_num(rows, 0.0, 0.0, 0.0))
            elif is_int8_cache(cache):  # its values are finite; a row's scale may not be
                cache.index_copy_(0, blocks.to(cache.device), scrub_nonfinite_int8(rows))

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        inputs = build_step_inputs(scheduler_output.scheduled, self.block_size, self.device)
        graphs = self.decode_graphs
        if graphs is not None and graphs.handles(inputs.meta):
            hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.attention
            )
        sampled = inputs.sampled_requests
        # Empty unless a chunk asked for prompt logprobs (then logits at its prompt positions).
        prompt_lp = prompt_logprobs(
            hidden, self.model.compute_logits, scheduler_output.scheduled, inputs.flat_starts
        )
        if not sampled:
            return ModelRunnerOutput(prompt_logprobs=prompt_lp)
        # Rows verifying drafts sample at each of their positions (runner/verify.py).
        rows, index = sampled, inputs.logits_indices
        if has_drafts(sampled):
            last = inputs.logits_indices.tolist()
            rows, flat = expand(sampled, last, inputs.flat_starts)
            index = torch.tensor(flat, dtype=torch.int64, device=hidden.device)
        logits = self.model.compute_logits(hidden[index])  # [S, V] float32
        # NaN / inf rows fail their request only (runner/nonfinite.py); their rows are zeroed.
        failed = {owner(rows[i].request_id): NONFINITE_MESSAGE for i in nonfinite_rows(logits)}
        if failed:
            self._scrub_blocks([r.block_ids for r in sampled if r.request_id in failed])
        # Raw logprobs: from the logits before the sampler touches them.
        raw = raw_logprobs(logits, rows)
        mask_logits(logits, [r.grammar for r in rows])  # structured output: allowed tokens
        tokens = sample(
            logits,
            [r.sampling_params for r in rows],
            [r.output_index for r in rows],
            generator=self.generator,
            histories=[r.token_history for r in rows],
            eos_token_ids=self.eos_token_ids,
            logits_writable=True,  # raw logprobs are taken; the mask already wrote in them
        )
        ids, lps, accepted, accepted_lps = collapse(
            sampled, tokens, sampled_logprobs(raw, rows, tokens)
        )
        out = ModelRunnerOutput(
            ids,
            logprobs=lps,
            prompt_logprobs=prompt_lp,
            failed=failed,
            accepted_draft_ids=accepted,
            accepted_logprobs=accepted_lps,
        )
        for rid in failed:  # a token sampled from zeros means nothing
            out.sampled_token_ids.pop(rid)
            out.logprobs.pop(rid, None)
            out.accepted_draft_ids.pop(rid, None)
        return out
