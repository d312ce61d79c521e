"""Azure 2023 and BurstGPT CSV loaders on small fixtures."""

from pathlib import Path

import pytest

from kvtwin.traces import schema as s
from kvtwin.traces.azure import load_azure
from kvtwin.traces.burstgpt import load_burstgpt
from kvtwin.traces.errors import TraceError
from kvtwin.traces.stats import summarize

FIXTURES = Path(__file__).parent / "fixtures"


def test_azure_times_keep_seven_digit_fractions_relative_to_the_first_row():
    table = load_azure(FIXTURES / "azure_small.csv")
    s.validate(table)
    times = table.column(s.ARRIVAL_TIME_S).to_pylist()
    assert times[0] == 0.0
    assert times[1] == pytest.approx(0.0520001, abs=1e-9)
    assert times[3] == pytest.approx(56.02004, abs=1e-9)
    assert table.column(s.PROMPT_TOKENS).to_pylist() == [4808, 3180, 120, 7]
    meta = s.trace_meta(table)
    assert meta.time_origin == "2023-11-16 18:17:03.979960000"
    assert meta.content_identity == s.IDENTITY_NONE


def test_azure_has_no_prefix_reuse_bound():
    stats = summarize(load_azure(FIXTURES / "azure_small.csv"))
    assert stats.prefix_reuse is None and stats.to_json()["prefix_reuse_upper_bound"] is None


def test_burstgpt_failed_rows_are_dropped_counted_and_ids_point_at_source_rows():
    table = load_burstgpt(FIXTURES / "burstgpt1_small.csv")
    s.validate(table)
    assert table.column(s.REQUEST_ID).to_pylist() == ["0", "2"]
    assert table.column(s.ARRIVAL_TIME_S).to_pylist() == [0.0, 113.0]
    notes = s.trace_meta(table).notes
    assert any("dropped 2 failed" in note for note in notes)
    assert table.column(s.SESSION_ID).null_count == 2


def test_burstgpt3_reads_columns_by_name_and_numbers_turns_per_session():
    table = load_burstgpt(FIXTURES / "burstgpt3_small.csv")
    rows = table.to_pylist()
    assert [r[s.SESSION_ID] for r in rows] == ["aaa", None, "aaa", "aaa", "bbb"]
    assert [r[s.TURN] for r in rows] == [1, None, 2, 3, 1]
    assert [r[s.PROMPT_TOKENS] for r in rows] == [100, 36, 150, 400, 50]
    assert s.trace_meta(table).time_origin == "19440110 s"


def test_burstgpt_prompt_without_tokens_but_with_a_response_is_bad_input(tmp_path: Path):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Request tokens,Response tokens\n1,0,5\n")
    with pytest.raises(TraceError) as err:
        load_burstgpt(path)
    assert (err.value.line, err.value.field) == (2, "Request tokens")
