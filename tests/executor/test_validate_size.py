"""``kvtwin validate``'s sizes (``kvtwin.executor.sizes``): the CPU default (``small``) on
the default scenario still does what checks 1 and 2 are there to check — prefix hits,
evictions and preemptions, every one executed as simulated — and ``full`` leaves the
scenario as it is."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import kvtwin.executor.validate as validate_module
from kvtwin.cli import app
from kvtwin.executor.sizes import SIZES, requests_of, sized_scenario, sized_trace
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from kvtwin.traces import schema as col


@pytest.fixture(scope="module")
def default_cpu_run(tmp_path_factory):
    """``kvtwin validate --quiet`` with no other flag (the default scenario, on the CPU, at
    --size small), and the executor runs it made."""
    out = tmp_path_factory.mktemp("validate") / "run"
    runs = []
    real = validate_module.run_executor

    def spy(plan, trace, *args, **kwargs):
        run = real(plan, trace, *args, **kwargs)
        runs.append((plan, trace, run))
        return run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(validate_module, "run_executor", spy)
        result = CliRunner().invoke(app, ["validate", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return result, out, runs


def test_the_cpu_default_is_small_and_passes(default_cpu_run):
    result, out, runs = default_cpu_run
    lines = result.stdout.splitlines()
    assert lines[0].startswith("prefix hits: pass") and lines[1].startswith("predicted hits: pass")
    assert "(--size small)" in lines[-1]
    small = SIZES["small"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["max_model_len"] == 1056  # 1,024 + 32 tokens, the longest request left
    assert plan["num_blocks"] == int(1056 // 16 * small.pool_requests) + 1
    plan_on, trace, _ = runs[0]
    assert plan_on.engine.cache.enable_prefix_caching
    assert trace.num_rows == small.requests
    assert pc.max(trace.column(col.PROMPT_TOKENS)).as_py() == small.max_prompt_tokens
    assert pc.max(trace.column(col.OUTPUT_TOKENS)).as_py() <= small.max_output_tokens
    assert set(trace.column(col.ARRIVAL_TIME_S).to_pylist()) == {0.0}


def test_the_cpu_default_reuses_evicts_and_preempts(default_cpu_run):
    # A pass on a run that never reused, evicted or resumed anything would prove little.
    _, out, runs = default_cpu_run
    summary = runs[0][2].result.summary.to_pylist()[0]
    assert summary["prefix_cache_hit_rate"] > 0.3
    assert summary["num_evictions"] > 0
    assert summary["num_preemptions"] > 0
    rows = pq.read_table(out / "validation.parquet").to_pylist()
    hits = [r for r in rows if r["check"] == "prefix_hits_are_real" and r["metric"] == "max_relative_logit_error"]
    assert len(hits) == SIZES["small"].requests and all(r["passed"] for r in hits)
    preemptions = next(r for r in rows if r["metric"] == "num_preemptions")
    assert preemptions["passed"] and preemptions["observed"] == preemptions["expected"] == \
        summary["num_preemptions"]


def test_full_leaves_the_scenario_as_it_is():
    full = SIZES["full"]
    resolved = resolve_scenario(DEFAULT_SCENARIO, Overrides(limit=requests_of(full, "cpu", None)))
    trace = resolved.require_workload().load()
    assert trace.num_rows == 8 and requests_of(full, "cuda", None) == 100 and requests_of(full, "cpu", 3) == 3
    assert sized_trace(trace, full).equals(trace)
    assert sized_scenario(resolved, trace, full) is resolved
    with pytest.raises(ConfigError, match="--requests"):
        requests_of(full, "cpu", 0)


def test_small_keeps_a_pool_already_tighter():
    resolved = resolve_scenario(DEFAULT_SCENARIO, Overrides(limit=4))
    small = SIZES["small"]
    trace = sized_trace(resolved.require_workload().load(), small)
    cut = sized_scenario(resolved, trace, small)
    assert cut.plan().num_blocks == int(1056 // 16 * small.pool_requests) + 1
    # A scenario whose own pool is smaller than the small size's keeps it.
    engine = dataclasses.replace(cut.engine, kv_cache_memory_bytes=cut.plan().bytes_per_block * 80)
    tighter = dataclasses.replace(resolved, engine=engine)
    assert sized_scenario(tighter, trace, small).plan().num_blocks == 80
