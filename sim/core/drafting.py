"""The scheduler's rules for speculative decoding that need no scheduler state
(docs/semantics.md#speculative-decoding): which layouts and configs it models, how a
prefill chunk leaves room for a multi-module MTP drafter, which drafts a step verifies,
and what verifying them did. The loops that apply them are ``Scheduler``'s, with drafts
inline."""

from __future__ import annotations

from math import lcm

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.errors import ConfigError, require
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig, MambaSpec, SlidingWindowSpec
from kvtwin.sim.core.spec_decode_stats import RequestSpecDecodeMetrics, SpecDecodingStats


def check_drafting(kv_cache_config: KVCacheConfig, cfg: SchedulerConfig, cache_config: CacheConfig) -> None:
    """What of drafts and a draft head kvtwin models with this layout
    (docs/semantics.md#draft-heads-and-prefix-caching); a ``ConfigError`` names the rest."""
    mamba_specs = [g.spec for g in kv_cache_config.groups if isinstance(g.spec, MambaSpec)]
    if cfg.num_speculative_tokens:
        # A Mamba group keeps k speculative state blocks per request (vLLM 0.33 sizes its
        # spec from the speculative config).
        require(all(s.num_speculative_blocks == cfg.num_speculative_tokens for s in mamba_specs),
                "num_speculative_blocks", f"{cfg.num_speculative_tokens} (num_speculative_tokens) on every Mamba "
                "KV cache group", [s.num_speculative_blocks for s in mamba_specs])
        caching = cache_config.enable_prefix_caching
        # With caching on a head hashes with lookahead: vLLM's legacy trailing-block drop
        # (disable_lookahead_block_hashes) is not modelled.
        require(not (cfg.num_lookahead_tokens and caching) or cfg.num_hash_lookahead_tokens > 0,
                "num_hash_lookahead_tokens", "at least 1 with a draft head and prefix caching on (the legacy "
                "block drop is not modelled)", cfg.num_hash_lookahead_tokens)
        prefill_lookahead = cfg.num_prefill_lookahead_tokens
        if prefill_lookahead > 1:
            require(not mamba_specs, "num_prefill_lookahead_tokens", "at most 1 with Mamba groups (multi-module "
                    "MTP on a hybrid Mamba model is not modelled)", prefill_lookahead)
            block = lcm(*(g.spec.block_size for g in kv_cache_config.groups))
            # vLLM: the re-prefillable tail must fit the block a hit would drop.
            require(not caching or block >= prefill_lookahead, "num_prefill_lookahead_tokens",
                    f"at most the scheduler block size ({block}) with prefix caching on", prefill_lookahead)
    # vLLM's planner retains a multi-module MTP drafter's re-prefillable tail below every
    # sliding window (docs/semantics.md#sliding-window): a layout built for another
    # drafter would free window blocks at other steps.
    extra_retained = max(0, cfg.num_prefill_lookahead_tokens - 1)
    windows = [g.spec for g in kv_cache_config.groups if isinstance(g.spec, SlidingWindowSpec)]
    require(all(s.extra_retained_tokens == extra_retained for s in windows), "extra_retained_tokens",
            f"{extra_retained} (num_prefill_lookahead_tokens - 1, at least 0) on every sliding-window KV cache "
            "group", [s.extra_retained_tokens for s in windows])


def reserve_prefill_lookahead(request: Request, computed: int, num_new: int, lookahead: int) -> int:
    """vLLM's ``_reserve_prefill_lookahead``: a chunk that would end within ``lookahead``
    tokens of the prefill end is shortened to leave that many for the next one
    (multi-module MTP reads them as draft inputs)."""
    remaining = request.num_tokens - computed - num_new
    if 0 < remaining < lookahead:
        num_new -= lookahead - remaining
    return max(num_new, 0)


def pad_admission(out: SchedulerOutput, request_id: str, num_new: int, num_padding: int, num_spec_tokens: int,
                  long_prefill_threshold: int) -> None:
    """A one-token admission padded to a verify step (``Scheduler._first_chunk``): its
    ``num_padding`` placeholder drafts, never accepted (docs/semantics.md#scheduling-drafts)."""
    if num_padding != num_spec_tokens:
        # Only the long-prefill threshold shortens a padded row, and only without a Mamba
        # align-mode layout (which drops the padding instead); vLLM 0.33 then fails an
        # assertion and its engine stops.
        raise ConfigError("long_prefill_token_threshold",
                          f"0 or at least 1 + num_speculative_tokens = {1 + num_spec_tokens} (request {request_id}'s "
                          f"one-token admission, padded to a verify step, was cut to {num_new} tokens, where vLLM "
                          "0.33 fails an assertion)", long_prefill_threshold)
    assert out.scheduled_spec_decode_tokens is not None
    out.scheduled_spec_decode_tokens[request_id] = [-1] * num_padding


def schedule_spec_tokens(out: SchedulerOutput, request: Request, num_new: int) -> None:
    """The drafts that fit in the ``num_new`` tokens just scheduled for a running request
    (the first ones: the clips may cut them) are verified this step; the rest are
    dropped, and the request waits for new drafts from this step's output."""
    num_spec = num_new + request.num_computed_tokens - request.num_tokens - request.num_output_placeholders
    if num_spec > 0:
        spec_token_ids = request.spec_token_ids
        assert out.scheduled_spec_decode_tokens is not None
        out.scheduled_spec_decode_tokens[request.request_id] = (
            spec_token_ids[:num_spec] if len(spec_token_ids) > num_spec else spec_token_ids)
    request.spec_token_ids = []


def verify_drafts(request: Request, spec_stats: SpecDecodingStats, num_drafts: int, num_accepted: int,
                  stale: bool) -> None:
    """``request`` verified ``num_drafts`` drafts and accepted ``num_accepted``: the
    rejected ones leave its computed count (and placeholders), unless the output is stale
    (the preemption reset the counts already); it counts either way, in the batch's stats
    and the request's own, as vLLM's ``make_spec_decoding_stats`` does
    (docs/semantics.md#speculative-decoding)."""
    if not stale:
        num_rejected = num_drafts - num_accepted
        if request.num_computed_tokens > 0:
            request.num_computed_tokens -= num_rejected
        if request.num_output_placeholders > 0:
            request.num_output_placeholders -= num_rejected
    spec_stats.observe_draft(num_drafts, num_accepted)
    metrics = request.spec_decode_metrics
    if metrics is None:
        metrics = request.spec_decode_metrics = RequestSpecDecodeMetrics()
    metrics.observe(num_drafts, num_accepted)
