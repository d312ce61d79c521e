"""``kvtwin trace info/convert/synth`` through the CLI: output shape and one-line errors."""

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtwin.commands.trace import trace_app
from kvtwin.traces import schema as s
from kvtwin.traces.bundled import MOONCAKE_CONVERSATION

FIXTURES = Path(__file__).parent / "fixtures"
runner = CliRunner()


def _run(*args):
    return runner.invoke(trace_app, [str(a) for a in args])


def test_info_json_is_one_object_with_the_promised_keys():
    result = _run("info", FIXTURES / "mooncake_small.jsonl", "--json", "--arrivals", "burst")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    for key in ("requests", "duration_s", "rate_per_s", "input_tokens", "output_tokens", "prefix_reuse_upper_bound"):
        assert key in info
    for key in ("input_tokens", "output_tokens"):
        assert set(info[key]) >= {"mean", "p50", "p99", "max"}
    assert info["requests"] == 6 and info["duration_s"] == 6.0 and info["rate_per_s"] == 1.0
    assert info["block_tokens"] == 512
    # 16 blocks. Leading runs already seen: 0, [0], [0, 1], [0, 1, 2], [0], [0] = 8.
    assert info["prefix_reuse"]["blocks"] == 16 and info["prefix_reuse"]["reused_blocks"] == 8
    assert info["prefix_reuse_upper_bound"] == 0.5


def test_info_json_on_the_bundled_mooncake_trace_matches_the_published_bound():
    result = _run("info", f"bundled:{MOONCAKE_CONVERSATION}", "--json")
    info = json.loads(result.stdout)
    assert info["requests"] == 12_031
    assert round(info["prefix_reuse_upper_bound"], 4) == 0.3664
    assert info["block_tokens"] == 512 and "spread" in info["arrivals"]


def test_info_says_when_a_trace_has_no_content_identity():
    result = _run("info", FIXTURES / "azure_small.csv", "--json")
    info = json.loads(result.stdout)
    assert info["prefix_reuse_upper_bound"] is None and info["content_identity"] == "none"
    human = _run("info", FIXTURES / "azure_small.csv")
    assert "no content identity" in " ".join(human.stdout.split())


def test_info_with_the_session_assumption_says_it_is_assumed():
    result = _run("info", FIXTURES / "burstgpt3_small.csv", "--assume-session-history", "16", "--json")
    info = json.loads(result.stdout)
    assert info["identity_assumption"] == "session_history"
    assert info["prefix_reuse_upper_bound"] is not None
    assert any("ASSUMED" in note for note in info["notes"])


def test_bad_input_is_one_error_line_and_exit_status_2():
    result = _run("info", FIXTURES / "mooncake_bad.jsonl")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [f"kvtwin: error: {FIXTURES / 'mooncake_bad.jsonl'}:2: line: expected one JSON object per line, "
                     + lines[0].split("per line, ", 1)[1]]
    assert "Traceback" not in result.output


def test_skip_bad_reports_the_count_and_reasons():
    result = _run("info", FIXTURES / "mooncake_bad.jsonl", "--skip-bad", "--json")
    assert result.exit_code == 0
    info = json.loads(result.stdout)
    assert info["requests"] == 2 and info["skipped_bad_lines"] == 4
    assert "skipped 4 bad line" in result.stderr and ":3: input_length" in result.stderr


def test_missing_file_is_a_clean_error(tmp_path: Path):
    result = _run("info", tmp_path / "nope.jsonl")
    assert result.exit_code == 2 and "no such file" in result.stderr


def test_convert_applies_transforms_and_writes_a_trace(tmp_path: Path):
    out = tmp_path / "out.parquet"
    result = _run("convert", FIXTURES / "mooncake_small.jsonl", FIXTURES / "mooncake_small.jsonl", "-o", out,
                  "--arrivals", "burst", "--gap-s", "4", "--start-s", "1", "--rate-scale", "2", "--limit", "5")
    assert result.exit_code == 0, result.output
    table = s.read_parquet(out)
    assert table.num_rows == 5
    assert table.column(s.REQUEST_ID).to_pylist()[:3] == ["0:3", "0:4", "0:5"]
    assert table.column(s.ARRIVAL_TIME_S).to_pylist()[0] == pytest.approx(2.001 / 2)
    assert len(s.trace_meta(table).transforms) == 4


