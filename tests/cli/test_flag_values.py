"""Every bad flag value, unknown option or missing value is the one line
docs/commands.md#exit-codes promises (``kvtwin: error: <flag>: expected ..., got ...``,
exit code 2), never typer's usage block: settings' flags, the other numeric flags of each
command, and the command line's own mistakes."""

from __future__ import annotations

import pytest

from kvtwin.console import usage_error_line
from tests.cli_run import one_error_line, run


@pytest.mark.parametrize("args, needle", [
    (["replay", "--rate-scale", "abc"], "--rate-scale: expected a number, got 'abc'"),
    (["replay", "--rate-scale", "inf"], "--rate-scale: expected a finite number, got 'inf'"),
    (["replay", "--rate-scale", "-inf"], "--rate-scale: expected a finite number, got '-inf'"),
    (["replay", "--rate-scale", "nan"], "--rate-scale: expected a finite number, got 'nan'"),
    (["replay", "--limit", "1.5"], "--limit: expected an integer, got '1.5'"),
    (["replay", "--time-limit-s", "inf"], "--time-limit-s: expected a finite number, got 'inf'"),
    (["replay", "--tp", "two"], "--tp: expected an integer, got 'two'"),
    (["replay", "--offload-disk-latency", "nan"], "--offload-disk-latency: expected a finite number"),
    (["replay", "--spec-acceptance", "inf"], "--spec-acceptance: expected a finite number"),
    (["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpu-memory-utilization", "nan"],
     "--gpu-memory-utilization: expected a finite number, got 'nan'"),
    (["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--max-model-len", "8k"],
     "--max-model-len: expected an integer, got '8k'"),
    (["capacity", "--jobs", "abc"], "--jobs: expected an integer, got 'abc'"),
    (["capacity", "--jobs", "0"], "--jobs: expected a positive number of points at once, got 0"),
    (["capacity", "--rate-tolerance", "nan", "--find-max-rate"], "--rate-tolerance: expected a finite number"),
    (["capacity", "--target-rate", "inf", "--find-max-rate"], "--target-rate: expected a finite number"),
    (["capacity", "--max-replays", "lots", "--find-max-rate"], "--max-replays: expected an integer"),
    (["capacity", "--limit", "-3"], "--limit: expected a positive number of requests, got -3"),
    (["trace", "info", "bundled:mooncake_conversation_trace.jsonl", "--block-tokens", "0"],
     "--block-tokens: expected a positive number of tokens, got 0"),
    (["trace", "info", "bundled:mooncake_conversation_trace.jsonl", "--arrivals", "poisson"],
     "--arrivals: expected one of auto, spread, burst, got 'poisson'"),
    (["trace", "convert", "bundled:mooncake_conversation_trace.jsonl", "-o", "{tmp}/t.parquet", "--rate-scale", "inf"],
     "--rate-scale: expected a positive factor (2 = twice as fast), got inf"),
    (["trace", "convert", "bundled:mooncake_conversation_trace.jsonl", "-o", "{tmp}/t.parquet", "--rate-scale", "0"],
     "--rate-scale: expected a positive factor (2 = twice as fast), got 0.0"),
    (["trace", "convert", "bundled:mooncake_conversation_trace.jsonl", "-o", "{tmp}/t.parquet", "--gap-s", "-1"],
     "--gap-s: expected a non-negative number of seconds, got -1.0"),
    (["trace", "convert", "bundled:mooncake_conversation_trace.jsonl", "-o", "{tmp}/t.parquet", "--limit", "-1"],
     "--limit: expected a positive number of requests, got -1"),
    (["trace", "convert", "bundled:mooncake_conversation_trace.jsonl", "-o", "{tmp}/t.parquet",
      "--sample-sessions", "1.5"], "--sample-sessions: expected a fraction of sessions in (0, 1], got 1.5"),
    (["validate", "--requests", "many"], "--requests: expected an integer, got 'many'"),
    (["lockstep", "x", "--out", "{tmp}/o", "--max-diffs", "-1"],
     "--max-diffs: expected a non-negative number of differences, got -1"),
])
def test_a_bad_flag_value_is_one_line(tmp_path, args, needle):
    result = run(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    one_error_line(result, f"kvtwin: error: {needle}")
    assert not (tmp_path / "t.parquet").exists()


def test_an_end_before_the_start_names_both_flags(tmp_path):
    out = tmp_path / "t.parquet"
    result = run("trace", "convert", "bundled:mooncake_conversation_trace.jsonl", "-o", out, "--start-s", "10",
                 "--end-s", "5")
    one_error_line(result, "kvtwin: error: --end-s: expected a time after --start-s (10 s), got 5.0")
    assert not out.exists()


@pytest.mark.parametrize("args, needles", [
    (["replay", "--bogus"], ["--bogus: expected an option of kvtwin replay", "kvtwin replay --help", "got '--bogus'"]),
    (["replay", "--limit"], ["--limit: expected a value after it"]),
    (["trace", "convert"], ["INPUTS: expected a value (it is required"]),
    (["nonsense"], ["kvtwin: expected one of its commands", "got 'nonsense'"]),
    (["replay", "a.toml", "b.toml"], ["kvtwin replay: ", "b.toml"]),
])
def test_a_command_line_mistake_is_one_line(args, needles):
    one_error_line(run(*args), *needles)


def test_help_and_a_bare_group_still_print_help():
    assert run("replay", "--help").exit_code == 0
    assert "convert" in run("trace").output


def test_a_usage_error_without_a_parameter_names_the_command():
    class NoContext(Exception):
        message = "something odd"

    NoContext.__name__ = "UsageError"
    assert usage_error_line(NoContext()) == "kvtwin: error: kvtwin: something odd (kvtwin --help)"
