"""The import rules of docs/ARCHITECTURE.md, enforced by parsing imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "poise"

# Subpackage -> poise subpackages it may import. Torch lives only in model/ and runner/.
ALLOWED: dict[str, set[str]] = {
    "core": {"core", "config", "errors", "utils"},
    "kv": {"kv", "core", "config", "errors", "utils"},
    "sched": {"sched", "kv", "core", "config", "errors", "utils"},
    "engine": {"engine", "sched", "kv", "core", "config", "errors", "utils", "runner", "text"},
    "sim": {"sim", "engine", "sched", "kv", "core", "config", "errors", "utils", "workload"},
    "bench": {"bench", "workload", "utils", "core"},
    "lab": {"lab", "bench", "workload", "config", "errors", "utils", "sim"},
    "text": {"text", "errors", "core", "config"},
}
TORCH_FREE = ("core", "kv", "sched", "engine", "sim", "bench", "workload", "lab", "text")


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at_top_level) for each import in the file."""
    tree = ast.parse(path.read_text())
    top_level = set(id(n) for n in tree.body)
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top_level))
    return found


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_import_direction(sub: str) -> None:
    root = PKG / sub
    for path in root.rglob("*.py"):
        for module, top in _imports(path):
            parts = module.split(".")
            if parts[0] == "torch" and sub in TORCH_FREE:
                raise AssertionError(f"{path} imports torch")
            if parts[0] != "poise" or len(parts) < 2:
                continue
            # engine may reach the runner only lazily (inside a function), via the factory.
            if parts[1] == "runner" and sub == "engine":
                assert not top, f"{path}: runner import must be lazy"
                continue
            assert parts[1] in ALLOWED[sub], f"{path} imports {module}"


@pytest.mark.parametrize(
    "module", ["poise.core", "poise.kv", "poise.sched", "poise.engine", "poise.sim"]
)
def test_no_torch_in_subprocess(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
