"""Where a prefill chunk must end for a Mamba model in "align" mode (vLLM 0.33's
``Scheduler._mamba_block_aligned_split``; docs/semantics.md#mamba).

Align mode caches a Mamba state only where a prefill chunk ends, so chunks must end on
block boundaries. vLLM's scheduler cuts them in align mode whether prefix caching is on or
not (its engine config would switch the mode to "none" first).
"""

from __future__ import annotations

from kvtwin.sim.core.config import SchedulerConfig
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.spec import (KVCacheConfig, MambaSpec, get_mamba_prefill_checkpoint_position,
                                  is_mamba_prefill_checkpoint_valid)


class MambaChunks:
    """The chunk rule of one layout; ``block_size`` 0: no align-mode Mamba group, no rule."""

    def __init__(self, kv_cache_config: KVCacheConfig, scheduler_config: SchedulerConfig):
        mamba_specs = [g.spec for g in kv_cache_config.groups if isinstance(g.spec, MambaSpec)]
        align = [s for s in mamba_specs if s.mamba_cache_mode == "align"]
        self.block_size = align[0].block_size if align else 0
        # Unless every Mamba group's kernel can also leave the state at the prompt's last
        # cacheable boundary from inside the final chunk (a prefill checkpoint): then that
        # chunk need not stop there. vLLM takes the first Mamba group's alignment.
        self.has_prefill_checkpoint_blocks = bool(mamba_specs) and all(
            s.num_prefill_checkpoint_blocks > 0 for s in mamba_specs)
        self.prefill_checkpoint_alignment = mamba_specs[0].prefill_checkpoint_alignment if mamba_specs else None
        # A draft head with caching off drops attention hits' last block; Mamba checkpoints
        # follow it one block back (vLLM's ``use_eagle_block_drop``).
        self.use_eagle_block_drop = scheduler_config.use_eagle_block_drop
        self.hash_block_size = kv_cache_config.hash_block_size
        max_prefill_tokens = scheduler_config.max_num_batched_tokens
        if scheduler_config.long_prefill_token_threshold > 0:
            max_prefill_tokens = min(max_prefill_tokens, scheduler_config.long_prefill_token_threshold)
        self.max_prefill_tokens = max_prefill_tokens

    def aligned_split(self, request: Request, num_new: int, num_new_computed: int) -> int:
        """Clip a prefill chunk so it ends where a Mamba state must be cached.

        States are written only at chunk ends, so an unfinished prefill chunk must end on a
        block boundary; it also stops at the last cacheable boundary of the sequence and at
        a shared-prefix junction, so siblings sharing that prefix can reuse its state. A
        final chunk whose kernel exports that last boundary as a prefill checkpoint (vLLM
        0.33, ``is_mamba_prefill_checkpoint_valid``) runs through it, and may then start
        mid-block.
        """
        block_size = self.block_size
        start = request.num_computed_tokens + num_new_computed  # the local hit and any loaded tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return num_new
        end = start + num_new
        # The last boundary a later request can hit (hits stop at num_tokens - 1).
        drop = self.use_eagle_block_drop
        last_cache_position = get_mamba_prefill_checkpoint_position(request.num_tokens, block_size, drop)
        internal_checkpoint = (
            self.has_prefill_checkpoint_blocks and end >= prefill_end
            and is_mamba_prefill_checkpoint_valid(
                start, end, get_mamba_prefill_checkpoint_position(prefill_end, block_size, drop), self.hash_block_size,
                block_size, self.prefill_checkpoint_alignment))
        if internal_checkpoint:
            last_cache_position = 0
        if end < prefill_end:
            aligned_end = end // block_size * block_size
            if aligned_end > start or block_size <= self.max_prefill_tokens:
                end = aligned_end
        boundary = request.shared_prefix_boundary
        stops = (
            (start // block_size + 1) * block_size if start % block_size and not internal_checkpoint else 0,
            last_cache_position,
            start + (boundary - start) // block_size * block_size if start < boundary < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)
