"""Trace transforms: window, limit, rate scaling, session sampling, concatenation."""

from pathlib import Path

import numpy as np
import pytest

from kvtwin.traces import schema as s
from kvtwin.traces import transforms as t
from kvtwin.traces.burstgpt import load_burstgpt
from kvtwin.traces.mooncake import BURST, load_mooncake
from kvtwin.traces.stats import summarize

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def mooncake():
    return load_mooncake(FIXTURES / "mooncake_small.jsonl", arrivals=BURST)


@pytest.fixture
def sessions():
    return load_burstgpt(FIXTURES / "burstgpt3_small.csv")


def test_time_window_keeps_the_half_open_interval_and_shifts_it_to_zero(mooncake):
    window = t.time_window(mooncake, 3.0, 6.0)
    assert window.column(s.ARRIVAL_TIME_S).to_pylist() == pytest.approx([0.001])
    assert window.column(s.REQUEST_ID).to_pylist() == ["3"]
    assert s.trace_meta(window).transforms == ("window [3 s, 6 s) shifted to 0",)
    s.validate(window)
    with pytest.raises(ValueError):
        t.time_window(mooncake, 5.0, 5.0)


def test_limit_keeps_the_first_arrivals(mooncake):
    assert t.limit(mooncake, 2).column(s.REQUEST_ID).to_pylist() == ["0", "1"]
    assert t.limit(mooncake, 100).num_rows == mooncake.num_rows


def test_rate_scaling_divides_times(mooncake):
    fast = t.scale_rate(mooncake, 2.0)
    np.testing.assert_allclose(fast.column(s.ARRIVAL_TIME_S).to_numpy(),
                               mooncake.column(s.ARRIVAL_TIME_S).to_numpy() / 2)
    assert summarize(fast).rate_per_s == pytest.approx(2 * summarize(mooncake).rate_per_s)
    with pytest.raises(ValueError):
        t.scale_rate(mooncake, 0)


def test_session_sampling_keeps_whole_sessions_deterministically(sessions):
    # Sessions: aaa (3 requests), bbb (1), and one request without a session: 3 "sessions".
    kept = t.sample_sessions(sessions, 2 / 3, seed=1)
    again = t.sample_sessions(sessions, 2 / 3, seed=1)
    assert kept.equals(again)
    ids = kept.column(s.SESSION_ID).to_pylist()
    for session in set(ids) - {None}:
        assert ids.count(session) == sessions.column(s.SESSION_ID).to_pylist().count(session)
    chosen = {session for session in ids}
    assert len(chosen) == 2
    assert t.sample_sessions(sessions, 0.0, seed=1).num_rows == 0
    assert t.sample_sessions(sessions, 1.0, seed=1).num_rows == sessions.num_rows
    seeds = {tuple(t.sample_sessions(sessions, 1 / 3, seed=k).column(s.REQUEST_ID).to_pylist()) for k in range(20)}
    assert len(seeds) == 3  # each of the three sessions gets picked by some seed


def test_concat_plays_traces_one_after_another_without_accidental_sharing(mooncake):
    both = t.concat([mooncake, mooncake], gap_s=10.0)
    s.validate(both)
    times = both.column(s.ARRIVAL_TIME_S).to_numpy()
    assert times[6] == pytest.approx(6.0 + 10.0)
    assert both.column(s.REQUEST_ID).to_pylist()[:2] == ["0:0", "0:1"]
    assert both.column(s.REQUEST_ID).to_pylist()[6] == "1:0"
    single = summarize(mooncake).prefix_reuse
    separate = summarize(both).prefix_reuse
    assert separate.reused_blocks == 2 * single.reused_blocks
    shared = summarize(t.concat([mooncake, mooncake], share_prefixes=True)).prefix_reuse
    assert shared.reused_blocks == single.reused_blocks + single.blocks
    meta = s.trace_meta(both)
    assert meta.source_format == "concat" and meta.content_identity == s.IDENTITY_HASHES


def test_concat_of_unlike_traces_has_mixed_identity(mooncake, sessions):
    mixed = t.concat([mooncake, sessions])
    assert s.trace_meta(mixed).content_identity == t.IDENTITY_MIXED
    assert mixed.column(s.SESSION_ID).to_pylist()[6] == "1:aaa"
