"""The offline API's vLLM shape on a tiny random Llama with the real SmolLM2 tokenizer:
RequestOutput / CompletionOutput fields, finish and stop reasons, refusals of fields poise does
not implement, the progress bar, chat templates with tools and kwargs, generation_config
defaults, and greedy token ids equal to transformers (float32 pinned: see docs on dtype auto)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from poise import LLM, CompletionOutput, RequestOutput, SamplingParams
from poise.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128)


def _hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def test_request_output_has_vllms_shape(llm: LLM, tiny_model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(
        ["Hello, my name is", {"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False
    )
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    first, second = outs
    assert first.prompt == "Hello, my name is" and second.prompt is None
    assert first.prompt_token_ids == llm.get_tokenizer().encode("Hello, my name is")
    assert second.prompt_token_ids == [1, 2, 3]
    assert first.request_id != second.request_id and first.finished
    completion = first.outputs[0]
    assert isinstance(completion, CompletionOutput) and completion.index == 0
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.cumulative_logprob is None and completion.logprobs is None
    assert completion.token_ids == _hf_greedy(tiny_model_dir, first.prompt_token_ids, 6)
    assert completion.text == llm.get_tokenizer().decode(
        completion.token_ids, skip_special_tokens=True
    )
    m = first.metrics
    assert m is not None and m.ttft is not None and m.e2e is not None and m.e2e >= m.ttft
    assert m.num_output_tokens == 6


def test_stop_reasons(llm: LLM) -> None:
    base = llm.generate(
        "The", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    token = base.token_ids[2]
    by_token = llm.generate(
        "The",
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[token]),
        use_tqdm=False,
    )
    c = by_token[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == token
    assert c.token_ids == base.token_ids[: base.token_ids.index(token) + 1]
    stop = base.text[len(base.text) // 2 :][:3]
    if not stop.strip():
        pytest.skip("degenerate text")
    by_text = llm.generate(
        "The",
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop
    assert stop not in by_text.text and base.text.startswith(by_text.text)


@pytest.mark.parametrize(
    "field, value",
    [
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("allowed_token_ids", [1]),
        ("presence_penalty", 2.5),
        ("repetition_penalty", 0.0),
        ("min_tokens", 3),
        ("logit_bias", {10**6: 1.0}),
        ("n", 0),
    ],
)
def test_unimplemented_or_invalid_fields_are_refused_not_ignored(
    llm: LLM, field: str, value: Any
) -> None:
    params = SamplingParams(max_tokens=2, **{field: value})
    with pytest.raises(InvalidRequestError, match=field) as info:
        llm.generate(["a", "b"], params, use_tqdm=False)
    assert info.value.param == field
    assert not llm.engine.has_unfinished_requests()
    # Nothing of the refused batch was admitted: the next call runs normally.
    assert llm.generate("a", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_progress_bar_shows_throughput(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err
    assert "input:" in err and "output:" in err and "tok/s" in err
    llm.generate(["a"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% if shout %}LOUD\n{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_chat_template_tools_and_kwargs(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    out = llm.chat(
        msgs,
        params,
        use_tqdm=False,
        chat_template=TEMPLATE,
        tools=TOOLS,
        chat_template_kwargs={"shout": True},
    )[0]
    want = "<user>hi\nTOOLS:get_weather;LOUD\n<assistant>"  # trim_blocks, as transformers
    assert out.prompt == want
    assert out.prompt_token_ids == llm.get_tokenizer().encode(want, add_special_tokens=False)
    plain = llm.chat(msgs, params, use_tqdm=False, chat_template=TEMPLATE)[0]
    assert plain.prompt == "<user>hi\n<assistant>"
    # Without chat_template: the model's own (SmolLM2's ChatML).
    own = llm.chat(msgs, params, use_tqdm=False)[0]
    assert own.prompt is not None and "<|im_start|>user\nhi" in own.prompt


def test_generation_config_defaults(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    gen = {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.9,
        "max_new_tokens": 5,
        "repetition_penalty": 1.05,
        "do_sample": True,
    }
    (model / "generation_config.json").write_text(json.dumps(gen))
    auto = LLM(model=str(model), dtype="float32", num_kv_blocks=32)
    sp = auto.get_default_sampling_params()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens) == (0.6, 20, 0.9, 5)
    assert sp.repetition_penalty == 1.05  # vLLM's keys include it
    # No sampling_params: the model's defaults apply (max_new_tokens=5 -> 5 tokens).
    out = auto.generate("a", use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    vllm = LLM(model=str(model), dtype="float32", num_kv_blocks=32, generation_config="vllm")
    assert vllm.get_default_sampling_params() == SamplingParams()
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    folder = LLM(model=str(model), dtype="float32", num_kv_blocks=32, generation_config=str(other))
    assert folder.get_default_sampling_params().temperature == 0.3


def test_import_is_light() -> None:
    code = (
        "import sys; from poise import LLM, SamplingParams, RequestOutput; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_bad_prompt_refuses_the_whole_batch_before_admission(llm: LLM) -> None:
    too_long = [5] * (llm.engine.max_model_len + 1)
    with pytest.raises(InvalidRequestError, match="2049 tokens"):
        llm.generate([[1, 2, 3], too_long], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
