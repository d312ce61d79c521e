"""The P/D golden cases (``tests/golden/pd``, made by ``scripts/oracle/gen_pd_golden.py``
driving vLLM 0.33's real scheduler with the NIXL connector's real scheduler half): the
twin's prefill and decode engines, stepped in the same ticks with the same scripted
model and worker, must match every tick's record exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore, Execution, PDTier
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.pd_connector import PDConnector, StepPDTransfers, remote_prefill_tokens
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.spec import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                  MambaSpec, SlidingWindowSpec)
from kvtwin.sim.replay.clock.pd_cluster import truncated_prompt

CASES = sorted((Path(__file__).resolve().parents[2] / "golden" / "pd").glob("*.json"))


class Model:
    def __init__(self, outputs: dict[str, list[int]]):
        self.outputs = outputs

    def execute(self, output):
        # Asynchronous: a batch may sample past a request's last token; vLLM drops it.
        return Execution({rid: [self.outputs[rid][k] if k < len(self.outputs[rid]) else 0]
                          for rid, k in output.num_output_tokens.items()}, 1.0)


def build(cfg: dict, num_blocks: int) -> EngineCore:
    bs = cfg["block_size"]
    specs = []
    for g in cfg["kv_cache_groups"]:
        if g["kind"] == "full_attention":
            specs.append(FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8))
        elif g["kind"] == "mamba":
            specs.append(MambaSpec(block_size=bs, shapes=((4, 8),), dtype_bytes=(4,), mamba_cache_mode="align"))
        elif g["kind"] == "chunked_local":
            specs.append(ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8,
                                                   attention_chunk_size=g["attention_chunk_size"]))
        else:
            specs.append(SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=8,
                                           sliding_window=g["sliding_window"]))
    config = KVCacheConfig(num_blocks=num_blocks, groups=tuple(KVCacheGroupSpec((f"layer{i}",), s)
                                                                for i, s in enumerate(specs)), hash_block_size=bs)
    scheduler = SchedulerConfig(max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
                                max_num_batched_tokens=cfg["max_num_batched_tokens"],
                                async_scheduling=bool(cfg.get("async_scheduling", False)))
    return EngineCore(config, scheduler, CacheConfig(enable_prefix_caching=True),
                      pd=PDTier(PDConnector(config), StepPDTransfers(cfg["read_steps"])))


def record(engine: EngineCore, result, tick: int, scheduled_batch: int | None = None) -> dict:
    """One engine's tick; ``scheduled_batch`` None: a synchronous step (its batch is the tick)."""
    out = result.output
    sched = engine.scheduler
    live = set(sched.requests) | set(sched.connector_state.delayed_free)
    transfers = result.transfers
    # An asynchronous step that scheduled nothing issued no read.
    issued = engine.transfers.last_reads if scheduled_batch != -1 else []
    rec = dict(
        scheduled=dict(out.num_scheduled_tokens),
        computed=dict(zip(out.num_scheduled_tokens, out.num_computed_tokens)),
        reads=[[r.req_id, list(r.num_blocks)] for r in sorted(issued, key=lambda r: r.req_id)],
        finished=sorted(r.request_id for r in result.finished),
        freed=sorted(transfers.finished_sending) if transfers is not None else [],
        waiting_remote=sorted(rid for rid, r in sched.requests.items()
                              if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS),
        free_blocks=engine.kv_cache_manager.block_pool.get_num_free_blocks(),
        tables={rid: [list(g) for g in engine.kv_cache_manager.get_block_ids(rid)] for rid in sorted(live)})
    return rec


def step(engine: EngineCore, model: Model, tick: int) -> dict:
    assert engine.transfers.next_batch == tick  # each engine steps once a tick: batch k is tick k
    return record(engine, engine.step(model), tick)


