"""Token ids the executor feeds the model, and the output tokens it "samples".

A trace rarely carries token ids; most carry chained chunk hash ids (Mooncake) or nothing.
The executor needs real ids, and they must agree with what the KV cache manager assumed:
two prefixes with equal block hashes must hold equal tokens, or a correct prefix hit
would be numerically wrong. So a prompt's tokens are derived from its identity:

- ``TokenPrompt``: its own ids;
- ``HashIdPrompt``: token ``j`` of chunk ``c`` is a mix of the chunk's hash id and ``j``
  (chained ids name the whole prefix, so equal ids mean equal prefixes mean equal tokens);
  the part no id covers is unique to the request (a mix of its ``unique_id``).

Output tokens are scripted, not sampled from the logits: the token a request samples at
output index ``k`` is a fixed function of its id and ``k``, so the scheduler's decisions
(which depend on block hashes of outputs only through their identity) stay those of the
simulation, whichever clock or cache setting runs. The logits are kept for the checks.
"""

from __future__ import annotations

import zlib

import numpy as np

from kvtwin.sim.core.hashing import HashIdPrompt, PromptSource, TokenPrompt

_MASK64 = (1 << 64) - 1
TOKEN_ID_BITS = 31  # ids stay positive int32, like a real vocabulary's


def mix64(value: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread, deterministic integer hash."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def output_token_id(request_id: str, index: int) -> int:
    """The scripted token a request samples as its ``index``-th output."""
    return mix64((zlib.crc32(request_id.encode()) << 32) | index) >> (64 - TOKEN_ID_BITS)


def prompt_token_ids(prompt: PromptSource, start: int, end: int) -> list[int]:
    """Token ids of prompt positions ``[start, end)``."""
    if isinstance(prompt, TokenPrompt):
        return prompt.token_ids[start:end]
    if not isinstance(prompt, HashIdPrompt):
        raise TypeError(f"no token ids for a {type(prompt).__name__}")
    tokens = []
    chunk_tokens = prompt.hash_block_tokens
    covered = prompt.covered_tokens
    shift = 64 - TOKEN_ID_BITS
    for position in range(start, end):
        if position < covered:
            seed = (int(prompt.hash_ids[position // chunk_tokens]) & 0xFFFFFFFFFFFF) << 16 | position % chunk_tokens
        else:
            seed = ((int(prompt.unique_id) & 0xFFFFFFFF) << 32 | position) ^ 0x5A5A5A5A00000000
        tokens.append(mix64(seed) >> shift)
    return tokens


class RequestTokens:
    """The tokens of one request: its prompt's, then its scripted outputs."""

    __slots__ = ("request_id", "prompt", "num_prompt_tokens", "_ids", "_fingerprints")

    def __init__(self, request_id: str, prompt: PromptSource):
        self.request_id = request_id
        self.prompt = prompt
        self.num_prompt_tokens = prompt.num_tokens
        self._ids: list[int] = []  # materialised lazily, as far as asked
        self._fingerprints = np.zeros(0, dtype=np.uint64)

    def ids(self, start: int, end: int) -> list[int]:
        """Token ids of positions ``[start, end)`` (outputs included)."""
        self._materialise(end)
        return self._ids[start:end]

    def _materialise(self, end: int) -> None:
        have = len(self._ids)
        if end <= have:
            return
        prompt_end = min(end, self.num_prompt_tokens)
        if have < prompt_end:
            self._ids += prompt_token_ids(self.prompt, have, prompt_end)
            have = prompt_end
        self._ids += [output_token_id(self.request_id, p - self.num_prompt_tokens) for p in range(have, end)]

    def fingerprint(self, num_tokens: int) -> int:
        """A 64-bit name of the prefix ``[0, num_tokens)``: equal prefixes share it (and,
        but for hash collisions, only they). Used by the block audit."""
        if num_tokens <= 0:
            return 0
        if num_tokens > len(self._fingerprints):
            self._extend_fingerprints(num_tokens)
        return int(self._fingerprints[num_tokens - 1])

    def _extend_fingerprints(self, num_tokens: int) -> None:
        # A polynomial rolling hash, continued from where it stopped; uint64 wraps.
        target = max(num_tokens, 2 * len(self._fingerprints))
        ids = np.asarray(self.ids(0, target), dtype=np.uint64)
        done = len(self._fingerprints)
        out = np.empty(target, dtype=np.uint64)
        out[:done] = self._fingerprints
        state = int(self._fingerprints[-1]) if done else 0
        with np.errstate(over="ignore"):
            for position in range(done, target):
                state = (state * 0x100000001B3 + int(ids[position]) + 1) & _MASK64
                out[position] = state
        self._fingerprints = out
