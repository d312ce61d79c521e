"""Engine settings the scheduler and KV cache manager run with (docs/semantics.md#scheduler-defaults).

The bottom of one chain: a scenario's ``[engine]`` table becomes the planner's
``EngineConfig`` (vLLM's option names, None for "vLLM's default"), which resolves against a
model and GPU into a ``ResolvedEngineConfig`` holding the two configs here. The golden
cases build these two directly from their ``config.json``.

The rules each knob must satisfy live here once, in ``SCHEDULER_KNOBS`` and
``CACHE_KNOBS``: ``EngineConfig`` checks a scenario against the same table, so a value is
refused with the same words wherever it comes from. Strings are never booleans.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from kvtwin.sim.core.errors import require
from kvtwin.sim.core.hashing import HASH_FUNCTIONS

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float: an infinite or NaN setting would pass a range check (``inf > 0``)
    and then make nonsense of every figure computed from it."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value)


# Byte sizes, as scenario values, flags and sweep values all accept them: decimal units as
# disks and DRAM are sold, binary ones as GPUs and vLLM's logs count.
BYTE_UNITS: dict[str, int] = {"kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
BYTE_FORMS = "an integer, 1e9, or a number and a unit of kB, MB, GB, TB, KiB, MiB, GiB or TiB: 500GB, 1.5 TiB"
# At most a three-digit exponent: "1e999999999" would otherwise be a billion-digit integer.
_BYTES_TEXT = re.compile(r"\s*([-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]{1,3})?)\s*"
                         r"([A-Za-z]*)(/s)?\s*")


def byte_amount(value: object, *, per_second: bool = False) -> Fraction | None:
    """``value`` as an exact number of bytes (bytes per second with ``per_second``, where a
    unit may end in ``/s``), or None when it is not one: an int, a finite float, or text
    such as ``"1e9"``, ``"500GB"``, ``"1.5 TiB"``. Exact, so that ``1.5TB`` is a whole
    number of bytes and ``0.1`` is not; the sign is the caller's to judge."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(value) if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    match = _BYTES_TEXT.fullmatch(value)
    if match is None or (match.group(3) and not per_second):
        return None
    number, unit = match.group(1).replace("_", ""), match.group(2)
    if unit and unit not in BYTE_UNITS:
        return None
    try:
        amount = Fraction(number)
    except (ValueError, ZeroDivisionError):
        return None
    return amount * BYTE_UNITS[unit] if unit else amount


def byte_count(value: object, field: str, expected: str, *, minimum: int = 0) -> int:
    """``value`` as a whole number of bytes, at least ``minimum``; else a ``ConfigError``
    naming ``field`` (``expected`` says what it wanted)."""
    amount = byte_amount(value)
    require(amount is not None and amount.denominator == 1 and amount >= minimum, field, expected, value)
    assert amount is not None
    return int(amount)


def byte_rate(value: object, field: str, expected: str, *, positive: bool = False) -> float | int:
    """``value`` as bytes per second (non-negative; positive with ``positive``); a number
    comes back as it was given, text as a float."""
    amount = byte_amount(value, per_second=True)
    require(amount is not None and (amount > 0 if positive else amount >= 0), field, expected, value)
    assert amount is not None
    if isinstance(value, (int, float)):
        return value
    return int(amount) if amount.denominator == 1 else float(amount)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


Rule = tuple[Callable[[object], bool], str]
_BOOL: Rule = (_is_bool, "true or false")

# knob -> (accepts, what is expected); the fields of SchedulerConfig besides the sizes.
SCHEDULER_KNOBS: dict[str, Rule] = {
    "scheduling_policy": (lambda v: v in SCHEDULING_POLICIES, "'fcfs' or 'priority'"),
    "enable_chunked_prefill": _BOOL,
    "long_prefill_token_threshold": (lambda v: is_int(v) and v >= 0, "a non-negative integer (0 = off)"),
    "adaptive_long_prefill_threshold": _BOOL,
    "watermark": (lambda v: is_number(v) and 0.0 <= v < 1.0, "a fraction in [0, 1)"),
    "scheduler_reserve_full_isl": _BOOL,
    "async_scheduling": _BOOL,
    "prefill_schedule_interval": (lambda v: is_int(v) and v > 0, "a positive integer (1 = every step)"),
}
CACHE_KNOBS: dict[str, Rule] = {
    "enable_prefix_caching": _BOOL,
    "prefix_caching_hash_algo": (lambda v: v in HASH_FUNCTIONS, f"one of {', '.join(HASH_FUNCTIONS)}"),
    # None here is a value (dense retention), not "the default": ``check_knobs`` skips it.
    "prefix_cache_retention_interval": (lambda v: is_int(v) and v >= 0,
                                        "a non-negative number of tokens (0: semantic checkpoints only), or dense"),
}


