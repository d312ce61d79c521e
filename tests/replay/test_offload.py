"""KV offloading in the replay: the ``[offload]`` config, tiers per replica, and its metrics.

A session-heavy synthetic chat (most of each prompt the session's history) on a small GPU
KV cache (3 GiB, ~24k tokens of Llama-3.1-8B): the GPU cache turns over, so a CPU tier of
6 GiB (3,072 chunks, 48k tokens; it still evicts) catches reuse the GPU lost, and a disk
tier catches it when the CPU tier is tiny. cpu_bytes = 0 is no offloading at all.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.planner.offload import OffloadConfig, offload_config_from_mapping
from kvtwin.sim.replay.capacity_table import capacity_table
from kvtwin.sim.scenario.sweep_keys import apply_values, parse_sweeps, sweep_key, sweep_points
from kvtwin.sim.replay.output_columns import OFFLOAD
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.deployment import Deployment
from kvtwin.sim.scenario.parse import parse_scenario
from kvtwin.sim.scenario.resolve import resolve_scenario
from tests.replay.chat_workload import chat_trace, llama_plan
from tests.tables import assert_tables_equal

GIB = 2**30
OFFLOAD_REQUEST_COLUMNS = ("gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens", "load_wait_s", "load_transfer_s",
                           "load_defer_s")


def _plan(**engine):
    return llama_plan(**{"async_scheduling": False, **engine})


@pytest.fixture(scope="module")
def chat():
    return chat_trace(150)


@pytest.fixture(scope="module")
def llama():
    return _plan()


@pytest.fixture(scope="module")
def runs(chat, llama):
    cache = {}

    def run(cpu_gib: float = 0.0, disk_gib: float = 0.0, policy: str = "lru"):
        key = (cpu_gib, disk_gib, policy)
        if key not in cache:
            config = OffloadConfig(cpu_bytes=int(cpu_gib * GIB), disk_bytes=int(disk_gib * GIB), policy=policy,
                                   disk_bandwidth_bytes_per_s=5e9 if disk_gib else None)
            cache[key] = run_replay(llama, chat, offload=config.resolve(llama))
        return cache[key]

    return run


def _first_admission_hit_rate(result) -> float:
    r = result.requests
    admitted = ~np.isnan(r.column("first_scheduled_time_s").to_numpy())
    return r.column("prefix_hit_tokens").to_numpy()[admitted].sum() / r.column("prompt_tokens").to_numpy()[admitted].sum()


def _summary(result) -> dict:
    return result.summary.to_pylist()[0]


# -- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize("table, field", [
    ({"cpu_bytes": "8 gigs"}, "offload.cpu_bytes"),
    ({"cpu_bytes": True}, "offload.cpu_bytes"),
    ({"cpu_bytes": -1}, "offload.cpu_bytes"),
    ({"cpu_bytes": 8.5}, "offload.cpu_bytes"),
    ({"cpu_bytes": GIB, "policy": "fifo"}, "offload.policy"),
    ({"cpu_bytes": GIB, "policy": True}, "offload.policy"),
    ({"cpu_bytes": GIB, "disk_bytes": -5}, "offload.disk_bytes"),
    ({"cpu_bytes": GIB, "disk_bytes": GIB}, "offload.disk_bandwidth_bytes_per_s"),
    ({"cpu_bytes": GIB, "disk_bytes": GIB, "disk_bandwidth_bytes_per_s": "fast"}, "offload.disk_bandwidth_bytes_per_s"),
    ({"cpu_bytes": GIB, "disk_bytes": GIB, "disk_bandwidth_bytes_per_s": 0}, "offload.disk_bandwidth_bytes_per_s"),
    ({"cpu_bytes": 0, "disk_bytes": GIB, "disk_bandwidth_bytes_per_s": 1e9}, "offload.disk_bytes"),
    ({"cpu_bytes": GIB, "disk_latency_s": -1}, "offload.disk_latency_s"),
    ({"cpu_bytes": GIB, "disk_latency_s": False}, "offload.disk_latency_s"),
    ({"cpu_gib": 8}, "offload.cpu_gib"),
])
def test_bad_offload_settings_are_errors_naming_the_key(table, field):
    with pytest.raises(ConfigError) as err:
        offload_config_from_mapping(table)
    assert err.value.field == field


def test_offload_runs_with_vllms_default_asynchronous_scheduling(chat):
    """Two batches in flight (vLLM's default) offload too: the tier catches reuse the GPU
    lost, and a zero-byte tier is exactly the run without one."""
    assert parse_scenario({"engine": {}, "offload": {"cpu_bytes": GIB}}, base_dir=None).offload.cpu_bytes == GIB
    async_plan = _plan(async_scheduling=True)
    assert async_plan.engine.async_scheduling
    off = run_replay(async_plan, chat)
    on = run_replay(async_plan, chat, offload=OffloadConfig(cpu_bytes=6 * GIB).resolve(async_plan))
    s = _summary(on)
    assert s["cpu_hit_tokens"] > 0 and s["hit_rate_total"] >= _first_admission_hit_rate(off)
    assert s["completed"] == _summary(off)["completed"] == on.requests.num_rows
    # Each load is paired with its own batch's transfer (two batches in flight).
    loaded = on.requests.column("cpu_hit_tokens").to_numpy() > 0
    transfer = on.requests.column("load_transfer_s").to_numpy()
    wait = on.requests.column("load_wait_s").to_numpy()
    assert s["num_loads"] == loaded.sum() and np.isfinite(transfer[loaded]).all()
    assert (transfer[loaded] <= wait[loaded] + 1e-12).all()
    zero = run_replay(async_plan, chat, offload=OffloadConfig(cpu_bytes=0).resolve(async_plan))
    for name in ("requests", "steps", "summary", "replicas"):
        assert_tables_equal(getattr(off, name), getattr(zero, name), with_metadata=False)


def test_cpu_chunks_are_worker_bytes_times_world_size_rounded_to_the_page():
    tp2 = _plan(tensor_parallel_size=2)
    # Llama-3.1-8B at TP 2: 32 layers x K,V x 4 KV heads x 128 x 2 bytes x 16 tokens = 1 MiB a worker.
    assert tp2.bytes_per_block == 2**20
    resolved = OffloadConfig(cpu_bytes=10 * GIB + 5).resolve(tp2)
    assert resolved.chunk_bytes == 2 * 2**20 and resolved.num_cpu_chunks == 10 * GIB // (2 * 2**20)
    # Each worker moves its share over its own link: per-GPU rate x TP for the whole chunk.
    assert resolved.h2d_bytes_per_s == 2 * get_gpu("h100").pcie_h2d_bytes_per_s
    assert resolved.bytes_per_key / resolved.h2d_bytes_per_s == tp2.bytes_per_block / 50e9
    # An unaligned block is rounded up to the 4096-byte page; MLA with TP keeps one copy.
    fake = SimpleNamespace(engine=SimpleNamespace(tensor_parallel_size=4), bytes_per_block=1000,
                           model=SimpleNamespace(uses_mla=False, name="m", layer_kinds=("full",)), gpu=get_gpu("a100"))
    assert OffloadConfig(cpu_bytes=40960).resolve(fake).chunk_bytes == 4096
    assert OffloadConfig(cpu_bytes=40960).resolve(fake).num_cpu_chunks == 10
    fake.model.uses_mla = True
    mla = OffloadConfig(cpu_bytes=40960).resolve(fake)
    assert (mla.chunk_bytes, mla.copies, mla.h2d_bytes_per_s) == (4096, 1, 25e9)
    with pytest.raises(ConfigError, match="at least one CPU chunk"):
        OffloadConfig(cpu_bytes=4095).resolve(fake)
    assert OffloadConfig(cpu_bytes=0).resolve(tp2) is None


def test_offload_cpu_bytes_is_a_sweep_key():
    axis = parse_sweeps(["offload.cpu_bytes=0,8000000000"])[0]
    assert axis.key.kind == "int" and axis.values == (0, 8_000_000_000)
    assert apply_values({"engine": {}}, {"offload.cpu_bytes": 5})["offload"] == {"cpu_bytes": 5}
    assert sweep_key("offload.policy").kind == "str"
    with pytest.raises(ConfigError, match="cpu_bytes"):
        sweep_key("offload.cpu_gib")


# -- the replay ---------------------------------------------------------------------------


def test_a_cpu_tier_catches_reuse_the_gpu_lost(runs):
    off, on = runs(), runs(cpu_gib=6)
    s = _summary(on)
    assert s["offload_cpu_chunks"] == 3072 and s["offload_policy"] == "lru"
    assert s["offload_cpu_evicted_keys"] > 0  # the tier is smaller than what the run offers it
    assert s["cpu_hit_tokens"] > 0 and s["hit_rate_cpu"] > 0.05
    assert s["hit_rate_total"] >= _first_admission_hit_rate(off)
    assert s["hit_rate_total"] == pytest.approx(s["hit_rate_gpu"] + s["hit_rate_cpu"] + s["hit_rate_disk"])
    assert s["p99_ttft_ms"] <= _summary(off)["p99_ttft_ms"]
    assert s["completed"] == _summary(off)["completed"] == on.requests.num_rows


def test_offload_columns_add_up(runs, llama):
    on = runs(cpu_gib=6)
    r, steps, s = on.requests, on.steps, _summary(on)
    assert r.column_names[-len(OFFLOAD_REQUEST_COLUMNS):] == list(OFFLOAD_REQUEST_COLUMNS)
    gpu, cpu, disk = (r.column(f"{t}_hit_tokens").to_numpy() for t in ("gpu", "cpu", "disk"))
    prompt = r.column("prompt_tokens").to_numpy()
    assert (gpu + cpu + disk < prompt).all() and not disk.any()
    # The GPU part of a loaded request's hit is the prefix cache's hit.
    assert (r.column("prefix_hit_tokens").to_numpy() == gpu).all()
    wait = r.column("load_wait_s").to_numpy()
    loaded = cpu > 0
    assert np.isfinite(wait[loaded]).all() and (wait[loaded] > 0).all() and np.isnan(wait[~loaded]).all()
    assert s["num_loads"] == loaded.sum()
    # The transfer is part of the wait: 2 MiB chunks at 50 GB/s, behind earlier loads.
    transfer = r.column("load_transfer_s").to_numpy()
    assert (transfer[loaded] <= wait[loaded] + 1e-12).all()
    assert (transfer[loaded] >= cpu[loaded] / 16 * 2**21 / 50e9 - 1e-12).all()
    # A load finishes before its request's first token.
    ttft = r.column("ttft_s").to_numpy()
    assert (ttft[loaded] > wait[loaded]).all()
    # Bytes are keys times the KV bytes of a chunk; the summary sums the step columns.
    bytes_per_key = OffloadConfig(cpu_bytes=6 * GIB).resolve(llama).bytes_per_key
    loaded_keys = steps.column("offload_cpu_loaded_keys").to_numpy().sum()
    assert s["kv_offload_load_bytes"] == loaded_keys * bytes_per_key == s["offload_cpu_loaded_keys"] * bytes_per_key
    assert s["kv_offload_store_bytes"] == s["offload_cpu_stored_keys"] * bytes_per_key
    assert steps.column("offload_cpu_used_chunks").to_numpy().max() <= 3072
    assert set(OFFLOAD.summary) <= set(on.summary.column_names)
    assert "offload_disk_loaded_keys" not in steps.column_names  # no disk tier, no disk columns


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_with_gpu_prefix_caching_off_every_hit_is_a_cpu_load(chat, async_scheduling):
    """vLLM hashes blocks for a connector even with prefix caching off: the CPU tier still
    stores every prompt's full blocks and serves the reuse, and no hit comes from the GPU."""
    nocache = _plan(enable_prefix_caching=False, async_scheduling=async_scheduling)
    assert not nocache.engine.enable_prefix_caching
    config = OffloadConfig(cpu_bytes=6 * GIB).resolve(nocache)
    on = run_replay(nocache, chat, offload=config)
    s = _summary(on)
    r = on.requests
    gpu, cpu = r.column("gpu_hit_tokens").to_numpy(), r.column("cpu_hit_tokens").to_numpy()
    assert not gpu.any() and s["gpu_hit_tokens"] == 0 and s["hit_rate_gpu"] == 0
    assert s["prefix_cache_hits"] == 0 and not r.column("prefix_hit_tokens").to_numpy().any()
    assert s["cpu_hit_tokens"] == cpu.sum() > 0 and s["hit_rate_cpu"] > 0.05
    assert s["hit_rate_total"] == s["hit_rate_cpu"]
    assert s["kv_offload_store_bytes"] == s["offload_cpu_stored_keys"] * config.bytes_per_key > 0
    assert s["num_loads"] == (cpu > 0).sum()
    assert s["completed"] == r.num_rows
    # Without the tier the same run hits nothing at all.
    assert _summary(run_replay(nocache, chat))["prefix_cache_hits"] == 0


def test_a_hybrid_mamba_model_offloads_only_with_prefix_caching_on(tmp_path):
    """Outside align mode vLLM's offloading config asserts on a Mamba hybrid: the scenario
    is refused when it is resolved (sim/scenario/features.py)."""
    data = {"model": {"preset": "nemotron-h-8b"}, "hardware": {"gpu": "h100"},
            "engine": {"max_model_len": 16384, "enable_prefix_caching": False}, "offload": {"cpu_bytes": GIB}}
    with pytest.raises(ConfigError) as err:
        resolve_scenario(tmp_path / "s.toml", data=data)
    assert err.value.field == "offload.cpu_bytes" and "prefix caching off" in str(err.value)
    cached = plan(get_model("nemotron-h-8b"), get_gpu("h100"), EngineConfig(max_model_len=16384))
    assert OffloadConfig(cpu_bytes=GIB).resolve(cached).num_cpu_chunks > 0


def test_cpu_bytes_zero_is_exactly_the_run_without_offload(runs, chat, llama):
    off = runs()
    zero = run_replay(llama, chat, offload=OffloadConfig(cpu_bytes=0).resolve(llama))
    for name in ("requests", "steps", "summary", "replicas"):
        assert_tables_equal(getattr(off, name), getattr(zero, name), with_metadata=False)
    assert "hit_rate_total" not in off.summary.column_names
    assert not set(OFFLOAD_REQUEST_COLUMNS) & set(off.requests.column_names)


def test_an_offload_replay_is_deterministic(runs, chat, llama):
    first = runs(cpu_gib=6)
    again = run_replay(llama, chat, offload=OffloadConfig(cpu_bytes=6 * GIB).resolve(llama))
    for name in ("requests", "steps", "summary"):
        assert_tables_equal(getattr(first, name), getattr(again, name))


def test_a_disk_tier_adds_disk_hits_when_the_cpu_tier_is_tiny(runs):
    tiny, tiered = runs(cpu_gib=0.25), runs(cpu_gib=0.25, disk_gib=8)
    s = _summary(tiered)
    assert (s["offload_cpu_chunks"], s["offload_disk_chunks"]) == (128, 4096)
    assert s["disk_hit_tokens"] > 0 and s["offload_disk_loaded_keys"] > 0 and s["offload_disk_stored_keys"] > 0
    assert s["hit_rate_total"] > _summary(tiny)["hit_rate_total"] + 0.05
    assert tiered.steps.column("offload_disk_used_chunks").to_numpy().max() <= 4096
    disk = tiered.requests.column("disk_hit_tokens").to_numpy()
    assert np.isfinite(tiered.requests.column("load_wait_s").to_numpy()[disk > 0]).all()


@pytest.fixture(scope="module")
def slow_disk(chat, llama):
    """A tiny CPU tier over a disk whose one queue (0.5 GB/s) the write-through keeps busy:
    a disk hit's promotion waits behind the writes before its load can start."""
    config = OffloadConfig(cpu_bytes=GIB // 4, disk_bytes=8 * GIB, disk_bandwidth_bytes_per_s=5e8)
    return run_replay(llama, chat, offload=config.resolve(llama))


def _requests(result) -> dict[str, np.ndarray]:
    r = result.requests
    return {name: r.column(name).to_numpy() for name in r.column_names
            if name.endswith(("_s", "_tokens")) and name != "session_id"}


def test_a_disk_hits_load_wait_holds_its_promotion(slow_disk):
    """The wait for KV runs from the lookup that found the hit on disk (and started its
    promotion) to the first schedule: it is a disk hit's whole time to first schedule, but
    for the wait until its first lookup (the step running when it arrived)."""
    r = _requests(slow_disk)
    disk = r["disk_hit_tokens"] > 0
    assert disk.sum() >= 10
    queue = r["first_scheduled_time_s"] - r["arrival_time_s"]
    wait, defer, transfer = r["load_wait_s"], r["load_defer_s"], r["load_transfer_s"]
    longest_step = slow_disk.steps.column("duration_s").to_numpy().max()
    gap = queue[disk] - wait[disk]
    assert gap.min() >= -1e-12 and gap.max() <= longest_step
    # Most of it is the promotion queued behind the writes, before the load was issued.
    assert (defer[disk] > 0).all() and np.median(defer[disk]) > 0.1
    assert np.median(queue[disk]) > 10 * np.median(transfer[disk])
    # The wait is the time before the load, then the transfer, then the request's turn;
    # one that found its hit on the GPU in the end (another request loaded the chunks)
    # waited without a load.
    waited, loaded = np.isfinite(wait), np.isfinite(transfer)
    assert not (loaded & ~waited).any() and (waited & ~loaded).any()
    assert (defer[waited] >= 0).all() and (transfer[loaded] <= wait[loaded] - defer[loaded] + 1e-12).all()
    assert (defer[waited & ~loaded] == wait[waited & ~loaded]).all()
    assert np.isnan(defer[~waited]).all()
    s = _summary(slow_disk)
    assert (s["num_loads"], s["num_load_waits"]) == (loaded.sum(), waited.sum())
    for name, values in (("load_wait", wait[waited]), ("load_defer", defer[waited]),
                         ("load_transfer", transfer[loaded])):
        assert s[f"mean_{name}_ms"] == pytest.approx(values.mean() * 1000)
        for stat, q in (("median", 50), ("p90", 90), ("p99", 99)):
            assert s[f"{stat}_{name}_ms"] == pytest.approx(np.percentile(values, q) * 1000)


def test_requests_waiting_for_kv_per_step_are_the_requests_rows_waits(slow_disk):
    """``num_waiting_for_kv`` after each (synchronous) step: the requests whose wait for KV
    (``load_wait_s`` before their first schedule) covers the step's start. Where several
    steps start at one instant (empty steps reporting a transfer), after the last of them."""
    r = _requests(slow_disk)
    waited = np.isfinite(r["load_wait_s"])
    end = r["first_scheduled_time_s"][waited]
    start = end - r["load_wait_s"][waited]
    t = slow_disk.steps.column("time_s").to_numpy()
    last_at_instant = np.append(t[1:] != t[:-1], True)
    t = t[last_at_instant]
    expected = ((start[None, :] <= t[:, None] + 1e-12) & (t[:, None] < end[None, :] - 1e-12)).sum(axis=1)
    gauge = slow_disk.steps.column("num_waiting_for_kv").to_numpy()[last_at_instant]
    assert gauge.max() >= 3
    np.testing.assert_array_equal(gauge, expected)


def test_arc_keeps_more_of_a_small_tier_than_lru(runs):
    lru, arc = runs(cpu_gib=2, policy="lru"), runs(cpu_gib=2, policy="arc")
    assert _summary(arc)["offload_policy"] == "arc"
    assert _summary(arc)["hit_rate_cpu"] > _summary(lru)["hit_rate_cpu"]


def test_replicas_each_have_their_own_tier(chat):
    two = _plan()
    result = run_replay(two, chat, deployment=Deployment(2, "round_robin"),
                        offload=OffloadConfig(cpu_bytes=4 * GIB).resolve(two))
    per = result.replicas.to_pylist()
    s = _summary(result)
    assert [row["offload_cpu_chunks"] for row in per] == [2048, 2048]
    assert sum(row["cpu_hit_tokens"] for row in per) == s["cpu_hit_tokens"]
    assert sum(row["kv_offload_store_bytes"] for row in per) == s["kv_offload_store_bytes"]


def test_capacity_table_has_offload_columns_when_a_point_offloads(runs):
    axes = parse_sweeps(["offload.cpu_bytes=0,6442450944"])
    points = sweep_points(axes)
    rows = [{"point": 0, "status": "ok", "error": None, "summary": _summary(runs())},
            {"point": 1, "status": "ok", "error": None, "summary": _summary(runs(cpu_gib=6))}]
    table = capacity_table(rows, points, axes)
    assert table.column("hit_rate_total").to_pylist()[0] is None
    assert table.column("hit_rate_total").to_pylist()[1] > 0.7
    plain = capacity_table(rows[:1], points[:1], axes)
    assert "hit_rate_total" not in plain.column_names


# -- sanity on the bundled Mooncake trace (a GPU cache too small for its reuse) -------

@pytest.fixture(scope="module")
def mooncake_small_gpu():
    """The Mooncake conversation trace's first 400 requests (long multi-turn prompts) on a
    GPU cache small enough (10 GiB, ~80k tokens of Llama-3.1-8B) that it loses reuse; longer
    prompts than max_model_len are rejected, the same in every run."""
    from kvtwin.traces import transforms
    from kvtwin.traces.bundled import bundled_path
    from kvtwin.traces.load import load_trace
    trace = transforms.limit(load_trace(bundled_path("mooncake_conversation_trace.jsonl")), 400)
    return trace, _plan(max_model_len=65536, kv_cache_memory_bytes=10 * GIB)


def test_offload_never_lowers_the_total_hit_rate_on_mooncake(mooncake_small_gpu):
    """The trace's reuse is far apart (hundreds of thousands of tokens): a small tier adds
    little, a large one a lot, and none takes hits away."""
    trace, llama = mooncake_small_gpu
    off_rate = _first_admission_hit_rate(run_replay(llama, trace))
    rates = {}
    for policy, cpu_gib in (("lru", 128), ("lru", 512), ("arc", 512)):
        offload = OffloadConfig(cpu_bytes=cpu_gib * GIB, policy=policy).resolve(llama)
        rates[policy, cpu_gib] = _summary(run_replay(llama, trace, offload=offload))["hit_rate_total"]
    assert all(rate >= off_rate for rate in rates.values()), (off_rate, rates)
    assert rates["lru", 512] >= rates["lru", 128]
    assert rates["lru", 512] > off_rate + 0.05 and rates["arc", 512] > off_rate + 0.05


def test_a_zero_byte_cpu_tier_is_exactly_no_offload_on_mooncake(mooncake_small_gpu):
    trace, llama = mooncake_small_gpu
    off = run_replay(llama, trace)
    zero = run_replay(llama, trace, offload=OffloadConfig(cpu_bytes=0).resolve(llama))
    for name in ("requests", "steps", "summary", "replicas"):
        assert_tables_equal(getattr(off, name), getattr(zero, name), with_metadata=False)
