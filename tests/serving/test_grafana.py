"""deploy/grafana/poise.json: importable (Grafana's dashboard shape, a datasource input) and
every panel's PromQL names only metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from tests.serving.test_observability import slow_server

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "poise.json"
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")


def exported_names(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            family = line.split()[2]
            names.update(family + s for s in SUFFIXES)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_panel_query_names_an_exported_metric(smol_tokenizer: Any) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["__inputs"][0]["pluginId"] == "prometheus" and dash["panels"]
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"poise:[A-Za-z0-9_:]+", e)}
    assert len(used) >= 20
    # With speculation on, so its spec_decode_* series (exported only then) are there too.
    spec = '{"num_speculative_tokens": 2}'
    with slow_server(smol_tokenizer, delay_s=0.0, speculative_config=spec) as server:
        body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 3}
        assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
        exported = exported_names(httpx.get(server.base_url + "/metrics").text)
    missing = sorted(used - exported)
    assert not missing, f"panels query metrics the server does not export: {missing}"
    titles = [p["title"] for p in dash["panels"]]
    assert any("TTFT decomposed" in t for t in titles)
    stacked = next(p for p in dash["panels"] if "TTFT decomposed" in p["title"])
    assert stacked["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert len(stacked["targets"]) == 4
