"""reports/SCHEMA.md documents every column of capacity.parquet and hit_curve.parquet, and
nothing they never hold.

The tables are built by the code that writes them (``capacity_table`` on point rows of
every kind a sweep produces: ok and failed, aggregated, with offload tiers, disaggregated,
with and without ``--find-max-rate``; ``hit_curve`` on a small trace with a sweep point's
capacity), and their columns are compared with the sections' tables both ways: a column
written but not documented fails, and so does one documented but never written. A row whose
first cell begins with a backquoted name documents those names (with their type); a row that
begins in words is a group documented in ``summary.parquet``'s section, where each of its
columns is looked up. The headings ``kvtwin capacity`` prints are documented there too,
each beside its column.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pytest

from kvtwin.commands.capacity import print_points
from kvtwin.sim.calibration.band import CLOCK_COLUMNS
from kvtwin.sim.replay.capacity_points import MAX_RATE_COLUMNS
from kvtwin.sim.replay.capacity_table import (CAPACITY_METADATA_KEY, capacity_table,
                                              summary_schema)
from kvtwin.sim.replay.load_curve import LOAD_CURVE_COLUMNS
from kvtwin.sim.replay.reuse_curve import hit_curve
from kvtwin.sim.replay.output_columns import DISAGGREGATION, OFFLOAD
from kvtwin.sim.scenario.sweep_keys import parse_sweeps, sweep_points
from kvtwin.traces.schema import TRACE_SCHEMA

SCHEMA = Path(__file__).parents[2] / "reports" / "SCHEMA.md"


def _type_name(kind: pa.DataType) -> str:
    """An Arrow type as SCHEMA.md spells it (NumPy's names: ``float64``, not Arrow's ``double``)."""
    return {"double": "float64", "float": "float32"}.get(str(kind), str(kind))


def _section(title: str) -> str:
    return SCHEMA.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every table row of ``text`` (header and rule rows left out)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| column |"):
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def _documented(text: str) -> dict[str, str]:
    """Column name to its type cell, for the rows that begin with a backquoted name."""
    out = {}
    for cells in _table_rows(text):
        if cells[0].startswith("`"):
            for name in re.findall(r"`([a-z0-9_]+)`", cells[0]):
                out[name] = cells[1] if len(cells) > 3 else ""
    return out


def _group_rows(text: str) -> list[str]:
    """The first cells of the rows that describe a group in words."""
    return [cells[0] for cells in _table_rows(text) if not cells[0].startswith("`")]


def _summary_first_table() -> set[str]:
    body = _section("summary.parquet").split("The clock's calibration", 1)[0]
    return {n for cells in _table_rows(body) for n in re.findall(r"`([a-z0-9_]+)`", cells[0])}


def _summary_client_rows() -> set[str]:
    """The client-side columns as ``summary.parquet``'s section documents them."""
    rows = _table_rows(_section("summary.parquet"))
    return {n for cells in rows if "client" in cells[0] for n in re.findall(r"`([a-z0-9_]+)`", cells[0])}


def _summary_offload_table() -> set[str]:
    body = _section("summary.parquet").split("With offload tiers these columns follow", 1)[1]
    body = body.split("\n\n", 2)[1]  # the table under that paragraph
    return {n for cells in _table_rows(body) for n in re.findall(r"`([a-z0-9_]+)`", cells[0])}


def _summary(**extra) -> dict:
    row = {name: None for name in summary_schema().names}
    row.update(num_requests=10, completed=10, request_throughput=2.5, slo_attainment=1.0)
    row.update(extra)
    return row


