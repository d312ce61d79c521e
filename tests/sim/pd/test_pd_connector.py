"""The P/D connector's scheduler half, pinned by rules read from vLLM 0.33's NIXL pull
connector and scheduler (docs/semantics.md#disaggregated-prefill-and-decode)."""

from __future__ import annotations

import pytest

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.kv_connector import KVConnectorOutput
from kvtwin.sim.core.pd_connector import (PDConnector, PDConnectorMetadata, PDLink, PDTier, PDTransfers,
                                          prefill_backoff_tokens, remote_prefill_tokens, truncated_prompt)
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import MambaSpec
from tests.sim.builders import EchoModel, full, kv_config, tokens


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pd_engine(clock: Clock, *, num_blocks: int = 64, async_scheduling: bool = False,
              bandwidth: float = 16 * 1024.0, latency: float = 0.5, on_read=None) -> tuple[EngineCore, PDTier]:
    """An engine with a P/D connector on ``clock``, and that connector tier."""
    config = kv_config(full(), num_blocks=num_blocks)
    tier = PDTier(PDConnector(config), PDTransfers(clock, PDLink(bandwidth, latency), on_read))
    return EngineCore(config, SchedulerConfig(max_model_len=4096, async_scheduling=async_scheduling),
                      CacheConfig(enable_prefix_caching=True), tier), tier


def used_blocks(engine: EngineCore) -> int:
    pool = engine.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def test_prefill_side_keeps_blocks_until_finished_sending():
    clock = Clock()
    p, tier = pd_engine(clock)
    tier.connector.mark_remote_decode("r")
    p.add_request(Request("r", TokenPrompt(tokens(0, 40)), 1))
    result = p.step(EchoModel())
    assert [r.request_id for r in result.finished] == ["r"]
    # Finished, reported, but its 3 blocks stay allocated: the decode side reads them.
    assert used_blocks(p) == 3
    assert p.has_requests()  # vLLM keeps stepping while has_finished_requests
    assert p.kv_cache_manager.get_block_ids("r")[0] != []
    # No request is unfinished, yet the held blocks keep a clock waiting; nothing is timed yet.
    assert not p.has_unfinished_requests() and p.waits_for_transfers()
    assert p.next_transfer_event_s() is None
    tier.transfers.send_done("r", 2.0)
    assert p.next_transfer_event_s() == 2.0
    clock.now = 1.0
    p.step(EchoModel())
    assert used_blocks(p) == 3  # not yet: the read lands at 2.0
    clock.now = 2.0
    p.step(EchoModel())
    assert used_blocks(p) == 0
    assert not p.has_requests()
    assert not p.waits_for_transfers() and p.next_transfer_event_s() is None


def test_request_not_marked_frees_at_once():
    clock = Clock()
    p, _ = pd_engine(clock)
    p.add_request(Request("r", TokenPrompt(tokens(0, 40)), 1))
    p.step(EchoModel())
    assert used_blocks(p) == 0 and not p.scheduler.connector_state.delayed_free


def test_decode_side_loads_whole_prompt_then_recomputes_last_token():
    clock = Clock()
    reads = []
    d, tier = pd_engine(clock, on_read=lambda read, issued, done: reads.append((read.req_id, read.num_tokens, issued,
                                                                               done)))
    tier.connector.expect_remote_prefill("r", 40)
    req = Request("r", TokenPrompt(tokens(0, 40)), 4)
    d.add_request(req)
    out = d.step(EchoModel()).output
    # Admitted as an async load: blocks allocated, nothing computed this step.
    assert not out.num_scheduled_tokens
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == 40
    assert used_blocks(d) == 3
    assert isinstance(out.kv_connector_metadata, PDConnectorMetadata)
    # 3 blocks of one layer of a full-attention group: bytes over the link plus latency.
    page = full().real_page_size_bytes
    assert reads == [("r", 40, 0.0, 3 * page / (16 * 1024.0) + 0.5)]
    clock.now = reads[0][3]
    d.step(EchoModel())  # the empty step that reports finished_recving
    out = d.step(EchoModel()).output
    # The last prompt token is recomputed to sample the first output token.
    assert out.num_scheduled_tokens == {"r": 1}
    assert out.num_computed_tokens == [39]
    assert req.status is RequestStatus.RUNNING


def test_decode_side_local_hit_reads_the_rest_only():
    clock = Clock()
    d, tier = pd_engine(clock)
    # Warm D's prefix cache with the first 32 tokens.
    d.add_request(Request("warm", TokenPrompt(tokens(0, 32)), 1))
    d.step(EchoModel())
    connector = tier.connector
    connector.expect_remote_prefill("r", 40)
    assert connector.get_num_new_matched_tokens(Request("x", TokenPrompt(tokens(0, 40)), 1), 32) == (0, False)
    req = Request("r", TokenPrompt(tokens(0, 40)), 4)
    d.add_request(req)
    meta = d.step(EchoModel()).output.kv_connector_metadata
    assert [(r.num_tokens, r.num_blocks) for r in meta.reads] == [(8, (1,))]
    assert req.num_computed_tokens == 40


def test_full_local_hit_reads_nothing_but_still_notifies():
    # A hit never covers a prompt's last token, so only a backoff can make D's hit reach
    # everything P computed; the read is then empty (it only tells P to free).
    connector = PDConnector(kv_config(full()))
    connector.expect_remote_prefill("r", 32)
    req = Request("r", TokenPrompt(tokens(0, 33)), 4)
    assert connector.get_num_new_matched_tokens(req, 32) == (0, False)
    connector.update_state_after_alloc(req, KVCacheBlocks.empty(1), 0)
    reads = connector.build_connector_meta(SchedulerOutput(), None).reads
    assert [(r.num_tokens, r.num_bytes) for r in reads] == [(0, 0)]
    assert not connector.receiving


def test_one_read_per_request_even_after_preemption():
    connector = PDConnector(kv_config(full()))
    connector.expect_remote_prefill("r", 40)
    req = Request("r", TokenPrompt(tokens(0, 40)), 4)
    assert connector.get_num_new_matched_tokens(req, 0) == (40, True)
    connector.update_state_after_alloc(req, KVCacheBlocks.empty(1), 40)
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)


def test_backoff_for_mamba_only():
    assert prefill_backoff_tokens(kv_config(full())) == 0
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtype_bytes=(2,))
    assert prefill_backoff_tokens(kv_config(full(), mamba)) == 1


def test_a_prompt_no_longer_than_the_backoff_is_loaded_whole():
    """vLLM's decode side loads the prompt less the backoff, or all of it when it is no
    longer than the backoff, as the prefill side then computes it whole."""
    assert [remote_prefill_tokens(n, 1) for n in (1, 2, 3, 17)] == [1, 1, 2, 16]
    assert [remote_prefill_tokens(n, 0) for n in (1, 2)] == [1, 2]
    for n in (1, 2, 3):
        assert truncated_prompt(TokenPrompt(tokens(0, n)), 1).num_tokens == remote_prefill_tokens(n, 1)


def test_link_is_fifo():
    link = PDLink(100.0, 1.0)
    assert link.transfer(0.0, 100) == pytest.approx(2.0)
    assert link.transfer(0.0, 100) == pytest.approx(3.0)  # queued behind the first
    assert link.transfer(10.0, 0) == pytest.approx(11.0)


def test_offload_connector_output_has_no_sends():
    assert KVConnectorOutput().finished_sending == []
