"""Prompts that can never be served (the limits a scheduler checks before queueing one), and
how many tokens a request may take in one step."""

from __future__ import annotations

from poise.config import SchedulerConfig
from poise.kv.manager import KVCacheManager


def rejection_reason(
    num_prompt_tokens: int, kv: KVCacheManager, max_len: int, config: SchedulerConfig
) -> str | None:
    """Why a prompt of this length can never be served, naming the limit; None if it can.

    ``max_len``: the longest a request may grow (the model's limit and the whole pool).
    """
    if num_prompt_tokens >= kv.capacity_tokens:
        return (
            f"prompt has {num_prompt_tokens} tokens, more than the whole KV cache holds "
            f"({kv.num_blocks} blocks x {kv.block_size} = "
            f"{kv.capacity_tokens} tokens, one needed for the first output token)"
        )
    if num_prompt_tokens >= max_len:
        return (
            f"prompt has {num_prompt_tokens} tokens; max_model_len is {max_len}, "
            f"which leaves room for at most {max_len - 1} prompt tokens"
        )
    if not config.enable_chunked_prefill and num_prompt_tokens > config.max_num_batched_tokens:
        return (
            f"prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens "
            f"{config.max_num_batched_tokens}, and chunked prefill is disabled"
        )
    return None


def chunk_size(remaining: int, budget: int, long_prefill_cap: int, alone: bool) -> int:
    """Tokens a request ``remaining`` tokens behind takes out of ``budget`` now.

    ``budget``: what is left of the step's for this request (less what other classes hold
    reserved, for a prefill). A prefill (more than one token behind) takes at most
    ``long_prefill_cap`` (0: none) unless the request is ``alone`` in the engine, so one long
    prompt cannot take the whole budget from short ones.
    """
    n = min(remaining, budget)
    if long_prefill_cap > 0 and remaining > 1 and not alone:
        n = min(n, long_prefill_cap)
    return n