def _rows() -> list[dict]:
    """Four points: aggregated, with a CPU tier, disaggregated (2P2D), and failed."""
    searched = {name: None for name in MAX_RATE_COLUMNS}
    searched.update(max_rate_scale=2.0, max_request_rate=5.0, max_request_rate_per_replica=2.5,
                    replicas_needed_trace_rate=1, cost_per_hour=8.0, rate_search_refusal=None)
    clock = {"calibration": "uncalibrated", "calibration_note": "no bundled file"}
    offload = {name: None for name in OFFLOAD.summary} | {"hit_rate_total": 0.5, "offload_policy": "lru"}
    pd = {"pd_prefill_replicas": 2, "pd_decode_replicas": 2, "pd_link": "nvlink", "pd_transfer_mean_ms": 1.5,
          "pd_transfer_bytes_mean": 1e6, "pd_transfer_share_of_ttft": 0.1, "pd_transfer_share_of_ttft_total": 0.125}
    search = {"start_rate_scale": 1.0, "converged": True, "tried": [[1.0, True], [2.0, True], [4.0, False]]}
    return [
        {"point": 0, "status": "ok", "error": None, "summary": _summary(), "num_gpus": 2, "kv_cache_blocks": 100,
         "search": search, **clock, **searched},
        {"point": 1, "status": "ok", "error": None, "summary": _summary(**offload), "num_gpus": 2,
         "kv_cache_blocks": 100, "search": search, **clock, **searched},
        {"point": 2, "status": "ok", "error": None, "summary": _summary(**pd), "num_gpus": 4, "kv_cache_blocks": 100,
         "search": search, **clock, **searched},
        {"point": 3, "status": "failed", "error": "engine.replicas: expected a positive int, got 0",
         "summary": None},
    ]


AXES = parse_sweeps(["engine.replicas=1,2", "workload.rate_scale=0.5,1"])
POINTS = sweep_points(AXES)


def _plain(row: dict) -> dict:
    """A point's row as a sweep without a search gives it."""
    return {k: v for k, v in row.items() if k != "search" and k not in MAX_RATE_COLUMNS}


def _curve(row: dict) -> dict:
    """A point's row as a ``--load-curve`` gives it."""
    if row["status"] != "ok":
        return _plain(row)
    return _plain(row) | {"offered_request_rate": 5.0, "load_rate_scale": 2.0, "achieved_request_rate": 4.9,
                          "step_error": 0.2, "achieved_request_rate_pessimistic": 4.8,
                          "p99_ttft_ms_pessimistic": 120.0, "p99_tpot_ms_pessimistic": 30.0,
                          "sustained_pessimistic": True}


def _tables() -> dict[str, pa.Table]:
    """The tables a sweep can write: with a search, a load curve or neither, with offload,
    P/D or neither."""
    rows = _rows()
    out = {}
    for name, kept in (("aggregated", [rows[0], rows[3]]), ("offload", rows[:2] + rows[3:]),
                       ("pd", [rows[0], rows[2], rows[3]]), ("all", rows)):
        out[f"{name}, searched"] = capacity_table(kept, POINTS, AXES, find_max_rate=True)
        out[f"{name}, plain"] = capacity_table([_plain(r) for r in kept], POINTS, AXES)
        out[f"{name}, load curve"] = capacity_table([_curve(r) for r in kept], POINTS, AXES, load_curve=True)
    return out


def test_every_capacity_column_is_documented_in_its_section():
    section = _section("capacity.parquet")
    own = _documented(section)
    summary_names, offload_names = set(summary_schema().names), set(OFFLOAD.summary)
    written: dict[str, pa.DataType] = {}
    for label, table in _tables().items():
        for field in table.schema:
            written[field.name] = field.type
            if "." in field.name:
                assert field.name in {a.key.key for a in AXES}, (label, field.name)
            elif field.name in own:
                # Its type as documented (a "(null)" says only that it may be null).
                assert own[field.name].split(" (")[0] == _type_name(field.type), (label, field.name, own[field.name])
            elif field.name in summary_names:
                assert field.name in _summary_first_table() | _summary_client_rows(), (label, field.name)
            elif field.name in offload_names:
                assert field.name in _summary_offload_table(), (label, field.name)
            else:
                pytest.fail(f"{label}: capacity.parquet column {field.name} is documented nowhere")
    # Every documented name is written by some sweep, and the groups in words name their bounds.
    assert set(own) <= set(written), set(own) - set(written)
    groups = _group_rows(section)
    names = summary_schema().names
    first_table = [n for n in names if n not in _summary_client_rows()]
    assert any(f"`{first_table[0]}` ... `{first_table[-1]}`" in g for g in groups), \
        "summary group's first and last column"
    first, last = list(OFFLOAD.summary)[0], list(OFFLOAD.summary)[-1]
    assert any(f"`{first}` ... `{last}`" in g for g in groups), "offload group's first and last column"
    client = [n for n in names if n in _summary_client_rows()]
    assert any(f"`{client[0]}` ... `{client[-1]}`" in g for g in groups), "client group's first and last column"
    assert {*CLOCK_COLUMNS, *MAX_RATE_COLUMNS, *LOAD_CURVE_COLUMNS, *DISAGGREGATION.summary, "num_gpus"} <= set(own)


