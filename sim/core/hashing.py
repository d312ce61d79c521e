"""Chained block hashes: the identity of a prefix, one hash per full block.

docs/semantics.md#block-hashing. Block ``i``'s hash is ``hash_fn((parent, identity_i, None))`` — vLLM's
3-tuple with no extra keys (kvtwin models no LoRA, multimodal or cache-salt inputs) —
where ``parent`` is block ``i-1``'s hash (``NONE_HASH`` for the first block), so two
requests share block ``i``'s hash only when they share the whole prefix up to it. Only
full blocks are hashed, at the granularity ``hash_block_size``; a group with a coarser
block size uses the fine hash that ends where its block ends (``CoarseBlockHashes``).

Lookahead block hashes (docs/semantics.md#draft-heads-and-prefix-caching): with a draft
head (EAGLE, EAGLE-3, MTP) and caching on, vLLM 0.33 makes each hash also cover the
``L`` tokens after its block (``num_hash_lookahead_tokens``; ``L = 1`` for a single-module
head), because the drafter's KV at the block's last position was computed from the next
token. The extra keys become ``(None, *next_tokens)``; a block gets its hash only once
those tokens exist. ``L = 0`` (every other case) hashes exactly as before.

Two hash functions are offered and the simulator's decisions never depend on which:

* ``sha256`` — vLLM's default: SHA-256 of the pickled tuple, byte-for-byte what vLLM
  computes, for users who want to compare hash values with vLLM's KV events.
* ``builtin`` — Python's own tuple hash over ints (deterministic for ints, no salt),
  an order of magnitude faster; the default for replay.

Prompt identity comes in two forms, so a million-token prompt never becomes a million
Python ints: explicit token ids (``TokenPrompt``), or a trace's chained per-chunk hash ids
(``HashIdPrompt``, e.g. Mooncake's 512-token ids) from which block identities are derived.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from kvtwin.sim.core.errors import ConfigError

BlockHash = object  # bytes for sha256, int for builtin
HashFn = Callable[[object], BlockHash]


def sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def builtin_hash(obj: object) -> int:
    return hash(obj)


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_pickle, "builtin": builtin_hash}

# vLLM seeds the chain with hash_fn("vllm-none-hash") for cryptographic algorithms when
# PYTHONHASHSEED is unset; str hashing is salted per process for the builtin hash, so it
# gets a fixed integer seed instead.
_NONE_HASH_SEED = "vllm-none-hash"
_BUILTIN_NONE_HASH = 0x6B1E89D7_1198_0C0D


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ConfigError("prefix_caching_hash_algo", f"one of {', '.join(HASH_FUNCTIONS)}", name) from None


def none_hash(hash_fn: HashFn) -> BlockHash:
    if hash_fn is builtin_hash:
        return _BUILTIN_NONE_HASH
    return hash_fn(_NONE_HASH_SEED)


class TokenPrompt:
    """A prompt given as explicit token ids; block identity is the tuple of its tokens."""

    __slots__ = ("token_ids",)

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = list(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_identity(self, start: int, end: int, output_token_ids: list[int]) -> tuple:
        prompt = self.token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return tuple(prompt[start:end])
        head = prompt[start:num_prompt] if start < num_prompt else []
        return tuple(head) + tuple(output_token_ids[max(start - num_prompt, 0):end - num_prompt])


class HashIdPrompt:
    """A prompt known only by chained chunk hash ids (``hash_block_tokens`` tokens each).

    ``hash_ids[j]`` names the prefix up to the end of chunk ``j``, so the prefix ending at
    prompt token ``end`` is named by the id of the chunk holding token ``end - 1`` and
    ``end`` itself: no chaining, and no tokens, are needed to identify it. Where a trace's
    ids cover less than the prompt, the uncovered part is of unknown content and is
    treated as unique to the request (``unique_id``).
    """

    __slots__ = ("hash_ids", "hash_block_tokens", "num_tokens", "covered_tokens", "unique_id")

    def __init__(self, hash_ids: Sequence[int], hash_block_tokens: int, num_tokens: int,
                 unique_id: int | None = None):
        if hash_block_tokens <= 0:
            raise ConfigError("hash_block_tokens", "a positive integer", hash_block_tokens)
        covered = min(num_tokens, len(hash_ids) * hash_block_tokens)
        if covered < num_tokens and unique_id is None:
            raise ConfigError("hash_ids", f"enough ids to cover {num_tokens} prompt tokens at {hash_block_tokens} "
                              f"tokens each, or a unique_id for the uncovered rest", len(hash_ids))
        # A list, whatever sequence came in: the hot path indexes it for every block.
        self.hash_ids: list[int] = hash_ids if isinstance(hash_ids, list) else list(hash_ids)
        self.hash_block_tokens = hash_block_tokens
        self.num_tokens = num_tokens
        self.covered_tokens = covered
        self.unique_id = unique_id

    def prefix_identity(self, end: int) -> tuple:
        """A name for prompt tokens ``[0, end)`` that equal prefixes, and only they, share."""
        if end <= self.covered_tokens:
            return ("h", self.hash_ids[(end - 1) // self.hash_block_tokens], end)
        return ("u", self.unique_id, end)

    def block_identity(self, start: int, end: int, output_token_ids: list[int]) -> tuple:
        num_prompt = self.num_tokens
        if start >= num_prompt:
            return tuple(output_token_ids[start - num_prompt:end - num_prompt])
        prompt_part = self.prefix_identity(min(end, num_prompt))
        if end <= num_prompt:
            return prompt_part
        return prompt_part + tuple(output_token_ids[:end - num_prompt])


PromptSource = TokenPrompt | HashIdPrompt


class HashIdBlockHashes:
    """The block hashes of a ``HashIdPrompt`` request, made on demand.

    A prompt block's hash is a function of its prefix identity alone, so none is computed
    until a lookup or a cache registration asks for it: a request costs nothing per block
    at arrival. Blocks that reach into the output are chained and stored (``tail``).
    """

    __slots__ = ("prompt", "block_size", "hash_fn", "num_prompt_blocks", "tail", "_ids", "_ids_tokens",
                 "_fast_blocks", "_memo", "lookahead")

    def __init__(self, prompt: HashIdPrompt, block_size: int, hash_fn: HashFn, lookahead: int = 0):
        self.prompt = prompt
        self.block_size = block_size
        self.hash_fn = hash_fn
        # With lookahead hashes a prompt block's hash names the prefix up to ``lookahead``
        # tokens past its end (the chain plus the next tokens), so it needs them in the prompt.
        self.lookahead = lookahead
        self.num_prompt_blocks = max(prompt.num_tokens - lookahead, 0) // block_size
        self.tail: list = []
        # The hot case (builtin hash, a block the trace's ids cover) hashes
        # (chunk id, end) directly: this runs once or twice for every prompt block replayed.
        self._ids = prompt.hash_ids
        self._ids_tokens = prompt.hash_block_tokens
        fast = hash_fn is builtin_hash
        self._fast_blocks = min(self.num_prompt_blocks,
                                max(prompt.covered_tokens - lookahead, 0) // block_size) if fast else 0
        # Hashes made so far, kept while the request lives: a waiting request at the head
        # of a long queue is looked up again every step.
        self._memo: list = []

    def __len__(self) -> int:
        return self.num_prompt_blocks + len(self.tail)

    def __getitem__(self, index: int) -> BlockHash:
        if 0 <= index < self._fast_blocks:
            end = (index + 1) * self.block_size + self.lookahead
            return hash((self._ids[(end - 1) // self._ids_tokens], end))
        if index < 0:
            index += len(self)
        if index < self.num_prompt_blocks:
            identity = self.prompt.prefix_identity((index + 1) * self.block_size + self.lookahead)
            return self.hash_fn(identity)
        return self.tail[index - self.num_prompt_blocks]


    def range(self, start: int, stop: int) -> list:
        """Hashes of blocks ``[start, stop)`` in one call (the pool caches blocks in runs)."""
        memo = self._memo
        fast_stop = min(stop, self._fast_blocks)
        if len(memo) < fast_stop:
            ids, ids_tokens, bs, lookahead = self._ids, self._ids_tokens, self.block_size, self.lookahead
            # A counted loop (compiled, a C loop; a stepped range is iterated generically).
            for index in range(len(memo), fast_stop):
                end = (index + 1) * bs + lookahead
                memo.append(hash((ids[(end - 1) // ids_tokens], end)))
        if stop <= fast_stop:
            return memo[start:stop]
        out = memo[start:fast_stop] if start < fast_stop else []
        out.extend(self[i] for i in range(max(start, fast_stop), stop))
        return out


def hashes_in_range(block_hashes: BlockHashes, start: int, stop: int) -> list:
    """``list(block_hashes[start:stop])`` for every kind of block-hash sequence."""
    if isinstance(block_hashes, list):
        return block_hashes[start:stop]
    return block_hashes.range(start, stop)


class BlockHasher:
    """Computes a request's chained block hashes at one granularity with one hash function,
    each covering ``lookahead`` tokens past its block (0: none; module docstring)."""

    __slots__ = ("hash_fn", "hash_block_size", "none_hash", "lookahead")

    def __init__(self, hash_fn: HashFn, hash_block_size: int, lookahead: int = 0):
        self.hash_fn = hash_fn
        self.hash_block_size = hash_block_size
        self.none_hash = none_hash(hash_fn)
        self.lookahead = lookahead

    def new_hashes(self, prompt: PromptSource) -> list | HashIdBlockHashes:
        if isinstance(prompt, HashIdPrompt):
            return HashIdBlockHashes(prompt, self.hash_block_size, self.hash_fn, self.lookahead)
        return []

    def extend(self, hashes: list | HashIdBlockHashes, prompt: PromptSource, output_token_ids: list[int],
               num_tokens: int) -> None:
        """Append the hashes of blocks that became full (and, with lookahead, whose next
        tokens became known) since ``hashes`` was last extended."""
        bs = self.hash_block_size
        hash_fn = self.hash_fn
        lookahead = self.lookahead
        index = len(hashes)
        parent = hashes[index - 1] if index else self.none_hash
        tail = hashes.tail if isinstance(hashes, HashIdBlockHashes) else hashes
        while (index + 1) * bs + lookahead <= num_tokens:
            start = index * bs
            end = start + bs
            identity = prompt.block_identity(start, end, output_token_ids)
            # vLLM's extra keys: None, or (None, *next tokens) with lookahead hashes.
            extra = (None,) + prompt.block_identity(end, end + lookahead, output_token_ids) if lookahead else None
            parent = hash_fn((parent, identity, extra))
            tail.append(parent)
            index += 1


class CoarseBlockHashes:
    """Block hashes of a group whose block is ``factor`` fine hash blocks long.

    The fine chain already covers the whole prefix, so coarse block ``i`` reuses fine hash
    ``(i + 1) * factor - 1`` instead of hashing again (docs/semantics.md#coarser-groups).
    """

    __slots__ = ("fine", "factor")

    def __init__(self, fine: BlockHashes, factor: int):
        self.fine = fine
        self.factor = factor

    def __len__(self) -> int:
        return len(self.fine) // self.factor

    def __getitem__(self, index: int) -> BlockHash:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.fine[(index + 1) * self.factor - 1]

    def range(self, start: int, stop: int) -> list:
        return [self[i] for i in range(start, stop)]


# A request's block hashes: a plain list, the lazy view of a trace's hash ids, or a coarser
# view of either for a group with bigger blocks.
BlockHashes = list | HashIdBlockHashes | CoarseBlockHashes
