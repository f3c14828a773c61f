"""``/tokenize`` and ``/detokenize`` with vLLM's request and response shapes.

``POST /tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or
``{"messages": [...], "add_generation_prompt": true, "add_special_tokens": false,
"chat_template": ..., "chat_template_kwargs": {...}, "tools": [...]}`` (the chat template
rendered as for /v1/chat/completions) and answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs`` with ``return_token_strs``). ``POST /detokenize`` takes
``{"tokens": [...]}`` and answers ``{"prompt": str}``. A ``model`` other than a served name is
404 ``model_not_found``, as on the generation routes. The tokenizer runs on the generator's
tokenizer thread.

``GET /tokenizer_info`` (vLLM's route) describes the served tokenizer: its special tokens, chat
template, class and ``model_max_length``. With it and /tokenize, lm-eval's API models use the
server's own tokenizer (``tokenizer_backend=remote``, picked automatically), so evaluating the
embedded GGUF model needs no tokenizer directory on the client.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from poise.errors import InvalidRequestError
from poise.serving.messages import ChatMessage
from poise.serving.tool_calls import ToolDefinition, checked_template_kwargs
from poise.text.tokenizer import apply_chat_template, encode_prompt

# Exactly one of the two inputs, in the published schema as in the validator below.
_ONE_INPUT: JsonDict = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string", "minLength": 1}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_INPUT)

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, json_schema_extra={"enum": [False]})
    # Refused when given (below): a template is code the server runs; the operator's is
    # --chat-template.
    chat_template: str | None = Field(None, json_schema_extra={"enum": [None]})
    # Validated as the chat endpoint's: tool definitions, and no key that replaces one of
    # the template call's own arguments.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.continue_final_message:
            raise ValueError("continue_final_message is not supported")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def add_tokenize_routes(app: FastAPI, state: Any) -> None:
    from poise.serving.app import ERRORS
    from poise.serving.http_errors import error_response, map_exception

    def unknown_model(name: str | None) -> JSONResponse | None:
        if name is None or name in state.served_model_names:
            return None
        return error_response(
            404,
            f"The model `{name}` does not exist; this server serves {state.served_model_names}",
            param="model",
            code="model_not_found",
        )

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize(req: TokenizeRequest) -> Response:
        refused = unknown_model(req.model)
        if refused is not None:
            return refused
        if req.chat_template is not None:
            return error_response(
                400,
                "chat_template: a template from a request is not accepted (it is code the "
                "server would run; one nested loop can hold the tokenizer for hours); the "
                "server's is set with --chat-template",
                param="chat_template",
            )
        gen = state.generator
        try:
            if req.messages is not None:
                messages = [m.model_dump(exclude_none=True) for m in req.messages]
                kwargs = checked_template_kwargs(req.chat_template_kwargs)
                tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
                ids = await gen.call_tokenizer(
                    lambda: apply_chat_template(
                        gen.tokenizer,
                        messages,
                        req.add_generation_prompt,
                        tools=tools,
                        **kwargs,
                    )
                )
                if req.add_special_tokens:
                    ids = _with_special(gen.tokenizer, ids)
            else:
                special = True if req.add_special_tokens is None else req.add_special_tokens
                ids = await gen.call_tokenizer(
                    lambda: encode_prompt(gen.tokenizer, req.prompt or "", special)
                )
        except InvalidRequestError as exc:
            return map_exception(exc, state.metrics)
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": state.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if req.return_token_strs:
            body["token_strs"] = gen.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.get("/tokenizer_info")
    async def info() -> Response:
        return JSONResponse(tokenizer_info(state.generator.tokenizer, state.max_model_len))

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize(req: DetokenizeRequest) -> Response:
        refused = unknown_model(req.model)
        if refused is not None:
            return refused
        vocab = state.generator.vocab_size
        bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            return error_response(
                400, f"tokens: {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        gen = state.generator
        text = await gen.call_tokenizer(lambda: gen.tokenizer.decode(req.tokens))
        return JSONResponse({"prompt": text})


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The /tokenizer_info body: special tokens as text (None when the tokenizer has none)."""
    info: dict[str, Any] = {
        name: getattr(tokenizer, name, None)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    template = getattr(tokenizer, "chat_template", None)
    info |= {
        "chat_template": template if isinstance(template, str) else None,
        "tokenizer_class": type(tokenizer).__name__,
        "model_max_length": max_model_len,
    }
    return info


def _with_special(tokenizer: Any, ids: list[int]) -> list[int]:
    """A rendered chat prompt with the tokenizer's special tokens added (BOS), as
    add_special_tokens=True asks. transformers 5's TokenizersBackend has no
    build_inputs_with_special_tokens (a 500 the fuzz found): there, what the tokenizer adds to
    an empty text goes in front."""
    build = getattr(tokenizer, "build_inputs_with_special_tokens", None)
    built = (
        build(ids) if build is not None else [*tokenizer.encode("", add_special_tokens=True), *ids]
    )
    return [int(t) for t in built]
