"""Chained block hashes: the identity of a prefix, one hash per full block.

Semantics section 1. Block ``i``'s hash is ``hash_fn((parent, identity_i, extra_keys))``
where ``parent`` is block ``i-1``'s hash (``NONE_HASH`` for the first block), so two
requests share block ``i``'s hash only when they share the whole prefix up to it. Only
full blocks are hashed, at the granularity ``hash_block_size``; a group with a coarser
block size uses the fine hash that ends where its block ends (``CoarseBlockHashes``).

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
from dataclasses import dataclass

from sim.errors import ConfigError

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


@dataclass(frozen=True)
class ExtraKeys:
    """What besides the tokens makes a block distinct (semantics 1, "Extra keys")."""

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None

    def for_block(self, block_index: int) -> tuple | None:
        keys: list[tuple] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        if self.cache_salt is not None and block_index == 0:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None


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

    ``hash_ids[j]`` names the prefix up to the end of chunk ``j``, so a block inside the
    prompt is identified by the id of the chunk holding its last token and its end offset.
    Blocks that reach into the output mix that with the output tokens themselves.
    """

    __slots__ = ("hash_ids", "hash_block_tokens", "num_tokens")

    def __init__(self, hash_ids: Sequence[int], hash_block_tokens: int, num_tokens: int):
        if hash_block_tokens <= 0:
            raise ConfigError("hash_block_tokens", "a positive integer", hash_block_tokens)
        if len(hash_ids) * hash_block_tokens < num_tokens:
            raise ConfigError("hash_ids", f"enough ids to cover {num_tokens} prompt tokens "
                              f"at {hash_block_tokens} tokens each", len(hash_ids))
        self.hash_ids = hash_ids
        self.hash_block_tokens = hash_block_tokens
        self.num_tokens = num_tokens

    def block_identity(self, start: int, end: int, output_token_ids: list[int]) -> tuple:
        num_prompt = self.num_tokens
        if start >= num_prompt:
            return tuple(output_token_ids[start - num_prompt:end - num_prompt])
        prompt_end = min(end, num_prompt)
        prompt_part = ("h", self.hash_ids[(prompt_end - 1) // self.hash_block_tokens], prompt_end)
        if end <= num_prompt:
            return prompt_part
        return prompt_part + tuple(output_token_ids[:end - num_prompt])


PromptSource = TokenPrompt | HashIdPrompt


class BlockHasher:
    """Computes a request's chained block hashes at one granularity with one hash function."""

    __slots__ = ("hash_fn", "hash_block_size", "none_hash")

    def __init__(self, hash_fn: HashFn, hash_block_size: int):
        self.hash_fn = hash_fn
        self.hash_block_size = hash_block_size
        self.none_hash = none_hash(hash_fn)

    def extend(self, hashes: list, prompt: PromptSource, output_token_ids: list[int],
               num_tokens: int, extra: ExtraKeys | None) -> None:
        """Append the hashes of blocks that became full since ``hashes`` was last extended."""
        bs = self.hash_block_size
        hash_fn = self.hash_fn
        index = len(hashes)
        parent = hashes[-1] if hashes else self.none_hash
        while (index + 1) * bs <= num_tokens:
            start = index * bs
            identity = prompt.block_identity(start, start + bs, output_token_ids)
            keys = extra.for_block(index) if extra is not None else None
            parent = hash_fn((parent, identity, keys))
            hashes.append(parent)
            index += 1


class CoarseBlockHashes:
    """Block hashes of a group whose block is ``factor`` fine hash blocks long.

    The fine chain already covers the whole prefix, so coarse block ``i`` reuses fine hash
    ``(i + 1) * factor - 1`` instead of hashing again (semantics 1, "Coarser groups").
    """

    __slots__ = ("fine", "factor")

    def __init__(self, fine: list, factor: int):
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
