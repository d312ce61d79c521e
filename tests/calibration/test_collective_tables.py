"""The measured MoE collectives a calibration carries (docs/clock.md#moe-under-data-parallelism):
NCCL all-gather, reduce-scatter and all-to-all curves by GPU count and DeepEP dispatch/combine
tables by kernel and node count: read, checked, written back, scaled by the band, and the
bundled files' against the measurements they were fitted from."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from kvtwin.sim.calibration.band import pessimistic
from kvtwin.sim.calibration.efficiency import (CollectiveCurve, DeepEPTable, Efficiency, efficiency_from_mapping)
from kvtwin.sim.calibration.file import bundled_calibration, read_calibration
from kvtwin.sim.calibration.fit.step_model import write_calibration
from kvtwin.sim.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
MEASUREMENTS = REPO / "sim" / "replay" / "data" / "measurements"

CURVE = {"num_gpus": 4, "message_bytes": [1000, 3000], "seconds": [1e-5, 3e-5]}
TABLE = {"mode": "low_latency", "nodes": 2, "hidden_size": 7168, "top_k": 8, "tokens_per_rank": [1, 11],
         "dispatch_s": [1e-5, 2e-5], "combine_s": [2e-5, 6e-5]}


def test_the_tables_read_from_cost_model_keys_and_interpolate():
    eff = efficiency_from_mapping({"allgather": [CURVE], "alltoall": [dict(CURVE, num_gpus=8)], "deepep": [TABLE]})
    curve = eff.collective_curve("allgather", 4)
    assert curve == CollectiveCurve(4, (1000, 3000), (1e-5, 3e-5))
    assert curve.seconds_for(2000) == pytest.approx(2e-5, rel=1e-12)
    assert curve.seconds_for(10) == 1e-5  # the floor
    assert curve.seconds_for(5000) == pytest.approx(5e-5, rel=1e-12)  # the last segment's rate
    assert eff.collective_curve("allgather", 8) is None and eff.collective_curve("reducescatter", 4) is None
    assert eff.collective_curve("alltoall", 8).num_gpus == 8
    table = eff.deepep_table("low_latency", 2)
    assert eff.deepep_table("low_latency", 1) is None and eff.deepep_table("high_throughput", 2) is None
    # 6 tokens: half-way, dispatch 15 us + combine 40 us.
    assert table.seconds_for(6) == pytest.approx(55e-6, rel=1e-12)


def test_absent_keys_leave_the_defaults():
    eff = efficiency_from_mapping({"matmul_flops_fraction": 0.5})
    assert (eff.allgather, eff.reducescatter, eff.alltoall, eff.deepep) == ((), (), (), ())
    assert eff == Efficiency(matmul_flops_fraction=0.5)


@pytest.mark.parametrize("entry, field", [
    ({"allgather": {"num_gpus": 2}}, "cost_model.allgather"),
    ({"reducescatter": [dict(CURVE, num_gpus=1)]}, "cost_model.reducescatter[0].num_gpus"),
    ({"alltoall": [dict(CURVE, seconds=[1e-5])]}, "cost_model.alltoall[0].message_bytes"),
    ({"alltoall": [dict(CURVE, message_bytes=[3000, 1000])]}, "cost_model.alltoall[0].message_bytes"),
    ({"allgather": [CURVE, CURVE]}, "cost_model.allgather"),
    ({"allgather": [dict(CURVE, gpus=2)]}, "cost_model.allgather[0].gpus"),
    ({"deepep": [dict(TABLE, mode="normal")]}, "cost_model.deepep[0].mode"),
    ({"deepep": [dict(TABLE, nodes=0)]}, "cost_model.deepep[0].nodes"),
    ({"deepep": [dict(TABLE, combine_s=[1e-5, -1e-5])]}, "cost_model.deepep[0].combine_s"),
    ({"deepep": [{k: v for k, v in TABLE.items() if k != "top_k"}]}, "cost_model.deepep[0].top_k"),
    ({"deepep": [TABLE, TABLE]}, "cost_model.deepep"),
])
def test_a_bad_table_names_its_field(entry, field):
    with pytest.raises(ConfigError) as err:
        efficiency_from_mapping(entry)
    assert err.value.field == field


def test_the_tables_round_trip_through_a_written_file_and_replace_a_bases(tmp_path):
    eff = efficiency_from_mapping({"allgather": [CURVE], "reducescatter": [CURVE], "alltoall": [CURVE],
                                   "deepep": [TABLE, dict(TABLE, mode="high_throughput")]})
    path = write_calibration(tmp_path / "cal.toml", eff)
    assert read_calibration(path).efficiency == eff
    # A file without tables writes them empty: a base's do not leak into it.
    bare = write_calibration(tmp_path / "bare.toml", Efficiency())
    loaded = read_calibration(bare, base=eff).efficiency
    assert (loaded.allgather, loaded.reducescatter, loaded.alltoall, loaded.deepep) == ((), (), (), ())


def test_the_pessimistic_edge_scales_every_measured_time():
    eff = efficiency_from_mapping({"allgather": [CURVE], "deepep": [TABLE]})
    slow = pessimistic(eff, 0.5)
    assert slow.allgather[0].seconds == pytest.approx((1.5e-5, 4.5e-5), rel=1e-12)
    assert slow.allgather[0].message_bytes == (1000, 3000)
    assert slow.deepep[0].dispatch_s == pytest.approx((1.5e-5, 3e-5), rel=1e-12)
    assert slow.deepep[0].combine_s == pytest.approx((3e-5, 9e-5), rel=1e-12)
    assert slow.deepep[0].tokens_per_rank == (1, 11)


def _rows(name: str) -> list[dict]:
    with open(MEASUREMENTS / name, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("gpu", ["h100", "h200", "b200", "a100-80gb", "l40s"])
def test_the_bundled_curves_pass_through_the_measured_points(gpu):
    """Each bundled curve at a measured size is the measurement there, or the largest
    measured time below it (a curve never falls with size; a dip is noise)."""
    folder = gpu.split("-")[0]
    eff = bundled_calibration(gpu, "any").efficiency
    fields = {"all_gather": "allgather", "reduce_scatter": "reducescatter", "alltoall": "alltoall"}
    rows = _rows(f"collectives_{folder}.csv")
    assert {(r["op"], int(r["num_gpus"])) for r in rows} == {(op, n) for op in fields for n in (2, 4, 8)}
    for r in rows:
        curve = eff.collective_curve(fields[r["op"]], int(r["num_gpus"]))
        size = float(r["message_bytes"])
        floor = max(float(q["seconds"]) for q in rows if (q["op"], q["num_gpus"]) == (r["op"], r["num_gpus"])
                    and float(q["message_bytes"]) <= size)
        assert curve.seconds_for(size) == pytest.approx(floor, rel=1e-9)


@pytest.mark.parametrize("gpu, nodes", [("h100", (1, 2, 4, 8)), ("h200", (1, 2, 4, 8)), ("b200", (1,))])
def test_the_bundled_deepep_tables_are_the_measured_dispatch_and_combine(gpu, nodes):
    eff = bundled_calibration(gpu, "any").efficiency
    rows = _rows(f"deepep_{gpu}.csv")
    modes = {"ll": "low_latency", "normal": "high_throughput"}
    assert sorted((t.mode, t.nodes) for t in eff.deepep) == sorted((m, n) for m in modes.values() for n in nodes)
    # Spot rows: every one the table holds where the measured times already rise with tokens.
    checked = 0
    for r in rows:
        table = eff.deepep_table(modes[r["mode"]], int(r["nodes"]))
        assert (table.hidden_size, table.top_k) == (7168, 8)
        i = table.tokens_per_rank.index(float(r["tokens_per_rank"]))
        assert table.dispatch_s[i] >= float(r["dispatch_s"]) and table.combine_s[i] >= float(r["combine_s"])
        if table.dispatch_s[i] == float(r["dispatch_s"]) and table.combine_s[i] == float(r["combine_s"]):
            assert table.seconds_for(float(r["tokens_per_rank"])) == pytest.approx(
                float(r["dispatch_s"]) + float(r["combine_s"]), rel=1e-12)
            checked += 1
    assert checked > len(rows) / 2


def test_gpus_without_deepep_measurements_carry_no_table():
    for gpu in ("a100-80gb", "l40s"):
        assert bundled_calibration(gpu, "any").efficiency.deepep == ()


def test_fit_bundled_check_reports_the_collectives_leave_one_out_error():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "calibration" / "fit_bundled.py"), "--check",
                           "h200"], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert any(line.startswith("h200: NCCL collective curves: allgather for 2, 4, 8 GPUs") and "leave-one-out" in line
               for line in lines)
    assert any(line.startswith("h200: DeepEP dispatch+combine tables: low_latency 1 node(s)") for line in lines)
