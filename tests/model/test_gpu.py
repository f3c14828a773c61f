"""GPU checks (marked ``gpu``; run with ``-m gpu`` where CUDA exists): the CUDA path of the
runner against the CPU reference on a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from poise.model.loader import load_model
from tests.model.harness import PagedHarness
from tests.model.test_runner import PROMPTS, MiniScheduler, make_runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_logits_match_cpu(tiny_checkpoints: dict[str, Path]) -> None:
    path = str(tiny_checkpoints["qwen3"])
    logits = {}
    for device in ("cpu", "cuda"):
        loaded = load_model(path, torch.float32, torch.device(device))
        loaded.model.init_rope(loaded.arch.context_length)
        h = PagedHarness(loaded.model)
        first = h.step([("a", PROMPTS["c"][:9], 0), ("b", PROMPTS["a"], 0)])
        second = h.step([("a", PROMPTS["c"][9:], 9), ("b", [3], len(PROMPTS["a"]))])
        logits[device] = torch.cat([first["a"], second["a"], first["b"], second["b"]]).cpu()
    torch.testing.assert_close(logits["cuda"], logits["cpu"], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_runner_greedy_matches_cpu(tiny_checkpoints: dict[str, Path], dtype: str) -> None:
    outs = []
    for device in ("cpu", "cuda"):
        runner, info = make_runner(tiny_checkpoints["llama"], device=device, dtype=dtype)
        assert info.device == device
        sched = MiniScheduler(block_size=4, num_blocks=64, chunk=5)
        for rid, p in PROMPTS.items():
            sched.add(rid, p, max_tokens=6)
        outs.append(sched.run(runner))
    if dtype == "float32":
        assert outs[0] == outs[1]
    else:  # bf16 kernels differ across devices; the first token of each must still agree
        assert all(outs[0][r][0] == outs[1][r][0] for r in PROMPTS)
