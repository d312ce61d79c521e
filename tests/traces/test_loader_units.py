"""Every loader's arrival times, in each unit it accepts, recomputed from the raw values.

The generic loader reads a time column in s, ms, us or ns (``--time-unit``; CSV, JSONL and
parquet alike) or as date-times (CSV text, parquet timestamps) and makes it relative to
the earliest request. Here the raw values are written to small files and the expected
seconds are computed in the test: ``(raw - min(raw)) * seconds_per_unit`` with the unit's
factor written out, date-times through Python's ``calendar``/``decimal`` (not the loader's
parser). Rows are matched by request id (the loader sorts by arrival), and the earliest
time is put in the middle of each file so a loader taking the first row as its origin
shows. The fixed formats: Azure (``TIMESTAMP`` date-times to the 100 ns), BurstGPT
(``Timestamp`` seconds, made relative), Mooncake (``timestamp`` in ms from the trace
start, kept as recorded with ``--arrivals burst``) and Bailian (``timestamp`` seconds from
the trace start, kept).

``kvtwin trace info`` prints figures recomputed here with NumPy from a small file: count,
duration, rate, the token percentiles (linear interpolation, NumPy's default).
"""

from __future__ import annotations

import calendar
import json
import re
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.traces import schema as s
from kvtwin.traces.load import load_trace
from kvtwin.traces.options import LoadOptions

SECONDS_PER = {"s": 1.0, "ms": 0.001, "us": 0.000001, "ns": 0.000000001}
# Raw times in the file's unit; the earliest is the second row.
RAW = {"s": [12.5, 10.0, 17.25, 10.75],
       "ms": [2500, 1000, 9125, 1001],
       "us": [3_000_000, 1_250_000, 1_250_125, 4_000_000],
       "ns": [7_000_000_000, 2_000_000_000, 2_000_000_500, 2_500_000_000]}
PROMPTS = [10, 20, 30, 40]
OUTPUTS = [1, 2, 3, 4]


def arrivals_by_id(table: pa.Table) -> dict[str, float]:
    return dict(zip(table.column(s.REQUEST_ID).to_pylist(), table.column(s.ARRIVAL_TIME_S).to_pylist()))


def expected_s(raw: list[float], unit: str) -> dict[str, float]:
    origin = min(raw)
    return {f"r{i}": (value - origin) * SECONDS_PER[unit] for i, value in enumerate(raw)}


def write_generic(path, suffix: str, times: list) -> object:
    file = path / f"log{suffix}"
    rows = [{"rid": f"r{i}", "t": t, "in": p, "out": o} for i, (t, p, o) in enumerate(zip(times, PROMPTS, OUTPUTS))]
    if suffix == ".csv":
        file.write_text("rid,t,in,out\n" + "".join(f"{r['rid']},{r['t']},{r['in']},{r['out']}\n" for r in rows))
    elif suffix == ".jsonl":
        file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("rid", "t", "in", "out")}), file)
    return file


MAP = (("request_id", "rid"), ("arrival_time_s", "t"), ("prompt_tokens", "in"), ("output_tokens", "out"))


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_generic_numeric_units(tmp_path, suffix, unit):
    file = write_generic(tmp_path, suffix, RAW[unit])
    table = load_trace(file, LoadOptions(columns=MAP, time_unit=unit))
    got = arrivals_by_id(table)
    want = expected_s(RAW[unit], unit)
    assert got.keys() == want.keys()
    for rid, seconds in want.items():
        assert got[rid] == pytest.approx(seconds, rel=1e-12, abs=1e-15), (unit, rid)
    assert table.column(s.ARRIVAL_TIME_S).to_pylist() == pytest.approx(sorted(want.values()), rel=1e-12, abs=1e-15)
    # The origin kept in the provenance: the earliest raw time, in seconds.
    origin_s = float(s.trace_meta(table).time_origin.removesuffix(" s"))
    assert origin_s == pytest.approx(min(RAW[unit]) * SECONDS_PER[unit], rel=1e-12)


def test_generic_default_unit_is_seconds(tmp_path):
    file = write_generic(tmp_path, ".csv", RAW["s"])
    assert arrivals_by_id(load_trace(file, LoadOptions(columns=MAP))) == expected_s(RAW["s"], "s")


# Date-times: whole seconds through calendar.timegm, the fraction as a decimal.
DATES = ["2024-03-01 00:00:01.5", "2024-02-29 23:59:59.25", "2024-03-01T00:01:00", "2024-02-29 23:59:59.250000001"]


def datetime_seconds(text: str) -> Decimal:
    date, _, clock = text.replace("T", " ").partition(" ")
    whole, _, fraction = clock.partition(".")
    fields = [int(x) for x in date.split("-")] + [int(x) for x in whole.split(":")]
    return Decimal(calendar.timegm((*fields, 0, 0, 0))) + Decimal(f"0.{fraction or '0'}")


def expected_from_dates(dates: list[str]) -> dict[str, float]:
    values = [datetime_seconds(d) for d in dates]
    origin = min(values)
    return {f"r{i}": float(v - origin) for i, v in enumerate(values)}


