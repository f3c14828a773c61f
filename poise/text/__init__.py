"""Text in and out of the engine: tokenizer helpers, incremental detokenizer, stop strings.

Used by the offline ``LLM`` API and the HTTP server. Torch-free by contract (a test checks it in
a subprocess): everything here works on token id lists and strings.
"""

from __future__ import annotations

from poise.text.detokenizer import IncrementalDetokenizer, StopChecker, TextDelta
from poise.text.tokenizer import (
    apply_chat_template,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
)

__all__ = [
    "IncrementalDetokenizer",
    "StopChecker",
    "TextDelta",
    "apply_chat_template",
    "encode_prompt",
    "eos_token_ids",
    "load_tokenizer",
]
