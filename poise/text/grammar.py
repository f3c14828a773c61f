"""Structured output grammars with llguidance: compile once per spec, one matcher per request.

Why llguidance (and not xgrammar, vLLM's other backend): both are on the package index, but
xgrammar's wheel pulls triton and apache-tvm-ffi next to it (hundreds of MB for a CPU engine),
while llguidance is one 3 MB wheel with no dependencies. It compiles JSON schemas, regexes,
Lark and GBNF grammars lazily (a schema compiles in ~10 ms, the token trie is built once per
tokenizer, ~1 s for SmolLM2's 49k tokens) and computes a request's token bitmask in tens of
microseconds.

``LLGuidanceCompiler.new_state(params)`` is the engine's ``GrammarCompiler``: the first call
for a spec validates and compiles it into a template matcher (kept in an LRU cache keyed by the
spec); every request gets a ``deep_copy`` of the template (microseconds), so compiling never
happens in a step and a repeated schema is never compiled twice. Compilation errors raise
InvalidRequestError naming the request field the spec came from.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from poise.core.structured import StructuredOutputsParams
from poise.errors import InvalidRequestError
from poise.text.json_schema import close_objects

# Distinct specs kept compiled; a server sees a handful of schemas over and over.
_CACHE_SIZE = 256


class LLGuidanceGrammar:
    """One request's matcher (``core.structured.GrammarState``); the runner reads ``matcher``
    to fill the request's row of the step's bitmask."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.consume_token(token)) and not self.matcher.is_error()

    def is_terminated(self) -> bool:
        # llguidance's "stopped": only the end can follow (or the matcher is in error).
        return bool(self.matcher.is_stopped())

    def is_failed(self) -> bool:
        # After ``[ab]`` in ``(a|b)\x04`` only a byte no SmolLM2 token spells may follow: the
        # mask's computation puts the matcher in error and offers only the end, which would
        # otherwise finish the request as a success that breaks the grammar.
        return bool(self.matcher.is_error())


class LLGuidanceCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer; thread-safe (the server compiles
    on its tokenizer thread, the engine thread then only copies cached templates)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        allow_additional_properties: bool = False,
    ) -> None:
        self._hf_tokenizer = tokenizer
        # The server's switch (``--allow-additional-properties``): what a request that does not
        # set ``disable_additional_properties`` gets; json_schema.py says why closed is the default.
        self.allow_additional_properties = allow_additional_properties
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (~1 s)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                if self._hf_tokenizer is None:
                    raise InvalidRequestError(
                        "structured output needs a tokenizer; this model has none",
                        "structured_outputs",
                    )
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The template matcher for ``params`` (cached); InvalidRequestError if it is invalid."""
        key = (*params.spec(), *params.options())
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        template = self._build(params)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def new_state(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self.compile(params).deep_copy())

    def _build(self, params: StructuredOutputsParams) -> Any:
        import llguidance

        tokenizer = self.ll_tokenizer()
        where = params.source_field
        if params.kind() == "choice":
            _check_producible(tokenizer, params.choice or [], where)
        try:
            grammar = grammar_text(params, self.allow_additional_properties)
        except (ValueError, TypeError) as exc:  # llguidance's parse errors
            raise InvalidRequestError(f"invalid {params.kind()}: {exc}", where) from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"invalid {params.kind()}: {error}", where)
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {params.kind()}: {matcher.get_error()}", where)
        _check_forced_bytes(matcher, tokenizer, params.kind(), where)
        return matcher


def _spelled(tokenizer: Any, text: bytes) -> bool:
    """Whether tokens of this model spell ``text`` (its tokenization decodes back to it)."""
    return bool(tokenizer.decode_bytes(tokenizer.tokenize_bytes(text)) == text)


def _check_producible(tokenizer: Any, choices: list[str], where: str) -> None:
    """Each choice must be text some tokens of this model spell: a vocabulary may lack a byte
    (SmolLM2's has no token for 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d or the lead bytes of
    U+40000-U+BFFFF), and a choice holding one cannot be generated. llguidance 1.9.1 does not
    refuse such a grammar: its mask then offers a token its matcher rejects (llguidance issue
    366), which failed the request mid-generation with a 500 (found by the API fuzzer)."""
    for i, choice in enumerate(choices):
        if not _spelled(tokenizer, choice.encode("utf-8", "surrogatepass")):
            raise InvalidRequestError(
                f"choice {i} holds bytes that no token of this model produces", where
            )


def _check_forced_bytes(matcher: Any, tokenizer: Any, kind: str, where: str) -> None:
    """The bytes the grammar forces from its start (a literal regex, a single choice, a JSON
    schema's opening) must each be spelled by some token, for the same reason as choices (a
    regex forcing byte 0xF2 failed every request mid-generation). Alternatives further on are
    not checked: the mask leaves out what cannot be spelled, unless nothing else is left."""
    for byte in sorted(set(bytes(matcher.compute_ff_bytes()))):
        if not _spelled(tokenizer, bytes([byte])):
            raise InvalidRequestError(
                f"invalid {kind}: it requires byte 0x{byte:02x}, which no token of this model "
                "produces",
                where,
            )


def grammar_text(params: StructuredOutputsParams, allow_additional_properties: bool = False) -> str:
    """llguidance's grammar text for ``params`` (JSON schema options as vLLM passes them).

    A ``json`` schema's objects are closed (json_schema.py) unless the request says
    ``disable_additional_properties: false`` or, when it says nothing, the server allows
    additional properties. ``json_object`` is any object whatever the switch.
    """
    import llguidance

    kind, text = params.spec()
    flexible, no_extra, pattern = params.options()
    if no_extra is None:
        no_extra = not allow_additional_properties
    if kind in ("json", "json_object"):
        schema = json.loads(text) if kind == "json" else {"type": "object"}
        if no_extra and kind == "json":
            schema = close_objects(schema)
        defaults: Any = {"whitespace_flexible": flexible}  # llguidance's JsonCompileOptions
        if pattern is not None:
            defaults["whitespace_pattern"] = pattern
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults))
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(text))
    if kind == "choice":
        return str(llguidance.grammar_from("choice", text))
    return str(llguidance.grammar_from("grammar", text))  # Lark, or GBNF converted to Lark
