"""Thin helpers over a Hugging Face tokenizer: loading, chat template, prompt encoding, EOS ids.

Invariants:
- Importing this module imports neither transformers nor torch; ``load_tokenizer`` imports
  ``tokenizers``/transformers lazily, and torch only for tokenizers that need ``AutoTokenizer``.
  Everything else only calls methods on the tokenizer object it is given, typed by the
  ``Tokenizer`` protocol.
- Client mistakes (no chat template, empty or malformed messages, a template that rejects the
  conversation) raise ``InvalidRequestError`` naming the field, which the server maps to 400.
- The chat template is rendered to text and then encoded without extra special tokens, which is
  what ``transformers`` does internally; doing it in two steps keeps us independent of the
  return type of ``apply_chat_template`` (a list in older versions, a dict in newer ones).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from poise.errors import InvalidRequestError
from poise.text.tool_calls import for_template, tool_fields


class Tokenizer(Protocol):
    """The part of a transformers tokenizer that poise uses."""

    chat_template: Any
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: str | None = None) -> Tokenizer:
    """The one tokenizer loader: a HF directory (or its config.json), a ``.gguf`` file,
    ``dummy:<dir>``, or None for the embedded SmolLM2 GGUF.

    Torch-free where transformers allows it: a byte-level BPE GGUF is built with ``tokenizers``
    (checkpoint/gguf_tokenizer.py), and a directory whose tokenizer_config.json names the generic
    fast class is loaded with that class directly. Any other directory goes through
    ``AutoTokenizer`` (which imports torch), so that a model-specific tokenizer class keeps its own
    behaviour. Cached; never downloads (``local_files_only``).
    """
    from poise.checkpoint.embedded import embedded_gguf_path
    from poise.checkpoint.gguf_tokenizer import tokenizer_from_gguf

    path = embedded_gguf_path() if source is None else Path(source.removeprefix("dummy:"))
    if path.name == "config.json":
        path = path.parent
    if path.suffix == ".gguf":
        return cast(Tokenizer, tokenizer_from_gguf(path))
    if _tokenizer_class(path) in _GENERIC_FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        return cast(Tokenizer, fast)
    from transformers import AutoTokenizer  # imports torch (via transformers' config module)

    return cast(Tokenizer, AutoTokenizer.from_pretrained(str(path), local_files_only=True))


# tokenizer_config.json classes that AutoTokenizer maps to PreTrainedTokenizerFast itself.
_GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(directory: Path) -> str | None:
    config = directory / "tokenizer_config.json"
    if not (config.is_file() and (directory / "tokenizer.json").is_file()):
        return None
    value = json.loads(config.read_text()).get("tokenizer_class")
    return value if isinstance(value, str) else None


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


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages and reduce each to ``{"role": str, "content": str}`` plus, where
    given, ``tool_calls`` (arguments as objects, which templates expect: text/tool_calls.py),
    ``tool_call_id`` and ``name``."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string", "messages")
        out.append(
            {"role": role, "content": _message_content(message, i), **tool_fields(message, i)}
        )
    return out


def apply_chat_template(
    tokenizer: Tokenizer, messages: Any, add_generation_prompt: bool = True, **kwargs: Any
) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (``render_chat``)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    # The template already contains any BOS/role tokens it wants.
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat(
    tokenizer: Tokenizer,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """``messages`` rendered to text with ``chat_template`` (Jinja text) or the tokenizer's
    own; ``tools`` and ``template_kwargs`` (e.g. ``enable_thinking``) reach the template."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; use the completions endpoint with a "
            "plain prompt, or give one (--chat-template)",
            "messages",
        )
    conversation = for_template(template, normalize_messages(messages), tools)
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            tools=tools,
            **template_kwargs,
        )
    except Exception as exc:  # jinja's TemplateError from raise_exception(), and similar
        raise InvalidRequestError(
            f"chat template rejected the messages: {exc}", "messages"
        ) from exc
    if not isinstance(text, str):
        raise InvalidRequestError("chat template did not render to text", "messages")
    return text


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
