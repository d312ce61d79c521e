"""Bad input: every malformed line is reported with file, line and field; --skip-bad counts."""

from pathlib import Path

import pytest

from kvtwin.traces import schema as s
from kvtwin.traces.azure import load_azure
from kvtwin.traces.bailian import load_bailian
from kvtwin.traces.errors import TraceError
from kvtwin.traces.mooncake import BURST, load_mooncake

BAD = Path(__file__).parent / "fixtures" / "mooncake_bad.jsonl"


def test_the_first_bad_line_is_raised_with_file_line_and_field():
    with pytest.raises(TraceError) as err:
        load_mooncake(BAD)
    assert err.value.line == 2 and err.value.field == "line"
    assert str(err.value).startswith(f"{BAD}:2: line: expected one JSON object per line")


@pytest.mark.parametrize("body, line, field", [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
     '{"timestamp": 0, "output_length": 1, "hash_ids": [0]}\n', 2, "input_length"),
    ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}\n', 1, "input_length"),
    ('{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": [0]}\n', 1, "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": true, "hash_ids": [0]}\n', 1, "output_length"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n', 1, "timestamp"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": [0]}\n', 1, "output_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, -3]}\n', 1, "hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, null]}\n', 1, "hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}\n', 1, "hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, 1]}\n', 1, "hash_ids"),
    ('\n\n[1, 2]\n', 3, "line"),
    ('{"timestamp": 0, "input_length": 5, "input_length": 6, "output_length": 1, "hash_ids": [0]}\n', 1, "line"),
])
def test_each_kind_of_bad_mooncake_line_is_located(tmp_path: Path, body, line, field):
    path = tmp_path / "t.jsonl"
    path.write_text(body)
    with pytest.raises(TraceError) as err:
        load_mooncake(path)
    assert (err.value.line, err.value.field) == (line, field)
    assert str(err.value).startswith(f"{path}:{line}: {field}: expected")


def test_skip_bad_keeps_going_counts_and_keeps_the_first_reasons():
    table = load_mooncake(BAD, skip_bad=True, arrivals=BURST)
    assert table.num_rows == 2
    assert table.column(s.PROMPT_TOKENS).to_pylist() == [1100, 900]
    meta = s.trace_meta(table)
    assert meta.skipped_bad_lines == 4
    assert [reason.split(":")[1] for reason in meta.bad_line_reasons] == ["2", "3", "4", "5"]
    assert "input_length" in meta.bad_line_reasons[1] and "hash_ids" in meta.bad_line_reasons[3]
    assert any("skipped 4 bad line" in note for note in meta.notes)


def test_bad_csv_cell_and_short_row_are_located(tmp_path: Path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,48,10\n"
                    "2023-11-16 18:17:04,abc,8\n2023-11-16 18:17:05,3\n2023-02-30 18:17:05,3,4\n")
    with pytest.raises(TraceError) as err:
        load_azure(path)
    assert (err.value.line, err.value.field) == (3, "ContextTokens")
    table = load_azure(path, skip_bad=True)
    assert table.num_rows == 1
    reasons = s.trace_meta(table).bad_line_reasons
    assert [r.split(":")[1:3] for r in reasons] == [["3", " ContextTokens"], ["4", " row"], ["5", " TIMESTAMP"]]


def test_a_missing_csv_column_is_reported_even_with_skip_bad(tmp_path: Path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03,48\n")
    with pytest.raises(TraceError) as err:
        load_azure(path, skip_bad=True)
    assert (err.value.line, err.value.field) == (1, "GeneratedTokens")


def test_bailian_repeated_chat_id_is_a_bad_line(tmp_path: Path):
    line = '{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1, ' \
           '"turn": 1, "hash_ids": [4]}\n'
    path = tmp_path / "b.jsonl"
    path.write_text(line + line)
    with pytest.raises(TraceError) as err:
        load_bailian(path)
    assert (err.value.line, err.value.field) == (2, "chat_id")
