"""GGUF loading: header reader, dequantisation, Q/K unpermute, tokenizer, embedded SmolLM2.

Oracles: the ``gguf`` package (reader, quantiser), transformers' own GGUF loader
(``load_gguf_checkpoint``) on tiny files written here, and for SmolLM2 the greedy tokens
transformers produces from the same GGUF (recorded below; the slow tests recompute them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

from poise.checkpoint.embedded import embedded_gguf_path
from poise.checkpoint.gguf_file import GGUFFile
from poise.checkpoint.source import ModelSource
from poise.config import EngineConfig
from poise.model.gguf_dequant import _dequant_torch
from poise.model.loader_gguf import unpermute_qk
from poise.runner.factory import create_model_runner
from tests.model.harness import PagedHarness, load_ours
from tests.model.tiny_gguf import llama_cpp_permute, write_tiny_gguf
from tests.model.tiny_models import build_tiny_model

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# transformers 5.24 (load_gguf_checkpoint + LlamaForCausalLM, fp32) on the embedded GGUF.
CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]
CHAT_IDS += [411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47]
CHAT_IDS += [2, 198, 1, 520, 9531, 198]
GREEDY = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris.<|im_end|>"


def transformers_from_gguf(path: Path, head_dim: int | None = None, cfg: Any = None) -> Any:
    """transformers' GGUF reader for the weights; ``cfg`` replaces the config it derives."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = cfg or AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if head_dim is not None:
        cfg.head_dim = head_dim  # transformers does not read {arch}.attention.key_length
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}  # tied
    return model.eval()


@pytest.mark.parametrize(("kind", "head_dim"), [("llama", None), ("qwen2", None), ("qwen3", 32)])
def test_tiny_gguf_matches_transformers(tmp_path: Path, kind: str, head_dim: int | None) -> None:
    path = write_tiny_gguf(build_tiny_model(kind), tmp_path / "tiny-model.Q4_1.gguf", kind)
    ours = load_ours(str(path))
    ref = transformers_from_gguf(path, head_dim)
    ids = list(range(3, 40))
    h = PagedHarness(ours)
    got = torch.cat([h.step([("a", ids[:17], 0)])["a"], h.step([("a", ids[17:], 17)])["a"]])
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_gguf_llama3_rope_freqs(tmp_path: Path) -> None:
    """llama3 scaling arrives as a rope_freqs tensor; logits match the HF checkpoint."""
    hf = build_tiny_model("llama3_rope")
    path = write_tiny_gguf(hf, tmp_path / "l3.gguf", "llama")
    ours = load_ours(str(path))
    assert ours.arch.rope.freq_factors is not None
    # transformers ignores rope_freqs: give it the checkpoint's llama3 config and the GGUF's
    # (quantised) weights.
    ref = transformers_from_gguf(path, cfg=hf.config)
    ids = list(range(3, 60))  # past original_max_position_embeddings (32)
    got = PagedHarness(ours).step([("a", ids, 0)])["a"]
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_header_reader_matches_gguf_package(tmp_path: Path) -> None:
    path = write_tiny_gguf(build_tiny_model("qwen3"), tmp_path / "t.gguf", "qwen3")
    ours, ref = GGUFFile(path), GGUFReader(str(path))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert sorted(ours.tensors) == sorted(t.name for t in ref.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type and info.nbytes == t.n_bytes, t.name
        assert np.array_equal(
            ours.raw(info).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)
        )


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.F32])
def test_torch_dequant_matches_gguf_package(qtype: Q) -> None:
    data = np.random.default_rng(0).normal(size=(8, 96)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(data, qtype)).view(np.uint8)
    got = _dequant_torch(torch.from_numpy(raw.reshape(-1).copy()), qtype)
    assert got is not None
    want = dequantize(raw, qtype).reshape(-1)
    assert torch.equal(got.reshape(-1), torch.from_numpy(np.ascontiguousarray(want)))


def test_unpermute_inverts_llama_cpp_order() -> None:
    w = torch.randn(6 * 16, 8)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, 6), w)


def test_model_name_strips_quant_suffix() -> None:
    def model_name(path: str) -> str:
        return ModelSource("gguf", Path(path)).name

    assert model_name("SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert model_name("Qwen2.5-7B-Instruct-Q4_K_M.gguf") == "Qwen2.5-7B-Instruct"
    assert model_name("llama-3.2-1b-f16.gguf") == "llama-3.2-1b"


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return create_model_runner(EngineConfig.from_kwargs(num_kv_blocks=32))


def test_embedded_default_info(smollm2: Any) -> None:
    _, info = smollm2
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids) == (49152, 8192, {2})
    tok = info.tokenizer
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text, add_special_tokens=False) == CHAT_IDS


def _greedy(model: Any, n: int) -> list[int]:
    h = PagedHarness(model, block_size=16, num_blocks=32)
    seq, out = list(CHAT_IDS), []
    logits = h.step([("a", seq, 0)])["a"]
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        seq.append(out[-1])
        logits = h.step([("a", seq[-1:], len(seq) - 1)])["a"]
    return out


def test_embedded_default_greedy_equals_transformers(smollm2: Any) -> None:
    runner, _ = smollm2
    assert _greedy(runner.model, len(GREEDY)) == GREEDY


def test_embedded_default_bfloat16_greedy_equals_transformers() -> None:
    # transformers in bfloat16 on the same GGUF answers with the same ids as in fp32. Before
    # RMSNorm followed transformers' bf16 roundings, poise's first logits tied (25.0 / 25.0)
    # and it answered "L'Étoile, la Marseillaise, ..." instead.
    runner, _ = create_model_runner(EngineConfig.from_kwargs(num_kv_blocks=32, dtype="bfloat16"))
    assert _greedy(runner.model, len(GREEDY)) == GREEDY


@pytest.mark.slow
def test_smollm2_logits_match_transformers_live(smollm2: Any) -> None:
    runner, _ = smollm2
    ref = transformers_from_gguf(embedded_gguf_path())
    got = PagedHarness(runner.model, block_size=16, num_blocks=32).step([("a", CHAT_IDS, 0)])["a"]
    with torch.inference_mode():
        want = ref(torch.tensor([CHAT_IDS])).logits[0]
        gen = ref.generate(torch.tensor([CHAT_IDS]), max_new_tokens=len(GREEDY), do_sample=False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert gen[0, len(CHAT_IDS) :].tolist() == GREEDY


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(smollm2: Any) -> None:
    from transformers import AutoTokenizer

    ours = smollm2[1].tokenizer
    path = embedded_gguf_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [
        "Hello world",
        " lead",
        "naïve café — 東京 🚀",
        "<|im_start|>user\nhi<|im_end|>",
        "a\tb\r\n  c",
        "3.14159",
    ]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.apply_chat_template(CHAT, tokenize=False) == ref.apply_chat_template(
        CHAT, tokenize=False
    )
