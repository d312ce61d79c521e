"""docs/semantics.md#scheduler: the v1 scheduler's decisions."""

import pytest

from kvtwin.sim.core.request import RequestStatus
from kvtwin.sim.core.spec import MambaSpec

from .builders import EchoModel, engine, full, new_request, tokens


def run_until_done(eng, limit=10_000):
    model = EchoModel()
    results = []
    for _ in range(limit):
        if not eng.has_unfinished_requests():
            return results
        results.append(eng.step(model))
    raise AssertionError("did not finish")


def test_running_requests_are_scheduled_before_waiting_ones():
    eng = engine(full(), num_blocks=64, max_num_batched_tokens=64)
    eng.add_request(new_request("a", tokens(0, 100), max_tokens=3))
    eng.step(EchoModel())
    eng.add_request(new_request("b", tokens(5000, 40)))
    out = eng.step(EchoModel()).output
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert out.num_scheduled_tokens == {"a": 36, "b": 28}


def test_fcfs_preempts_the_last_running_request_and_requeues_it_first():
    eng = engine(full(), num_blocks=9, max_num_batched_tokens=256, max_num_seqs=4)
    eng.add_request(new_request("a", tokens(0, 60), max_tokens=30))
    eng.add_request(new_request("b", tokens(1000, 60), max_tokens=30))
    model = EchoModel()
    preempted_step = None
    for _ in range(60):
        result = eng.step(model)
        if result.output.preempted:
            preempted_step = result
            break
    assert preempted_step is not None
    assert preempted_step.output.preempted == ["b"]
    victim = eng.scheduler.waiting.peek()
    assert victim.request_id == "b" and victim.status is RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.num_output_tokens > 0  # outputs kept
    assert preempted_step.output.scheduled_new_reqs == []  # no admission in a step that preempted


def test_resumed_request_recomputes_its_tokens_minus_the_hit():
    # 8 usable blocks of 16: both 60-token prompts fill 4 blocks each at step 0. At step 5
    # "a" (64 computed) needs a fifth block and FCFS preempts "b", which then holds 65
    # tokens (60 + 5 outputs) in 4 full, hashed blocks. Freed tail first, those blocks
    # are evicted as "a" grows to 90 tokens (6 blocks): 2 of b's survive. When "a"
    # finishes, "b" comes back with a 32-token hit and recomputes 65 - 32 = 33 tokens.
    eng = engine(full(), num_blocks=9, max_num_batched_tokens=256)
    eng.add_request(new_request("a", tokens(0, 60), max_tokens=30))
    eng.add_request(new_request("b", tokens(1000, 60), max_tokens=30))
    results = run_until_done(eng)
    preemptions = [(step, result.output.preempted) for step, result in enumerate(results) if result.output.preempted]
    assert preemptions == [(5, ["b"])]
    readmissions = [(step, result, a) for step, result in enumerate(results)
                    for a in result.output.scheduled_new_reqs if a.resumed]
    assert [(step, a.req_id, a.hit_tokens) for step, _, a in readmissions] == [(30, "b", 32)]
    _, result, admission = readmissions[0]
    assert result.output.num_scheduled_tokens == {"b": 65 - 32}


def test_priority_preempts_the_lowest_priority_latest_arrival():
    eng = engine(full(), num_blocks=9, max_num_batched_tokens=256, scheduling_policy="priority")
    eng.add_request(new_request("low", tokens(0, 60), max_tokens=30, priority=5, arrival_time=0))
    eng.add_request(new_request("high", tokens(1000, 60), max_tokens=30, priority=0, arrival_time=1))
    model = EchoModel()
    for _ in range(100):
        out = eng.step(model).output
        if out.preempted:
            assert out.preempted == ["low"]
            return
    pytest.fail("expected a preemption")


def test_waiting_admission_stops_at_the_first_request_that_does_not_fit():
    eng = engine(full(), num_blocks=12, max_num_batched_tokens=1024)
    eng.add_request(new_request("fits", tokens(0, 100), max_tokens=50))
    eng.add_request(new_request("big", tokens(1000, 150)))
    eng.add_request(new_request("small", tokens(2000, 10)))
    out = eng.step(EchoModel()).output
    assert list(out.num_scheduled_tokens) == ["fits"]  # "small" would fit, but FCFS blocks it


def test_max_num_seqs_limits_running_requests():
    eng = engine(full(), num_blocks=64, max_num_seqs=2)
    for i in range(4):
        eng.add_request(new_request(f"r{i}", tokens(1000 * i, 20)))
    out = eng.step(EchoModel()).output
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]


def test_chunked_prefill_off_stops_when_the_prompt_exceeds_the_remaining_budget():
    eng = engine(full(), num_blocks=64, max_num_batched_tokens=128, max_model_len=128, enable_chunked_prefill=False)
    eng.add_request(new_request("a", tokens(0, 100)))
    eng.add_request(new_request("b", tokens(1000, 100)))
    out = eng.step(EchoModel()).output
    assert out.num_scheduled_tokens == {"a": 100}


