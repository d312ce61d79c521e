"""The calibration fit: it recovers known efficiency factors from steps the cost model
itself timed, says what it cannot determine, and writes a file read_calibration reads."""

import tomllib
from dataclasses import fields

import numpy as np
import pytest

from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.calibration.fit.step_model import (Fit, StepSample, ape_by_kind, batch_kind, fit_efficiency, predict_s,
                                           write_calibration)
from kvtwin.sim.calibration.file import read_calibration
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.calibration.efficiency import AllReduceCurve, Efficiency

# Far enough from the defaults that a fit which does not move would fail.
TRUE = Efficiency(matmul_flops_fraction=0.42, attention_flops_fraction=0.31, hbm_bandwidth_fraction=0.66,
                  step_overhead_s=0.9e-3, per_request_overhead_s=22e-6)
FITTED = ("matmul_flops_fraction", "attention_flops_fraction", "hbm_bandwidth_fraction",
          "step_overhead_s", "per_request_overhead_s")


def cost_model(model="llama-3.1-8b", gpu="b200", tp=4, async_scheduling=True, eff=Efficiency()):
    # Llama-8B over four B200s: a step's weights take under a millisecond, so small decode
    # batches are CPU-bound under async scheduling and the overheads show.
    p = plan(get_model(model), get_gpu(gpu), EngineConfig(tensor_parallel_size=tp, max_model_len=32768))
    return CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=tp, async_scheduling=async_scheduling,
                     efficiency=eff)


def peaks(cm):
    return dict(flops_per_s=cm.gpu.bf16_flops, bytes_per_s=cm.gpu.hbm_bandwidth_bytes_per_s,
                async_scheduling=cm.async_scheduling)


def batches(rng, n=200):
    """(decode ends, prefill items) per step: long-context decodes (memory-bound),
    short-context decodes (overhead-bound), prefill chunks (compute-bound), mixed."""
    out = []
    for i in range(n):
        family = i % 4
        if family == 0:
            size = int(rng.integers(1, 257))
            out.append(([int(c) for c in np.exp(rng.uniform(np.log(16), np.log(32000), size))], []))
        elif family == 1:
            out.append(([int(c) for c in rng.integers(16, 513, int(rng.integers(16, 257)))], []))
        elif family == 2:
            out.append(([], [(int(rng.integers(256, 8193)), int(rng.integers(0, 24000)))
                             for _ in range(int(rng.integers(1, 4)))]))
        else:
            decodes = [int(c) for c in rng.integers(16, 16000, int(rng.integers(1, 129)))]
            out.append((decodes, [(int(rng.integers(16, 2049)), int(rng.integers(0, 16000)))]))
    return out


def kind_of(decodes, prefills):
    return batch_kind(len(decodes), sum(new for new, _ in prefills))


def measured_samples(truth, current, steps, noise=0.0, seed=11):
    """Samples whose measured time is the truth model's, times seeded noise; their cost
    breakdown is the current model's, as a real calibration run would have it."""
    rng = np.random.default_rng(seed)
    samples = []
    for decodes, prefills in steps:
        measured = truth.split_step_cost(decodes, prefills).total_s * (1.0 + noise * rng.standard_normal())
        samples.append(StepSample(current.split_step_cost(decodes, prefills), measured, kind_of(decodes, prefills)))
    return samples


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("noise, tolerance", [(0.0, 0.01), (0.03, 0.05)])
def test_the_fit_recovers_known_factors(async_scheduling, noise, tolerance):
    truth = cost_model(async_scheduling=async_scheduling, eff=TRUE)
    current = cost_model(async_scheduling=async_scheduling)
    samples = measured_samples(truth, current, batches(np.random.default_rng(7)), noise=noise)
    fit = fit_efficiency(samples, **peaks(current), base=Efficiency())
    assert fit.identified == FITTED
    for name in FITTED:
        assert getattr(fit.efficiency, name) == pytest.approx(getattr(TRUE, name), rel=tolerance), name
    assert fit.efficiency.interconnect_fraction == Efficiency().interconnect_fraction
    if noise:
        assert 0.01 < fit.median_ape < 0.03  # about the noise, not less (overfit) nor much more
    else:
        assert fit.median_ape < 1e-9 and fit.p90_ape < 1e-9
        assert fit.notes == ()


