"""The trace schema: table assembly, validation, parquet round trips with provenance."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtwin.traces import schema as s
from kvtwin.traces.errors import TraceError


def _table(**overrides):
    columns = {
        s.REQUEST_ID: ["a", "b", "c"],
        s.ARRIVAL_TIME_S: [2.0, 0.5, 1.0],
        s.PROMPT_TOKENS: [40, 10, 17],
        s.OUTPUT_TOKENS: [1, 2, 3],
        s.BLOCK_HASHES: pa.array([[1, 2, 3], [1], [1, 9]], s.BLOCK_HASHES_TYPE),
        s.HASH_BLOCK_TOKENS: [16, 16, 16],
    }
    columns.update(overrides)
    return s.build_table(columns, s.TraceMeta(source_format="test", content_identity=s.IDENTITY_HASHES))


def test_build_table_has_the_schema_fills_nulls_and_sorts_by_arrival():
    table = _table()
    assert table.schema.remove_metadata() == s.TRACE_SCHEMA
    assert table.column(s.ARRIVAL_TIME_S).to_pylist() == [0.5, 1.0, 2.0]
    assert table.column(s.REQUEST_ID).to_pylist() == ["b", "c", "a"]
    assert table.column(s.SESSION_ID).null_count == 3
    s.validate(table)


def test_build_table_rejects_unknown_columns():
    with pytest.raises(ValueError, match="not trace columns"):
        s.build_table({s.ARRIVAL_TIME_S: [0.0], "bogus": [1]}, s.TraceMeta(source_format="x"))


def test_parquet_round_trip_keeps_rows_types_and_provenance(tmp_path: Path):
    table = s.with_meta(_table(), s.trace_meta(_table()).with_note("hello"))
    out = s.write_parquet(table, tmp_path / "sub" / "t.parquet")
    back = s.read_parquet(out)
    assert back.equals(table)
    assert s.trace_meta(back) == s.trace_meta(table)
    assert s.trace_meta(back).notes == ("hello",)
    assert [p.name for p in out.parent.iterdir()] == ["t.parquet"]  # no temp file left behind


def test_same_table_writes_byte_identical_files(tmp_path: Path):
    a = s.write_parquet(_table(), tmp_path / "a.parquet")
    b = s.write_parquet(_table(), tmp_path / "b.parquet")
    assert a.read_bytes() == b.read_bytes()


def test_reading_a_parquet_without_kvtwin_metadata_is_an_error(tmp_path: Path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1]}), path)
    with pytest.raises(TraceError, match="kvtwin.trace"):
        s.read_parquet(path)


@pytest.mark.parametrize("overrides, field", [
    ({s.PROMPT_TOKENS: [40, 0, 17]}, s.PROMPT_TOKENS),
    ({s.OUTPUT_TOKENS: [1, 0, 3]}, s.OUTPUT_TOKENS),
    ({s.REQUEST_ID: ["a", "a", "c"]}, s.REQUEST_ID),
    ({s.ARRIVAL_TIME_S: [2.0, -1.0, 1.0]}, s.ARRIVAL_TIME_S),
    ({s.BLOCK_HASHES: pa.array([[1, 2, 3, 4], [1], [1, 9]], s.BLOCK_HASHES_TYPE)}, s.BLOCK_HASHES),
    ({s.HASH_BLOCK_TOKENS: pa.array([16, None, 16], pa.int32())}, s.HASH_BLOCK_TOKENS),
    ({s.PROMPT_TOKEN_IDS: pa.array([[1, 2], None, None], s.PROMPT_TOKEN_IDS_TYPE)}, s.PROMPT_TOKEN_IDS),
])
def test_validate_names_the_broken_column(overrides, field):
    with pytest.raises(TraceError) as err:
        s.validate(_table(**overrides), "x.parquet")
    assert err.value.field == field
    assert str(err.value).startswith("x.parquet")


def test_validate_rejects_a_foreign_schema():
    with pytest.raises(TraceError, match="schema"):
        s.validate(pa.table({"a": [1]}))


def test_unsorted_rows_are_rejected_by_validate():
    table = _table()
    reversed_rows = table.take(pa.array(np.arange(table.num_rows)[::-1]))
    with pytest.raises(TraceError, match="arrival order"):
        s.validate(reversed_rows)


def test_hash_block_tokens_of_reports_the_single_size():
    assert s.hash_block_tokens_of(_table()) == 16
    mixed = _table(**{s.HASH_BLOCK_TOKENS: [16, 512, 16]})
    with pytest.raises(ValueError, match="mixes"):
        s.hash_block_tokens_of(mixed)
