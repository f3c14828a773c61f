"""poise.text tokenizer helpers on the real SmolLM2 tokenizer (byte-level BPE, ChatML template)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from poise.errors import InvalidRequestError
from poise.text import apply_chat_template, encode_prompt, eos_token_ids, load_tokenizer
from poise.text.tokenizer import Tokenizer

SHORT = "用三句话解释 continuous batching。"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return load_tokenizer()  # cached per process: loading the GGUF tokenizer takes seconds


def test_import_poise_text_does_not_import_torch() -> None:
    code = "import sys, poise.text; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False", out.stderr


def test_chat_template_matches_chatml_rendering(tok: Tokenizer) -> None:
    ids = apply_chat_template(tok, [{"role": "user", "content": SHORT}])
    expected_text = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{SHORT}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == tok.encode(expected_text, add_special_tokens=False)
    # Pinned: special tokens are single ids (<|im_start|> = 1, <|im_end|> = 2).
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert len(ids) == 45


def test_chat_template_without_generation_prompt_and_text_parts(tok: Tokenizer) -> None:
    parts = [
        {"type": "text", "text": "用三句话"},
        {"type": "text", "text": "解释 continuous batching。"},
    ]
    with_parts = apply_chat_template(tok, [{"role": "user", "content": parts}], False)
    plain = apply_chat_template(tok, [{"role": "user", "content": SHORT}], False)
    assert with_parts == plain
    assert plain[-2:] == [2, 198]  # ends with the user's <|im_end|>\n, no assistant header


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        None,
        [{"content": "no role"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ["not a dict"],
    ],
)
def test_malformed_messages_raise_invalid_request(tok: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        apply_chat_template(tok, messages)
    assert err.value.param == "messages"


class _FakeTokenizer:
    eos_token_id: int | None = None

    def __init__(self, template: str | None) -> None:
        self.chat_template = template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in token_ids)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        raise ValueError("Conversation roles must alternate user/assistant")


def test_no_chat_template_is_a_clear_400() -> None:
    with pytest.raises(InvalidRequestError, match="no chat template"):
        apply_chat_template(_FakeTokenizer(None), [{"role": "user", "content": "hi"}])


def test_template_exception_becomes_invalid_request() -> None:
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        apply_chat_template(_FakeTokenizer("{{x}}"), [{"role": "user", "content": "hi"}])


def test_encode_prompt_and_eos(tok: Tokenizer) -> None:
    ids = encode_prompt(tok, SHORT)
    assert tok.decode(ids) == SHORT
    with pytest.raises(InvalidRequestError):
        encode_prompt(tok, "")
    assert eos_token_ids(tok) == frozenset({2})  # <|im_end|>
    assert eos_token_ids(tok, extra=[0]) == frozenset({0, 2})