def test_memory_bound_decodes_leave_the_compute_fractions_unidentified():
    truth = cost_model(async_scheduling=False, eff=TRUE)
    current = cost_model(async_scheduling=False)
    rng = np.random.default_rng(3)
    steps = [([int(c) for c in rng.integers(4000, 32000, int(rng.integers(1, 129)))], []) for _ in range(60)]
    samples = measured_samples(truth, current, steps)
    assert all(s.cost.memory_s > s.cost.compute_s for s in samples)
    base = Efficiency(matmul_flops_fraction=0.55, attention_flops_fraction=0.5)
    fit = fit_efficiency(samples, **peaks(current), base=base)
    assert fit.identified == ("hbm_bandwidth_fraction", "step_overhead_s", "per_request_overhead_s")
    assert fit.efficiency.matmul_flops_fraction == 0.55 and fit.efficiency.attention_flops_fraction == 0.5
    assert fit.efficiency.hbm_bandwidth_fraction == pytest.approx(TRUE.hbm_bandwidth_fraction, rel=1e-9)
    assert any(note.startswith("matmul_flops_fraction: not identified") for note in fit.notes)
    assert any(note.startswith("attention_flops_fraction: not identified") for note in fit.notes)


def test_without_overhead_fitting_the_overheads_stay_at_base():
    truth = cost_model(async_scheduling=False, eff=TRUE)
    current = cost_model(async_scheduling=False)
    samples = measured_samples(truth, current, batches(np.random.default_rng(5), n=40))
    fit = fit_efficiency(samples, **peaks(current), fit_overhead=False)
    assert fit.identified == FITTED[:3]
    assert fit.efficiency.step_overhead_s == Efficiency().step_overhead_s
    assert fit.efficiency.per_request_overhead_s == Efficiency().per_request_overhead_s


def test_a_device_faster_than_its_datasheet_is_clamped_to_the_peak():
    peak = Efficiency(matmul_flops_fraction=1.0, attention_flops_fraction=1.0, step_overhead_s=0.0,
                      per_request_overhead_s=0.0)
    truth = cost_model(async_scheduling=False, eff=peak)
    current = cost_model(async_scheduling=False)
    rng = np.random.default_rng(9)
    steps = [([], [(int(rng.integers(4096, 8193)), int(rng.integers(0, 8000)))]) for _ in range(20)]
    samples = [StepSample(s.cost, s.measured_s * 0.5, s.kind) for s in measured_samples(truth, current, steps)]
    fit = fit_efficiency(samples, **peaks(current))
    assert fit.efficiency.matmul_flops_fraction == 1.0 and type(fit.efficiency.matmul_flops_fraction) is float
    assert any("matmul_flops_fraction" in note and "datasheet" in note for note in fit.notes)


@pytest.mark.parametrize("model, tp", [("llama-3.1-8b", 4), ("gpt-oss-20b", 2), ("qwen3-8b", 1)])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_predict_s_agrees_with_the_cost_model(model, tp, async_scheduling):
    cm = cost_model(model=model, tp=tp, async_scheduling=async_scheduling, eff=TRUE)
    for decodes, prefills in batches(np.random.default_rng(1), n=40):
        cost = cm.split_step_cost(decodes, prefills)
        assert predict_s(cost, TRUE, **peaks(cm)) == pytest.approx(cost.total_s, rel=1e-12)
        assert cost.flops == cost.linear_flops + cost.attention_flops
        assert cost.num_requests == len(decodes) + len(prefills)


