"""The Mooncake loader on a small fixture: fields, hashes, arrival spreading, chaining check."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.traces import schema as s
from kvtwin.traces.arrivals import bucketing
from kvtwin.traces.mooncake import BURST, SPREAD, load_mooncake

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


MS = FIXTURES / "mooncake_ms.jsonl"  # Mooncake's fields, real millisecond arrival times (no buckets)


def test_millisecond_timestamps_are_kept_by_default_and_a_note_says_so():
    recorded = [t / 1000 for t in (0, 412, 413, 1250, 1250, 2718, 3140, 4099, 5287, 5288, 6020, 7455)]
    table = load_mooncake(MS)
    assert table.column(s.ARRIVAL_TIME_S).to_pylist() == recorded
    meta = s.trace_meta(table)
    assert meta.arrivals.startswith("as recorded")
    notes = [note for note in meta.notes if "not bucketed" in note]
    assert len(notes) == 1 and "--arrivals spread" in notes[0], meta.notes
    forced = load_mooncake(MS, arrivals=SPREAD).column(s.ARRIVAL_TIME_S).to_pylist()
    assert forced != recorded and s.trace_meta(load_mooncake(MS, arrivals=SPREAD)).notes == ()
    assert load_mooncake(MS, arrivals=BURST).column(s.ARRIVAL_TIME_S).to_pylist() == recorded


def test_bucketed_timestamps_are_spread_by_default_as_when_forced():
    default = load_mooncake(SMALL, seed=3)
    forced = load_mooncake(SMALL, seed=3, arrivals=SPREAD)
    assert default.column(s.ARRIVAL_TIME_S).equals(forced.column(s.ARRIVAL_TIME_S))
    assert s.trace_meta(default).arrivals == s.trace_meta(forced).arrivals == \
        "spread uniformly within 3 s buckets (seed 3)"


@pytest.mark.parametrize("times_ms, width_s", [
    # Mooncake's clock: 3 s buckets, a few ms of jitter, several requests each.
    ([0, 0, 0, 3001, 3001, 5999, 5999, 9000, 9000], 3.0),
    # An empty bucket is a gap of two widths.
    ([0, 0, 3000, 3000, 9000, 9000, 12_000, 12_000], 3.0),
    # Whole seconds, several requests per second.
    ([0, 0, 0, 1000, 1000, 2000, 4000, 4000], 1.0),
    # Gaps off the grid by more than 1% of the width: not a bucketed clock.
    ([0, 0, 3000, 3000, 6100, 6100, 9000, 9000], None),
    # One request per tick: a clock that groups nothing (a steady rate is not a bucket).
    ([0, 1000, 2000, 3000, 4000, 5000], None),
    # Real arrival times.
    ([0, 412, 413, 1250, 1250, 2718, 3140, 4099], None),
    # One timestamp: no width to tell.
    ([500, 500, 500], None),
    ([], None),
])
def test_bucket_width_detects_a_bucketed_clock(times_ms, width_s):
    found = bucketing(np.asarray(times_ms, dtype=np.float64) / 1000).width_s
    assert found == (None if width_s is None else pytest.approx(width_s, abs=0.005))
