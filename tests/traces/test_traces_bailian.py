"""The Bailian-style loader: per-block ids chained, sessions from parent links, failed rows."""

from pathlib import Path

from kvtwin.traces import schema as s
from kvtwin.traces.bailian import load_bailian, session_roots
from kvtwin.traces.stats import summarize

import numpy as np

SMALL = Path(__file__).parent / "fixtures" / "bailian_small.jsonl"


def _rows():
    table = load_bailian(SMALL)
    s.validate(table)
    return table, {row[s.REQUEST_ID]: row for row in table.to_pylist()}


def test_rows_fields_and_the_failed_request_is_dropped_with_a_note():
    table, rows = _rows()
    assert sorted(rows) == ["10", "11", "12", "14", "15"]  # chat 13 generated 0 tokens
    assert any("output_length 0" in note for note in s.trace_meta(table).notes)
    assert rows["12"][s.ARRIVAL_TIME_S] == 2.25
    assert rows["12"][s.TURN] == 2
    assert rows["12"][s.HASH_BLOCK_TOKENS] == 16


def test_equal_block_ids_only_share_when_the_whole_prefix_is_shared():
    _, rows = _rows()
    h10, h11, h12, h14 = (rows[k][s.BLOCK_HASHES] for k in ("10", "11", "12", "14"))
    # Chat 11 repeats raw ids 2, 3 of chat 10 after a different first block: nothing shared.
    assert not set(h11) & set(h10)
    # Chat 12 extends chat 10's prompt: its first three chained ids are chat 10's.
    assert h12[:3] == h10
    assert h14[:5] == h12 and h14[5] not in h12


def test_sessions_follow_parent_links_to_the_oldest_ancestor_in_the_file():
    _, rows = _rows()
    assert rows["10"][s.SESSION_ID] == rows["12"][s.SESSION_ID] == rows["14"][s.SESSION_ID] == "10"
    assert rows["11"][s.SESSION_ID] == "11"
    assert rows["15"][s.SESSION_ID] == "99"  # parent absent from the file


def test_session_roots_handles_deep_chains():
    chats = np.array([1, 2, 3, 4])
    parents = np.array([-1, 1, 2, 3])
    assert session_roots(chats, parents).tolist() == [1, 1, 1, 1]


def test_prefix_reuse_counts_only_chained_sharing():
    table, _ = _rows()
    reuse = summarize(table).prefix_reuse
    # Blocks: 10 -> 3 (new), 11 -> 3 (new), 12 -> 5 (3 reused), 14 -> 7 (5 reused), 15 -> 1 (new).
    assert reuse.blocks == 19 and reuse.reused_blocks == 8
