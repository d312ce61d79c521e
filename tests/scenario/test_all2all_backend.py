"""``[engine] all2all_backend`` (docs/clock.md#moe-under-data-parallelism): vLLM 0.33's
``--all2all-backend`` names and default, the names vLLM runs as another backend resolved
to it, and anything else refused with one line from a scenario, the flag and a sweep."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import GPU_PRESETS
from kvtwin.sim.planner.models import MODEL_PRESETS
from tests.cli_run import one_error_line, run

# Read off vllm/config/parallel.py's ``All2AllBackend`` (lines 45-60) less "passthrough",
# which vllm/engine/arg_utils.py:1159 takes out of the command line's choices.
VLLM_033_CHOICES = {"naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
                    "mori_high_throughput", "mori_low_latency", "moonep", "nixl_ep", "allgather_reducescatter",
                    "flashinfer_all2allv", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided"}
# What vLLM 0.33 runs instead: parallel.py:537-543 (naive, pplx), cuda_communicator.py:252-264.
RUNS_AS = {"naive": "allgather_reducescatter", "pplx": "allgather_reducescatter",
           "flashinfer_all2allv": "flashinfer_nvlink_two_sided"}

SCENARIO = """\
[model]
preset = "gpt-oss-20b"

[hardware]
gpu = "h100"

[engine]
max_model_len = 8192
{line}

[workload]
trace = "bundled:mooncake_conversation_trace.jsonl"
limit = 5
"""


def _resolved(backend: str):
    return EngineConfig(all2all_backend=backend).resolve(MODEL_PRESETS["gpt-oss-20b"], GPU_PRESETS["h100"])


def test_the_default_is_vllms():
    assert EngineConfig().all2all_backend == "allgather_reducescatter"
    assert EngineConfig().resolve(MODEL_PRESETS["llama-3.1-8b"], GPU_PRESETS["h100"]).all2all_backend == \
        "allgather_reducescatter"


@pytest.mark.parametrize("backend", sorted(VLLM_033_CHOICES))
def test_every_vllm_choice_is_taken_and_runs_as_vllm_runs_it(backend):
    assert _resolved(backend).all2all_backend == RUNS_AS.get(backend, backend)


@pytest.mark.parametrize("backend", ["passthrough", "deepep", "DeepEP_low_latency", "", 1])
def test_anything_else_is_refused_by_name(backend):
    with pytest.raises(ConfigError) as raised:
        EngineConfig(all2all_backend=backend)
    assert "all2all_backend" in str(raised.value) and "deepep_low_latency" in str(raised.value)


def test_a_dense_model_without_dp_takes_it_unused():
    """Accepted everywhere; only a DP group of a MoE model prices it."""
    dense = EngineConfig(all2all_backend="deepep_low_latency").resolve(MODEL_PRESETS["llama-3.1-8b"],
                                                                       GPU_PRESETS["h100"])
    assert dense.all2all_backend == "deepep_low_latency"


def test_a_bad_value_in_a_scenario_is_one_line(tmp_path: Path):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(line='all2all_backend = "pplx_kernels"'))
    one_error_line(run("replay", path, "--out", tmp_path / "out"), "engine.all2all_backend: expected one of ",
                   "got 'pplx_kernels'")
    assert not (tmp_path / "out").exists()


def test_a_bad_flag_value_is_one_line(tmp_path: Path):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(line=""))
    one_error_line(run("replay", path, "--all2all-backend", "nccl", "--out", tmp_path / "out"),
                   "kvtwin: error: --all2all-backend: expected one of allgather_reducescatter, ", "got 'nccl'")


def test_a_bad_sweep_value_is_one_line(tmp_path: Path):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(line=""))
    one_error_line(run("capacity", path, "--sweep", "engine.all2all_backend=deepep_low_latency,nccl", "-q",
                       "--out", tmp_path / "cap"), "engine.all2all_backend", "got 'nccl'")
    assert not (tmp_path / "cap").exists()