def test_capacity_columns_come_in_the_documented_order():
    # The documented groups, in order; each written column belongs to one, and the table
    # never goes back to an earlier group.
    order = ["point", "status", "error", "key", "summary", "clock", "offload", "num_gpus", "pd", "search", "curve"]

    def group(name: str) -> str:
        if name in order:
            return name
        if "." in name:
            return "key"
        for kind, names in (("summary", summary_schema().names), ("clock", CLOCK_COLUMNS),
                            ("offload", OFFLOAD.summary), ("pd", DISAGGREGATION.summary),
                            ("search", MAX_RATE_COLUMNS), ("curve", LOAD_CURVE_COLUMNS)):
            if name in names:
                return kind
        raise AssertionError(name)

    table = _tables()["all, searched"]
    positions = [order.index(group(n)) for n in table.column_names]
    assert positions == sorted(positions)
    assert set(positions) == set(range(len(order))) - {order.index("curve")}
    # A load curve's columns come where a search's would (step_error, in both, reads as the search's).
    curve = [order.index(group(n)) for n in _tables()["all, load curve"].column_names]
    assert curve == sorted(curve) and order.index("curve") in curve and order.index("search") in curve
    # The section's own rows are in that order too.
    own = list(_documented(_section("capacity.parquet")))
    assert [order.index(group(n)) for n in own] == sorted(order.index(group(n)) for n in own)


def test_the_capacity_metadata_is_documented_as_written():
    section = _section("capacity.parquet")
    key = CAPACITY_METADATA_KEY.decode()
    assert f"`{key}`" in section
    table = _tables()["all, searched"]
    searches = json.loads(table.schema.metadata[CAPACITY_METADATA_KEY])
    # Keyed by the point's number as a string; failed points are not in it.
    assert set(searches) == {"0", "1", "2"}
    for fields in searches.values():
        for field in fields:
            assert f"`{field}`" in section, field
    assert _tables()["all, plain"].schema.metadata is None  # no search, no record


def _trace() -> pa.Table:
    rows = [(40, 8, [1, 2]), (48, 4, [1, 2, 3]), (40, 8, [1, 2])]
    return pa.Table.from_pylist([
        {"request_id": f"r{i}", "arrival_time_s": float(i), "prompt_tokens": p, "output_tokens": o,
         "session_id": None, "turn": None, "priority": None, "block_hashes": hashes,
         "hash_block_tokens": 16, "prompt_token_ids": None}
        for i, (p, o, hashes) in enumerate(rows)], schema=TRACE_SCHEMA)


def test_every_hit_curve_column_is_documented():
    documented = _documented(_section("hit_curve.parquet"))
    for capacities in (None, [3]):  # the grid alone, and with a sweep point's pool
        table = hit_curve(_trace(), 16, capacities)
        written = {f.name: _type_name(f.type) for f in table.schema}
        assert written == {name: kind.split(" (")[0] for name, kind in documented.items()}
        blocks = table.column("kv_cache_blocks").to_pylist()
        assert blocks == sorted(set(blocks))  # increasing, as documented
        assert table.column("kv_cache_tokens").to_pylist() == [b * 16 for b in blocks]


def test_every_printed_heading_is_documented_with_its_column(capsys):
    # Every optional heading shown: offload, P/D, rejections, a target rate and a slow edge.
    rows = _rows()
    for row in rows[:3]:
        row.update(replicas_needed_target_rate=4, step_error=0.25, max_request_rate_pessimistic=4.0,
                   replicas_needed_trace_rate_pessimistic=2)
        row["summary"]["rejected_share"] = 0.125
    table = capacity_table(rows, POINTS, AXES, find_max_rate=True)
    print_points(table, AXES, True)
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in next(ln for ln in lines if "p99 TTFT" in ln).strip("│┃ ").split("┃")]
    section = _section("capacity.parquet")
    printed = section.split("`kvtwin capacity` prints one row per point", 1)[1]
    headings = [h for h in header if h not in ("point", "status", *(a.key.key for a in AXES))]
    assert len(headings) == 19  # every optional heading is there
    for heading in headings:
        # Documented as `heading` (`column`); a heading split over two lines of the file is rejoined.
        assert f"`{heading}`" in " ".join(printed.split()), heading