@pytest.mark.parametrize("bad_line", [False, True])
def test_generic_csv_datetimes(tmp_path, bad_line):
    file = write_generic(tmp_path, ".csv", DATES)
    if bad_line:  # a line with 0 output tokens, skipped: the file is read line by line
        file.write_text(file.read_text() + "rbad,2024-03-01 00:00:02,5,0\n")
    table = load_trace(file, LoadOptions(columns=MAP, time_unit="datetime", skip_bad=bad_line))
    got = arrivals_by_id(table)
    want = expected_from_dates(DATES)
    assert got.keys() == want.keys()
    for rid, seconds in want.items():
        assert got[rid] == pytest.approx(seconds, abs=1e-9), rid
    assert want["r3"] == pytest.approx(1e-9) and got["r3"] > 0  # one nanosecond after r1


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_generic_parquet_timestamps(tmp_path, unit):
    """A parquet timestamp column of any resolution, read as date-times."""
    whole = [Decimal(x) for x in ("1709251201", "1709251199", "1709251260", "1709251200")]
    # Fractions only where the resolution holds them.
    seconds = whole if unit == "s" else [w + Decimal(f) for w, f in zip(whole, ("0.5", "0.25", "0", "0.75"))]
    per = Decimal(str(SECONDS_PER[unit]))
    ticks = [int(v / per) for v in seconds]
    file = tmp_path / "ts.parquet"
    pq.write_table(pa.table({"rid": [f"r{i}" for i in range(4)], "t": pa.array(ticks, pa.timestamp(unit)),
                             "in": PROMPTS, "out": OUTPUTS}), file)
    got = arrivals_by_id(load_trace(file, LoadOptions(columns=MAP, time_unit="datetime")))
    origin = min(seconds)
    for i, v in enumerate(seconds):
        assert got[f"r{i}"] == pytest.approx(float(v - origin), abs=1e-9), (unit, i)


@pytest.mark.parametrize("bad_line", [False, True])
def test_azure_timestamps(tmp_path, bad_line):
    """Read whole by the vectorised reader, or line by line (a bad line skipped sends the
    file down the slow path, which parses the date-times itself): the same seconds."""
    stamps = ["2023-11-16 18:15:46.6805900", "2023-11-16 18:15:46.5000000", "2023-11-16 18:15:47.0000001",
              "2023-11-16 18:16:00.1234567"]
    file = tmp_path / "azure.csv"
    bad = "2023-11-16 18:15:50.0000000,0,5\n" if bad_line else ""  # 0 context tokens: skipped
    file.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + bad
                    + "".join(f"{t},{p},{o}\n" for t, p, o in zip(stamps, PROMPTS, OUTPUTS)))
    table = load_trace(file, LoadOptions(skip_bad=bad_line))
    assert s.trace_meta(table).source_format == "azure"
    assert s.trace_meta(table).skipped_bad_lines == int(bad_line)
    want = expected_from_dates(stamps)
    # Azure ids are the 0-based rows of the requests kept: r{i} is stamps[i].
    got = {f"r{rid}": t for rid, t in arrivals_by_id(table).items()}
    for rid, seconds in want.items():
        assert got[rid] == pytest.approx(seconds, abs=1e-9), rid
    assert got["r2"] == pytest.approx(0.5000001, abs=1e-9)  # to the 100 ns


def test_burstgpt_seconds_relative_to_the_first(tmp_path):
    raw = [400.5, 100.0, 250.25, 100.125]
    file = tmp_path / "burst.csv"
    file.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    + "".join(f"{t},ChatGPT,{p},{o},{p + o},Conversation log\n" for t, p, o in zip(raw, PROMPTS, OUTPUTS)))
    table = load_trace(file)
    assert s.trace_meta(table).source_format == "burstgpt"
    got = {f"r{rid}": t for rid, t in arrivals_by_id(table).items()}
    assert got == pytest.approx(expected_s(raw, "s"), rel=1e-12)


def test_mooncake_milliseconds_kept_as_recorded(tmp_path):
    raw_ms = [0, 1500, 3250, 3251, 10_000]
    file = tmp_path / "mooncake.jsonl"
    file.write_text("".join(json.dumps({"timestamp": t, "input_length": 600, "output_length": 3,
                                        "hash_ids": [i * 2, i * 2 + 1]}) + "\n" for i, t in enumerate(raw_ms)))
    table = load_trace(file, LoadOptions(format="mooncake", arrivals="burst"))
    got = {f"r{rid}": t for rid, t in arrivals_by_id(table).items()}
    assert got == pytest.approx({f"r{i}": t / 1000 for i, t in enumerate(raw_ms)}, rel=1e-12)


def test_bailian_seconds_kept(tmp_path):
    raw = [5.0, 2.5, 1.25, 30.0]  # seconds from the trace start, kept: not made relative
    file = tmp_path / "bailian.jsonl"
    file.write_text("".join(json.dumps({"chat_id": 100 + i, "parent_chat_id": -1, "timestamp": t, "input_length": p,
                                        "output_length": o, "turn": 1, "type": "text", "hash_ids": [i]}) + "\n"
                            for i, (t, p, o) in enumerate(zip(raw, PROMPTS, OUTPUTS))))
    table = load_trace(file, LoadOptions(format="bailian"))
    got = arrivals_by_id(table)
    assert got == pytest.approx({str(100 + i): t for i, t in enumerate(raw)}, rel=1e-12)


