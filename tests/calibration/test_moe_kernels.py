"""The MoE experts' fit (sim/calibration/fit/moe_kernels.py, docs/clock.md#moe-under-data-parallelism):
it recovers known coefficients and load factors from synthetic layers, the Efficiency keys
are checked, and the bundled H200 file states the held-out error its measurements give."""

from __future__ import annotations

import csv
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.calibration.fit.moe_kernels import fit_imbalance, fit_measured, fit_moe, moe_rows, subset
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.hardware import get_gpu

REPO = Path(__file__).resolve().parents[2]
PEAK_FLOPS, PEAK_BYTES = 1.0e15, 4.0e12
TRUE = dict(f=0.55, h=6.0, b=0.7, floor=20e-6, per_value=1.2e-11)
SHAPES = [("bfloat16", 4096, 1536, 8, 128), ("fp8_block", 7168, 2048, 8, 256), ("w4a16_mxfp4", 2880, 2880, 4, 32)]
BYTES = {"bfloat16": 2.0, "fp8_block": 1.0, "w4a16_mxfp4": 4.25 / 8}


def _layer_s(dtype, tokens, hidden, inter, topk, experts, tp, ep, load=1.0, **p):
    """One layer's seconds written out from the model's definition, apart from the module."""
    p = {**TRUE, **p}
    pairs = tokens * topk / ep * load
    flops = pairs * 6 * hidden * inter / tp
    rows = tokens * topk / experts
    compute = flops / (PEAK_FLOPS * p["f"] * rows / (rows + p["h"]))
    local = -(-experts // ep)
    touched = local * (1 - (1 - topk / experts) ** tokens)
    weights = touched * 3 * hidden * inter / tp * BYTES[dtype] / (PEAK_BYTES * p["b"])
    return p["floor"] + max(compute, weights) + p["per_value"] * tokens * hidden


def _records(load_ep=1.0, load_tp=1.0):
    cols = {k: [] for k in ("dtype", "tokens", "hidden", "inter", "topk", "experts", "tp", "ep", "s", "bal")}
    for dtype, hidden, inter, topk, experts in SHAPES:
        for tp, ep in ((1, 1), (2, 1), (8, 1), (1, 4), (1, 16)):
            for tokens in (1, 4, 16, 64, 256, 1024, 4096, 16384):
                load = load_ep if ep > 1 else load_tp
                for key, value in zip(("dtype", "tokens", "hidden", "inter", "topk", "experts", "tp", "ep"),
                                      (dtype, tokens, hidden, inter, topk, experts, tp, ep)):
                    cols[key].append(value)
                cols["s"].append(_layer_s(dtype, tokens, hidden, inter, topk, experts, tp, ep, load))
                cols["bal"].append(_layer_s(dtype, tokens, hidden, inter, topk, experts, tp, ep))
    return cols


def _rows(cols, seconds):
    return moe_rows(cols["dtype"], cols["tokens"], cols["hidden"], cols["inter"], cols["topk"], cols["experts"],
                    cols["tp"], cols["ep"], seconds)


def test_the_fit_recovers_known_coefficients_from_synthetic_layers():
    cols = _records()
    fit = fit_moe(_rows(cols, cols["s"]), flops_per_s=PEAK_FLOPS, bytes_per_s=PEAK_BYTES)
    assert fit.moe_flops_fraction == pytest.approx(TRUE["f"], rel=0.02)
    assert fit.moe_half_rows_per_expert == pytest.approx(TRUE["h"], rel=0.05)
    assert fit.moe_hbm_bandwidth_fraction == pytest.approx(TRUE["b"], rel=0.02)
    assert fit.moe_floor_s == pytest.approx(TRUE["floor"], rel=0.05)
    assert fit.moe_s_per_token_value == pytest.approx(TRUE["per_value"], rel=0.05)


def test_the_load_factors_are_recovered_from_skewed_against_balanced_layers():
    cols = _records(load_ep=1.4, load_tp=1.1)
    rows = _rows(cols, cols["s"])
    fit = fit_moe(_rows(cols, cols["bal"]), flops_per_s=PEAK_FLOPS, bytes_per_s=PEAK_BYTES)
    balanced = np.array(cols["bal"])
    for ep, expected in ((True, 1.4), (False, 1.1)):
        mask = rows.expert_parallel == ep
        got = fit_imbalance(fit, subset(rows, mask), balanced[mask], flops_per_s=PEAK_FLOPS, bytes_per_s=PEAK_BYTES)
        assert got == pytest.approx(expected, rel=0.01)
    # No skew: no load factor above 1.
    assert fit_imbalance(fit, _rows(cols, cols["bal"]), balanced, flops_per_s=PEAK_FLOPS,
                         bytes_per_s=PEAK_BYTES) == 1.0


@pytest.mark.parametrize("key, value", [("moe_ep_imbalance", 0.9), ("moe_tp_imbalance", 0.0),
                                        ("moe_flops_fraction", 1.5), ("moe_hbm_bandwidth_fraction", -0.1),
                                        ("moe_expert_half_tokens", -1.0), ("moe_floor_s", -1e-6)])
def test_the_moe_keys_are_checked(key, value):
    with pytest.raises(ConfigError) as err:
        Efficiency(**{key: value})
    assert err.value.field == f"cost_model.{key}"


def test_an_efficiency_without_the_keys_has_no_moe_fit():
    assert not Efficiency().moe_fitted
    assert Efficiency(moe_flops_fraction=0.5).moe_fitted


def test_the_bundled_h200_file_states_the_held_out_error_of_its_measurements():
    path = REPO / "sim" / "replay" / "data" / "calibration" / "h200.toml"
    text = path.read_text()
    stated = re.search(r"# h200: MoE experts .*held-out median ([0-9.]+)%, p90 ([0-9.]+)%\)", text)
    assert stated, "no MoE line in the h200 header"
    with (REPO / "sim" / "replay" / "data" / "measurements" / "moe_h200.csv").open() as f:
        records = list(csv.DictReader(f))
    gpu = get_gpu("h200")
    measured = fit_measured(records, flops_per_s=gpu.bf16_flops, bytes_per_s=gpu.hbm_bandwidth_bytes_per_s)
    errors = measured.held_out_errors
    assert len(errors) == sum(r["distribution"] == "balanced" for r in records)
    assert float(stated.group(1)) == pytest.approx(100 * np.median(errors), abs=0.05)
    assert float(stated.group(2)) == pytest.approx(100 * np.percentile(errors, 90), abs=0.05)
    keys = tomllib.loads(text)["cost_model"]
    assert keys["moe_flops_fraction"] == pytest.approx(measured.fit.moe_flops_fraction, abs=5e-5)
    assert keys["moe_ep_imbalance"] == pytest.approx(measured.ep_imbalance, abs=5e-4)
    assert keys["moe_tp_imbalance"] == pytest.approx(measured.tp_imbalance, abs=5e-4)
