"""What a decode side's read moves (docs/semantics.md#disaggregated-prefill-and-decode,
"D side, allocation"): the blocks its admission took from the pool for the loaded tokens,
per KV cache group, clipped as vLLM's NIXL connector clips them.

The expected counts are derived here two ways, neither of them the connector's:

* from the managers' rules: the table of a new request holds null for its skipped
  prefix (``get_num_skipped_tokens`` of everything loaded), then its local hit, then
  fresh blocks up to the loaded tokens, so the fresh count is ``cdiv(N, bs) -
  max(skipped blocks, hit blocks)``; a Mamba group reads its one state block;
* from the decode engine's block table after the admission: the blocks in it that were
  not cached before (a pool large enough that nothing is evicted).

The golden cases ``pd_swa*_reads``, ``pd_chunked*_reads`` (``tests/sim/pd/test_pd_golden.py``)
pin the same counts against vLLM's own connector."""

from __future__ import annotations

import pytest

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.pd_connector import (PDConnector, PDTier, StepPDTransfers, group_block_bytes, read_blocks_by_group,
                                          remote_prefill_tokens)
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.spec import (ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec,
                                  cdiv)
from tests.sim.builders import EchoModel, full, kv_config

BS = 16


def swa(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, sliding_window=window)


def chunked(chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=chunk)


MAMBA = MambaSpec(block_size=BS, shapes=((4, 8),), dtype_bytes=(4,), mamba_cache_mode="align")

LAYOUTS = ([(full(),)] + [(full(), swa(w)) for w in (5, 8, 15, 16, 17, 24, 32, 40, 64, 100)]
           + [(full(), chunked(c)) for c in (16, 32, 40, 48, 64)] + [(full(), MAMBA)])


