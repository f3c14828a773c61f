"""Structured output offline (vLLM's ``SamplingParams(structured_outputs=...)``), on a tiny
random Llama that never writes JSON by itself: every output parses and validates, greedy and
random, whatever else is in the batch; unconstrained neighbours are unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from poise import LLM, SamplingParams
from poise.core.structured import GuidedDecodingParams, StructuredOutputsParams
from poise.errors import InvalidRequestError
from tests.structured.schemas import SCHEMAS


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256)


def _json(schema: object, **kw: object) -> SamplingParams:
    return SamplingParams(
        max_tokens=96, structured_outputs=StructuredOutputsParams(json=schema), **kw
    )  # type: ignore[arg-type]


def test_random_model_writes_no_json_by_itself(llm: LLM) -> None:
    text = (
        llm.generate(
            "Give me a JSON object:", SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_greedy_and_random(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    params = [_json(schema, temperature=0.0)]
    params += [_json(schema, temperature=1.0, seed=s) for s in range(4)]
    params += [_json(schema, temperature=1.5, top_p=0.9)]  # unseeded, flatter
    outs = llm.generate(["Write JSON:"] * len(params), params, use_tqdm=False)
    texts = set()
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
        texts.add(o.text)
    assert len(texts) > 1  # random sampling still samples within the grammar


def test_unconstrained_neighbours_are_unchanged(llm: LLM) -> None:
    prompts = ["The capital of", "Once upon a time", "1, 2, 3,"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    mixed = llm.generate(
        [prompts[0], "x", prompts[1], "y", prompts[2]],
        [greedy, _json(SCHEMAS["person"], seed=1), greedy, _json(SCHEMAS["nested"]), greedy],
        use_tqdm=False,
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i, name in ((1, "person"), (3, "nested")):
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMAS[name])


def test_regex_choice_grammar_and_vllm_dict_form(llm: LLM) -> None:
    specs = [
        StructuredOutputsParams(regex=r"[a-z]{3}-\d{2}"),
        StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
        GuidedDecodingParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'),
        {"json_object": True},  # vLLM's dict form
    ]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs=s) for s in specs
    ]  # type: ignore[arg-type]
    outs = [o.outputs[0] for o in llm.generate(["a"] * 4, params, use_tqdm=False)]
    assert re.fullmatch(r"[a-z]{3}-\d{2}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"\(\d(\+\d)*\)", outs[2].text) or outs[2].finish_reason == "length"
    if outs[3].finish_reason == "stop":
        assert isinstance(json.loads(outs[3].text), dict)
    else:  # any object: a random model may not close it in 40 tokens, but it is a prefix
        assert outs[3].text.startswith("{")


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"json": {"type": "objec"}}, "objec"),
        ({"regex": "[a-z"}, "unclosed"),
        ({"grammar": "start: nope"}, "nope"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "choice"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"structural_tag": "x"}, "structural_tag"),
        ({"jsn": {}}, "unknown field"),
        # No token of SmolLM2's vocabulary spells byte 0x04 or the lead byte of U+534D8: such a
        # choice cannot be generated (it used to fail mid-generation: llguidance issue 366).
        ({"choice": ["yes", "a\x04b"]}, "choice 1 holds bytes"),
        ({"choice": ["N-\U000534d8"]}, "choice 0 holds bytes"),
        ({"regex": "\U00090fd0x"}, "requires byte 0xf2"),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(llm: LLM, spec: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        llm.generate(
            "a",
            SamplingParams(max_tokens=4, structured_outputs=spec),  # type: ignore[arg-type]
            use_tqdm=False,
        )
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("regex", ["(a|b)\x04", "[ab]c\x04d"])
def test_a_grammar_the_vocabulary_cannot_complete_ends_in_error(llm: LLM, regex: str) -> None:
    """The byte SmolLM2 cannot spell comes after alternatives, so it is not refused up front.
    ``(a|b)\x04``: after the letter the mask offered only the end, which finished as "stop"
    with text breaking the grammar; ``[ab]c\x04d``: the mask offered "d" and the matcher
    refused it (llguidance issue 366). Both end in an error naming the field, and the request
    beside them is served as if alone."""
    spec = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"regex": regex})  # type: ignore[arg-type]
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate("b", plain, use_tqdm=False)[0].outputs[0].token_ids
    bad, ok = llm.generate(["a", "b"], [spec, plain], use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error", bad.outputs[0]
    assert "no token of this model produces" in (bad.error_message or "")
    assert ok.outputs[0].token_ids == alone
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_compiled_grammars_are_cached_by_spec(llm: LLM) -> None:
    compiler = llm.engine.grammars
    a = StructuredOutputsParams(json=SCHEMAS["person"])
    b = StructuredOutputsParams(json=json.dumps(SCHEMAS["person"]))  # same schema as text
    assert compiler.compile(a) is compiler.compile(b)  # type: ignore[union-attr]
    s1, s2 = compiler.new_state(a), compiler.new_state(a)  # type: ignore[union-attr]
    assert s1 is not s2 and s1.matcher is not s2.matcher  # type: ignore[attr-defined]


def test_chat_with_tools_renders_them_for_a_template_without_tools(llm: LLM) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    out = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        tools=tools,
    )[0]
    assert out.prompt is not None and "# Tools" in out.prompt and '"name": "lookup"' in out.prompt
    plain = llm.chat(
        [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False
    )[0]
    assert plain.prompt is not None and "# Tools" not in plain.prompt
