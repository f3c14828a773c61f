"""``text.load_tokenizer`` on a Hugging Face directory: a generic fast tokenizer loads without
torch (what ``poise simulate --tokenizer DIR`` needs) and speaks exactly as ``AutoTokenizer``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TEXTS = ["Hello world", " spaced  out\n\nx", "é 日本 🙂 <|im_end|>"]


def test_generic_fast_tokenizer_dir_loads_without_torch_and_matches(
    smol_tokenizer_dir: Path, smol_tokenizer: Any
) -> None:
    code = (
        "import json, sys\n"
        "from poise.text import apply_chat_template, load_tokenizer\n"
        f"tok = load_tokenizer({str(smol_tokenizer_dir)!r})\n"
        f"ids = [tok.encode(t) for t in {TEXTS!r}]\n"
        "chat = apply_chat_template(tok, [{'role': 'user', 'content': 'hi'}])\n"
        "print(json.dumps([ids, chat, 'torch' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ids, chat, torch_loaded = json.loads(out.stdout.splitlines()[-1])
    assert not torch_loaded
    assert ids == [smol_tokenizer.encode(t) for t in TEXTS]
    rendered = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == smol_tokenizer.encode(rendered, add_special_tokens=False)
