"""bench/bench_fidelity_serving.py's pure parts: reading the points file, the error and band
arithmetic, the targets' verdicts; that the bundled points file is complete; and one point end
to end."""

import importlib.util
import io
import math
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "bench_fidelity_serving.py"

HEADER = ("point_id,source,series,gpu,tp,model,max_num_seqs,max_num_batched_tokens,max_model_len,"
          "enable_prefix_caching,async_scheduling,gpu_memory_utilization,kv_cache_tokens,input_tokens,output_tokens,"
          "arrival,rate_per_s,num_prompts,seed,source_saturated,req_s,out_tok_s,ttft_mean_ms,ttft_p50_ms,ttft_p99_ms,"
          "tpot_mean_ms,tpot_p50_ms,tpot_p99_ms,itl_p99_ms,e2e_mean_ms,notes\n")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_fidelity_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _csv(*rows):
    return io.StringIO(HEADER + "".join(r + "\n" for r in rows))


def test_a_row_is_typed_and_empty_cells_are_none(bench):
    [p] = bench.parse_points(_csv("a,S9,s,h100,1,llama-3.1-8b,,2048,8192,false,,0.9,,1024,128,poisson,2.5,120,42,0,"
                                  "1.97,252,,58.8,103.7,,7.17,8.92,35.3,,note"))
    assert p["tp"] == 1 and p["max_num_batched_tokens"] == 2048 and p["max_num_seqs"] is None
    assert p["enable_prefix_caching"] is False and p["async_scheduling"] is None
    assert p["rate_per_s"] == 2.5 and p["ttft_p99_ms"] == 103.7 and p["ttft_mean_ms"] is None
    assert p["source_saturated"] == 0 and p["notes"] == "note"


@pytest.mark.parametrize("row, words", [
    ("b,S9,s,h100,1,m,,,,,,,,1024,128,closed,,10,0,0,,,,,,,,,,,", "arrival"),
    ("c,S9,s,h100,1,m,,,,,,,,1024,128,poisson,,10,0,0,,,,,,,,,,,", "rate_per_s"),
    ("d,S9,s,h100,1,m,,,,yes,,,,1024,128,burst,,10,0,0,,,,,,,,,,,", "enable_prefix_caching"),
    ("e,S9,s,h100,1,m,,,,,,,,1024,0,burst,,10,0,0,,,,,,,,,,,", "output_tokens"),
    ("f,S9,s,h100,1,m,,,,,,,,1024,128,burst,,ten,0,0,,,,,,,,,,,", "num_prompts"),
])
def test_a_bad_row_names_its_point_and_column(bench, row, words):
    with pytest.raises(bench.PointError) as raised:
        bench.parse_points(_csv(row))
    assert str(raised.value).startswith(row.split(",")[0] + ":") and words in str(raised.value)


def test_relative_error(bench):
    assert bench.relative_error(110.0, 100.0) == pytest.approx(0.10)
    assert bench.relative_error(45.0, 50.0) == pytest.approx(-0.10)
    for predicted, measured in ((None, 1.0), (1.0, None), (1.0, 0.0), (math.nan, 1.0)):
        assert math.isnan(bench.relative_error(predicted, measured))


def test_covers(bench):
    assert bench.covers(90.0, 110.0, 100.0) is True
    assert bench.covers(90.0, 110.0, 110.0) is True  # the edge is inside
    assert bench.covers(90.0, 110.0, 111.0) is False
    assert bench.covers(math.nan, math.nan, 100.0) is False  # no band: not covered
    assert bench.covers(90.0, 110.0, None) is None  # nothing measured: not judged


def _result(source, saturated, ttft, tpot, e2e, req_s, covered):
    return {"source": source, "source_saturated": saturated, "err_ttft_mean": ttft, "err_ttft_p50": math.nan,
            "err_tpot_mean": tpot, "err_tpot_p50": tpot, "err_e2e_mean": e2e, "err_req_s": req_s,
            "covered_ttft": covered, "covered_tpot": None, "covered_itl": None}


def test_verdicts_against_hand_computed_figures(bench):
    results = [_result("A", 1, 0.02, -0.10, math.nan, 0.04, True),
               _result("A", 0, -0.04, 0.01, 0.03, 0.50, True),
               _result("B", 1, 0.30, 0.02, -0.06, -0.07, False)]
    v = {row["target"].split()[0]: row for row in bench.verdicts(results)}
    # TTFT: |0.02|, |-0.04|, |0.30| (the p50s are NaN) -> median 0.04.
    assert v["TTFT"]["value"] == pytest.approx(0.04) and v["TTFT"]["points"] == 3 and v["TTFT"]["holds"]
    # TPOT: mean and p50 pooled: 0.10, 0.10, 0.01, 0.01, 0.02, 0.02 -> median 0.02.
    assert v["TPOT"]["value"] == pytest.approx(0.02) and v["TPOT"]["points"] == 6
    # E2E: 0.03 and 0.06 -> 0.045.
    assert v["E2E"]["value"] == pytest.approx(0.045) and v["E2E"]["holds"]
    # Saturation: only the saturated points (0.04, -0.07); the worst fails the 5% target.
    assert v["saturation"]["value"] == pytest.approx(0.07) and v["saturation"]["points"] == 2
    assert v["saturation"]["within"] == 1
    assert not v["saturation"]["holds"]
    # Band: 2 of 3 judged p99s held -> 66.7% < 80%.
    assert v["band"]["value"] == pytest.approx(2 / 3) and v["band"]["points"] == 3 and not v["band"]["holds"]
    rows = {r["source"]: r for r in bench.by_source(results)}
    assert rows["A"]["saturation"] == pytest.approx(0.04) and rows["all"]["points"] == 3
    assert rows["B"]["coverage"] == 0.0 and rows["all"]["coverage"] == pytest.approx(2 / 3)


