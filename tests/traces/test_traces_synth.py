"""Synthetic workloads: determinism, the shape each kind promises, and strict spec errors."""

import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvtwin.traces import schema as s
from kvtwin.traces.bundled import MOONCAKE_CONVERSATION, bundled_path
from kvtwin.traces.errors import TraceError
from kvtwin.traces.load import load_trace
from kvtwin.traces.synth import synthesize
from kvtwin.traces.synth_spec import parse_spec, read_spec

WORKLOADS = Path(__file__).parents[2] / "scenarios" / "workloads"

CHAT = {
    "kind": "chat", "seed": 5, "num_requests": 300, "block_tokens": 16,
    "arrival": {"process": "poisson", "rate_per_s": 2.0},
    "shared_prefix": {"count": 3, "tokens": 100, "zipf_s": 1.0},
    "turns": {"dist": "zipf", "s": 1.8, "max": 8},
    "user_tokens": {"dist": "lognormal", "mean": 60, "sigma": 0.5},
    "output_tokens": {"dist": "lognormal", "mean": 40, "sigma": 0.5},
    "turn_gap_s": {"dist": "exponential", "mean": 5},
}


def _synth(**changes):
    """CHAT with ``changes``; a None value removes the key."""
    return synthesize(parse_spec({k: v for k, v in {**CHAT, **changes}.items() if v is not None}))


def test_same_spec_gives_a_byte_identical_parquet_and_seed_matters(tmp_path: Path):
    a = s.write_parquet(_synth(), tmp_path / "a.parquet").read_bytes()
    b = s.write_parquet(_synth(), tmp_path / "b.parquet").read_bytes()
    c = s.write_parquet(_synth(seed=6), tmp_path / "c.parquet").read_bytes()
    assert a == b and a != c


def test_changing_one_distribution_leaves_the_other_draws_alone():
    requests = dict(kind="requests", prompt_tokens={"dist": "lognormal", "mean": 80, "sigma": 0.5}, turns=None,
                    user_tokens=None, turn_gap_s=None)
    base = _synth(**requests)
    other = _synth(output_tokens=9, **requests)
    for name in (s.ARRIVAL_TIME_S, s.PROMPT_TOKENS, s.BLOCK_HASHES):
        assert base.column(name).equals(other.column(name))
    assert set(other.column(s.OUTPUT_TOKENS).to_pylist()) == {9}
    assert not base.column(s.OUTPUT_TOKENS).equals(other.column(s.OUTPUT_TOKENS))


def test_chat_turns_contain_the_previous_prompt_and_output():
    table = _synth()
    s.validate(table)
    assert table.num_rows == 300
    by_session = {}
    for row in table.to_pylist():
        by_session.setdefault(row[s.SESSION_ID], []).append(row)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        turns.sort(key=lambda r: r[s.TURN])
        for before, after in zip(turns, turns[1:]):
            assert after[s.TURN] == before[s.TURN] + 1
            assert after[s.ARRIVAL_TIME_S] >= before[s.ARRIVAL_TIME_S]
            history = before[s.PROMPT_TOKENS] + before[s.OUTPUT_TOKENS]
            assert after[s.PROMPT_TOKENS] > history
            full = before[s.PROMPT_TOKENS] // 16
            assert after[s.BLOCK_HASHES][:full] == before[s.BLOCK_HASHES][:full]
            # Blocks holding the previous output were never in a prompt before.
            output_blocks = after[s.BLOCK_HASHES][full + 1: history // 16]
            assert not set(output_blocks) & set(before[s.BLOCK_HASHES])


def test_requests_share_exactly_their_system_prompt_blocks():
    table = _synth(kind="requests", prompt_tokens=50, num_requests=400,
                   shared_prefix={"count": 4, "tokens": 64, "zipf_s": 1.5},
                   turns=None, user_tokens=None, turn_gap_s=None)
    hashes = table.column(s.BLOCK_HASHES).to_pylist()
    heads = [tuple(h[:4]) for h in hashes]
    counts = sorted((heads.count(head) for head in set(heads)), reverse=True)
    assert len(counts) == 4 and counts[0] > counts[-1]  # Zipf: one prompt much more popular
    tails = [h[4:] for h in hashes]
    flat = [x for tail in tails for x in tail]
    assert len(flat) == len(set(flat))  # the requests' own text is never shared
    assert set(table.column(s.PROMPT_TOKENS).to_pylist()) == {114}


def test_poisson_and_gamma_arrival_rates_and_burstiness():
    for process, cv in (("poisson", 1.0), ("gamma", 3.0)):
        arrival = {"process": process, "rate_per_s": 4.0} | ({"cv": cv} if process == "gamma" else {})
        table = _synth(kind="requests", prompt_tokens=10, num_requests=4000, arrival=arrival, shared_prefix=None,
                       turns=None, user_tokens=None, turn_gap_s=None)
        gaps = np.diff(table.column(s.ARRIVAL_TIME_S).to_numpy())
        assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.15)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.2)