# -- trace info's printed figures ---------------------------------------------------------


INFO_TIMES_MS = [0, 400, 1000, 2500, 4000]
INFO_PROMPTS = [100, 250, 50, 1000, 333]
INFO_OUTPUTS = [10, 1, 7, 200, 42]


@pytest.fixture
def info_file(tmp_path):
    file = tmp_path / "info.csv"
    file.write_text("t,in,out\n" + "".join(f"{t},{p},{o}\n" for t, p, o in zip(INFO_TIMES_MS, INFO_PROMPTS,
                                                                               INFO_OUTPUTS)))
    return file


def info_args(file, *extra):
    return ["trace", "info", str(file), "--map", "arrival_time_s=t", "--map", "prompt_tokens=in",
            "--map", "output_tokens=out", "--time-unit", "ms", *extra]


def test_trace_info_json_recomputed(info_file):
    result = CliRunner().invoke(app, info_args(info_file, "--json"))
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    duration_s = (max(INFO_TIMES_MS) - min(INFO_TIMES_MS)) / 1000
    assert info["requests"] == len(INFO_PROMPTS)
    assert info["duration_s"] == pytest.approx(duration_s)
    assert info["rate_per_s"] == pytest.approx(len(INFO_PROMPTS) / duration_s)
    for key, values in (("input_tokens", INFO_PROMPTS), ("output_tokens", INFO_OUTPUTS)):
        p50, p99 = np.percentile(values, [50, 99])
        assert info[key] == pytest.approx({"mean": np.mean(values), "p50": p50, "p99": p99, "max": max(values)}), key


def test_trace_info_text_recomputed(info_file):
    result = CliRunner().invoke(app, info_args(info_file))
    assert result.exit_code == 0, result.output
    text = result.stdout
    duration_s = (max(INFO_TIMES_MS) - min(INFO_TIMES_MS)) / 1000
    rate = len(INFO_PROMPTS) / duration_s
    assert f"{len(INFO_PROMPTS)} requests over {duration_s:,.1f} s, {rate:.3g} req/s" in text
    for name, values in (("input", INFO_PROMPTS), ("output", INFO_OUTPUTS)):
        p50, p99 = np.percentile(values, [50, 99])
        row = [f"{v:,.1f}" for v in (np.mean(values), p50, p99, max(values))]
        assert re.search(name + r"\s*│\s*" + r"\s*│\s*".join(map(re.escape, row)), text), (name, row, text)


CONVERT_MAP = ["--map", "arrival_time_s=t", "--map", "prompt_tokens=in", "--map", "output_tokens=out",
               "--time-unit", "ms"]


def convert(*args) -> pa.Table:
    result = CliRunner().invoke(app, ["trace", "convert", *map(str, args), *CONVERT_MAP])
    assert result.exit_code == 0, result.output
    return result


def test_trace_convert_keeps_the_seconds(info_file, tmp_path):
    out = tmp_path / "out.parquet"
    result = convert(info_file, "-o", out)
    assert f"{len(INFO_PROMPTS)} requests" in result.output
    table = s.read_parquet(out)
    assert table.column(s.ARRIVAL_TIME_S).to_pylist() == pytest.approx([t / 1000 for t in INFO_TIMES_MS])


def test_trace_convert_cuts_in_seconds(info_file, tmp_path):
    """--start-s/--end-s keep [start, end) of the converted seconds and shift start to 0;
    --rate-scale divides the times; the cut counts are what is printed."""
    out = tmp_path / "cut.parquet"
    start_s, end_s, scale = 0.3, 4.0, 2.0  # 4.0 is an arrival: end excluded
    seconds = [t / 1000 for t in INFO_TIMES_MS]
    kept = [(t - start_s) / scale for t in seconds if start_s <= t < end_s]
    result = convert(info_file, "-o", out, "--start-s", start_s, "--end-s", end_s, "--rate-scale", scale)
    assert f"{len(kept)} requests" in result.output
    assert s.read_parquet(out).column(s.ARRIVAL_TIME_S).to_pylist() == pytest.approx(kept)


def test_trace_convert_concatenates_after_the_last_arrival(info_file, tmp_path):
    """Two files played one after the other: the second starts --gap-s after the first's
    last arrival."""
    out = tmp_path / "two.parquet"
    gap_s = 1.5
    seconds = [t / 1000 for t in INFO_TIMES_MS]
    result = convert(info_file, info_file, "-o", out, "--gap-s", gap_s)
    assert f"{2 * len(seconds)} requests" in result.output
    second = [t + max(seconds) + gap_s for t in seconds]
    assert s.read_parquet(out).column(s.ARRIVAL_TIME_S).to_pylist() == pytest.approx(seconds + second)
