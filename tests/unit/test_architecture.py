"""The import rules of docs/ARCHITECTURE.md, enforced by parsing imports and by importing.

A *unit* is a subpackage of poise (``kv``) or a top-level module (``config``). Every unit on
disk must have a row in ``ALLOWED`` (a new package fails until its rules are written down);
every import between units, at module level or inside a function, must follow a row; the
unit graph has no cycle; torch (and transformers, where the row says so) appear nowhere in the
torch-free units' source, and importing any of their modules loads neither.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "poise"

# Unit -> the other units it may import (at module level or lazily).
ALLOWED: dict[str, set[str]] = {
    "__init__": {"core", "engine"},  # engine only lazily: `from poise import LLM`
    "__main__": {"cli"},
    "errors": set(),
    "config": {"config_model", "config_spec"},
    "config_model": set(),  # ModelConfig and the field helpers, re-exported by config
    "config_spec": {"config_model"},  # SpeculativeConfig, re-exported by config
    "workload": set(),
    "core": {"config", "errors"},
    "kv": {"core", "config", "errors"},
    "sched": {"kv", "core", "config", "errors", "spec"},
    "spec": {"core", "config"},  # proposers (speculative decoding), torch-free
    # spec: the proposer a speculating engine hands its scheduler (the draft model's, engine/)
    "engine": {"sched", "kv", "core", "config", "errors", "text", "runner", "spec"},
    "checkpoint": {"errors"},
    "text": {"checkpoint", "core", "config", "errors"},
    "model": {"checkpoint", "config", "errors"},
    "runner": {"model", "checkpoint", "text", "core", "config", "errors"},
    "router": {"sched", "kv", "core", "config", "errors"},
    "sim": {
        "engine",
        "sched",
        "kv",
        "core",
        "config",
        "errors",
        "workload",
        "checkpoint",
        "router",
    },
    "bench": {"workload"},
    # sched: the tuner reads and rewrites traffic-class specs (lab/tune_slo.py).
    "lab": {"bench", "workload", "sim", "sched", "config", "errors"},
    "serving": {"engine", "text", "core", "config", "errors"},
    "deploy": {"router", "serving", "text", "config", "errors"},
    "cli": {"*"},  # the entry point wires everything; its imports before dispatch are tested below
}
# Edges allowed only inside a function, so importing the importer does not load the target.
LAZY_ONLY: set[tuple[str, str]] = {
    ("engine", "runner"),
    ("engine", "text"),
    ("__init__", "engine"),
}
# Known debts: an edge allowed for now, with why. A stale entry (the edge is gone) fails.
DEBTS: dict[tuple[str, str], str] = {
    ("serving", "sim"): "serving/server.py takes the step tracer from sim/trace.py; it moves to "
    "the engine's observers (issue 17, item 1)",
}

TORCH = {"torch"}
HEAVY = {"torch", "transformers"}
# Unit -> heavy top-level modules its source must never name (at module level or lazily).
BANNED: dict[str, set[str]] = {
    **{
        u: HEAVY
        for u in (
            "__init__",
            "__main__",
            "errors",
            "config",
            "config_model",
            "config_spec",
            "spec",
            "workload",
            "core",
            "kv",
            "sched",
            "router",
        )
    },
    **{u: HEAVY for u in ("engine", "sim", "bench", "lab", "serving", "deploy")},
    "checkpoint": TORCH,  # transformers only inside gguf_tokenizer's functions
    "text": TORCH,  # transformers only inside load_tokenizer
    "model": set(),
    "runner": set(),
    "cli": set(),  # subcommands import torch when they run; build_parser() must not (below)
}
# Units whose every module must import without loading torch or transformers.
IMPORT_LIGHT = sorted(u for u, banned in BANNED.items() if banned and u != "__main__")


def _unit_of(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0].removesuffix(".py")


def _units_on_disk() -> set[str]:
    units = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    return units | {p.stem for p in PKG.glob("*.py")}


UNITS = _units_on_disk()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute module name, at module level) for each import in the file; relative imports
    resolved; ``from poise import x`` reported as ``poise.x``."""
    tree = ast.parse(path.read_text())
    top_level = {id(n) for n in tree.body}
    package = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        top = id(node) in top_level
        if isinstance(node, ast.Import):
            found += [(a.name, top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module == "poise" or (node.level and not node.module):
                found += [(f"{module}.{a.name}", top) for a in node.names]
            else:
                found.append((module, top))
    return found


def _edges() -> dict[tuple[str, str], list[tuple[Path, bool]]]:
    """(importer unit, imported unit) -> [(file, at module level)]."""
    edges: dict[tuple[str, str], list[tuple[Path, bool]]] = {}
    for path in PKG.rglob("*.py"):
        src = _unit_of(path)
        for module, top in _imports(path):
            parts = module.split(".")
            if parts[0] != "poise" or len(parts) < 2 or parts[1] not in UNITS:
                continue
            if parts[1] != src:
                edges.setdefault((src, parts[1]), []).append((path, top))
    return edges


EDGES = _edges()


def test_every_unit_has_rules() -> None:
    assert set(ALLOWED) == UNITS, f"write ALLOWED rows for {sorted(UNITS ^ set(ALLOWED))}"
    assert set(BANNED) == UNITS, f"write BANNED rows for {sorted(UNITS ^ set(BANNED))}"


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_import_direction(unit: str) -> None:
    for (src, dst), sites in EDGES.items():
        if src != unit or "*" in ALLOWED[src]:
            continue
        where = ", ".join(sorted({str(p.relative_to(PKG)) for p, _ in sites}))
        assert dst in ALLOWED[src] or (src, dst) in DEBTS, f"{unit} may not import {dst} ({where})"
        if (src, dst) in LAZY_ONLY:
            assert not any(top for _, top in sites), f"{unit} -> {dst} must be lazy ({where})"


def test_debts_are_still_real() -> None:
    for edge, why in DEBTS.items():
        assert edge in EDGES, f"{edge} is gone: drop it from DEBTS ({why})"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for src, dst in EDGES:
        graph.setdefault(src, set()).add(dst)
    assert _cycles(graph) == []


def test_cycle_finder_finds_cycles() -> None:
    # The check above is only as good as this: a two-unit and a three-unit loop are found.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}}) == [["a", "b"]]
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == [["x", "y", "z"]]


@pytest.mark.parametrize("unit", sorted(u for u in UNITS if BANNED.get(u)))
def test_no_heavy_imports_in_source(unit: str) -> None:
    paths = [PKG / f"{unit}.py"] if (PKG / f"{unit}.py").is_file() else (PKG / unit).rglob("*.py")
    for path in paths:
        for module, _ in _imports(path):
            root = module.split(".")[0]
            assert root not in BANNED[unit], f"{path.relative_to(PKG)} imports {module}"


def _modules(unit: str) -> list[str]:
    if (PKG / f"{unit}.py").is_file():
        return ["poise" if unit == "__init__" else f"poise.{unit}"]
    return sorted(
        ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in (PKG / unit).rglob("*.py")
    )


def _loaded_after(code: str) -> list[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [m for m in json.loads(out.stdout.splitlines()[-1]) if m.split(".")[0] in HEAVY]


@pytest.mark.parametrize("unit", IMPORT_LIGHT)
def test_importing_loads_no_torch(unit: str) -> None:
    imports = "\n".join(f"import {m}" for m in _modules(unit))
    heavy = {m.split(".")[0] for m in _loaded_after(imports)}
    assert not heavy, f"importing poise.{unit} loads {sorted(heavy)}"


def test_cli_before_dispatch_loads_no_torch() -> None:
    """``poise --help`` and argument parsing for every subcommand stay light: torch and
    transformers load only when a subcommand that needs them runs."""
    heavy = _loaded_after("from poise.cli import build_parser\nbuild_parser()")
    assert not heavy, sorted({m.split(".")[0] for m in heavy})


def test_tokenizer_and_description_load_without_torch() -> None:
    """What ``poise simulate --tokenizer`` and the model shapes need: the embedded model's
    tokenizer and its architecture, built without loading torch."""
    code = (
        "from poise.checkpoint import describe, resolve_model\n"
        "from poise.text import load_tokenizer\n"
        "assert describe(resolve_model(None)).num_layers == 30\n"
        "assert load_tokenizer(None).encode('hi', add_special_tokens=False)\n"
        "from poise.sim.shapes import load_shape\n"
        "from poise.checkpoint import embedded_gguf_path\n"
        "assert load_shape(embedded_gguf_path()).num_layers == 30"
    )
    loaded = {m.split(".")[0] for m in _loaded_after(code)}
    assert "torch" not in loaded


DOC = PKG.parent / "docs" / "ARCHITECTURE.md"


def _doc_rules() -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's package table: unit -> the units its "may import" column names
    ("anything" is ``*``; a listed debt's target counts as named)."""
    rules: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        units = re.findall(r"`([a-z_]+)(?:/|\.py)`", cells[0])
        words = set(re.findall(r"[a-z_]+", cells[2]))
        named = {"*"} if "anything" in words else words & UNITS
        for unit in units:
            rules[unit] = named
    return rules


def test_architecture_doc_states_the_rules() -> None:
    """The doc's table is the rule book: every unit has a row and names exactly what the test
    allows it (besides the listed debts)."""
    doc = _doc_rules()
    assert sorted(UNITS - set(doc)) == [], "units without a row in docs/ARCHITECTURE.md"
    debts = {(a, b) for a, b in DEBTS}
    for unit, allowed in ALLOWED.items():
        named = doc[unit] - {b for a, b in debts if a == unit}
        assert named == allowed, f"{unit}: doc names {sorted(named)}, the test {sorted(allowed)}"
