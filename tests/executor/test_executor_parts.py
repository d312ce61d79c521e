"""Unit tests of the executor's parts: token ids, block tables and state copies, the shared
KV pool, and the block audit."""

from __future__ import annotations

import random

import pytest
import torch

from kvtwin.executor.audit import BlockAudit
from kvtwin.executor.block_tables import NULL_BLOCK, BlockTables, StateCopy
from kvtwin.executor.device_replay import ExecutorOptions, build_executor
from kvtwin.executor.shapes import MIXER_ATTENTION, MIXER_STATE, pool_page_bytes
from kvtwin.executor.tokens import TOKEN_ID_BITS, RequestTokens, output_token_id, prompt_token_ids
from kvtwin.sim.core.block_pool import KVCacheBlock
from kvtwin.sim.core.engine import EngineCore, Execution
from kvtwin.sim.core.hashing import HashIdPrompt, TokenPrompt
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvtwin.sim.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from tests.executor.toys import scenario

# ---------------------------------------------------------------------------------------
# tokens
# ---------------------------------------------------------------------------------------


def test_equal_chained_hash_ids_give_equal_tokens_and_only_they():
    a = HashIdPrompt([11, 22, 33], 16, 48)
    b = HashIdPrompt([11, 22, 99], 16, 48)
    ta, tb = prompt_token_ids(a, 0, 48), prompt_token_ids(b, 0, 48)
    assert ta[:32] == tb[:32]
    assert all(x != y for x, y in zip(ta[32:], tb[32:]))
    assert len(set(ta[:16])) == 16  # positions within a chunk differ too
    assert all(0 <= t < 2 ** TOKEN_ID_BITS for t in ta + tb)
    assert prompt_token_ids(a, 20, 40) == ta[20:40]
    # The part no id covers is the request's own: equal for one unique_id, different otherwise.
    c1, c2, c1_again = (HashIdPrompt([11], 16, 40, unique_id=u) for u in (1, 2, 1))
    t1, t2 = prompt_token_ids(c1, 0, 40), prompt_token_ids(c2, 0, 40)
    assert t1[:16] == t2[:16] == ta[:16]
    assert all(x != y for x, y in zip(t1[16:], t2[16:]))
    assert prompt_token_ids(c1_again, 0, 40) == t1
    assert prompt_token_ids(TokenPrompt([5, 6, 7, 8]), 1, 3) == [6, 7]


def test_output_tokens_are_a_function_of_request_and_index_only():
    keys = [(f"r{i}", k) for i in range(5) for k in range(6)]
    first = {key: output_token_id(*key) for key in keys}
    shuffled = keys[:]
    random.Random(0).shuffle(shuffled)
    assert {key: output_token_id(*key) for key in shuffled} == first
    assert len(set(first.values())) == len(keys)
    # RequestTokens: prompt, then the scripted outputs, however it is asked.
    prompt = HashIdPrompt([1, 2], 16, 30, unique_id=7)
    whole = RequestTokens("r3", prompt).ids(0, 36)
    pieces = RequestTokens("r3", prompt)
    assert pieces.ids(31, 34) + pieces.ids(0, 31) + pieces.ids(34, 36) == whole[31:34] + whole[:31] + whole[34:]
    assert whole[:30] == prompt_token_ids(prompt, 0, 30)
    assert whole[30:] == [output_token_id("r3", k) for k in range(6)]


def test_fingerprints_are_equal_exactly_for_equal_prefixes():
    a = RequestTokens("a", HashIdPrompt([11, 22, 33], 16, 48))
    b = RequestTokens("b", HashIdPrompt([11, 22, 99], 16, 48))
    late = RequestTokens("a", HashIdPrompt([11, 22, 33], 16, 48))
    assert late.fingerprint(70) and late.fingerprint(3) == a.fingerprint(3)  # asked out of order
    assert a.fingerprint(0) == 0
    assert all(a.fingerprint(n) == b.fingerprint(n) for n in range(1, 33))
    assert all(a.fingerprint(n) != b.fingerprint(n) for n in range(33, 60))
    assert all(a.fingerprint(n) == late.fingerprint(n) for n in range(1, 71))
    # Same prompt, another request: the prefixes part at the first output token.
    other = RequestTokens("c", HashIdPrompt([11, 22, 33], 16, 48))
    assert other.fingerprint(48) == a.fingerprint(48) and other.fingerprint(49) != a.fingerprint(49)