class AsyncStepper:
    """Steps one engine as vLLM's ``step_with_batch_queue`` (``EngineCore.step_async``) and
    numbers its batches as the oracle does: scheduled in order, updated in order."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.updated = 0

    def __call__(self, model: Model, tick: int) -> dict:
        engine = self.engine
        before = engine.transfers.next_batch
        result = engine.step_async(model)
        scheduled = before if engine.transfers.next_batch > before else None
        rec = record(engine, result, tick, -1 if scheduled is None else scheduled)
        updated = None
        if result.updated is not None:
            updated, self.updated = self.updated, self.updated + 1
        rec.update(scheduled_batch=scheduled, updated_batch=updated)
        return rec

    def busy(self) -> bool:
        return self.engine.has_requests() or bool(self.engine.batch_queue)


def require_pools(case: dict, p: EngineCore, d: EngineCore, source: str | None) -> None:
    """Refuse, before the first tick, a case whose prefill or decode pool cannot hold its
    longest request: vLLM refuses to start an engine whose pool cannot hold one request
    (of ``max_model_len``; the cases size their pools for their own requests, below
    that), and its scheduler would keep such a request waiting forever."""
    requests = case["requests"]
    backoff = p.pd.connector.prefill_backoff_tokens
    try:
        p.require_pool_holds(max(remote_prefill_tokens(len(r["prompt_token_ids"]), backoff) + 1 for r in requests),
                             "config.prefill_num_blocks")
        d.require_pool_holds(max(len(r["prompt_token_ids"]) + len(r["output_token_ids"]) for r in requests),
                             "config.decode_num_blocks")
    except ConfigError as err:
        raise err.with_source(source) if source else err from None


def admit(engine: EngineCore, request: Request, side: str, source: str | None) -> None:
    """Queue ``request``; one the engine rejects (it could never run) refuses the case."""
    if not engine.add_request(request):
        rejection = engine.rejected[-1]
        raise ConfigError(f"requests.{request.request_id}", f"a request the {side} engine can run",
                          f"{rejection.code}: {rejection.detail}", source=source)


def run(case: dict, divergent_hits: bool = True, source: str | None = None) -> list[dict]:
    cfg = case["config"]
    outputs = {r["request_id"]: r["output_token_ids"] for r in case["requests"]}
    prompts = {r["request_id"]: r["prompt_token_ids"] for r in case["requests"]}
    model = Model(outputs)
    p, d = build(cfg, cfg["prefill_num_blocks"]), build(cfg, cfg["decode_num_blocks"])
    d.pd.connector.supports_divergent_local_hybrid_hits = divergent_hits
    require_pools(case, p, d, source)
    if cfg.get("async_scheduling"):
        return run_async(case, model, p, d, source)
    pending = sorted(case["requests"], key=lambda r: r["arrival_tick"])
    ticks, tick, done = [], 0, 0
    while done < len(case["requests"]):
        while pending and pending[0]["arrival_tick"] <= tick:
            arrive(p, pending.pop(0), source)
        p_record = step(p, model, tick)
        for rid in p_record["finished"]:
            # What the prefill side computed: the prompt less the backoff, a prompt no longer than it whole.
            d.pd.connector.expect_remote_prefill(rid, remote_prefill_tokens(len(prompts[rid]),
                                                                            d.pd.connector.prefill_backoff_tokens))
            admit(d, Request(rid, TokenPrompt(prompts[rid]), len(outputs[rid])), "decode", source)
        d_record = step(d, model, tick)
        for rid, _ in d_record["reads"]:
            p.transfers.send_done(rid, tick + cfg["read_steps"])
        done += len(d_record["finished"])
        ticks.append(dict(tick=tick, prefill=p_record, decode=d_record))
        tick += 1
        assert tick < 5000
    while p.scheduler.requests or p.scheduler.connector_state.delayed_free:
        ticks.append(dict(tick=tick, prefill=step(p, model, tick), decode=None))
        tick += 1
        assert tick < 5000
    return ticks


def arrive(p: EngineCore, r: dict, source: str | None) -> None:
    p.pd.connector.mark_remote_decode(r["request_id"])
    # The prefill side drops the connector's backoff (vLLM: on_new_request).
    prompt = truncated_prompt(TokenPrompt(r["prompt_token_ids"]), p.pd.connector.prefill_backoff_tokens)
    admit(p, Request(r["request_id"], prompt, 1), "prefill", source)


def run_async(case: dict, model: Model, p: EngineCore, d: EngineCore, source: str | None) -> list[dict]:
    """``run`` with two batches in flight on each engine (the oracle's ``run_case_async``):
    reads land with the update of the decode batch ``read_steps`` after theirs, the
    prefill side hears of one ``read_steps`` batches after its next; on until both idle."""
    cfg = case["config"]
    read_steps = cfg["read_steps"]
    prompts = {r["request_id"]: r["prompt_token_ids"] for r in case["requests"]}
    step_p, step_d = AsyncStepper(p), AsyncStepper(d)
    pending = sorted(case["requests"], key=lambda r: r["arrival_tick"])
    ticks, tick, done = [], 0, 0
    while done < len(case["requests"]) or step_p.busy() or step_d.busy():
        while pending and pending[0]["arrival_tick"] <= tick:
            arrive(p, pending.pop(0), source)
        p_record = step_p(model, tick)
        for rid in p_record["finished"]:
            d.pd.connector.expect_remote_prefill(rid, remote_prefill_tokens(len(prompts[rid]),
                                                                            d.pd.connector.prefill_backoff_tokens))
            admit(d, Request(rid, TokenPrompt(prompts[rid]), len(model.outputs[rid])), "decode", source)
        d_record = step_d(model, tick)
        for rid, _ in d_record["reads"]:
            p.transfers.send_done(rid, p.transfers.next_batch + read_steps - 1)
        done += len(d_record["finished"])
        ticks.append(dict(tick=tick, prefill=p_record, decode=d_record))
        tick += 1
        assert tick < 5000
    return ticks


@pytest.mark.parametrize("path", CASES, ids=[c.stem for c in CASES])
def test_pd_golden(path):
    case = json.loads(path.read_text())
    actual = run(case, source=path.name)
    expected = case["expected_ticks"]
    for exp, act in zip(expected, actual):
        assert act == exp, f"tick {exp['tick']}"
    assert len(actual) == len(expected)


def test_cases_exist():
    assert len(CASES) >= 7
    assert sum(json.loads(c.read_text())["config"].get("async_scheduling", False) for c in CASES) >= 2


def test_mamba_case_needs_the_divergent_local_hit():
    """vLLM's decode side of a hybrid Mamba model takes the full-attention group's local
    hit where the Mamba group's lags (NIXL brings the state). Without that capability the
    twin takes the hit every group agrees on: the same ticks up to the first such
    admission, which then reads more full-attention blocks than vLLM did."""
    path = next(c for c in CASES if "mamba" in c.stem)
    case = json.loads(path.read_text())
    actual, expected = run(case, divergent_hits=False), case["expected_ticks"]
    first = next(i for i, (a, e) in enumerate(zip(actual, expected)) if a != e)
    assert first == 5 and actual[:first] == expected[:first]
    ours, theirs = actual[first]["decode"]["reads"], expected[first]["decode"]["reads"]
    assert [r for r, _ in ours] == [r for r, _ in theirs]
    assert ours[0][1][0] > theirs[0][1][0]


def load_case(stem: str) -> dict:
    return json.loads(next(c for c in CASES if c.stem == stem).read_text())


@pytest.mark.parametrize("stem, field, blocks", [
    ("pd_hybrid_mamba_short_prompts", "decode_num_blocks", 2),
    ("pd_full_basic", "decode_num_blocks", 5),
    ("pd_async_full_tight_decode", "decode_num_blocks", 6),
    ("pd_full_basic", "prefill_num_blocks", 4),
])
def test_a_pool_too_small_for_one_request_is_refused_up_front(stem, field, blocks, monkeypatch):
    """A pool that cannot hold the case's longest request is refused before the first
    tick with one line naming it, as an engine whose pool cannot hold one request refuses
    to start (the harness used to queue the request, see it rejected, and tick on)."""
    case = load_case(stem)
    case["config"][field] = blocks
    monkeypatch.setattr(EngineCore, "step", lambda *a: pytest.fail("stepped"))
    monkeypatch.setattr(EngineCore, "step_async", lambda *a: pytest.fail("stepped"))
    with pytest.raises(ConfigError) as err:
        run(case, source=f"{stem}.json")
    message = str(err.value)
    assert err.value.field == f"config.{field}" and err.value.got == blocks - 1
    assert "\n" not in message and message.startswith(f"{stem}.json: config.{field}: expected a KV pool that holds")


def test_a_request_an_engine_rejects_is_refused():
    """A request the decode engine rejects (its prompt and output exceed max_model_len)
    refuses the case at once, naming it, instead of ticking to the limit waiting for it."""
    case = load_case("pd_full_basic")
    longest = max(case["requests"], key=lambda r: len(r["prompt_token_ids"]))
    case["config"]["max_model_len"] = len(longest["prompt_token_ids"]) + 1
    with pytest.raises(ConfigError) as err:
        run(case)
    assert err.value.field == f"requests.{longest['request_id']}"
    assert "exceeds_max_model_len" in str(err.value) and "\n" not in str(err.value)
