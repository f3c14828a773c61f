"""The tuning lab: ``poise sweep`` (server configs x bench cells, resumable, one report) and
``poise tune`` (the seed's tuning procedure as a tool).

Layout: ``metrics`` (one measured cell as flat numbers), ``probe`` (config -> metrics: live
server + bench, mock function, simulator), ``tune`` (the decision procedure), ``server`` (start,
wait-ready, stop by PID), ``bench_adapter`` (the one seam to ``poise.bench``), ``store``
(per-cell results on disk), ``sweep``, ``report``, ``presets`` (the lab's A/B/C scaled to the
machine), ``calibration`` (bench records -> the simulator's calibration; imported on demand).
Nothing here imports torch; ``poise.sim`` and ``poise.bench`` are imported lazily.
"""