def test_write_calibration_round_trips_through_read_calibration(tmp_path):
    eff = Efficiency(matmul_flops_fraction=1 / 3, attention_flops_fraction=0.1 + 0.2, hbm_bandwidth_fraction=1.0,
                     interconnect_fraction=0.7, allreduce_latency_s=0, step_overhead_s=9.000000000000001e-4,
                     per_request_overhead_s=2.2e-05)
    path = tmp_path / "cal.toml"
    path.write_text("stale = true\n")  # replaced whole
    write_calibration(path, eff, comment_lines=["measured on a test\nsecond line"])
    text = path.read_text()
    data = tomllib.loads(text)
    assert set(data) == {"cost_model"}
    assert set(data["cost_model"]) == {f.name for f in fields(Efficiency)}
    assert read_calibration(path).efficiency == eff
    assert read_calibration(path, base=TRUE).efficiency == eff  # every field written, nothing from base
    assert "# measured on a test\n# second line\n" in text
    assert [p.name for p in tmp_path.iterdir()] == ["cal.toml"]  # no temporary file left


def test_all_reduce_curves_round_trip_and_interpolate(tmp_path):
    curve = AllReduceCurve(4, (1024.0, 1048576.0, 16777216.0), (6e-6, 10e-6, 70e-6))
    eff = Efficiency(matmul_half_tokens=96.0, layer_fixed_s=3e-5, step_gpu_fixed_s=2e-4, allreduce=(curve,))
    path = write_calibration(tmp_path / "cal.toml", eff)
    assert read_calibration(path, base=TRUE).efficiency == eff
    assert read_calibration(write_calibration(tmp_path / "none.toml", TRUE), base=eff).efficiency.allreduce == ()
    assert curve.seconds_for(10) == 6e-6  # the latency floor
    assert curve.seconds_for((1048576 + 16777216) / 2) == pytest.approx(40e-6, rel=1e-12)
    # Past the last point, at the last segment's rate: 60 us per 15 MiB.
    assert curve.seconds_for(16777216 + 15728640) == pytest.approx(130e-6, rel=1e-12)


def test_write_calibration_from_a_fit_records_it_in_comments(tmp_path):
    truth = cost_model(async_scheduling=False, eff=TRUE)
    current = cost_model(async_scheduling=False)
    fit = fit_efficiency(measured_samples(truth, current, batches(np.random.default_rng(2), n=40)), **peaks(current))
    assert isinstance(fit, Fit)
    path = write_calibration(tmp_path / "fit.toml", fit)
    assert read_calibration(path).efficiency == fit.efficiency
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any("identified: matmul_flops_fraction" in line for line in header)
    cost = current.split_step_cost([100, 200], [(512, 0)])
    assert fit.predict_s(cost) == predict_s(cost, fit.efficiency, **peaks(current))


@pytest.mark.parametrize("decode, prefill, kind", [
    (5, 0, "decode-only"), (0, 100, "prefill-heavy"), (10, 90, "prefill-heavy"), (11, 89, "mixed"),
    (200, 1, "mixed"),
])
def test_batch_kind(decode, prefill, kind):
    assert batch_kind(decode, prefill) == kind


def test_batch_kind_rejects_an_empty_step():
    with pytest.raises(ValueError):
        batch_kind(0, 0)


def test_ape_by_kind_on_a_hand_example():
    rows = ape_by_kind([1.1, 0.9, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0],
                       ["decode-only", "decode-only", "mixed", "prefill-heavy"])
    assert [r["kind"] for r in rows] == ["all", "decode-only", "mixed", "prefill-heavy"]
    assert [r["count"] for r in rows] == [4, 2, 1, 1]
    every = rows[0]
    # Errors 0.1, 0.1, 1.0, 0.0: sorted [0, .1, .1, 1]; the p90 lies 0.7 of the way from .1 to 1.
    assert every["median_ape"] == pytest.approx(0.1)
    assert every["p90_ape"] == pytest.approx(0.1 + 0.7 * 0.9)
    assert rows[1]["median_ape"] == pytest.approx(0.1) and rows[1]["p90_ape"] == pytest.approx(0.1)
    assert rows[2]["median_ape"] == pytest.approx(1.0) and rows[3]["p90_ape"] == 0.0


def test_ape_by_kind_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        ape_by_kind([1.0], [1.0, 2.0], ["mixed"])
    with pytest.raises(ValueError):
        ape_by_kind([1.0], [1.0], ["prefill"])
