"""`poise bench`: a load-test lab for any OpenAI-compatible server.

Modules (import what you need; only ``client`` and ``runner`` need aiohttp):
- ``metrics``: pure metric math (RequestRecord -> per-cell summaries); stdlib only.
- ``interference``: how long prompts' prefills delay and stall the other requests.
- ``prom``: Prometheus scrapes mapped to common names per engine.
- ``record``: ExperimentRecord / CellResult (YAML + JSONL), ``build_cell`` from any records.
- ``config``: WorkloadSpec (the traffic), BenchConfig, CellSpec and the request sample of a cell.
- ``client`` / ``runner``: timed streaming requests; ``run_cell`` and ``run_matrix``.
- ``report`` / ``plot``: terminal table and progress; PNG/HTML plots.

This package imports only ``poise.workload`` from poise, so it can ship on its own.
"""
