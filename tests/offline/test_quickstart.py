"""vLLM's offline quickstart, written fresh with ``vllm`` replaced by ``poise``, on the embedded
model: a prompts list, SamplingParams(temperature=0.8, top_p=0.95), LLM(model=...),
llm.generate(prompts, sampling_params), then output.prompt and output.outputs[0].text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

QUICKSTART = """
from poise import LLM, SamplingParams
from poise.checkpoint import embedded_gguf_path

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model=str(embedded_gguf_path()))
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""


def test_vllm_quickstart_runs_unchanged() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", QUICKSTART],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("Prompt: 'The capital of France is', Generated text: ")
    # Sixteen sampled tokens (vLLM's default max_tokens) are never empty text.
    assert all(not line.endswith(("Generated text: ''", 'Generated text: ""')) for line in lines)
    # use_tqdm defaults to True, as in vLLM: the bar with throughput goes to stderr.
    assert "Processed prompts" in proc.stderr and "tok/s" in proc.stderr
