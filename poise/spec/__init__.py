"""Speculative decoding's proposers: who guesses the next tokens a request will produce.

``Proposer`` is the one interface (``proposer.py``); ``NgramProposer`` (prompt lookup, no
extra model, the default method) is here, pure Python; the draft-model proposer needs torch and
lives in ``runner/draft.py``. Which depth each request gets per step is the scheduler's
decision (``sched/speculation.py``); verifying the drafts is the runner's (``runner/verify.py``).
"""

from poise.spec.ngram import NgramProposer
from poise.spec.proposer import Proposer

__all__ = ["NgramProposer", "Proposer"]
