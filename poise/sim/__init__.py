"""The simulator: the real EngineCore + Scheduler + KVCacheManager in virtual time.

Stdlib only. Cost models (``cost``, ``roofline``, ``fit``) say how long a step takes;
``SimExecutor`` advances a ``VirtualClock`` by that time instead of running a model;
``simulate_cell`` drives closed- or open-loop workloads through it. See docs/simulator.md.
"""