def check_knobs(values: Mapping[str, object], rules: Mapping[str, Rule]) -> None:
    """Raise a ``ConfigError`` naming the first value its rule refuses (None is skipped:
    it means "the default" to callers that allow it)."""
    for name, value in values.items():
        accepts, expected = rules[name]
        if value is not None:
            require(accepts(value), name, expected, value)


# vLLM's speculative-decoding methods kvtwin runs (docs/semantics.md#speculative-decoding),
# and those whose drafter is a model with its own KV cache (vLLM's ``use_eagle()``): the one
# list the scenario layer, the golden-case loader and the planner's draft head read.
SPEC_METHODS = ("ngram", "eagle", "eagle3", "mtp")
HEAD_METHODS = ("eagle", "eagle3", "mtp")


@dataclass(frozen=True)
class SchedulerConfig:
    """vLLM's scheduler knobs; defaults are vLLM 0.33's ``SchedulerConfig`` defaults.

    ``async_scheduling`` has none here: vLLM resolves it at engine level (on unless something
    rules it out, docs/semantics.md#asynchronous-scheduling), and the planner's
    ``EngineConfig`` holds that default; whatever else builds a scheduler config (a golden
    case, a test) says which scheduler it means."""

    max_model_len: int
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # Raise the threshold to a fair share of the budget (budget // eligible requests).
    adaptive_long_prefill_threshold: bool = False
    scheduling_policy: SchedulingPolicy = "fcfs"
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = True
    # Prefill work on every Nth step (1: every step): on a data-parallel MoE group's shared
    # step counter (docs/semantics.md#data-parallel-lockstep), else the scheduler's own
    # cadence (docs/semantics.md#local-prefill-cadence).
    prefill_schedule_interval: int = 1
    # The engine's DP size as vLLM's scheduler sees it: > 1 only on a MoE model's DP rank,
    # whose engine core drives the cadence; a single engine and a dense model's DP ranks
    # (which vLLM reconfigures as independent engines) see 1 and keep a local cadence.
    data_parallel_size: int = 1
    # vLLM's AsyncScheduler: two batches in flight (EngineCore.step_async), which also
    # doubles the tokens the sliding-window and chunked-local admission caps must cover.
    async_scheduling: bool = dataclasses.field(kw_only=True)
    # Speculative decoding (docs/semantics.md#speculative-decoding): k draft tokens verified
    # per decode (vLLM's ``num_speculative_tokens``; 0: off) and the KV slots reserved past
    # them for a drafter that writes its own KV (``num_lookahead_tokens``: 0 for n-gram).
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    # With a draft head and prefix caching on, the tokens after each block that its hash
    # covers (vLLM's ``num_hash_lookahead_tokens``: 1 for EAGLE, EAGLE-3 and single-module
    # MTP, k for multi-module MTP; docs/semantics.md#draft-heads-and-prefix-caching); 0:
    # plain hashes. And the prefill tokens past a chunk the drafter reads (vLLM's
    # ``num_prefill_lookahead_tokens``: k for multi-module MTP; 0 or 1 change nothing).
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead_tokens: int = 0
    # vLLM's ``pipeline_parallel_size``: the engine keeps this many batches in flight
    # through its batch queue with the synchronous scheduler, one more with asynchronous
    # scheduling (docs/semantics.md#pipeline-parallelism).
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "pipeline_parallel_size",
                     "data_parallel_size"):
            value = getattr(self, name)
            require(is_int(value) and value > 0, name, "a positive integer", value)
        check_knobs({name: getattr(self, name) for name in SCHEDULER_KNOBS}, SCHEDULER_KNOBS)
        if (self.num_speculative_tokens or self.num_lookahead_tokens or self.num_hash_lookahead_tokens
                or self.num_prefill_lookahead_tokens):
            self._check_speculative()
        if self.pipeline_parallel_size > 1:
            self._check_pipeline()
        if self.local_prefill_interval > 1:
            require(self.num_speculative_tokens == 0 and self.pipeline_parallel_size == 1,
                    "prefill_schedule_interval", "1 with speculative decoding or pipeline stages (a local prefill "
                    "cadence is modelled for one plain engine: docs/semantics.md#local-prefill-cadence)",
                    self.prefill_schedule_interval)
        if not self.enable_chunked_prefill:
            # Without chunking a max_model_len prompt must fit one step, as vLLM requires.
            require(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                    f">= max_model_len ({self.max_model_len}) when chunked prefill is off",
                    self.max_num_batched_tokens)

    def _check_pipeline(self) -> None:
        """What kvtwin runs with pipeline parallelism: either scheduler, without drafts
        (docs/semantics.md#pipeline-parallelism)."""
        pp = self.pipeline_parallel_size
        require(not self.num_speculative_tokens, "pipeline_parallel_size",
                "1 with speculative decoding (drafts with several batches in flight are not modelled)", pp)

    def _check_speculative(self) -> None:
        k = self.num_speculative_tokens
        require(is_int(k) and k >= 0, "num_speculative_tokens", "a non-negative integer (0 = off)", k)
        # vLLM would clip a verify step to the budget; a budget that can never verify all k
        # drafts of even one request is a configuration mistake, so it is refused here.
        require(k + 1 <= self.max_num_batched_tokens, "num_speculative_tokens",
                f"at most max_num_batched_tokens - 1 = {self.max_num_batched_tokens - 1} (one decode token "
                f"plus k drafts must fit one step's budget)", k)
        lookahead = self.num_lookahead_tokens
        require(is_int(lookahead) and lookahead >= 0, "num_lookahead_tokens", "a non-negative integer", lookahead)
        require(k > 0 or lookahead == 0, "num_lookahead_tokens", "0 unless num_speculative_tokens > 0", lookahead)
        prefill_lookahead = self.num_prefill_lookahead_tokens
        require(is_int(prefill_lookahead) and 0 <= prefill_lookahead <= k, "num_prefill_lookahead_tokens",
                f"an integer from 0 to num_speculative_tokens ({k})", prefill_lookahead)
        require(lookahead > 0 or prefill_lookahead == 0, "num_prefill_lookahead_tokens",
                "0 unless a draft head reserves lookahead slots (num_lookahead_tokens > 0)", prefill_lookahead)
        hash_lookahead = self.num_hash_lookahead_tokens
        # vLLM hashes with exactly the drafter's prefill lookahead, or not at all.
        require(hash_lookahead in (0, max(1, prefill_lookahead)), "num_hash_lookahead_tokens",
                f"0 or {max(1, prefill_lookahead)} (num_prefill_lookahead_tokens, at least 1)", hash_lookahead)
        require(lookahead > 0 or hash_lookahead == 0, "num_hash_lookahead_tokens",
                "0 unless a draft head reserves lookahead slots (num_lookahead_tokens > 0)", hash_lookahead)

    @property
    def use_eagle_block_drop(self) -> bool:
        """vLLM's ``use_eagle_block_drop``: a draft head whose hashes cover no lookahead
        (prefix caching off; with caching on the scheduler requires lookahead hashes). It
        only moves a Mamba group's checkpoint stop (docs/semantics.md#draft-heads-and-prefix-caching)."""
        return self.num_lookahead_tokens > 0 and self.num_hash_lookahead_tokens == 0

    @property
    def local_prefill_interval(self) -> int:
        """The scheduler's own prefill cadence (vLLM's ``Scheduler.local_prefill_interval``):
        ``prefill_schedule_interval`` unless a DP MoE group's engine core drives it
        (docs/semantics.md#local-prefill-cadence)."""
        return self.prefill_schedule_interval if self.data_parallel_size == 1 else 1

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine keeps in flight (vLLM's ``VllmConfig.max_concurrent_batches``
        with its default V2 model runner): one per pipeline stage, and one more with
        asynchronous scheduling (docs/semantics.md#asynchronous-pipeline-parallelism)."""
        if self.async_scheduling:
            return self.pipeline_parallel_size + 1
        return self.pipeline_parallel_size

    @property
    def max_in_flight_tokens(self) -> int:
        """What the sliding-window / chunked-local admission caps add to the window."""
        return self.max_concurrent_batches * self.max_num_batched_tokens


@dataclass(frozen=True)
class CacheConfig:
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    # vLLM's ``CacheConfig.prefix_cache_retention_interval``, the engine's setting: 0 by
    # default (sliding-window and Mamba groups keep semantic checkpoints only), N also every
    # N tokens, None every block. The planner copies it into the ``KVCacheConfig`` the KV
    # cache manager runs on; an offload connector reads it here
    # (docs/semantics.md#prefix-cache-retention).
    prefix_cache_retention_interval: int | None = 0

    def __post_init__(self) -> None:
        check_knobs({name: getattr(self, name) for name in CACHE_KNOBS}, CACHE_KNOBS)
