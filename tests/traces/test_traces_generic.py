"""The generic CSV/parquet loader with a column map, and format detection."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtwin.traces import schema as s
from kvtwin.traces.errors import TraceError
from kvtwin.traces.generic import ColumnMap, load_generic
from kvtwin.traces.load import LoadOptions, detect_format, load_trace
from kvtwin.traces.stats import summarize

FIXTURES = Path(__file__).parent / "fixtures"


def test_csv_with_a_column_map_converts_units_and_rebases_time():
    columns = ColumnMap.from_pairs(["arrival_time_s=ts_ms", "prompt_tokens=prompt", "output_tokens=completion",
                                    "session_id=user", "priority=prio", "request_id=rid"], time_unit="ms")
    table = load_generic(FIXTURES / "generic_small.csv", columns)
    s.validate(table)
    assert table.column(s.REQUEST_ID).to_pylist() == ["b", "a", "c"]
    assert table.column(s.ARRIVAL_TIME_S).to_pylist() == [0.0, 1.0, 2.5]
    assert table.column(s.PRIORITY).to_pylist() == [1, 0, 0]
    assert table.column(s.SESSION_ID).to_pylist() == ["u2", "u1", "u1"]
    assert s.trace_meta(table).time_origin == "1 s"


def test_parquet_with_per_block_hashes_gets_them_chained(tmp_path: Path):
    path = tmp_path / "log.parquet"
    pq.write_table(pa.table({
        "t": [0.0, 1.0, 2.0],
        "in": [32, 32, 32],
        "out": [1, 1, 1],
        "blocks": [[5, 6], [7, 6], [5, 6]],
    }), path)
    columns = ColumnMap(arrival_time_s="t", prompt_tokens="in", output_tokens="out", block_hashes="blocks",
                        hash_block_tokens=16, hashes_chained=False)
    table = load_generic(path, columns)
    a, b, c = table.column(s.BLOCK_HASHES).to_pylist()
    assert a == c and a[1] != b[1]
    assert summarize(table).prefix_reuse.reused_blocks == 2


def test_parquet_with_token_ids_has_token_identity(tmp_path: Path):
    path = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"t": [0, 1], "in": [3, 4], "out": [1, 1], "ids": [[1, 2, 3], [1, 2, 3, 4]]}), path)
    columns = ColumnMap(arrival_time_s="t", prompt_tokens="in", output_tokens="out", prompt_token_ids="ids")
    table = load_generic(path, columns)
    assert s.trace_meta(table).content_identity == s.IDENTITY_TOKEN_IDS
    reuse = summarize(table, block_tokens=2).prefix_reuse
    assert (reuse.blocks, reuse.reused_blocks) == (4, 1)


def test_parquet_bad_rows_name_the_column_and_row_and_can_be_skipped(tmp_path: Path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"t": [0.0, 1.0, 2.0], "in": [10, 0, 10], "out": [1, 1, None]}), path)
    columns = ColumnMap(arrival_time_s="t", prompt_tokens="in", output_tokens="out")
    with pytest.raises(TraceError) as err:
        load_generic(path, columns)
    assert (err.value.field, err.value.line) == ("in", 2)
    table = load_generic(path, columns, skip_bad=True)
    assert table.num_rows == 1 and s.trace_meta(table).skipped_bad_lines == 2


def test_a_missing_mapped_column_is_an_error():
    columns = ColumnMap(arrival_time_s="nope", prompt_tokens="prompt", output_tokens="completion")
    with pytest.raises(TraceError, match="nope"):
        load_generic(FIXTURES / "generic_small.csv", columns)


def test_column_map_rejects_bad_pairs():
    with pytest.raises(ValueError):
        ColumnMap.from_pairs(["arrival_time_s=a", "bogus=b"])
    with pytest.raises(ValueError, match="prompt_tokens"):
        ColumnMap.from_pairs(["arrival_time_s=a"])


@pytest.mark.parametrize("name, fmt", [
    ("mooncake_small.jsonl", "mooncake"), ("bailian_small.jsonl", "bailian"), ("azure_small.csv", "azure"),
    ("burstgpt1_small.csv", "burstgpt"), ("burstgpt3_small.csv", "burstgpt"), ("generic_small.csv", "generic"),
])
def test_format_detection_reads_the_content(name, fmt):
    assert detect_format(FIXTURES / name) == fmt


def test_detected_generic_needs_a_map():
    with pytest.raises(TraceError, match="column map"):
        load_trace(FIXTURES / "generic_small.csv")


def test_load_trace_reads_back_a_converted_parquet(tmp_path: Path):
    table = load_trace(FIXTURES / "mooncake_small.jsonl")
    out = s.write_parquet(table, tmp_path / "m.parquet")
    assert detect_format(out) == "parquet"
    assert load_trace(out).equals(table)


def test_session_assumption_refuses_traces_with_identity():
    with pytest.raises(TraceError, match="content identity"):
        load_trace(FIXTURES / "mooncake_small.jsonl", LoadOptions(assume_session_history=16))
