"""Verifying draft tokens in the step's forward (speculative decoding, the runner's part).

A row with ``num_draft_tokens = k`` fed ``[t, d1 .. dk]`` (its last token and the drafts) at
positions ``s .. s+k`` in the flat batch, beside the step's prefill chunks and decodes. Its
logits at those k+1 positions are the target's distributions for output tokens
``output_index .. output_index + k``, each given the drafts before it.

``expand`` turns each such row into k+1 *position rows*: the same request at output index
``output_index + j``, its token history extended by ``d1 .. dj`` (penalties count them, as they
would count tokens sampled one per step), one logits row each. Everything after that is the
ordinary path: raw logprobs, the structured-output mask, the penalties, temperature, top-k/p,
min-p and the draw, row by row. ``collapse`` then keeps the drafts while each equals the token
the target drew at its position, and emits the target's token at the first mismatch (or the
bonus token after the last draft).

Why that is exact: a proposer's drafts are deterministic, a point mass q = 1 at d. Rejection
sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise draws from the
residual (p - q)+ normalised, which is p without d. Drawing x ~ p and accepting iff x == d does
both at once: P(accept) = p(d), and a rejected x is distributed as p given x != d. So each
emitted token has the target's distribution given the tokens before it, for greedy rows (the
argmax) and sampled rows alike; a seeded row even draws the same uniforms (hashed from its
output index) as it would without speculation, so it emits the same tokens.
"""

from __future__ import annotations

from dataclasses import replace

from poise.core.logprobs import TokenLogprob
from poise.core.outputs import ScheduledRequest

# Joins a request id and a draft position into a position row's id (not a character request
# ids contain: they come from the engine or the client's header, printable).
_SEP = "\x1f"


def has_drafts(rows: list[ScheduledRequest]) -> bool:
    return any(r.num_draft_tokens for r in rows)


def expand(
    sampled: list[ScheduledRequest], last_indices: list[int], flat_starts: dict[str, int]
) -> tuple[list[ScheduledRequest], list[int]]:
    """(position rows, their flat indices): rows without drafts as they are (at their last
    index), each row with drafts as its k+1 position rows (at its first k+1 flat indices)."""
    rows: list[ScheduledRequest] = []
    indices: list[int] = []
    for r, last in zip(sampled, last_indices, strict=True):
        k = r.num_draft_tokens
        if not k:
            rows.append(r)
            indices.append(last)
            continue
        drafts = r.token_ids[-k:]
        first = flat_starts[r.request_id] + r.num_tokens - 1 - k
        for j in range(k + 1):
            history = r.token_history
            if history is not None and j:
                history = (history[0], [*history[1], *drafts[:j]])
            rows.append(
                replace(
                    r,
                    request_id=f"{r.request_id}{_SEP}{j}",
                    output_index=r.output_index + j,
                    token_history=history,
                    num_draft_tokens=0,
                )
            )
            indices.append(first + j)
    return rows, indices


def owner(row_id: str) -> str:
    """The request a position row belongs to."""
    return row_id.split(_SEP, 1)[0]


def collapse(
    sampled: list[ScheduledRequest],
    tokens: list[int],
    logprobs: dict[str, TokenLogprob],
) -> tuple[
    dict[str, int], dict[str, TokenLogprob], dict[str, list[int]], dict[str, list[TokenLogprob]]
]:
    """Per request: (the token sampled_token_ids reports, its logprob, the accepted drafts,
    their logprobs), from the position rows' ``tokens`` (in ``expand``'s order) and logprobs
    (keyed by position row id)."""
    out: dict[str, int] = {}
    out_lp: dict[str, TokenLogprob] = {}
    accepted: dict[str, list[int]] = {}
    accepted_lp: dict[str, list[TokenLogprob]] = {}
    i = 0
    for r in sampled:
        k = r.num_draft_tokens
        rid = r.request_id
        if not k:
            out[rid] = tokens[i]
            if rid in logprobs:
                out_lp[rid] = logprobs[rid]
            i += 1
            continue
        drafts = r.token_ids[-k:]
        drawn = tokens[i : i + k + 1]
        a = 0
        while a < k and drawn[a] == drafts[a]:
            a += 1
        out[rid] = drawn[a]
        accepted[rid] = drafts[:a]
        lps = [logprobs.get(f"{rid}{_SEP}{j}") for j in range(a + 1)]
        if all(lp is not None for lp in lps):
            accepted_lp[rid] = [lp for lp in lps[:a] if lp is not None]
            last = lps[a]
            if last is not None:
                out_lp[rid] = last
        i += k + 1
    return out, out_lp, accepted, accepted_lp
