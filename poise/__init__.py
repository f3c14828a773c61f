"""poise: an LLM serving engine built around the TTFT/throughput balance of continuous batching."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
