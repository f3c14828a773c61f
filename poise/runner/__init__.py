"""The torch executor: flat inputs from a SchedulerOutput, model forward, sampling, KV pool.

The OpenMP wait policy default is set in ``poise/__init__.py`` (it must precede torch's load).
"""
