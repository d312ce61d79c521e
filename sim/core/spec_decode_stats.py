"""What verifying drafts did, counted by the scheduler as it applies a batch
(docs/semantics.md#speculative-decoding).

vLLM's scheduler counts drafts where it rolls back the rejected ones, in its one
``update_from_output`` loop, and hands the front end the batch's ``SpecDecodingStats``
inside ``SchedulerStats`` and each request's own counts on the request. The replay reads
these, never the drafts and sampled tokens to count them again: a request whose output
the scheduler drops (it finished while the batch was in flight) is then dropped from the
counts by the same rule.
"""

from __future__ import annotations


class SpecDecodingStats:
    """One batch's verify steps (vLLM's ``SpecDecodingStats``): how many requests verified
    drafts, the drafts and the accepted ones, and per draft position how many were
    accepted (a draft counts only if every one before it was accepted)."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")

    def __init__(self, num_spec_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for position in range(num_accepted_tokens):
            per_pos[position] += 1


class RequestSpecDecodeMetrics:
    """One request's verify steps over its life (vLLM's ``RequestSpecDecodeMetrics``, its
    totals): steps, drafts verified, drafts accepted."""

    __slots__ = ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens")

    def __init__(self) -> None:
        self.num_verify_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_verify_steps += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