# ---------------------------------------------------------------------------------------
# block tables against the real engine
# ---------------------------------------------------------------------------------------


class TablesOnly:
    """A model executor that keeps the executor's ``BlockTables`` (and moves states as the
    device executor does) and samples the scripted tokens; no model."""

    def __init__(self, config: KVCacheConfig):
        self.tables = BlockTables(config)
        self.copies: list[StateCopy] = []
        self.num_replacements = 0
        self.num_preemptions = 0

    def execute(self, output: SchedulerOutput) -> Execution:
        self.num_replacements += sum(map(len, output.scheduled_cached_reqs.replaced_block_ids.values()))
        self.num_preemptions += len(output.preempted)
        new_ids = self.tables.apply(output)
        if output.num_scheduled_tokens:
            copies = self.tables.state_copies(output, new_ids)
            for copy in copies:
                table = self.tables.tables[copy.request_id][copy.group_id]
                assert NULL_BLOCK not in (copy.src_block, copy.dst_block) and copy.src_block != copy.dst_block
                assert table[self.tables.state_idx[copy.group_id][copy.request_id]] == copy.dst_block
            self.copies += copies
            self.tables.advance(output)
        return Execution({rid: [output_token_id(rid, k)] for rid, k in output.num_output_tokens.items()}, 1e-3)


TABLE_CASES = [("three", True), ("three", False), ("chunked", True), ("mamba2", False), ("mamba1", True)]


@pytest.mark.parametrize("kind, async_scheduling", TABLE_CASES)
def test_block_tables_equal_the_managers_after_every_step(kind, async_scheduling, tmp_path):
    resolved = scenario(kind, tmp_path, async_scheduling=async_scheduling, num_requests=16)
    plan = resolved.plan()
    config = plan.require_fits()
    engine = EngineCore(config, plan.engine.scheduler, plan.engine.cache)
    executor = TablesOnly(config)
    step = engine.step_async if async_scheduling else engine.step
    pending = [a.request for a in arrivals_from_trace(resolved.workload.load())]
    finished: set[str] = set()
    steps = 0
    while pending or engine.has_requests() or engine.batch_queue:
        if pending:
            engine.add_request(pending.pop(0))  # one arrival per step
        finished |= {r.request_id for r in step(executor).finished}
        steps += 1
        assert steps < 2000
        running = {r.request_id: r for r in engine.scheduler.running}
        tables = executor.tables
        for rid, request in running.items():
            assert tables.tables[rid] == engine.kv_cache_manager.get_block_ids(rid), (steps, rid)
            assert tables.num_computed_tokens[rid] == request.num_computed_tokens, (steps, rid)
        # Besides the running requests, only finished ones not yet reported with an output.
        assert set(tables.tables) - running.keys() <= finished
    assert len(finished) == 16
    assert executor.num_preemptions > 0 and executor.num_replacements > 0
    if any(g.spec.kind == "mamba" for g in config.groups):
        assert executor.copies


def _config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, groups=tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)))


def _new(rid: str, tables: list[list[int]], computed: int, *, resumed: bool = False) -> NewRequestData:
    blocks = KVCacheBlocks(tuple([KVCacheBlock(b) for b in ids] for ids in tables))
    return NewRequestData(rid, blocks, computed, 40, 40, computed, resumed, TokenPrompt(list(range(40))))


def _output(scheduled: dict[str, int], computed: list[int], new=(), appended=None) -> SchedulerOutput:
    cached = CachedRequestData()
    for rid, per_group in (appended or {}).items():
        cached.new_blocks[rid] = KVCacheBlocks(tuple([KVCacheBlock(b) for b in ids] for ids in per_group))
    return SchedulerOutput(num_scheduled_tokens=scheduled, num_computed_tokens=computed,
                           scheduled_new_reqs=list(new), scheduled_cached_reqs=cached)


