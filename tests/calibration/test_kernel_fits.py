"""The kernel fits recover known coefficients from synthetic timings, and hold out honestly."""

import numpy as np
import pytest

from kvtwin.sim.calibration.efficiency import AllReduceCurve
from kvtwin.sim.calibration.fit.kernels import (allreduce_points, attention_model_s, fit_attention, fit_decode_attention,
                                          fit_gemm, gemm_model_s, holdout_predictions, interpolate_s, layer_fixed_s,
                                          relative_errors)

PEAK_FLOPS, PEAK_BYTES = 989e12, 3.35e12


def synthetic_gemms(f, h, b, noise=0.0, seed=3):
    rng = np.random.default_rng(seed)
    shapes = [(4096, 6144), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 1024), (1280, 8192)]
    m, n, k = [], [], []
    for rows in (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        for cols, inner in shapes:
            m.append(rows), n.append(cols), k.append(inner)
    m, n, k = (np.array(a, float) for a in (m, n, k))
    t = gemm_model_s(m, n, k, PEAK_FLOPS, PEAK_BYTES, f, h, b) * (1 + noise * rng.standard_normal(len(m)))
    return m, n, k, t


@pytest.mark.parametrize("f, h, b", [(0.78, 96.0, 0.82), (0.55, 0.0, 0.6), (0.9, 300.0, 0.6)])
def test_fit_gemm_recovers_known_coefficients(f, h, b):
    m, n, k, t = synthetic_gemms(f, h, b)
    fit = fit_gemm(m, n, k, t, flops_per_s=PEAK_FLOPS, bytes_per_s=PEAK_BYTES)
    assert fit.matmul_flops_fraction == pytest.approx(f, rel=0.01)
    assert fit.matmul_half_tokens == pytest.approx(h, rel=0.05, abs=2.0)
    assert fit.hbm_bandwidth_fraction == pytest.approx(b, rel=0.01)


def test_fit_gemm_with_noise_stays_close_and_its_holdout_error_shows_the_noise():
    m, n, k, t = synthetic_gemms(0.78, 96.0, 0.82, noise=0.03)
    fit = fit_gemm(m, n, k, t, flops_per_s=PEAK_FLOPS, bytes_per_s=PEAK_BYTES)
    assert fit.matmul_flops_fraction == pytest.approx(0.78, rel=0.03)
    assert fit.hbm_bandwidth_fraction == pytest.approx(0.82, rel=0.03)
    folds = np.arange(len(t)) % 3
    predicted = holdout_predictions(
        lambda mask: fit_gemm(m[mask], n[mask], k[mask], t[mask], flops_per_s=PEAK_FLOPS, bytes_per_s=PEAK_BYTES),
        lambda model, mask: model.predict_s(m[mask], n[mask], k[mask], PEAK_FLOPS, PEAK_BYTES), folds)
    assert np.all(predicted > 0)
    assert 0.01 < np.median(relative_errors(predicted, t)) < 0.04  # the 3% noise, not zero and not a bad fit
    with pytest.raises(ValueError):
        fit_gemm([1, 2], [1, 2], [1, 2], [1e-6, 2e-6], flops_per_s=PEAK_FLOPS, bytes_per_s=PEAK_BYTES)


def test_allreduce_points_take_the_fastest_and_never_decrease():
    sizes, times = allreduce_points([1024, 1024, 4096, 2048, 8192], [9e-6, 7e-6, 8e-6, 10e-6, 20e-6])
    assert sizes == (1024.0, 2048.0, 4096.0, 8192.0)
    assert times == (7e-6, 10e-6, 10e-6, 20e-6)  # 4096's 8 us dip is noise: raised to 10
    query = np.array([512.0, 3072.0, 16384.0])
    curve = AllReduceCurve(2, sizes, times)
    assert list(interpolate_s(sizes, times, query)) == pytest.approx([curve.seconds_for(q) for q in query], rel=1e-12)
    one = AllReduceCurve(2, (1024.0,), (5e-6,))
    assert list(interpolate_s((1024.0,), (5e-6,), query)) == pytest.approx([one.seconds_for(q) for q in query],
                                                                           rel=1e-12)


def test_layer_fixed_time_is_every_kernel_floor_of_a_layer():
    # Four GEMMs and five small kernels at the GEMM floor, one attention at its own.
    assert layer_fixed_s(3e-6, 10e-6) == pytest.approx(9 * 3e-6 + 10e-6)


def test_fit_attention_recovers_fraction_half_and_floor():
    rng = np.random.default_rng(8)
    q = rng.choice([16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0], 300)
    heads, batch = rng.choice([8.0, 32.0, 64.0], 300), rng.choice([1.0, 4.0, 16.0], 300)
    flops = 4 * heads * 128 * batch * q * (q + 1) / 2
    kv = batch * q * 2 * heads / 8 * 128 * 2
    t = attention_model_s(flops, kv, q, PEAK_FLOPS, PEAK_BYTES * 0.8, 0.62, 900.0, 11e-6)
    fit = fit_attention(flops, kv, q, t, flops_per_s=PEAK_FLOPS, bytes_per_s=PEAK_BYTES * 0.8)
    assert fit.attention_flops_fraction == pytest.approx(0.62, rel=0.02)
    assert fit.attention_half_query_tokens == pytest.approx(900.0, rel=0.05)
    assert fit.launch_s == pytest.approx(11e-6, rel=0.05)


def test_fit_decode_attention_recovers_floor_and_per_head_time():
    rng = np.random.default_rng(9)
    kv = rng.uniform(1e5, 1e9, 200)
    work = rng.uniform(8, 65536, 200)
    t = 11e-6 + kv / 2.8e12 + 4e-9 * work
    fit = fit_decode_attention(kv, work, t, bytes_per_s=2.8e12)
    assert fit.launch_s == pytest.approx(11e-6, rel=1e-6)
    assert fit.seconds_per_head == pytest.approx(4e-9, rel=1e-6)
    assert list(fit.predict_s(kv[:3], work[:3], 2.8e12)) == pytest.approx(list(t[:3]), rel=1e-9)