def expected_counts(specs, hit: int, num_tokens: int) -> tuple[int, ...]:
    """The managers' rules: blocks a read of tokens ``[hit, num_tokens)`` takes per group."""
    if num_tokens <= hit:
        return (0,) * len(specs)
    counts = []
    for spec in specs:
        if isinstance(spec, MambaSpec):
            counts.append(1)
            continue
        if isinstance(spec, SlidingWindowSpec):
            skipped = max(0, num_tokens - spec.sliding_window + 1)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            skipped = num_tokens // spec.attention_chunk_size * spec.attention_chunk_size
        else:
            skipped = 0
        bs = spec.block_size
        counts.append(cdiv(num_tokens, bs) - max(skipped // bs, hit // bs))
    return tuple(counts)


def decode_engine(specs) -> tuple[EngineCore, PDTier]:
    """A decode-side engine on the step clock, and its connector tier."""
    config = kv_config(*specs, num_blocks=2048)
    tier = PDTier(PDConnector(config), StepPDTransfers(1))
    return EngineCore(config, SchedulerConfig(max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=64,
                                              async_scheduling=False),
                      CacheConfig(enable_prefix_caching=True), tier), tier


def run_until_done(engine: EngineCore) -> None:
    for _ in range(50):
        if not engine.has_requests():
            return
        engine.step(EchoModel())
    raise AssertionError("the priming request did not finish")


PREFIX = list(range(1, 1 + 7 * BS))


def read_of(engine: EngineCore, tier: PDTier, specs, request_id: str, prompt: list[int]):
    """Admit ``prompt`` as a remote prefill; its read and the blocks its table gained that
    were not cached before, per group."""
    pool = engine.kv_cache_manager.block_pool
    cached_before = {b.block_id for b in pool.blocks if b.block_hash is not None}
    backoff = tier.connector.prefill_backoff_tokens
    tier.connector.expect_remote_prefill(request_id, remote_prefill_tokens(len(prompt), backoff))
    assert engine.add_request(Request(request_id, TokenPrompt(prompt), 2))
    engine.step(EchoModel())
    (read,) = tier.transfers.last_reads
    assert read.req_id == request_id
    tables = engine.kv_cache_manager.get_block_ids(request_id)
    taken = tuple(len({b for b in table if b != 0} - cached_before) for table in tables)
    return read, taken


LENGTHS = [*range(1, 40), *range(40, 10 * BS + 1, 7)]


def layout_id(specs) -> str:
    return "+".join(f"swa{s.sliding_window}" if isinstance(s, SlidingWindowSpec) else
                    f"chunked{s.attention_chunk_size}" if isinstance(s, ChunkedLocalAttentionSpec) else
                    "mamba" if isinstance(s, MambaSpec) else "full" for s in specs)


@pytest.mark.parametrize("specs", LAYOUTS, ids=layout_id)
def test_read_is_what_the_admission_took(specs):
    """Every (hit, prompt length) with a cached prefix of 0..7 blocks and prompts up to
    ten blocks past it: the read's blocks are the managers' count and the table's fresh
    blocks, and its bytes those blocks' pages."""
    block_bytes = group_block_bytes(kv_config(*specs))
    checked = 0
    for hit_blocks in range(0, 8):
        engine, tier = decode_engine(specs)
        if hit_blocks:
            # Cache the prefix on the decode side (a local request, run to the end).
            engine.add_request(Request("prime", TokenPrompt(PREFIX[:hit_blocks * BS] + [99_000]), 1))
            run_until_done(engine)
        for k, length in enumerate(LENGTHS):
            request_id = f"r{k}"
            prompt = PREFIX[:hit_blocks * BS] + [100_000 + 1000 * k + i for i in range(length)]
            read, taken = read_of(engine, tier, specs, request_id, prompt)
            num_tokens = remote_prefill_tokens(len(prompt), tier.connector.prefill_backoff_tokens)
            hit = num_tokens - read.num_tokens
            assert read.hit_tokens == hit or not read.num_tokens
            assert hit == min(hit_blocks * BS, (len(prompt) - 1) // BS * BS) or any(
                isinstance(s, MambaSpec) for s in specs), (hit_blocks, length, hit)
            expected = expected_counts(specs, hit, num_tokens)
            assert read.num_blocks == expected, (hit_blocks, length, hit, num_tokens)
            if read.num_tokens:
                # Nothing clipped: the admission took exactly what is read.
                assert taken == expected, (hit_blocks, length, hit, num_tokens)
            assert read.num_bytes == sum(n * b for n, b in zip(expected, block_bytes))
            checked += 1
    assert checked == 8 * len(LENGTHS)


def test_skipped_prefix_is_not_read():
    """A 64-token load into a 32-token window skips 33 tokens (two whole blocks): the
    window's group reads 2 blocks, not the 3 its clip would allow."""
    specs = (full(), swa(32))
    engine, tier = decode_engine(specs)
    read, taken = read_of(engine, tier, specs, "r", list(range(1, 65)))
    assert read.num_tokens == 64
    assert read.num_blocks == (4, 2) == taken


def test_a_chunk_boundary_reads_nothing_of_the_local_group():
    """128 loaded tokens end a 32-token chunk: the chunked group skips them all and
    allocates no block, so it reads none."""
    specs = (full(), chunked(32))
    engine, tier = decode_engine(specs)
    read, taken = read_of(engine, tier, specs, "r", list(range(1, 129)))
    assert read.num_blocks == (8, 0) == taken


def test_clip_only_where_a_group_is_not_full_attention():
    """vLLM clips only when some group is not full attention; a window never holds more
    than its clip, so the clip only shows on a table that has more fresh blocks than the
    window needs (built by hand here)."""
    from kvtwin.sim.core.block_pool import KVCacheBlock

    def fresh(n: int) -> list[KVCacheBlock]:
        return [KVCacheBlock(i + 1) for i in range(n)]

    config = kv_config(full(), swa(32))
    assert read_blocks_by_group(config, KVCacheBlocks((fresh(10), fresh(6))), 160) == (10, 3)
    config = kv_config(full(), MAMBA)
    assert read_blocks_by_group(config, KVCacheBlocks((fresh(10), fresh(2))), 160) == (10, 1)
    assert read_blocks_by_group(config, KVCacheBlocks((fresh(10), fresh(2))), 0) == (0, 0)
    assert read_blocks_by_group(kv_config(full()), KVCacheBlocks((fresh(10),)), 160) == (10,)
    assert isinstance(config.groups[0].spec, FullAttentionSpec)