def _step(tables: BlockTables, output: SchedulerOutput) -> list[StateCopy]:
    copies = tables.state_copies(output, tables.apply(output))
    tables.advance(output)
    return copies


def test_state_copies_follow_the_running_state():
    state = MambaSpec(block_size=4, shapes=((3, 8),), dtype_bytes=(4,), mamba_cache_mode="align")
    tables = BlockTables(_config(state, FullAttentionSpec(block_size=4)))
    assert tables.align_groups == [0]

    # A fresh request (computed 0) copies nothing, wherever its prefill ends.
    assert _step(tables, _output({"a": 8}, [0], [_new("a", [[1, 2], [11, 12]], 0)])) == []
    assert tables.state_idx[0]["a"] == 1
    # A decode that crosses into a new block copies the state from the previous column.
    assert _step(tables, _output({"a": 1}, [8], appended={"a": [[3], [13]]})) == [StateCopy(0, "a", 2, 3)]
    # A decode within the block: nothing to move.
    assert _step(tables, _output({"a": 1}, [9])) == []
    assert tables.state_idx[0]["a"] == 2

    # A resumed request with a hit of 8 tokens starts from the hit's state block (column 1).
    resumed = _new("b", [[21, 22, 23], [31, 32, 33]], 8, resumed=True)
    assert _step(tables, _output({"a": 1, "b": 3}, [10, 8], [resumed])) == [StateCopy(0, "b", 22, 23)]
    # A prefill continued from mid-block moves on to the block its chunk ends in.
    assert _step(tables, _output({"c": 5}, [0], [_new("c", [[41, 42, 43], [51, 52, 53]], 0)])) == []
    assert _step(tables, _output({"c": 5}, [5])) == [StateCopy(0, "c", 42, 43)]


def test_no_state_copies_without_an_align_mode_state_group():
    tables = BlockTables(_config(FullAttentionSpec(block_size=4),
                                 MambaSpec(block_size=4, shapes=((3, 8),), dtype_bytes=(4,), mamba_cache_mode="none")))
    assert _step(tables, _output({"a": 8}, [0], [_new("a", [[1, 2], [5]], 0)])) == []
    assert _step(tables, _output({"a": 1}, [8], appended={"a": [[3], []]})) == []
    assert tables.tables["a"] == ([1, 2, 3], [5])


# ---------------------------------------------------------------------------------------
# the KV pool
# ---------------------------------------------------------------------------------------


def test_groups_sharing_a_slot_share_the_bytes_of_a_block(tmp_path):
    plan = scenario("three", tmp_path).plan()
    executor = build_executor(plan, ExecutorOptions())
    pool, shape, config = executor.pool, executor.shape, executor.config
    pages = pool_page_bytes(shape, config, 4)  # fp32 on a CPU
    assert pool.nbytes == config.num_blocks * sum(pages)
    assert [tuple(t.shape) for t in pool.tensors] == [(config.num_blocks, p) for p in pages]
    assert all(layer.page_bytes(4) <= pages[layer.slot] for layer in shape.layers)

    slot0 = [layer for layer in shape.layers if layer.slot == 0]
    assert len({layer.group_id for layer in slot0}) == len(config.groups) == 5
    sliding = next(layer for layer in slot0 if layer.mixer == MIXER_ATTENTION and layer.sliding_window)
    full = next(layer for layer in slot0 if layer.mixer == MIXER_ATTENTION and not layer.sliding_window)
    state = next(layer for layer in slot0 if layer.mixer == MIXER_STATE)
    b = 7
    written = torch.randn(pool.layers[sliding.name].k[b].shape)
    pool.layers[sliding.name].k[b] = written
    # Block b of another group, at the same slot, is the same bytes.
    assert torch.equal(pool.layers[full.name].k[b], written)
    conv = pool.layers[state.name].conv[b]
    assert torch.equal(conv.contiguous().view(torch.uint8).flatten(),
                       written.view(torch.uint8).flatten()[:conv.numel() * conv.element_size()])
    # ... and only block b: its neighbours and the other slot are untouched.
    assert not pool.tensors[0][b - 1].any() and not pool.tensors[0][b + 1].any()
    assert all(not t.any() for t in pool.tensors[1:])
    # The recurrent state (fp32, after the conv window) lands in the same page.
    ssm = torch.randn(pool.layers[state.name].ssm[b].shape)
    pool.layers[state.name].ssm[b] = ssm
    offset = state.conv_state_bytes(4)
    assert torch.equal(pool.tensors[0][b, offset:offset + ssm.numel() * 4], ssm.view(torch.uint8).flatten())


