"""The column sets of ``sim/replay/output_columns.py``: each feature's columns are declared
once, placed where the table says, and a run writes exactly the sets of the features it
had; SCHEMA.md documents every declared column in its file's section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtwin.sim.replay.output_columns import BAND, CLIENT_SIDE, COLUMN_SETS, DISAGGREGATION, OFFLOAD, assemble
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "scenarios"


def test_each_set_lands_where_the_table_puts_it():
    base = {"request_id": 0, "e2el_s": 1, "replica": 2}
    features = {"speculative": {"draft_tokens": 3, "accepted_draft_tokens": 4, "verify_steps": 5},
                "client_side": {"e2el_client_s": 7, "ttft_client_s": 6}}
    out = assemble("requests", base, features)
    # The client's columns right after the server's E2E, in the set's own order (not the
    # order given); the drafting columns after the base columns.
    assert list(out) == ["request_id", "e2el_s", "ttft_client_s", "e2el_client_s", "replica",
                         "draft_tokens", "accepted_draft_tokens", "verify_steps"]
    assert list(out.values()) == [0, 1, 6, 7, 2, 3, 4, 5]


def test_summary_sets_follow_the_base_in_the_tables_order():
    base = {"completed": 1}
    band = dict.fromkeys(BAND.summary, 0.0)
    client = dict.fromkeys(CLIENT_SIDE.summary, 0.0)
    pd = dict.fromkeys(DISAGGREGATION.summary, 0.0)
    out = assemble("summary", base, {"band": band, "client_side": client, "disaggregation": pd})
    assert list(out) == ["completed", *DISAGGREGATION.summary, *CLIENT_SIDE.summary, *BAND.summary]


@pytest.mark.parametrize("given, message", [
    ({"speculative": {"draft_tokens": 1, "accepted_draft_tokens": 1, "verify_steps": 1, "extra": 1}}, "not declared"),
    ({"speculative": {"draft_tokens": 1, "verify_steps": 1}}, "missing"),
    ({"sessions": {"turn": 1}}, "no column set named"),
])
def test_a_set_gives_its_declared_columns_all_of_them(given, message):
    with pytest.raises(AssertionError, match=message):
        assemble("requests", {"e2el_s": 0.0}, given)


def test_an_optional_column_may_be_left_out_and_keeps_its_place():
    counters = {name: 0 for name in OFFLOAD.steps if name not in OFFLOAD.optional}
    out = assemble("steps", {"step": 0}, {"offload": counters})
    assert list(out) == ["step", *[name for name in OFFLOAD.steps if name not in OFFLOAD.optional]]
    full = assemble("steps", {"step": 0}, {"offload": dict.fromkeys(reversed(OFFLOAD.steps), 0)})
    assert list(full) == ["step", *OFFLOAD.steps]


def test_a_set_may_not_rename_a_base_column():
    with pytest.raises(AssertionError, match="both a base column"):
        assemble("summary", {"gpu_hit_tokens": 1}, {"offload": dict.fromkeys(OFFLOAD.summary, 0)})


def test_every_declared_column_is_documented_in_its_files_section():
    text = (REPO / "reports" / "SCHEMA.md").read_text()
    sections = {name: body for name, body in re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, re.S | re.M)}
    for column_set in COLUMN_SETS:
        for table, names in (("requests", column_set.requests), ("steps", column_set.steps),
                             ("summary", tuple(column_set.summary))):
            body = sections[f"{table}.parquet"]
            missing = [name for name in names if f"`{name}`" not in body]
            assert not missing, f"{column_set.feature}: {missing} not in SCHEMA.md's {table}.parquet section"


def _replay(scenario: str, limit: int, **flags):
    resolved = resolve_scenario(SCENARIOS / scenario, Overrides(limit=limit, **flags))
    planned = resolved.plan()
    return resolved, run_replay(planned, resolved.require_workload().load(), deployment=resolved.deployment,
                                efficiency=resolved.efficiency, slo=resolved.slo, offload=resolved.offload_for(planned),
                                disaggregation=resolved.disaggregation, speculative=resolved.speculative,
                                calibration=resolved.calibration)


FEATURE_RUNS = {
    "plain": ("mooncake-llama8b-h100-overload.toml", set()),
    "offload": ("mooncake-llama8b-b200-offload.toml", {"offload"}),
    "disaggregation": ("mooncake-llama8b-h100-pd.toml", {"disaggregation"}),
    "speculative": ("mooncake-llama8b-h100-eagle3.toml", {"speculative"}),
}


@pytest.fixture(scope="module")
def feature_runs():
    return {name: _replay(scenario, 40) for name, (scenario, _) in FEATURE_RUNS.items()}


@pytest.mark.parametrize("name", sorted(FEATURE_RUNS))
def test_a_run_writes_exactly_the_sets_of_its_features(feature_runs, name):
    """Every run has the client-side set and, from ``kvtwin replay`` with its calibration,
    the band; each feature's set is there exactly when the feature was on, and every other
    column is a base column shared by all four runs."""
    _, on = FEATURE_RUNS[name]
    _, result = feature_runs[name]
    tables = {"requests": result.requests.column_names, "steps": result.steps.column_names,
              "summary": result.summary.column_names}
    always = {"client_side", "band"}
    for column_set in COLUMN_SETS:
        expected_on = column_set.feature in on or column_set.feature in always
        for table, names in (("requests", column_set.requests), ("steps", column_set.steps),
                             ("summary", tuple(column_set.summary))):
            present = [n for n in names if n in tables[table]]
            required = [n for n in names if n not in column_set.optional]
            if expected_on:
                assert set(required) <= set(present), f"{name}: {column_set.feature} {table} columns missing"
            else:
                assert not present, f"{name}: {column_set.feature}'s {table} columns {present} in a run without it"
    declared = {n for s in COLUMN_SETS for n in (*s.requests, *s.steps, *s.summary)}
    plain = feature_runs["plain"][1]
    for table in tables:
        base = [n for n in getattr(plain, table).column_names if n not in declared]
        assert [n for n in tables[table] if n not in declared] == base


def test_the_band_is_written_only_with_a_calibration(feature_runs):
    resolved, _ = feature_runs["plain"]
    planned = resolved.plan()
    without = run_replay(planned, resolved.require_workload().load(), deployment=resolved.deployment,
                         efficiency=resolved.efficiency, slo=resolved.slo)
    assert not set(BAND.summary) & set(without.summary.column_names)
    with_band = feature_runs["plain"][1].summary
    assert with_band.column_names[:without.summary.num_columns] == without.summary.column_names
    assert with_band.column_names[without.summary.num_columns:] == list(BAND.summary)
    # Adding the band changes no other figure.
    assert with_band.select(without.summary.column_names).equals(without.summary)
