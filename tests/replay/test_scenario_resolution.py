"""One resolution of a scenario with command-line overrides, shared by `plan` and `replay`,
and the bad values it refuses: one `kvtwin: error:` line naming the flag or the scenario key,
exit code 2, before any simulation starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from tests.cli_run import one_error_line, run

SCENARIO = """\
[model]
preset = "llama-3.1-8b"

[hardware]
gpu = "h100"

[engine]
max_model_len = 32768
watermark = 0.01
scheduling_policy = "priority"

[workload]
trace = "bundled:mooncake_conversation_trace.jsonl"
limit = 40
rate_scale = 0.5

[run]
time_limit_s = 600
"""


@pytest.fixture
def scenario(tmp_path) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO)
    return path


# -- precedence --------------------------------------------------------------------------


def test_the_scenario_supplies_what_no_flag_overrides(scenario):
    r = resolve_scenario(scenario)
    assert (r.model.name, r.gpu.name, r.engine.max_model_len) == ("llama-3.1-8b", "h100", 32768)
    assert r.engine.scheduling_policy == "priority" and r.engine.watermark == 0.01
    assert r.workload.transforms == {"limit": 40, "rate_scale": 0.5}
    assert r.time_limit_s == 600


def test_flags_win_field_by_field(scenario):
    r = resolve_scenario(scenario, Overrides(model="qwen3-8b", gpu="h200", limit=7, time_limit_s=5.0,
                                             engine={"tensor_parallel_size": 2, "max_model_len": None}))
    assert (r.model.name, r.gpu.name) == ("qwen3-8b", "h200")
    # A flag not given (None) leaves the scenario's value.
    assert r.engine.tensor_parallel_size == 2 and r.engine.max_model_len == 32768
    assert r.workload.transforms == {"limit": 7, "rate_scale": 0.5} and r.time_limit_s == 5.0


def test_another_trace_keeps_the_scenarios_cuts(scenario):
    r = resolve_scenario(scenario, Overrides(trace="bundled:AzureLLMInferenceTrace_conv.csv"))
    assert r.workload.trace.name == "AzureLLMInferenceTrace_conv.csv"
    assert r.workload.transforms == {"limit": 40, "rate_scale": 0.5}


def test_plan_and_replay_resolve_the_same_engine(scenario, tmp_path):
    """`plan --scenario` and `replay` read the same scenario into the same layout."""
    planned = run("plan", "--scenario", str(scenario), "--json")
    assert planned.exit_code == 0, planned.stderr
    replayed = run("replay", str(scenario), "--limit", "5", "--quiet", "--out", str(tmp_path / "run"))
    assert replayed.exit_code == 0, replayed.stderr
    import json
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["num_blocks"] == \
        json.loads(planned.stdout)["num_blocks"]


def test_model_and_hf_config_together_are_refused():
    with pytest.raises(ConfigError, match="--model"):
        resolve_scenario(None, Overrides(model="qwen3-8b", hf_config=Path("x.json"), gpu="h100"))


def test_without_a_model_or_gpu_the_error_says_where_to_put_one(scenario, tmp_path):
    with pytest.raises(ConfigError, match=r"--model PRESET"):
        resolve_scenario(None, Overrides(gpu="h100"))
    bare = tmp_path / "bare.toml"
    bare.write_text('[model]\npreset = "qwen3-8b"\n')
    with pytest.raises(ConfigError, match=r"--gpu PRESET") as err:
        resolve_scenario(bare)
    assert err.value.source == str(bare)


# -- bad flags (one test per rejected flag value) -------------------------------------


@pytest.mark.parametrize("flag, value, expected", [
    ("--limit", "-5", "a positive number of requests"),
    ("--limit", "0", "a positive number of requests"),
    ("--rate-scale", "0", "a positive factor"),
    ("--rate-scale", "-1", "a positive factor"),
    ("--time-limit-s", "-1", "a positive number of simulated seconds"),
])
def test_bad_replay_flags_are_refused_before_the_run(scenario, tmp_path, flag, value, expected):
    out = tmp_path / "run"
    result = run("replay", str(scenario), flag, value, "--quiet", "--out", str(out))
    one_error_line(result, f"kvtwin: error: {flag}: expected {expected}", f"got {value}")
    assert not out.exists()


@pytest.mark.parametrize("line, field, expected", [
    ('watermark = "yes"', "engine.watermark", "a fraction in [0, 1)"),
    ("watermark = true", "engine.watermark", "a fraction in [0, 1)"),
    ('enable_chunked_prefill = "no"', "engine.enable_chunked_prefill", "true or false"),
    ('enable_chunked_prefill = "false"', "engine.enable_chunked_prefill", "true or false"),
    ('scheduler_reserve_full_isl = "yes"', "engine.scheduler_reserve_full_isl", "true or false"),
    ('async_scheduling = 1', "engine.async_scheduling", "true or false"),
    ('long_prefill_token_threshold = "512"', "engine.long_prefill_token_threshold", "a non-negative integer"),
    ('prefix_caching_hash_algo = "md5"', "engine.prefix_caching_hash_algo", "one of sha256, builtin"),
])
def test_strings_are_not_booleans_or_numbers_in_a_scenario(tmp_path, line, field, expected):
    path = tmp_path / "bad.toml"
    key = line.split("=")[0].strip()
    text = "".join(kept for kept in SCENARIO.splitlines(keepends=True) if not kept.startswith(key + " "))
    path.write_text(text.replace("[engine]\n", f"[engine]\n{line}\n"))
    for args in (["replay", str(path), "--quiet", "--out", str(tmp_path / "run")],
                 ["plan", "--scenario", str(path)]):
        one_error_line(run(*args), f"{path}: {field}: expected {expected}")
    assert not (tmp_path / "run").exists()


def test_an_unknown_engine_key_lists_every_engine_setting_scheduler_ones_included(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(SCENARIO.replace("[engine]\n", "[engine]\nschedulng_policy = 'fcfs'\n"))
    line = one_error_line(run("plan", "--scenario", str(path)), "engine.schedulng_policy")
    for key in ("scheduling_policy", "watermark", "enable_chunked_prefill", "scheduler_reserve_full_isl",
                "long_prefill_token_threshold", "prefix_caching_hash_algo", "max_model_len", "block_size"):
        assert key in line


@pytest.mark.parametrize("value", ["7", "8", "24"])
def test_a_block_size_the_attention_kernel_cannot_tile_is_refused_with_valid_sizes(value):
    line = one_error_line(run("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--block-size", value),
                          "block_size", "a multiple of 16 tokens", "16, 32, 64", f"got {value}")
    assert "h100" in line


def test_a_block_size_the_kernel_can_tile_is_kept():
    import json
    result = run("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--block-size", "32", "--json")
    assert json.loads(result.stdout)["block_size"] == 32


@pytest.mark.parametrize("line, field", [
    ("skip_bad = 'yes'", "workload.skip_bad"),
    ("sample_sessions = 1.5", "workload.sample_sessions"),
    ("end_s = -3", "workload.end_s"),
])
def test_bad_workload_values_name_the_key(tmp_path, line, field):
    path = tmp_path / "bad.toml"
    path.write_text(SCENARIO.replace("limit = 40\n", f"limit = 40\n{line}\n"))
    one_error_line(run("replay", str(path), "--quiet", "--out", str(tmp_path / "run")), f"{path}: {field}: ")


def test_an_unknown_bundled_trace_in_a_scenario_names_the_file_and_lists_the_bundled_ones(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(SCENARIO.replace("bundled:mooncake_conversation_trace.jsonl", "bundled:nope.jsonl"))
    one_error_line(run("replay", str(path), "--quiet", "--out", str(tmp_path / "run")),
                   f"{path}: workload.trace: ", "bundled:mooncake_conversation_trace.jsonl", "'bundled:nope.jsonl'")


def test_a_model_that_does_not_fit_is_refused_before_the_trace_is_read(scenario, tmp_path, monkeypatch):
    import kvtwin.sim.scenario.parse as parse

    monkeypatch.setattr(parse.Workload, "load", lambda self: pytest.fail("the trace was read"))
    out = tmp_path / "run"
    one_error_line(run("replay", str(scenario), "--model", "llama-3.1-70b", "--gpu", "l40s", "--max-model-len",
                       "131072", "--quiet", "--out", str(out)), "model: expected a layout that fits",
                   "would fit: tensor_parallel_size = 8")
    assert not out.exists()


# -- nothing to replay ---------------------------------------------------------------------


def test_a_trace_with_a_header_and_no_rows_is_refused(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    out = tmp_path / "run"
    result = run("replay", "--trace", str(empty), "--quiet", "--out", str(out))
    one_error_line(result, f"kvtwin: error: {empty}: requests: expected at least one request")
    assert not out.exists()


@pytest.mark.parametrize("cut, key", [("start_s = 1e9", "workload.start_s"),
                                      ("end_s = 0.000001", "workload.end_s"),
                                      ("end_s = 0.000001\nstart_s = 0.0", "workload.start_s and workload.end_s")])
def test_a_cut_that_leaves_no_request_is_refused_naming_it(tmp_path, cut, key):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.replace("limit = 40", cut))
    result = run("replay", str(path), "--quiet", "--out", str(tmp_path / "run"))
    one_error_line(result, f"kvtwin: error: {key}: expected a cut that leaves at least one of the")


# -- a user's own trace: columns named as the schema's, format and map ----------------------

TRACE_FIXTURES = Path(__file__).parents[1] / "traces" / "fixtures"
SCHEMA_NAMED = TRACE_FIXTURES / "schema_named.csv"  # the trace schema's own column names
UNNAMED = TRACE_FIXTURES / "generic_small.csv"  # ts_ms, prompt, completion, ...


def _own_trace_scenario(tmp_path: Path, workload: str) -> Path:
    path = tmp_path / "own.toml"
    path.write_text(SCENARIO.split("[workload]")[0] + "[workload]\n" + workload + "\n[slo]\nttft_s = 2.0\n")
    return path


def test_replay_reads_a_csv_with_the_schemas_column_names_without_a_map(tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "run"
    result = run("replay", "--trace", str(SCHEMA_NAMED), "--quiet", "--no-report", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert pq.read_table(out / "requests.parquet").num_rows == 4


def test_a_scenario_reads_its_own_csv_by_name_or_through_its_map(tmp_path):
    by_name = _own_trace_scenario(tmp_path, f'trace = "{SCHEMA_NAMED}"')
    assert resolve_scenario(by_name).workload.load().num_rows == 4
    mapped = _own_trace_scenario(tmp_path, f'trace = "{UNNAMED}"\ntime_unit = "ms"\n'
                                           'map = { arrival_time_s = "ts_ms", prompt_tokens = "prompt", '
                                           'output_tokens = "completion", request_id = "rid" }')
    table = resolve_scenario(mapped).workload.load()
    assert table.column("request_id").to_pylist() == ["b", "a", "c"]
    assert table.column("arrival_time_s").to_pylist() == [0.0, 1.0, 2.5]


def test_replay_flags_map_the_trace(tmp_path):
    r = resolve_scenario(None, Overrides(model="llama-3.1-8b", gpu="h100", trace=str(UNNAMED), trace_options={
        "map": {"arrival_time_s": "ts_ms", "prompt_tokens": "prompt", "output_tokens": "completion"},
        "time_unit": "ms"}))
    assert r.workload.load().column("arrival_time_s").to_pylist() == [0.0, 1.0, 2.5]


def test_capacity_sweeps_a_scenario_of_its_own_csv(tmp_path):
    import pyarrow.parquet as pq

    path = _own_trace_scenario(tmp_path, f'trace = "{SCHEMA_NAMED}"')
    out = tmp_path / "sweep"
    result = run("capacity", str(path), "--sweep", "engine.max_num_seqs=8,16", "--jobs", "1", "-q", "--no-report",
                 "--out", str(out))
    assert result.exit_code == 0, result.output
    assert pq.read_table(out / "capacity.parquet").column("status").to_pylist() == ["ok", "ok"]


def test_a_trace_without_a_map_names_the_flags_or_keys_of_the_command(tmp_path):
    out = tmp_path / "run"
    missing = "arrival_time_s, prompt_tokens, output_tokens (the trace schema's names) or a column map"
    one_error_line(run("replay", "--trace", str(UNNAMED), "--quiet", "--out", str(out)),
                   f"kvtwin: error: {UNNAMED}: columns: expected columns named {missing} "
                   "(--map arrival_time_s=COLUMN --map prompt_tokens=COLUMN --map output_tokens=COLUMN)")
    path = _own_trace_scenario(tmp_path, f'trace = "{UNNAMED}"')
    keys = ('(workload.map = { arrival_time_s = "COLUMN", prompt_tokens = "COLUMN", output_tokens = "COLUMN" })')
    one_error_line(run("replay", str(path), "--quiet", "--out", str(out)), f"{UNNAMED}: columns: ", keys)
    # capacity refuses it before the first point, not once per point.
    one_error_line(run("capacity", str(path), "--sweep", "engine.max_num_seqs=8,16", "--jobs", "1", "-q",
                       "--out", str(tmp_path / "sweep")), f"{UNNAMED}: columns: ", keys)
    assert not out.exists() and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("line, expected", [
    ('map = "ts_ms"', "workload.map: expected a table of trace column = source column, got 'ts_ms'"),
    ('map = { arrival = "ts_ms" }', "workload.map.arrival: expected a trace column (arrival_time_s, "),
    ('map = { arrival_time_s = 3 }', "workload.map.arrival_time_s: expected the name of a column of the file, "
                                     "got 3"),
    ('time_unit = "hours"', "workload.time_unit: expected one of s, ms, us, ns, datetime, got 'hours'"),
    ('arrivals = "sometimes"', "workload.arrivals: expected one of auto, spread, burst, got 'sometimes'"),
    ('arrival_seed = -1', "workload.arrival_seed: expected an integer seed >= 0, got -1"),
    ('format = "csv"', "workload.format: expected one of parquet, mooncake, bailian, azure, burstgpt, generic, "
                       "got 'csv'"),
    ('format = "mooncake"\nmap = { prompt_tokens = "input_length" }',
     "workload.map: expected no map with format mooncake (only a generic file reads it)"),
    ("hash_block_tokens = 0", "workload.hash_block_tokens: expected a number of tokens >= 1, got 0"),
    ("per_block_hashes = 'yes'", "workload.per_block_hashes: expected true or false, got 'yes'"),
])
def test_bad_reading_keys_of_a_scenario_name_the_key(tmp_path, line, expected):
    path = _own_trace_scenario(tmp_path, f'trace = "{SCHEMA_NAMED}"\n{line}')
    one_error_line(run("replay", str(path), "--quiet", "--out", str(tmp_path / "run")), f"{path}: {expected}")
    one_error_line(run("plan", "--scenario", str(path)), f"{path}: {expected}")


@pytest.mark.parametrize("args, expected", [
    (["--map", "nonsense"], "kvtwin: error: --map: expected TRACE_COLUMN=SOURCE_COLUMN"),
    (["--arrivals", "sometimes"], "kvtwin: error: --arrivals: expected one of auto, spread, burst"),
    (["--format", "generic", "--time-unit", "hours"], "kvtwin: error: --time-unit: expected one of s, ms"),
])
def test_bad_reading_flags_of_replay_name_the_flag(scenario, tmp_path, args, expected):
    out = tmp_path / "run"
    one_error_line(run("replay", str(scenario), *args, "--quiet", "--out", str(out)), expected)
    assert not out.exists()


def test_reading_flags_need_a_trace_to_read(tmp_path):
    synth = _own_trace_scenario(tmp_path, 'kind = "requests"\nseed = 1\nnum_requests = 4\n'
                                          'arrival = { rate_per_s = 1 }\nprompt_tokens = 10\noutput_tokens = 2')
    one_error_line(run("replay", str(synth), "--format", "generic", "--quiet", "--out", str(tmp_path / "run")),
                   "--format: expected a trace to read (--trace, or a scenario whose [workload] names a trace)")


def test_replay_says_when_it_keeps_a_traces_unbucketed_timestamps(tmp_path):
    ms = TRACE_FIXTURES / "mooncake_ms.jsonl"
    result = run("replay", "--trace", str(ms), "--quiet", "--no-report", "--out", str(tmp_path / "a"))
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("kvtwin: note: ")]
    assert len(notes) == 1 and "arrival times kept as recorded" in notes[0] and "--arrivals spread" in notes[0]
    path = _own_trace_scenario(tmp_path, f'trace = "{ms}"')
    result = run("replay", str(path), "--quiet", "--no-report", "--out", str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert 'workload.arrivals = "spread"' in result.stderr
    forced = run("replay", "--trace", str(ms), "--arrivals", "spread", "--quiet", "--no-report", "--out",
                 str(tmp_path / "c"))
    assert forced.exit_code == 0 and "kvtwin: note:" not in forced.stderr
