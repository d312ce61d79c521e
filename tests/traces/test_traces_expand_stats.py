"""Reblocking, pseudo token expansion, and the prefix-reuse bound, against brute force."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtwin.traces import schema as s
from kvtwin.traces.expand import expand_request, expand_token_ids, reblock
from kvtwin.traces.hashing import hash_token_blocks
from kvtwin.traces.sessions import assume_session_history
from kvtwin.traces.stats import prefix_reuse, summarize

# Prompts over a two-letter alphabet built from a few shared stems, so prefixes collide often.
prompts = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 1), min_size=0, max_size=40)),
    min_size=1, max_size=12,
).map(lambda rows: [[7] * (5 * stem) + tail or [9] for stem, tail in rows])


def _token_table(token_lists):
    return s.build_table({
        s.REQUEST_ID: [str(i) for i in range(len(token_lists))],
        s.ARRIVAL_TIME_S: np.arange(len(token_lists), dtype=float),
        s.PROMPT_TOKENS: [len(x) for x in token_lists],
        s.OUTPUT_TOKENS: [1] * len(token_lists),
        s.PROMPT_TOKEN_IDS: pa.array(token_lists, s.PROMPT_TOKEN_IDS_TYPE),
    }, s.TraceMeta(source_format="test", content_identity=s.IDENTITY_TOKEN_IDS))


def _brute_force_reuse(token_lists, block):
    seen, reused = set(), 0
    for tokens in token_lists:
        keys = [tuple(tokens[: min((k + 1) * block, len(tokens))]) for k in range(-(-len(tokens) // block))]
        run = 0
        while run < len(keys) and keys[run] in seen:
            run += 1
        reused += run
        seen.update(keys)
    return reused


@settings(max_examples=60, deadline=None)
@given(prompts, st.integers(1, 8))
def test_prefix_reuse_of_token_prompts_matches_brute_force(token_lists, block):
    reuse = summarize(_token_table(token_lists), block_tokens=block).prefix_reuse
    assert reuse.reused_blocks == _brute_force_reuse(token_lists, block)
    assert reuse.blocks == sum(-(-len(x) // block) for x in token_lists)


@settings(max_examples=60, deadline=None)
@given(prompts, st.integers(1, 6), st.integers(1, 4))
def test_reblocked_ids_only_claim_sharing_that_exists(token_lists, hash_block, block_multiple):
    hashes = hash_token_blocks(pa.array(token_lists, s.PROMPT_TOKEN_IDS_TYPE), hash_block)
    lengths = np.array([len(x) for x in token_lists])
    for block in (block_multiple * hash_block, max(1, hash_block // 2), hash_block + 1):
        ids = reblock(hashes, hash_block, lengths, block).to_pylist()
        owner = {}
        for row, row_ids in enumerate(ids):
            assert len(row_ids) == -(-lengths[row] // block)
            for k, value in enumerate(row_ids):
                end = min((k + 1) * block, lengths[row])
                if value in owner:
                    other_row, other_end = owner[value]
                    assert token_lists[row][:end] == token_lists[other_row][:other_end]
                owner.setdefault(value, (row, end))
        if block % hash_block == 0:
            # Block ends on hash boundaries: full blocks with equal content get equal ids.
            for a in range(len(token_lists)):
                for b in range(a):
                    for k in range(min(lengths[a], lengths[b]) // block):
                        if token_lists[a][: (k + 1) * block] == token_lists[b][: (k + 1) * block]:
                            assert ids[a][k] == ids[b][k]


def test_reblock_at_the_hash_block_size_returns_the_ids():
    hashes = pa.array([[1, 2], [1, 3]], s.BLOCK_HASHES_TYPE)
    assert reblock(hashes, 512, np.array([600, 1024]), 512).to_pylist() == [[1, 2], [1, 3]]


def test_reblock_stops_where_the_hashes_stop():
    hashes = pa.array([[1]], s.BLOCK_HASHES_TYPE)
    assert len(reblock(hashes, 16, np.array([100]), 8).to_pylist()[0]) == 2


def test_expanded_tokens_follow_the_hashes():
    a = expand_request(np.array([10, 11], np.uint64), 16, 30, vocab_size=1000, request_salt=1)
    b = expand_request(np.array([10, 12], np.uint64), 16, 32, vocab_size=1000, request_salt=2)
    assert a.dtype == np.int32 and len(a) == 30 and a.min() >= 0 and a.max() < 1000
    assert np.array_equal(a[:16], b[:16]) and not np.array_equal(a[16:30], b[16:30])
    # Beyond the hashes' coverage the content is unknown: different per request.
    c = expand_request(np.array([10], np.uint64), 16, 40, vocab_size=1000, request_salt=1)
    d = expand_request(np.array([10], np.uint64), 16, 40, vocab_size=1000, request_salt=2)
    assert np.array_equal(c[:16], d[:16]) and not np.array_equal(c[16:], d[16:])


def test_expand_token_ids_of_a_table():
    table = _token_table([[1, 2, 3], [4, 5]])
    assert expand_token_ids(table, vocab_size=10).to_pylist() == [[1, 2, 3], [4, 5]]


def test_expanded_hash_trace_has_the_same_reuse_as_its_hashes():
    hashes = [[1, 2, 3], [1, 2, 4], [5]]
    table = s.build_table({
        s.REQUEST_ID: ["a", "b", "c"], s.ARRIVAL_TIME_S: [0.0, 1.0, 2.0], s.PROMPT_TOKENS: [40, 48, 10],
        s.OUTPUT_TOKENS: [1, 1, 1], s.BLOCK_HASHES: pa.array(hashes, s.BLOCK_HASHES_TYPE),
        s.HASH_BLOCK_TOKENS: [16, 16, 16],
    }, s.TraceMeta(source_format="test", content_identity=s.IDENTITY_HASHES))
    tokens = expand_token_ids(table, vocab_size=50_000).to_pylist()
    assert [len(x) for x in tokens] == [40, 48, 10]
    by_hash = summarize(table).prefix_reuse.reused_blocks
    by_tokens = summarize(_token_table(tokens), block_tokens=16).prefix_reuse.reused_blocks
    assert by_hash == by_tokens == 2


def test_prefix_reuse_counts_the_leading_run_only():
    ids = pa.array([[1, 2, 3], [1, 9, 3], [1, 2, 3, 4]], s.BLOCK_HASHES_TYPE)
    reuse = prefix_reuse(ids, np.array([48, 48, 60]), 16)
    assert (reuse.blocks, reuse.reused_blocks) == (10, 1 + 3)
    assert reuse.token_fraction == pytest.approx((16 + 48) / 156)


def test_session_assumption_shares_the_history_and_says_so():
    table = s.build_table({
        s.REQUEST_ID: ["a", "b", "c", "d"], s.ARRIVAL_TIME_S: [0.0, 1.0, 2.0, 3.0],
        s.PROMPT_TOKENS: [40, 100, 40, 20], s.OUTPUT_TOKENS: [30, 5, 1, 1],
        s.SESSION_ID: ["x", "x", None, "x"],
    }, s.TraceMeta(source_format="test"))
    assumed = assume_session_history(table, block_tokens=16)
    s.validate(assumed)
    a, b, c, d = assumed.column(s.BLOCK_HASHES).to_pylist()
    # b re-sends a's 40 prompt + 30 output = 70 tokens: 4 full blocks shared, a's 2 full prompt blocks among them.
    assert b[:2] == a[:2] and b[2] != a[2]
    assert not set(c) & (set(a) | set(b))
    # d (20 tokens) is shorter than the 105-token history it should re-send: it breaks the
    # assumption, still shares its one full block, and its partial block is fresh.
    assert d[0] == b[0] and d[1] not in b
    meta = s.trace_meta(assumed)
    assert meta.identity_assumption == s.ASSUMPTION_SESSION_HISTORY
    assert any("ASSUMED" in note and "1 turn(s)" in note for note in meta.notes)
    assert summarize(assumed).identity_assumption == s.ASSUMPTION_SESSION_HISTORY
