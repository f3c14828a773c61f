"""Prompt lengths in tokens for simulated requests, and the workload -> SimRequest adapter.

The workload (``poise.workload``) gives prompt *texts*; the scheduler only needs their length in
tokens after the server's chat template. For the embedded SmolLM2-135M-Instruct the seed
prompts were measured once with its GGUF tokenizer and chat template (which adds a default
system prompt: 30 tokens of template around an empty message) and are stored here; a salt
``[xxxxxxxx-N] `` (what ``poise bench`` prepends) measured 10-13 tokens, 12 on average. Other
texts use a rough estimate (about 1.06 tokens per ASCII word, one per CJK character) unless the
caller passes a real tokenizer's count function.

Invariants: lengths are >= 1; identical texts always get identical lengths.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from poise import workload as wl
from poise.sim.simulator import SimRequest

# Measured: SmolLM2-135M-Instruct GGUF tokenizer, chat template, add_generation_prompt=True.
SMOLLM2_CHAT_TOKENS: dict[str, int] = {wl.SHORT_PROMPT: 45, wl.LONG_PROMPT: 3363}
SMOLLM2_TEMPLATE_TOKENS = 30
SMOLLM2_SALT_TOKENS = 12

_CJK = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")
_WORD = re.compile(r"[A-Za-z0-9_=%;.,:!?'\"()\[\]-]+")


def estimate_text_tokens(text: str) -> int:
    """A tokenizer-free guess: ~1.06 tokens per ASCII word, one per CJK character."""
    return round(1.06 * len(_WORD.findall(text))) + len(_CJK.findall(text))


@dataclass
class PromptLengths:
    """Prompt text (+ salt) -> tokens the server would see.

    ``count`` (a real tokenizer's chat-templated length) wins when given; otherwise the
    measured table, then the estimate plus ``template_tokens``.
    """

    table: dict[str, int] = field(default_factory=lambda: dict(SMOLLM2_CHAT_TOKENS))
    template_tokens: int = SMOLLM2_TEMPLATE_TOKENS
    salt_tokens: int = SMOLLM2_SALT_TOKENS
    count: Callable[[str], int] | None = None
    _cache: dict[tuple[str, str | None], int] = field(default_factory=dict, repr=False)

    def __call__(self, prompt: str, salt: str | None = None) -> int:
        key = (prompt, salt)
        n = self._cache.get(key)
        if n is None:
            if self.count is not None:
                n = self.count(wl.salted(prompt, salt))
            else:
                base = self.table.get(prompt)
                if base is None:
                    base = self.template_tokens + estimate_text_tokens(prompt)
                n = base + (self.salt_tokens if salt else 0)
            n = max(1, n)
            self._cache[key] = n
        return n


def to_sim_requests(
    requests: Sequence[wl.WorkloadRequest],
    lengths: Callable[[str, str | None], int],
    *,
    salt: str | None = None,
    num_warmup: int = 0,
    ignore_eos: bool = True,
    send_class: bool = False,
    class_priority: Mapping[str, int] | None = None,
) -> list[SimRequest]:
    """Workload requests as simulator requests. The first ``num_warmup`` are warmup; the
    prompt text (salted) keys the synthetic token ids, so equal prompts stay equal."""
    out = []
    for r in requests:
        text = wl.salted(r.prompt, salt)
        out.append(
            SimRequest(
                index=r.index,
                prompt_len=lengths(r.prompt, salt),
                max_tokens=r.max_tokens,
                arrival=r.arrival,
                class_name=r.class_name,
                prompt_key=text,
                warmup=r.index < num_warmup,
                ignore_eos=ignore_eos,
                priority=(class_priority or {}).get(r.class_name, 0),
                traffic_class=r.class_name if send_class else None,
            )
        )
    return out