def test_length_distributions():
    common = dict(kind="requests", num_requests=3000, shared_prefix=None, turns=None, user_tokens=None,
                  turn_gap_s=None)
    lognormal = _synth(prompt_tokens={"dist": "lognormal", "mean": 500, "sigma": 0.6}, **common)
    assert lognormal.column(s.PROMPT_TOKENS).to_numpy().mean() == pytest.approx(500, rel=0.05)
    zipf = _synth(prompt_tokens={"dist": "zipf", "s": 2.0, "scale": 100, "max": 2000}, **common)
    values = zipf.column(s.PROMPT_TOKENS).to_numpy()
    assert set(np.unique(values) % 100) == {0} and values.max() <= 2000 and np.mean(values == 100) > 0.5
    empirical = _synth(prompt_tokens={"dist": "empirical", "trace": f"bundled:{MOONCAKE_CONVERSATION}"},
                       output_tokens=7, **common)
    source = set(load_trace(bundled_path(MOONCAKE_CONVERSATION)).column(s.PROMPT_TOKENS).to_pylist())
    assert set(empirical.column(s.PROMPT_TOKENS).to_pylist()) <= source
    assert set(empirical.column(s.OUTPUT_TOKENS).to_pylist()) == {7}


def test_duration_and_max_prompt_tokens_bound_the_workload():
    table = _synth(num_requests=None, duration_s=60.0, max_prompt_tokens=400)
    assert table.num_rows > 0
    assert table.column(s.ARRIVAL_TIME_S).to_numpy().max() < 60.0
    assert table.column(s.PROMPT_TOKENS).to_numpy().max() <= 400
    assert any("max_prompt_tokens" in note for note in s.trace_meta(table).notes)


def test_agent_loops_share_their_long_context():
    table = _synth(kind="agent", shared_prefix={"count": 2, "tokens": 4000, "zipf_s": 0},
                   user_tokens={"dist": "lognormal", "mean": 50, "sigma": 0.3}, output_tokens=20)
    heads = {tuple(h[:250]) for h in table.column(s.BLOCK_HASHES).to_pylist()}
    assert len(heads) == 2


@pytest.mark.parametrize("name", ["chat_sessions.toml", "agent_loops.toml"])
def test_example_workloads_parse_and_generate(name):
    spec = read_spec(WORKLOADS / name)
    raw = tomllib.loads((WORKLOADS / name).read_text())
    small = synthesize(parse_spec({**raw, "num_requests": 100}), base_dir=WORKLOADS)
    assert small.num_rows == 100 and spec.kind in name


@pytest.mark.parametrize("changes, field", [
    ({"bogus": 1}, "bogus"),
    ({"kind": "batch"}, "kind"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"arrival": {"rate_per_s": 0}}, "arrival.rate_per_s"),
    ({"arrival": {"rate_per_s": 1, "cv": 2}}, "arrival.cv"),
    ({"turns": {"dist": "zipf", "s": 1.0}}, "turns.s"),
    ({"user_tokens": {"dist": "lognormal", "mean": 5}}, "user_tokens.sigma"),
    ({"user_tokens": {"dist": "fixed", "value": 5, "extra": 1}}, "user_tokens.extra"),
    ({"output_tokens": "many"}, "output_tokens"),
    ({"turn_gap_s": None}, "turn_gap_s"),
    ({"prompt_tokens": 10}, "prompt_tokens"),
    ({"num_requests": None}, "num_requests"),
    ({"output_tokens": {"dist": "lognormal", "mean": 5, "sigma": 1, "min": 10, "max": 2}}, "output_tokens.max"),
])
def test_spec_errors_name_the_key(changes, field):
    raw = {key: value for key, value in {**CHAT, **changes}.items() if value is not None}
    with pytest.raises(TraceError) as err:
        parse_spec(raw, "spec.toml")
    assert err.value.field == field and str(err.value).startswith("spec.toml: ")


def test_invalid_toml_reports_its_line(tmp_path: Path):
    path = tmp_path / "w.toml"
    path.write_text('kind = "chat"\nseed = = 3\n')
    with pytest.raises(TraceError) as err:
        read_spec(path)
    assert err.value.line == 2


def test_a_workload_table_inside_a_scenario_is_read(tmp_path: Path):
    path = tmp_path / "scenario.toml"
    path.write_text('[model]\nname = "x"\n\n[workload]\nkind = "requests"\nseed = 1\nnum_requests = 5\n'
                    'arrival = { rate_per_s = 1 }\nprompt_tokens = 20\noutput_tokens = 3\n')
    assert synthesize(read_spec(path)).num_rows == 5
