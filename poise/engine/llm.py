"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams)``
and ``chat(messages, ...)`` return ``RequestOutput``s (``poise.engine.request_output``).

Runs the engine loop in the caller's thread until every request of the call is finished.
Text handling (chat template, incremental detokenization, stop strings) comes from
``poise.text``, the same code the server uses. Loading the model imports torch; importing this
module does not.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from poise.config import EngineConfig
from poise.core.sampling_params import SamplingParams
from poise.engine.builder import build_engine
from poise.engine.progress import run_requests
from poise.engine.request_output import RequestOutput

# A prompt: text, token ids, or vLLM's dict form {"prompt": ...} / {"prompt_token_ids": [...]}.
Prompt = str | list[int] | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    """Offline batch generation with the same engine the server runs.

    ``model`` and the engine options are those of ``poise serve`` (``EngineConfig.from_kwargs``:
    vLLM's names, e.g. ``max_num_seqs``, ``dtype``, ``generation_config``).
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        self.engine, self.model_info = build_engine(self.config)
        self.tokenizer = self.model_info.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (``generation_config``
        option; none under ``vllm``), as vLLM's method of the same name."""
        return SamplingParams(**self.model_info.default_sampling)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            return self.encode(str(prompt["prompt"]))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; give token ids")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs in prompt order. ``use_tqdm`` shows a
        progress bar with input and output tokens/s (on stderr)."""
        batch: Sequence[Prompt]
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = prompts  # type: ignore[assignment]
        texts = [_prompt_text(p) for p in batch]
        token_lists = [self.encode(p) for p in batch]
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or ``chat_template``: Jinja text) to each
        conversation and generate. ``tools`` and ``chat_template_kwargs`` are passed to the
        template (a template that ignores tools gets them as a system block:
        text/tool_calls.py); the reply is text, as vLLM's ``LLM.chat``."""
        from poise.text.tokenizer import render_chat

        if self.tokenizer is None:
            raise ValueError("chat: this model has no tokenizer; use generate with token ids")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts: list[str | None] = []
        token_lists: list[list[int]] = []
        for conv in conversations:
            text = render_chat(
                self.tokenizer,
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            texts.append(text)
            token_lists.append(list(self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    def _run(
        self,
        texts: list[str | None],
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:  # vLLM: the model's defaults (generation_config)
            sampling_params = self.get_default_sampling_params()
        params = _broadcast(sampling_params, len(token_lists))
        if self.tokenizer is None and any(sp.stop for sp in params):
            raise ValueError("stop: stop strings need a tokenizer; this model has none")
        ids = [str(next(self._ids)) for _ in token_lists]
        return run_requests(
            self.engine, self.tokenizer, ids, texts, token_lists, params, use_tqdm=use_tqdm
        )


def _prompt_text(prompt: Prompt) -> str | None:
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _broadcast(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return list(params)