# ---------------------------------------------------------------------------------------
# the block audit
# ---------------------------------------------------------------------------------------


def test_block_audit_names_a_never_written_block_and_another_prefix():
    a = RequestTokens("a", TokenPrompt(list(range(40))))
    b = RequestTokens("b", TokenPrompt(list(range(100, 140))))
    c = RequestTokens("c", TokenPrompt(list(range(32)) + [7] * 8))  # a's first 32 tokens
    audit = BlockAudit(num_groups=2, num_blocks=16)

    audit.check_reads(1, "a", 0, [3, 4, 5], 16, 0, 40, a)
    [never] = audit.findings[:1]
    assert (never.step, never.request_id, never.group_id, never.position, never.block_id) == (1, "a", 0, 0, 3)
    assert never.detail == "never written" and never.found_tokens == -1 and never.expected_tokens == 16
    assert "step 1, request a, group 0, block 3 (table position 0)" in never.describe()

    audit.findings.clear()
    audit.wrote_tokens(0, [3, 4, 5], 16, 0, 40, a)
    audit.check_reads(2, "a", 0, [3, 4, 5], 16, 0, 40, a)
    audit.check_reads(2, "c", 0, [3, 4], 16, 0, 32, c)  # the shared part: c's own prefix
    audit.check_reads(2, "a", 1, [0, 4], 16, 20, 30, a)  # group 1 never written... through a window
    assert [(f.group_id, f.block_id, f.position, f.detail) for f in audit.findings] == [(1, 4, 1, "never written")]

    audit.findings.clear()
    audit.check_reads(3, "b", 0, [3, 4, 5], 16, 0, 40, b)
    assert [(f.request_id, f.block_id, f.detail) for f in audit.findings] == [
        ("b", block, "holds another prefix's tokens") for block in (3, 4, 5)]
    audit.findings.clear()
    audit.check_reads(3, "c", 0, [3, 4, 5], 16, 0, 40, c)  # c and a part in the third block
    assert [(f.block_id, f.expected_tokens, f.found_tokens, f.detail) for f in audit.findings] == [
        (5, 40, 40, "holds another prefix's tokens")]

    audit.findings.clear()
    audit.wrote_tokens(0, [9, 10], 16, 0, 20, b)  # b's block 10 holds 20 tokens
    audit.check_reads(4, "b", 0, [9, 10], 16, 0, 30, b)
    audit.check_reads(4, "b", 0, [9, 0], 16, 0, 20, b)
    assert [(f.block_id, f.detail) for f in audit.findings] == [
        (10, "holds 20 tokens' worth, expected 30"), (0, "a position the step reads maps to the null block")]


def test_block_audit_follows_states_and_their_copies():
    a = RequestTokens("a", TokenPrompt(list(range(40))))
    b = RequestTokens("b", TokenPrompt(list(range(100, 140))))
    audit = BlockAudit(num_groups=1, num_blocks=16)
    audit.wrote_state(0, 7, 16, a)
    audit.copied(0, 7, 9)
    audit.check_state(5, "a", 0, 0, 7, 16, a)
    audit.check_state(5, "a", 0, 1, 9, 16, a)
    assert audit.findings == []
    audit.check_state(5, "b", 0, 0, 7, 16, b)
    audit.check_state(5, "a", 0, 2, 11, 32, a)
    audit.check_state(5, "a", 0, 0, 7, 17, a)
    assert [(f.request_id, f.block_id, f.detail) for f in audit.findings] == [
        ("b", 7, "holds another prefix's tokens"), ("a", 11, "never written"),
        ("a", 7, "holds 16 tokens' worth, expected 17")]
