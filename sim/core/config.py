"""Engine settings the scheduler and KV cache manager run with (semantics section 6 defaults).

Frozen, validated on construction: a bad value is a ``ConfigError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtwin.sim.core.errors import require

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    """vLLM's scheduler knobs; defaults are vLLM 0.33's ``SchedulerConfig`` defaults."""

    max_model_len: int
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # Raise the threshold to a fair share of the budget (budget // eligible requests).
    adaptive_long_prefill_threshold: bool = False
    policy: SchedulingPolicy = "fcfs"
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = True
    # Two batches in flight double the tokens the sliding-window and chunked-local
    # admission caps must cover. The step loop itself is synchronous.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                    "a positive integer", value)
        require(isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0,
                "long_prefill_token_threshold", "a non-negative integer (0 = off)", self.long_prefill_token_threshold)
        require(self.policy in ("fcfs", "priority"), "scheduling_policy", "'fcfs' or 'priority'", self.policy)
        require(0.0 <= self.watermark < 1.0, "watermark", "a fraction in [0, 1)", self.watermark)
        if not self.enable_chunked_prefill:
            # Without chunking a max_model_len prompt must fit one step, as vLLM requires.
            require(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                    f">= max_model_len ({self.max_model_len}) when chunked prefill is off",
                    self.max_num_batched_tokens)

    @property
    def max_in_flight_tokens(self) -> int:
        return (2 if self.async_scheduling else 1) * self.max_num_batched_tokens


@dataclass(frozen=True)
class CacheConfig:
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    enable_kv_events: bool = False