def test_convert_generic_csv_with_a_map(tmp_path: Path):
    out = tmp_path / "g.parquet"
    result = _run("convert", FIXTURES / "generic_small.csv", "-o", out, "--map", "arrival_time_s=ts_ms",
                  "--map", "prompt_tokens=prompt", "--map", "output_tokens=completion", "--time-unit", "ms")
    assert result.exit_code == 0, result.output
    assert s.read_parquet(out).column(s.ARRIVAL_TIME_S).to_pylist() == [0.0, 1.0, 2.5]
    bad = _run("convert", FIXTURES / "generic_small.csv", "-o", out, "--map", "nonsense")
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_synth_writes_the_same_bytes_twice(tmp_path: Path):
    spec = tmp_path / "w.toml"
    spec.write_text('kind = "requests"\nseed = 3\nnum_requests = 50\narrival = { rate_per_s = 2 }\n'
                    'prompt_tokens = { dist = "lognormal", mean = 300, sigma = 0.5 }\noutput_tokens = 20\n'
                    'shared_prefix = { count = 3, tokens = 64 }\n')
    for name in ("a.parquet", "b.parquet"):
        result = _run("synth", spec, "-o", tmp_path / name)
        assert result.exit_code == 0, result.output
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert s.read_parquet(tmp_path / "a.parquet").num_rows == 50


def test_synth_spec_error_is_one_line(tmp_path: Path):
    spec = tmp_path / "w.toml"
    spec.write_text('kind = "requests"\nseed = 3\nnum_requests = 50\narrival = { rate_per_s = -2 }\n'
                    'prompt_tokens = 10\noutput_tokens = 20\n')
    result = _run("synth", spec, "-o", tmp_path / "x.parquet")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"kvtwin: error: {spec}: arrival.rate_per_s: expected a number > 0, got -2"
    assert not (tmp_path / "x.parquet").exists()


