"""A host-side record of what every block holds, to name the block behind a wrong number.

The numeric check (``validate`` check 1) says *that* a request's logits went wrong; this
says *where*. For every group and block it remembers the prefix whose tokens were last
written into it (attention: the tokens up to the block's filled end; state: the tokens
the state is after), as ``(num_tokens, fingerprint)`` of ``RequestTokens.fingerprint``.
Before a step runs, every block a scheduled request is about to read through its table
must hold that request's own prefix: a block whose record disagrees is reported with the
request, step, group, table position and block id.

Records change only where the executor really writes or copies (the same calls, so a
skipped write or copy leaves the record as stale as the bytes), and never read the
scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtwin.executor.block_tables import NULL_BLOCK
from kvtwin.executor.tokens import RequestTokens


@dataclass(frozen=True)
class Finding:
    step: int
    request_id: str
    group_id: int
    position: int  # table column
    block_id: int
    expected_tokens: int
    found_tokens: int
    detail: str

    def describe(self) -> str:
        return (f"step {self.step}, request {self.request_id}, group {self.group_id}, block {self.block_id} "
                f"(table position {self.position}): {self.detail}")


class BlockAudit:
    def __init__(self, num_groups: int, num_blocks: int, max_findings: int = 100):
        self.num_tokens = np.full((num_groups, num_blocks), -1, dtype=np.int64)
        self.fingerprint = np.zeros((num_groups, num_blocks), dtype=np.uint64)
        self.findings: list[Finding] = []
        self.max_findings = max_findings

    # -- records ---------------------------------------------------------------------------

    def wrote_tokens(self, group_id: int, table: list[int], block_size: int, start: int, end: int,
                     tokens: RequestTokens) -> None:
        """Positions ``[start, end)`` of a request were written through ``table``."""
        if end <= start:
            return
        for column in range(start // block_size, (end - 1) // block_size + 1):
            block = table[column]
            if block == NULL_BLOCK:
                continue
            filled = min(end, (column + 1) * block_size)
            self.num_tokens[group_id, block] = filled
            self.fingerprint[group_id, block] = tokens.fingerprint(filled)

    def wrote_state(self, group_id: int, block: int, num_tokens: int, tokens: RequestTokens) -> None:
        if block != NULL_BLOCK:
            self.num_tokens[group_id, block] = num_tokens
            self.fingerprint[group_id, block] = tokens.fingerprint(num_tokens)

    def copied(self, group_id: int, src: int, dst: int) -> None:
        self.num_tokens[group_id, dst] = self.num_tokens[group_id, src]
        self.fingerprint[group_id, dst] = self.fingerprint[group_id, src]

    # -- checks ----------------------------------------------------------------------------

    def check_reads(self, step: int, request_id: str, group_id: int, table: list[int], block_size: int,
                    first_visible: int, computed: int, tokens: RequestTokens) -> None:
        """Every block holding positions ``[first_visible, computed)`` must be real and hold
        this request's prefix up to its filled end."""
        if computed <= first_visible or len(self.findings) >= self.max_findings:
            return
        for column in range(first_visible // block_size, (computed - 1) // block_size + 1):
            block = table[column] if column < len(table) else NULL_BLOCK
            if block == NULL_BLOCK:
                self._report(step, request_id, group_id, column, block, computed, -1,
                             "a position the step reads maps to the null block")
                return
            expected = min(computed, (column + 1) * block_size)
            self._expect(step, request_id, group_id, column, block, expected, tokens)

    def check_state(self, step: int, request_id: str, group_id: int, column: int, block: int, computed: int,
                    tokens: RequestTokens) -> None:
        """The state a step resumes from must be this request's after ``computed`` tokens."""
        if computed > 0 and len(self.findings) < self.max_findings:
            self._expect(step, request_id, group_id, column, block, computed, tokens)

    def _expect(self, step, request_id, group_id, column, block, expected, tokens) -> None:
        found = int(self.num_tokens[group_id, block])
        if found == expected and int(self.fingerprint[group_id, block]) == tokens.fingerprint(expected):
            return
        if found < 0:
            detail = "never written"
        elif found != expected:
            detail = f"holds {found} tokens' worth, expected {expected}"
        else:
            detail = "holds another prefix's tokens"
        self._report(step, request_id, group_id, column, block, expected, found, detail)

    def _report(self, step, request_id, group_id, column, block, expected, found, detail) -> None:
        self.findings.append(Finding(step, request_id, group_id, column, block, expected, found, detail))
