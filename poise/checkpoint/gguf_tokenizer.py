"""A transformers tokenizer built straight from a GGUF file's tokenizer metadata.

Why not ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``: it takes ~10 s for SmolLM2 on
this CPU (it reparses the file and goes through a slow-tokenizer class); this takes well
under a second. Byte-level BPE files (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3,
Qwen2/3) are built here with the ``tokenizers`` library the same way transformers builds them
(tests check identical ids and text on the real SmolLM2 file); other tokenizer types fall
back to transformers.

Byte-level BPE spells every byte as a printable character (GPT-2's byte alphabet); a GGUF
token that is not already in that alphabet is stored raw and is respelled byte by byte.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from poise.checkpoint.gguf_file import GGUFFile

_CONTROL, _USER_DEFINED = 3, 4


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes map to themselves,
    the rest (controls, space, ...) to code points 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _split_regex(pre: str | None) -> str | None:
    """The pre-tokenizer split pattern transformers uses for this vocabulary, if any."""
    if pre is None:
        return None
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:
        return None
    value = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
    return str(value) if value is not None else None


def _backend(gf: GGUFFile) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    tokens: list[str] = gf.get("tokenizer.ggml.tokens")
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in gf.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _split_regex(gf.get("tokenizer.ggml.pre"))
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        prefix = bool(gf.get("tokenizer.ggml.add_space_prefix", False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
    tok.decoder = decoders.ByteLevel()
    types = gf.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types, strict=False)
            if kind == _CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == _USER_DEFINED and t in vocab
        ]
    )
    return tok


def tokenizer_from_gguf(path: str | Path, gf: GGUFFile | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` with the file's special tokens and chat template."""
    path = Path(path)
    gf = gf or GGUFFile(path)
    if gf.get("tokenizer.ggml.model") != "gpt2":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = gf.get("tokenizer.ggml.tokens")

    def special(key: str) -> str | None:
        idx = gf.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=_backend(gf),
        bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        chat_template=gf.get("tokenizer.chat_template"),
        add_bos_token=bool(gf.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(gf.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
    )