def test_trace_is_wired_into_the_kvtwin_app():
    from kvtwin.cli import app

    result = runner.invoke(app, ["trace", "info", str(FIXTURES / "azure_small.csv"), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["requests"] == 4


def _spec(tmp_path: Path) -> Path:
    spec = tmp_path / "w.toml"
    spec.write_text('kind = "requests"\nseed = 3\nnum_requests = 5\narrival = { rate_per_s = 2 }\n'
                    'prompt_tokens = 10\noutput_tokens = 20\n')
    return spec


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_synth_to_an_unwritable_place_names_the_path_given(tmp_path: Path, where):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    out = {"proc": Path("/proc/kvtwin.parquet"), "under_a_file": a_file / "x.parquet"}[where]
    result = _run("synth", _spec(tmp_path), "-o", out)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error: --output: expected ")
    assert lines[0].endswith(f"got '{out}'") and ".tmp" not in lines[0]


def test_trace_writer_errors_name_the_final_path_not_the_temp_file(tmp_path: Path, monkeypatch):
    assert _run("synth", _spec(tmp_path), "-o", tmp_path / "t.parquet").exit_code == 0
    table = s.read_parquet(tmp_path / "t.parquet")

    def disk_full(table, where, **kwargs):
        raise OSError(28, "No space left on device", str(where))

    monkeypatch.setattr(s.pq, "write_table", disk_full)
    with pytest.raises(s.TraceError) as err:
        s.write_parquet(table, tmp_path / "out.parquet")
    assert str(err.value) == f"{tmp_path / 'out.parquet'}: output: expected a file path kvtwin can write, " \
                             "got 'No space left on device'"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet", "w.toml"]  # no temp file left


def test_unknown_bundled_trace_lists_the_bundled_ones(tmp_path: Path):
    from kvtwin.cli import app
    from kvtwin.traces.bundled import BUNDLED

    result = runner.invoke(app, ["replay", "--trace", "bundled:nope.jsonl", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error: bundled:nope.jsonl: ")
    assert all(f"bundled:{name}" in lines[0] for name in BUNDLED)


def test_trace_list_names_every_bundled_trace_with_its_rows():
    from kvtwin.traces.bundled import BUNDLED

    result = _run("list")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert len(lines) == len(BUNDLED)
    assert lines[0].startswith(f"bundled:{MOONCAKE_CONVERSATION}") and "12,031 rows" in lines[0]
    listed = json.loads(_run("list", "--json").stdout)
    assert [t["name"] for t in listed] == [f"bundled:{name}" for name in BUNDLED]
    assert all(t["rows"] > 0 and t["description"] for t in listed)


@pytest.mark.parametrize("command", ["convert", "synth"])
def test_written_traces_get_the_mode_the_umask_gives_any_new_file(tmp_path: Path, command):
    out = tmp_path / "t.parquet"
    args = (("convert", FIXTURES / "mooncake_small.jsonl") if command == "convert" else ("synth", _spec(tmp_path)))
    old = os.umask(0o022)
    try:
        result = _run(*args, "-o", out)
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("content", [b"a,b\n1,2\n", b"", b"PAR1 not really PAR1"], ids=["csv", "empty", "magic"])
def test_a_file_named_parquet_that_is_not_parquet_is_one_error_line(tmp_path: Path, content):
    from kvtwin.cli import app

    fake = tmp_path / "log.parquet"
    fake.write_bytes(content)
    for args in (["trace", "info", fake], ["trace", "convert", fake, "-o", tmp_path / "out.parquet"],
                 ["trace", "info", fake, "--map", "arrival_time_s=a", "--map", "prompt_tokens=b",
                  "--map", "output_tokens=b"],
                 ["replay", "--trace", fake, "--quiet", "--out", tmp_path / "run"]):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvtwin: error: {fake}: file: expected a parquet file, got "), \
            (args, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.parquet"]


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error: ") and "Traceback" not in result.output, \
        result.stderr
    return lines[0]


@pytest.mark.parametrize("flags, expected", [
    (["--limit", "0"], "kvtwin: error: --limit: expected a positive number of requests, got 0"),
    (["--limit", "-2"], "kvtwin: error: --limit: expected a positive number of requests, got -2"),
    (["--start-s", "100"], "kvtwin: error: --start-s: expected a cut that leaves at least one of the 6 requests, "
                           "got 100.0"),
    (["--start-s", "1", "--end-s", "2"], "kvtwin: error: --start-s and --end-s: expected a cut that leaves at "
                                         "least one of the 6 requests, got (1.0, 2.0)"),
    (["--sample-sessions", "0"], "kvtwin: error: --sample-sessions: expected a fraction of sessions in (0, 1], "
                                 "got 0.0"),
])
def test_convert_refuses_to_write_a_trace_without_requests(tmp_path: Path, flags, expected):
    out = tmp_path / "out.parquet"
    result = _run("convert", FIXTURES / "mooncake_small.jsonl", "-o", out, "--arrivals", "burst", *flags)
    assert _one_error_line(result) == expected
    assert not out.exists()


def test_convert_refuses_an_input_without_requests(tmp_path: Path):
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    out = tmp_path / "out.parquet"
    line = _one_error_line(_run("convert", FIXTURES / "azure_small.csv", empty, "-o", out))
    assert line == f"kvtwin: error: {empty}: requests: expected at least one request (the trace has none)"
    assert not out.exists()


@pytest.mark.parametrize("stop", ["duration_s = 60", "num_requests = 5"])
def test_synth_refuses_a_spec_that_generates_no_request(tmp_path: Path, stop):
    spec = tmp_path / "w.toml"
    spec.write_text(f'kind = "chat"\nseed = 1\n{stop}\narrival = {{ rate_per_s = 1 }}\n'
                    'turns = 3\nuser_tokens = 500\noutput_tokens = 10\nturn_gap_s = 5\nmax_prompt_tokens = 100\n')
    out = tmp_path / "out.parquet"
    line = _one_error_line(_run("synth", spec, "-o", out))
    assert line.startswith(f"kvtwin: error: {spec}: max_prompt_tokens: expected a limit that lets at least one "
                           "request through"), line
    assert not out.exists()


def test_a_repeated_request_id_names_the_input_file_and_its_line_or_row(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv = tmp_path / "log.csv"
    csv.write_text("ts,in,out,rid\n0,10,1,a\n1,10,1,b\n\n2,10,1,a\n")
    maps = ["--map", "arrival_time_s=ts", "--map", "prompt_tokens=in", "--map", "output_tokens=out",
            "--map", "request_id=rid"]
    out = tmp_path / "out.parquet"
    line = _one_error_line(_run("convert", csv, "-o", out, *maps))
    assert line == f"kvtwin: error: {csv}:5: rid: expected a request id not used by an earlier line, got 'a'"
    skipped = _run("convert", csv, "-o", out, *maps, "--skip-bad")
    assert skipped.exit_code == 0, skipped.output
    assert s.read_parquet(out).column(s.REQUEST_ID).to_pylist() == ["a", "b"]
    out.unlink()

    log = tmp_path / "log.parquet"
    pq.write_table(pa.table({"ts": [0.0, 1.0, 2.0], "in": [10, 10, 10], "out": [1, 1, 1], "rid": [7, 8, 7]}), log)
    line = _one_error_line(_run("convert", log, "-o", out, *maps))
    assert line == f"kvtwin: error: {log}:3: rid: expected a request id not used by an earlier row, got '7'"

    # A kvtwin trace file edited by hand: the row is named too.
    table = s.read_parquet(s.write_parquet(load_small_mooncake(), tmp_path / "t.parquet"))
    ids = table.column(s.REQUEST_ID).to_pylist()
    ids[4] = ids[1]
    edited = table.set_column(0, s.TRACE_SCHEMA.field(s.REQUEST_ID), pa.array(ids, pa.string()))
    pq.write_table(edited, tmp_path / "edited.parquet")
    line = _one_error_line(_run("info", tmp_path / "edited.parquet"))
    assert line == (f"kvtwin: error: {tmp_path / 'edited.parquet'}:5: request_id: expected unique request ids, "
                    f"got {ids[1]!r}")
    assert not out.exists()


def load_small_mooncake():
    from kvtwin.traces.load import load_trace

    return load_trace(FIXTURES / "mooncake_small.jsonl")


# -- a user's own file: columns named as the trace schema's need no map ----------------------

SCHEMA_NAMED = FIXTURES / "schema_named.csv"


def _schema_named_copies(tmp_path: Path) -> dict[str, Path]:
    """The same four requests as a CSV, a JSONL and a (non-kvtwin) parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(request_id="a", arrival_time_s=0.0, prompt_tokens=120, output_tokens=12, session_id="s1", turn=1,
                 priority=0),
            dict(request_id="b", arrival_time_s=0.5, prompt_tokens=300, output_tokens=20, session_id="s2", turn=1,
                 priority=1),
            dict(request_id="c", arrival_time_s=1.25, prompt_tokens=180, output_tokens=8, session_id="s1", turn=2,
                 priority=0),
            dict(request_id="d", arrival_time_s=2.0, prompt_tokens=64, output_tokens=4, session_id=None, turn=None,
                 priority=None)]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    parquet = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    return {"csv": SCHEMA_NAMED, "jsonl": jsonl, "parquet": parquet}


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_a_file_with_the_schemas_column_names_needs_no_map(tmp_path: Path, kind):
    path = _schema_named_copies(tmp_path)[kind]
    info = _run("info", path, "--json")
    assert info.exit_code == 0, info.output
    assert json.loads(info.stdout)["requests"] == 4 and json.loads(info.stdout)["format"] == "generic"
    out = tmp_path / "out.parquet"
    converted = _run("convert", path, "-o", out)
    assert converted.exit_code == 0, converted.output
    table = s.read_parquet(out)
    assert table.column(s.REQUEST_ID).to_pylist() == ["a", "b", "c", "d"]
    assert table.column(s.ARRIVAL_TIME_S).to_pylist() == [0.0, 0.5, 1.25, 2.0]
    assert table.column(s.SESSION_ID).to_pylist() == ["s1", "s2", "s1", None]
    assert table.column(s.TURN).to_pylist() == [1, 1, 2, None]
    assert table.column(s.PRIORITY).to_pylist() == [0, 1, 0, None]


def test_a_map_names_only_the_columns_whose_names_differ(tmp_path: Path):
    path = tmp_path / "log.csv"
    path.write_text("ts_ms,prompt_tokens,output_tokens\n1000,10,2\n3500,20,3\n")
    info = _run("info", path, "--json", "--map", "arrival_time_s=ts_ms", "--time-unit", "ms")
    assert info.exit_code == 0, info.output
    assert json.loads(info.stdout)["duration_s"] == 2.5


def test_a_file_it_cannot_map_names_the_flags_that_map_it():
    line = _one_error_line(_run("info", FIXTURES / "generic_small.csv"))
    assert line == (f"kvtwin: error: {FIXTURES / 'generic_small.csv'}: columns: expected columns named "
                    "arrival_time_s, prompt_tokens, output_tokens (the trace schema's names) or a column map "
                    "(--map arrival_time_s=COLUMN --map prompt_tokens=COLUMN --map output_tokens=COLUMN), "
                    "got 'ts_ms, prompt, completion, user, prio, rid'")
    partial = _one_error_line(_run("info", FIXTURES / "generic_small.csv", "--map", "arrival_time_s=ts_ms"))
    assert "(--map prompt_tokens=COLUMN --map output_tokens=COLUMN)" in partial


@pytest.mark.parametrize("args, expected", [
    (["--map", "prompt_tokens=input_length", "--format", "mooncake"],
     "kvtwin: error: --map: expected no map with format mooncake (only a generic file reads it), "
     "got {'prompt_tokens': 'input_length'}"),
    (["--map", "prompt_tokens"], "kvtwin: error: --map: expected TRACE_COLUMN=SOURCE_COLUMN"),
    (["--map", "prompt_tokens=a", "--map", "prompt_tokens=b"], "kvtwin: error: --map: expected one source for "
                                                              "prompt_tokens, got 'prompt_tokens=b'"),
    (["--time-unit", "hours"], "kvtwin: error: --time-unit: expected one of s, ms, us, ns, datetime, got 'hours'"),
    (["--arrivals", "sometimes"], "kvtwin: error: --arrivals: expected one of auto, spread, burst, got 'sometimes'"),
    (["--seed", "-1"], "kvtwin: error: --seed: expected an integer seed >= 0, got -1"),
    (["--hash-block-tokens", "16"], f"kvtwin: error: {SCHEMA_NAMED}: --hash-block-tokens: expected block hashes "
                                    "for it to describe"),
])
def test_bad_reading_flags_are_one_error_line_naming_the_flag(args, expected):
    path = FIXTURES / ("mooncake_small.jsonl" if "--format" in args or "--arrivals" in args or "--seed" in args
                       else "schema_named.csv")
    assert _one_error_line(_run("info", path, *args)).startswith(expected)


def test_a_jsonl_files_first_line_names_its_columns(tmp_path: Path):
    path = tmp_path / "late.jsonl"
    path.write_text('{"arrival_time_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n'
                    '{"arrival_time_s": 1, "prompt_tokens": 5, "output_tokens": 1, "session_id": "x"}\n')
    assert _one_error_line(_run("info", path)) == (
        f"kvtwin: error: {path}:2: session_id: expected no session_id (the first line, which names the columns, "
        "has none)")


def test_block_hashes_by_name_take_their_size_from_a_one_valued_column(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "hashed.parquet"
    columns = {"arrival_time_s": [0.0, 1.0], "prompt_tokens": [32, 20], "output_tokens": [1, 1],
               "block_hashes": [[5, 6], [5, 7]], "hash_block_tokens": [16, 16]}
    pq.write_table(pa.table(columns), path)
    info = json.loads(_run("info", path, "--json").stdout)
    assert info["block_tokens"] == 16 and info["prefix_reuse"]["reused_blocks"] == 1
    pq.write_table(pa.table({**columns, "hash_block_tokens": [16, 32]}), path)
    assert _one_error_line(_run("info", path)) == (
        f"kvtwin: error: {path}:2: hash_block_tokens: expected one number of tokens >= 1 in every row with block "
        "hashes, got 32")
    pq.write_table(pa.table({k: v for k, v in columns.items() if k != "hash_block_tokens"}), path)
    assert "--hash-block-tokens N" in _one_error_line(_run("info", path))
    info = json.loads(_run("info", path, "--json", "--hash-block-tokens", "16").stdout)
    assert info["block_tokens"] == 16


def test_millisecond_mooncake_timestamps_are_kept_with_a_note():
    result = _run("info", FIXTURES / "mooncake_ms.jsonl", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["duration_s"] == 7.455 and info["arrivals"].startswith("as recorded")
    notes = [line for line in result.stderr.splitlines() if line.startswith("kvtwin: note: ")]
    assert len(notes) == 1 and "not bucketed" in notes[0] and "--arrivals spread" in notes[0], result.stderr
    forced = json.loads(_run("info", FIXTURES / "mooncake_ms.jsonl", "--json", "--arrivals", "spread").stdout)
    assert forced["arrivals"].startswith("spread") and forced["duration_s"] != 7.455


def test_jsonl_block_hashes_by_name_with_their_size_column(tmp_path: Path):
    path = tmp_path / "hashed.jsonl"
    lines = ['{"arrival_time_s": 0, "prompt_tokens": 32, "output_tokens": 1, "block_hashes": [5, 6], '
             '"hash_block_tokens": 16}',
             '{"arrival_time_s": 1, "prompt_tokens": 20, "output_tokens": 1, "block_hashes": [5, 7], '
             '"hash_block_tokens": 16}']
    path.write_text("\n".join(lines) + "\n")
    info = json.loads(_run("info", path, "--json").stdout)
    assert info["block_tokens"] == 16 and info["prefix_reuse"]["reused_blocks"] == 1
    path.write_text(lines[0] + "\n\n" + lines[1].replace('"hash_block_tokens": 16', '"hash_block_tokens": 8') + "\n")
    assert _one_error_line(_run("info", path)) == (
        f"kvtwin: error: {path}:3: hash_block_tokens: expected one number of tokens >= 1 in every line with block "
        "hashes, got 8")
