"""The draft-model proposer (``{"method": "draft_model", "model": PATH, ...}``): a smaller
model, loaded like ``--model``, guesses the next ``k`` tokens greedily.

It owns its model runner and its own KV pool (a ``KVCacheManager`` without prefix caching, as
many blocks as the target's pool: it never holds more tokens than the target, plus drafts).
Per request it remembers the tokens its KV holds; a proposal first drops what no longer
matches the request (the drafts the target rejected), feeds the rest of the request's tokens
in one chunk, then one draft at a time. Greedy, so a request's drafts are a function of its
tokens: the point mass that makes verification exact (``runner/verify.py``).

Why here and not in ``runner/`` or ``spec/``: it needs a model runner (torch) and KV block
bookkeeping (``kv/``); the engine is the unit that may use both. One request at a time, which
is simple and right; batching the draft's steps across requests is not done yet.

A draft whose vocabulary is not the target's is refused at startup naming
``speculative_config.model`` (its tokens would mean something else to the target).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

from poise.config import EngineConfig
from poise.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from poise.core.request import Request
from poise.core.sampling_params import SamplingParams
from poise.engine.executor import Executor
from poise.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from poise.runner.factory import ModelInfo

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
FIELD = "speculative_config.model"


class DraftModelProposer:
    def __init__(self, runner: Executor, kv: KVCacheManager, max_model_len: int) -> None:
        self.runner = runner
        self.kv = kv
        self.max_len = min(max_model_len, kv.capacity_tokens)
        # Per request: the tokens whose KV the draft holds (positions 0..len-1), and the
        # request (its blocks are freed by it).
        self._held: dict[str, list[int]] = {}
        self._requests: dict[str, Request] = {}
        self._steps = itertools.count()

    def propose(self, request: Request, k: int) -> list[int]:
        rid = request.request_id
        tokens = request.prompt_token_ids + request.output_token_ids
        k = min(k, self.max_len - len(tokens))
        if k <= 0:
            return []
        held = self._held.get(rid, [])
        # Still right: the longest common prefix, less at least the last token (fed to sample).
        keep = next(
            (i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != b),
            min(len(held), len(tokens)),
        )
        keep = min(keep, len(tokens) - 1)
        self.kv.trim(rid, keep)
        drafts: list[int] = []
        feed, pos = tokens[keep:], keep
        for _ in range(k):
            if (
                self.kv.allocate_slots(rid, num_computed_tokens=pos, num_new_tokens=len(feed))
                is None
            ):
                break  # the draft's pool is full: propose what there is
            token = self._sample(rid, feed, pos, len(request.prompt_token_ids))
            if token is None:
                break
            pos += len(feed)
            drafts.append(token)
            feed = [token]
        self.kv.trim(rid, pos)
        self._held[rid] = (tokens + drafts)[:pos]
        self._requests[rid] = request
        return drafts

    def _sample(self, rid: str, feed: list[int], pos: int, num_prompt: int) -> int | None:
        row = ScheduledRequest(
            request_id=rid,
            token_ids=feed,
            start_position=pos,
            block_ids=self.kv.get_block_ids(rid),
            sample=True,
            sampling_params=GREEDY,
            output_index=max(0, pos + len(feed) - num_prompt),
            num_prompt_tokens=num_prompt,
        )
        out: ModelRunnerOutput = self.runner.execute(
            SchedulerOutput(step_id=next(self._steps), scheduled=[row])
        )
        return out.sampled_token_ids.get(rid)

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.kv.free(request)


def build_draft_proposer(config: EngineConfig, target: ModelInfo) -> DraftModelProposer:
    """Load ``speculative_config.model`` with the target's dtype, device and block size, a KV
    pool of the target's block count, and check that it shares the target's vocabulary."""
    from poise.runner.factory import create_model_runner

    spec = config.scheduler.speculative_config
    assert spec is not None and spec.method == "draft_model" and spec.model is not None
    draft_config = dataclasses.replace(
        config,
        model=dataclasses.replace(
            config.model, model=spec.model, tokenizer=None, quantization=None
        ),
        cache=dataclasses.replace(
            config.cache, num_kv_blocks=target.num_kv_blocks, enable_prefix_caching=False
        ),
    )
    try:
        runner, info = create_model_runner(draft_config)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{FIELD}: cannot load the draft {spec.model!r}: {exc}") from exc
    check_same_vocabulary(info.vocab_size, target.vocab_size, info.tokenizer, target.tokenizer)
    kv = KVCacheManager(info.num_kv_blocks, info.block_size, False)
    return DraftModelProposer(runner, kv, info.max_model_len)


def check_same_vocabulary(
    draft_size: int, target_size: int, draft_tok: Any, target_tok: Any
) -> None:
    if draft_size != target_size:
        raise ValueError(
            f"{FIELD}: the draft's vocabulary has {draft_size} tokens, the target's "
            f"{target_size}: a draft must share the target's tokenizer"
        )
    both = draft_tok is not None and target_tok is not None
    if both and draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(
            f"{FIELD}: the draft's tokenizer maps tokens to other ids than the target's: "
            "a draft must share the target's tokenizer"
        )