def test_nothing_to_judge_does_not_pass(bench):
    v = bench.verdicts([_result("A", 0, math.nan, math.nan, math.nan, math.nan, None)])
    assert [row["holds"] for row in v] == [False] * 5


def test_the_bundled_points_are_complete(bench):
    with bench.POINTS_CSV.open() as f:
        points = bench.parse_points(f)
    hardware = tomllib.loads(bench.HARDWARE_TOML.read_text())
    sources = (REPO / "bench" / "data" / "FIDELITY_SOURCES.md").read_text()
    assert len({p["point_id"] for p in points}) == len(points)
    for p in points:
        if p["model"].startswith("hf:"):
            assert (bench.MODELS_DIR / f"{p['model'][3:]}.json").is_file(), p["point_id"]
        if p["gpu"].startswith("inline:"):
            assert p["gpu"][7:] in hardware, p["point_id"]
        assert f"**{p['source']}**" in sources, p["point_id"]
        data = bench.scenario_data(p, hardware)
        assert data["engine"]["tensor_parallel_size"] == p["tp"]
    # Every source past its knee somewhere: the saturation target has points to judge.
    assert {p["source"] for p in points if p["source_saturated"]} == {p["source"] for p in points}


def test_one_point_end_to_end(bench, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "f.parquet"
    assert bench.main(["--only", "s4-t4-n10", "--out", str(out)]) == 0
    [row] = pq.read_table(out).to_pylist()
    assert row["point_id"] == "s4-t4-n10" and row["kv_cache_tokens"] == 93872  # the source's logged KV size
    assert row["replayed_requests"] == 10 and row["latency_side"] in ("client", "server")
    assert row["err_req_s"] == pytest.approx((row["kvtwin_req_s"] - 0.70) / 0.70)


def _point(series, calibration, ttft, tpot, kvtwin_ttft=100.0, kvtwin_tpot=10.0):
    return {"series": series, "calibration": calibration, "measured_ttft_p99_ms": ttft, "kvtwin_ttft_p99_ms": kvtwin_ttft,
            "measured_tpot_p99_ms": tpot, "kvtwin_tpot_p99_ms": kvtwin_tpot, "measured_itl_p99_ms": None,
            "kvtwin_itl_p99_ms": 9.0}


def test_the_band_is_the_ratio_quantiles_and_each_series_is_judged_without_itself(bench):
    # Ratios measured / replayed: series a 1.0..2.0 TTFT, series b 0.5 and 3.0; an uncalibrated
    # point makes no claim and is never in a band.
    results = [_point("a", "cal", 100.0 + 10.0 * i, 10.0) for i in range(11)]
    results += [_point("b", "cal", 50.0, 30.0), _point("b", "cal", 300.0, 10.0),
                _point("c", "uncalibrated", 1000.0, 1000.0)]
    ratios = bench.p99_ratios(results)
    assert len(ratios) == 2 * 13 and all(series != "c" for series, _, _ in ratios)
    ttft = sorted(v for _, kind, v in ratios if kind == "ttft")
    band = bench.serving_band(ratios)
    q05, q95 = (float(x) for x in __import__("numpy").quantile(ttft, [0.05, 0.95]))
    assert band["ttft"] == pytest.approx((min(q05, 1.0), q95))
    # TPOT: twelve ratios of 1.0 and one of 3.0 -> the band holds 1 and reaches towards 3.
    assert band["tpot"][0] == 1.0 and 1.0 < band["tpot"][1] < 3.0
    assert band["e2e"] == (min(band["ttft"][0], band["tpot"][0]), max(band["ttft"][1], band["tpot"][1]))
    # Without series a, the band is b's alone: 0.5 .. 3.0 (TTFT, up to interpolation).
    alone = bench.serving_band(ratios, without="a")
    assert alone["ttft"][0] == pytest.approx(0.5 + 0.05 * 2.5) and alone["ttft"][1] == pytest.approx(3.0 - 0.05 * 2.5)
    bench.judge_bands(results)
    # a's points, judged on b's band (0.625 .. 2.875 x 100 ms): every TTFT p99 (100-200 ms) inside.
    assert all(r["covered_ttft"] for r in results if r["series"] == "a")
    assert results[0]["band_ttft_low_ms"] == pytest.approx(62.5)
    # b's 0.5 point, judged on a's band (1.0 .. ~1.95): outside; c has no band: not judged.
    assert results[11]["covered_ttft"] is False and results[13]["covered_ttft"] is None
    assert results[0]["covered_itl"] is None  # nothing measured
    text = bench.band_file_text(bench.serving_band(ratios), results)
    assert "ttft = [" in text and "e2e = [" in text
    import tomllib as toml
    parsed = toml.loads(text)
    assert parsed["ttft"] == pytest.approx(list(band["ttft"]), rel=1e-3)