def test_long_prefill_threshold_clips_chunks():
    eng = engine(full(), num_blocks=64, max_num_batched_tokens=512, long_prefill_token_threshold=64)
    eng.add_request(new_request("a", tokens(0, 300)))
    eng.add_request(new_request("b", tokens(1000, 300)))
    out = eng.step(EchoModel()).output
    assert out.num_scheduled_tokens == {"a": 64, "b": 64}


def test_token_budget_is_never_exceeded():
    eng = engine(full(), num_blocks=256, max_num_batched_tokens=100, max_num_seqs=8)
    for i in range(6):
        eng.add_request(new_request(f"r{i}", tokens(1000 * i, 90), max_tokens=5))
    for result in run_until_done(eng):
        assert result.output.total_num_scheduled_tokens <= 100


def test_finished_requests_free_their_blocks_at_once():
    eng = engine(full(), num_blocks=32)
    eng.add_request(new_request("a", tokens(0, 40), max_tokens=1))
    result = eng.step(EchoModel())
    assert [r.request_id for r in result.finished] == ["a"]
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == 31


def test_mamba_align_prefill_chunks_end_on_block_boundaries():
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtype_bytes=(2,), mamba_cache_mode="align")
    eng = engine(full(), mamba, num_blocks=64, max_num_batched_tokens=50)
    eng.add_request(new_request("a", tokens(0, 120)))
    first = eng.step(EchoModel()).output.num_scheduled_tokens["a"]
    assert first == 48  # 50 rounded down to a block boundary
    second = eng.step(EchoModel()).output.num_scheduled_tokens["a"]
    # Stops at the last boundary a later request could hit: (120 - 1) // 16 * 16 = 112.
    assert 48 + second <= 112 and (48 + second) % 16 == 0


def test_prompts_that_leave_no_room_are_rejected_with_a_reason():
    eng = engine(full(), max_model_len=64)
    assert not eng.add_request(new_request("long", tokens(0, 64)))
    rejection = eng.rejected[0]
    assert rejection.request.status is RequestStatus.REJECTED and rejection.code == "prompt_too_long"
    assert "max_model_len 64" in rejection.detail
    assert not eng.has_unfinished_requests()


def test_long_prefill_threshold_is_ignored_for_a_lone_request():
    eng = engine(full(), num_blocks=64, max_num_batched_tokens=512, long_prefill_token_threshold=64)
    eng.add_request(new_request("a", tokens(0, 300)))
    out = eng.step(EchoModel()).output
    assert out.num_scheduled_tokens == {"a": 300}


def test_adaptive_long_prefill_threshold_floors_at_a_fair_share():
    eng = engine(full(), num_blocks=64, max_num_batched_tokens=512, long_prefill_token_threshold=64,
                 adaptive_long_prefill_threshold=True)
    eng.add_request(new_request("a", tokens(0, 300)))
    eng.add_request(new_request("b", tokens(1000, 300)))
    out = eng.step(EchoModel()).output
    assert out.num_scheduled_tokens == {"a": 256, "b": 256}  # max(64, 512 // 2)


def _self_preemption_run(policy: str):
    """A (priority 0) and B (priority 5, the lowest) run; C (priority 1) joins a step later,
    behind B in the running order. The pool is full when B crosses into a new block."""
    eng = engine(full(), num_blocks=6, max_num_batched_tokens=256, scheduling_policy=policy)
    eng.add_request(new_request("A", tokens(0, 16), max_tokens=40, priority=0, arrival_time=0))
    eng.add_request(new_request("B", tokens(1000, 10), max_tokens=40, priority=5, arrival_time=1))
    model = EchoModel()
    for step in range(60):
        if step == 1:
            eng.add_request(new_request("C", tokens(2000, 16), max_tokens=40, priority=1, arrival_time=2))
        order = [r.request_id for r in eng.scheduler.running]
        out = eng.step(model).output
        if out.preempted:
            return order, out
    pytest.fail("expected a preemption")


def test_priority_self_preemption_goes_on_with_the_next_running_request():
    """docs/semantics.md#running-requests (vLLM 0.33 scheduler.py, the ``new_blocks is None`` branch): the
    lowest-priority request that cannot grow preempts itself, and the pass continues."""
    order, out = _self_preemption_run("priority")
    assert order == ["A", "B", "C"] and out.preempted == ["B"]
    # Nobody before B needed blocks (so B preempted itself), and C, after it, still ran.
    assert "A" not in out.scheduled_cached_reqs.new_blocks
    assert "C" in out.num_scheduled_tokens and "B" not in out.num_scheduled_tokens
