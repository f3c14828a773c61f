"""Scheduling: which requests run in the next forward, and with how many tokens."""

from __future__ import annotations

from poise.sched.scheduler import Scheduler

__all__ = ["Scheduler"]
