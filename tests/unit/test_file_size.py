"""No source file in poise/ over 400 lines: small modules with one job each (DEVELOPERS'
rule; issue 17's acceptance). A file that grows past it is split, not exempted."""

from __future__ import annotations

from pathlib import Path

LIMIT = 400
ROOT = Path(__file__).resolve().parents[2] / "poise"


def test_no_source_file_in_poise_is_over_400_lines() -> None:
    sources = [p for p in ROOT.rglob("*") if p.suffix in {".py", ".cpp", ".h"}]
    assert len(sources) > 100  # the walk found the package
    too_long = {
        str(p.relative_to(ROOT)): n
        for p in sources
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > LIMIT
    }
    assert not too_long, f"split these files (lines): {too_long}"
