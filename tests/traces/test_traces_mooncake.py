"""The Mooncake loader on a small fixture: fields, hashes, arrival spreading, chaining check."""

from pathlib import Path

import numpy as np
import pyarrow as pa

from kvtwin.traces import schema as s
from kvtwin.traces.mooncake import BURST, load_mooncake

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = FIXTURES / "mooncake_small.jsonl"


def test_fields_and_hashes_are_loaded_as_recorded_in_burst_mode():
    table = load_mooncake(SMALL, arrivals=BURST)
    s.validate(table)
    assert table.num_rows == 6
    assert table.column(s.ARRIVAL_TIME_S).to_pylist() == [0.0, 0.0, 0.0, 3.001, 6.0, 6.0]
    assert table.column(s.PROMPT_TOKENS).to_pylist() == [1100, 600, 1500, 1536, 100, 2000]
    assert table.column(s.OUTPUT_TOKENS).to_pylist() == [20, 5, 7, 9, 1, 30]
    assert table.column(s.BLOCK_HASHES).to_pylist()[0] == [0, 1, 2]
    assert set(table.column(s.HASH_BLOCK_TOKENS).to_pylist()) == {512}
    meta = s.trace_meta(table)
    assert meta.content_identity == s.IDENTITY_HASHES and meta.source_format == "mooncake"
    assert "as recorded" in meta.arrivals


def test_spreading_stays_inside_each_bucket_keeps_file_order_and_is_seeded():
    burst = load_mooncake(SMALL, arrivals=BURST).column(s.ARRIVAL_TIME_S).to_numpy()
    spread = load_mooncake(SMALL, seed=3).column(s.ARRIVAL_TIME_S).to_numpy()
    again = load_mooncake(SMALL, seed=3).column(s.ARRIVAL_TIME_S).to_numpy()
    other = load_mooncake(SMALL, seed=4).column(s.ARRIVAL_TIME_S).to_numpy()
    np.testing.assert_array_equal(spread, again)
    assert not np.array_equal(spread, other)
    # Median gap between the distinct timestamps 0, 3.001, 6.0 is 3.0 s: each bucket is [t, t + 3).
    assert np.all(spread >= burst) and np.all(spread < burst + 3.0)
    assert np.all(np.diff(spread) >= 0)
    # Same ids, in the same order: spreading never reorders requests.
    ids = load_mooncake(SMALL, seed=3).column(s.REQUEST_ID).to_pylist()
    assert ids == [str(i) for i in range(6)]


def test_ids_that_are_not_chained_get_chained_with_a_note(tmp_path: Path):
    path = tmp_path / "flat.jsonl"
    # Id 7 follows 1 in one request and 2 in another: a per-block id, not a prefix id.
    path.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 7]}\n'
                    '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [2, 7]}\n')
    table = load_mooncake(path, arrivals=BURST)
    first, second = table.column(s.BLOCK_HASHES).to_pylist()
    assert first[1] != second[1]
    assert any("chained" in note for note in s.trace_meta(table).notes)


def test_fast_and_line_by_line_paths_agree(tmp_path: Path):
    clean = load_mooncake(SMALL, arrivals=BURST)
    # A trailing bad line forces the line-by-line path; skipping it must give the same table.
    path = tmp_path / "with_bad.jsonl"
    path.write_text(SMALL.read_text() + "{not json}\n")
    skipped = load_mooncake(path, arrivals=BURST, skip_bad=True)
    assert s.trace_meta(skipped).skipped_bad_lines == 1
    for name in s.TRACE_SCHEMA.names:
        assert skipped.column(name).equals(clean.column(name)), name


def test_empty_file_loads_as_an_empty_trace(tmp_path: Path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    table = load_mooncake(path)
    assert table.num_rows == 0
    assert table.schema.remove_metadata() == s.TRACE_SCHEMA
    assert isinstance(table.column(s.BLOCK_HASHES).type, pa.ListType)
