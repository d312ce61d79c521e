"""Pipeline parallelism: the batch queue's depth and the synchronous scheduler with several
batches in flight (docs/semantics.md#pipeline-parallelism). The pp_* golden cases
(tests/sim/test_golden.py) check exactness against vLLM 0.33."""

import json
import shutil
from pathlib import Path

import pytest

from kvtwin.sim.core.config import SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.pipeline_scheduler import PipelineScheduler
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler import Scheduler
from kvtwin.sim.lockstep.golden import load_case
from kvtwin.sim.lockstep.runner import ScriptedModel

CASES_DIR = Path(__file__).parent.parent / "golden" / "cases"
PP_CASES = sorted(p.name for p in CASES_DIR.iterdir() if p.name.startswith("pp_"))

# vLLM 0.33's VllmConfig.max_concurrent_batches with the V1 model runner (config/vllm.py
# l.588-598), as the oracle printed it for each (pipeline_parallel_size, async_scheduling).
VLLM_BATCHES = {(1, False): 1, (1, True): 2, (2, False): 2, (3, False): 3, (4, False): 4, (8, False): 8}


@pytest.mark.parametrize(("pp", "is_async"), sorted(VLLM_BATCHES))
def test_max_concurrent_batches_is_vllms(pp, is_async):
    config = SchedulerConfig(max_model_len=512, async_scheduling=is_async, pipeline_parallel_size=pp)
    assert config.max_concurrent_batches == VLLM_BATCHES[pp, is_async]
    # The sliding-window admission cap covers every batch in flight (vLLM's max_in_flight_tokens).
    assert config.max_in_flight_tokens == VLLM_BATCHES[pp, is_async] * config.max_num_batched_tokens


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True, None])
def test_pipeline_parallel_size_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(max_model_len=512, async_scheduling=False, pipeline_parallel_size=bad)
    assert err.value.field == "pipeline_parallel_size"
    assert "\n" not in str(err.value) and "a positive integer" in str(err.value)


def test_asynchronous_scheduling_with_pp_is_refused_in_one_line():
    # vLLM 0.33's V1 model runner refuses it; its V2 runner's stagger is not modelled.
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(max_model_len=512, async_scheduling=True, pipeline_parallel_size=2)
    assert err.value.field == "pipeline_parallel_size" and "async_scheduling" in err.value.expected
    assert "\n" not in str(err.value)


def test_drafts_with_pp_are_refused():
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(max_model_len=512, async_scheduling=False, pipeline_parallel_size=2, num_speculative_tokens=2)
    assert err.value.field == "pipeline_parallel_size"


def test_a_golden_config_with_a_bad_pipeline_parallel_size_is_refused(tmp_path):
    case = tmp_path / "case"
    shutil.copytree(CASES_DIR / PP_CASES[0], case)
    config = json.loads((case / "config.json").read_text())
    config["pipeline_parallel_size"] = "4"
    (case / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_case(case)
    assert err.value.field == "pipeline_parallel_size"


def test_the_pp_cases_are_synchronous_with_several_stages():
    assert len(PP_CASES) >= 3
    sizes = set()
    for name in PP_CASES:
        config = load_case(CASES_DIR / name).scheduler_config
        assert not config.async_scheduling and config.pipeline_parallel_size > 1, name
        sizes.add(config.pipeline_parallel_size)
    assert {2, 4} <= sizes


def test_pp_picks_the_pipeline_scheduler_and_its_batch_queue():
    case = load_case(CASES_DIR / PP_CASES[0])
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    assert isinstance(engine.scheduler, PipelineScheduler)
    assert engine.batch_queue_size == case.scheduler_config.pipeline_parallel_size
    assert engine.async_scheduling  # the clocks step it through the batch queue
    assert engine.window_scheduler() is None
    one = SchedulerConfig(max_model_len=512, async_scheduling=False)
    plain = EngineCore(case.kv_cache_config, one, case.cache_config)
    assert type(plain.scheduler) is Scheduler and plain.batch_queue_size == 1 and not plain.async_scheduling


@pytest.mark.parametrize("name", PP_CASES)
def test_batches_in_flight_and_requests_in_them(name):
    """At most ``pipeline_parallel_size`` batches are in flight (between steps one fewer:
    a step that fills the queue updates its oldest); a request samples in at most one of
    them; its tokens in flight are those the unfinished batches hold for it."""
    case = load_case(CASES_DIR / name)
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    model = ScriptedModel({r.request_id: r.output_token_ids for r in case.requests})
    pending = list(case.requests)
    depth = case.scheduler_config.pipeline_parallel_size
    step = 0
    most = 0
    while pending or engine.has_unfinished_requests() or engine.batch_queue:
        while pending and pending[0].arrival_step == step:
            spec = pending.pop(0)
            engine.add_request(Request(spec.request_id, TokenPrompt(spec.prompt_token_ids),
                                       len(spec.output_token_ids), arrival_time=float(step), priority=spec.priority))
        engine.step_async(model)
        queue = engine.batch_queue
        most = max(most, len(queue))
        assert len(queue) <= depth - 1
        samplers = [rid for batch in queue for rid in batch.output.num_output_tokens]
        assert len(samplers) == len(set(samplers))
        held: dict[str, int] = {}
        for batch in queue:
            for rid, n in batch.output.num_scheduled_tokens.items():
                held[rid] = held.get(rid, 0) + n
        for rid, request in engine.scheduler.requests.items():
            assert request.num_in_flight_tokens == held.get(rid, 0), (step, rid)
            assert request.num_output_placeholders == 0
        step += 1
        assert step < 10_000
    assert most == depth - 1
