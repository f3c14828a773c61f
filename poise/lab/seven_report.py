"""The `poise lab` report: ``report.md`` with one section per question (answer, this run's
numbers, a plot) and ``plots/``; and, back into ``lab.yaml``, which questions this run answers
and why not the others. Rebuilt from the run's folder alone, so it can be redrawn any time
(``poise lab --report-only OUT``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from poise.lab.seven_answers import Section
from poise.lab.seven_answers_late import ANSWERS
from poise.lab.seven_data import LabData, load
from poise.lab.seven_plan import QUESTIONS
from poise.lab.seven_plots import PLOTS
from poise.lab.seven_run import MANIFEST

logger = logging.getLogger(__name__)


def _header(d: LabData) -> list[str]:
    m = d.manifest
    if d.simulated:
        cost = m.get("cost_model") or {}
        what = (
            f"simulated (`poise simulate`'s engine in virtual time), cost model "
            f"{cost.get('name') or cost.get('kind') or cost}"
        )
    else:
        what = f"measured live on {m.get('target')}, model {m.get('model')}"
    lines = [
        "# The seed lab's seven questions, answered by one `poise lab` run",
        "",
        f"- Run: {what}; sizes / {m.get('scale')} of the seed's (doc 004); started "
        f"{m.get('started_at')}, {m.get('wall_s')} s wall "
        f"({', '.join(f'{k} {v} s' for k, v in (m.get('group_wall_s') or {}).items())}).",
        f"- Command: `{m.get('command')}`" if m.get("command") else "",
        "- Every number below is read from this run's records (`lab.yaml` lists them); the "
        "sentences follow the signs of the measured differences.",
    ]
    if d.missing:
        lines.append(f"- Records missing: {', '.join(d.missing)}.")
    return [x for x in lines if x] + [""]


def _groups(d: LabData) -> list[str]:
    out = ["## The cells", ""]
    for name, g in (d.manifest.get("groups") or {}).items():
        configs = g.get("configs") or {}
        w = g.get("workload") or {}
        load = f"concurrency {w.get('concurrency')}, max_tokens {w.get('max_tokens')}"
        mix = (
            f"long ratio {w.get('long_ratio')}"
            if not w.get("classes") and not w.get("jsonl")
            else "classes"
            if w.get("classes")
            else "documents (JSONL)"
        )
        qs = ", ".join(f"Q{q}" for q in g.get("questions", []))
        out.append(
            f"- **{name}** ({qs}): {', '.join(configs)}; {load}; {mix}"
            + (f"; {g['note']}" if g.get("note") else "")
        )
    return out + [""]


def render(d: LabData, plots: dict[str, str]) -> tuple[str, list[Section]]:
    sections = [answer(d) for answer in ANSWERS]
    lines = _header(d) + _groups(d)
    for s in sections:
        lines += [f"## Q{s.question}. {QUESTIONS[s.question]}", ""]
        lines += s.lines
        if s.plot and s.plot in plots:
            lines += ["", f"![Q{s.question}]({plots[s.plot]})", ""]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n", sections


def write_report(out_dir: str | Path, *, plots: bool = True) -> Path:
    """report.md and plots/ from the run's folder; the answerable questions into lab.yaml."""
    out = Path(out_dir)
    d = load(out)
    drawn: dict[str, str] = {}
    if plots:
        for key, fn in PLOTS.items():
            path = out / "plots" / f"{key}.png"
            try:
                if fn(d, path):
                    drawn[key] = str(path.relative_to(out))
            except Exception as exc:  # a plot is a view; the text stands without it
                logger.warning("plot %s failed: %s", key, exc)
    text, sections = render(d, drawn)
    (out / "report.md").write_text(text, encoding="utf-8")
    _record_answers(out, sections)
    return out / "report.md"


def _record_answers(out: Path, sections: list[Section]) -> None:
    path = out / MANIFEST
    manifest: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    manifest["answers"] = {
        f"Q{s.question}": {"answered": s.answered, **({"why_not": s.why_not} if s.why_not else {})}
        for s in sections
    }
    path.write_text(
        yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True, width=100), encoding="utf-8"
    )
