"""Benchmark: the simulator's own memory per KV block and per replica, the two constants
``sim/planner/host_memory.py`` estimates a replay's pools with before building them.

Measured with ``tracemalloc`` (bytes Python allocated, not RSS, so the figures do not
depend on the allocator's arenas or on what else the process holds):

- per block: a ``BlockPool`` of N blocks as built, then with every block allocated,
  cached under a hash like the replay's (Python's tuple hash of a chain) and freed again,
  the most a pool ever holds;
- per replica: the same small replay (Llama-3.1-8B, a pool of 40 blocks, 40 short chat
  requests) with 1 and with R replicas; the difference, less R - 1 pools (every block
  cached, the upper bound), over R - 1.

Prints both beside the constants and writes one row to ``bench/out/bench_sim_memory.parquet``.
Run ``.venv/bin/python bench/bench_sim_memory.py`` (and with ``KVTWIN_INTERPRETED=1``: the
interpreted core boxes each block id in an int, so it is the larger). Nothing here is timed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import tracemalloc
from pathlib import Path

OUT = Path(__file__).parent / "out" / "bench_sim_memory.parquet"
SMALL_POOL_BLOCKS = 40


def measure_block_bytes(num_blocks: int) -> dict[str, float]:
    """Bytes per block of a pool as built (``built``) and with every block cached (``cached``)."""
    from kvtwin.sim.core.block_pool import BlockPool
    from kvtwin.sim.core.hashing import builtin_hash

    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        pool = BlockPool(num_blocks, 1, True)
        built = tracemalloc.get_traced_memory()[0] - start
        blocks = pool.get_new_blocks(num_blocks - 1)
        hashes: list[object] = []
        parent: object = None
        for index in range(num_blocks - 1):
            parent = builtin_hash((parent, tuple(range(index, index + 16)), None))
            hashes.append(parent)
        pool.cache_full_blocks(blocks, hashes, 0, len(blocks), 0)
        pool.free_blocks(reversed(blocks))
        del blocks, hashes, parent
        gc.collect()
        cached = tracemalloc.get_traced_memory()[0] - start
        assert pool.num_cached_blocks() == num_blocks - 1
    finally:
        tracemalloc.stop()
    return {"built": built / num_blocks, "cached": cached / num_blocks}


def _replay_peak(num_replicas: int, trace, planned) -> int:
    from kvtwin.sim.replay.run import run_replay
    from kvtwin.sim.scenario.deployment import Deployment

    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        run_replay(planned, trace, deployment=Deployment(replicas=num_replicas))
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def measure_replica_bytes(num_replicas: int, num_requests: int = 40) -> dict[str, float]:
    """Peak bytes of a small replay per replica beyond its pool (``fixed``), from runs with
    one and with ``num_replicas`` replicas of ``SMALL_POOL_BLOCKS`` blocks each."""
    from kvtwin.sim.planner.engine_config import EngineConfig
    from kvtwin.sim.planner.hardware import get_gpu
    from kvtwin.sim.planner.models import get_model
    from kvtwin.sim.planner.plan import plan
    from kvtwin.traces.synth import synthesize
    from kvtwin.traces.synth_spec import parse_spec

    model, gpu = get_model("llama-3.1-8b"), get_gpu("h100")
    probe = plan(model, gpu, EngineConfig(max_model_len=512, kv_cache_memory_bytes=1 << 30))
    planned = plan(model, gpu, EngineConfig(max_model_len=512, max_num_batched_tokens=512, max_num_seqs=64,
                                            kv_cache_memory_bytes=probe.bytes_per_block * SMALL_POOL_BLOCKS))
    trace = synthesize(parse_spec({
        "kind": "chat", "seed": 1, "num_requests": num_requests, "block_tokens": 16,
        "arrival": {"process": "poisson", "rate_per_s": 2.0}, "shared_prefix": {"count": 2, "tokens": 100},
        "turns": {"dist": "zipf", "s": 1.2, "max": 4}, "user_tokens": {"dist": "lognormal", "mean": 60, "sigma": 0.5},
        "output_tokens": {"dist": "lognormal", "mean": 20, "sigma": 0.5}, "turn_gap_s": {"dist": "exponential", "mean": 5},
        "max_prompt_tokens": 400}))
    _replay_peak(1, trace, planned)  # imports and one-time caches, outside the figures
    one = _replay_peak(1, trace, planned)
    many = _replay_peak(num_replicas, trace, planned)
    per_replica = (many - one) / (num_replicas - 1)
    pool = measure_block_bytes(planned.num_blocks)["cached"] * planned.num_blocks
    return {"per_replica": per_replica, "fixed": per_replica - pool, "pool_blocks": planned.num_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=200_000, help="blocks of the measured pool")
    parser.add_argument("--replicas", type=int, default=41, help="replicas of the many-replica replay")
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvtwin import CORE_BUILD, __version__
    from kvtwin.sim.planner.host_memory import BYTES_PER_BLOCK, BYTES_PER_REPLICA

    block = measure_block_bytes(args.blocks)
    replica = measure_replica_bytes(args.replicas)
    print(CORE_BUILD.describe())
    print(f"per block, as built:            {block['built']:8.1f} bytes")
    print(f"per block, every block cached:  {block['cached']:8.1f} bytes   (BYTES_PER_BLOCK = {BYTES_PER_BLOCK})")
    print(f"per replica beyond its pool:    {replica['fixed']:8.0f} bytes   (BYTES_PER_REPLICA = {BYTES_PER_REPLICA}; "
          f"{args.replicas} replicas of {replica['pool_blocks']} blocks)")
    row = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "version": __version__,
           "core": CORE_BUILD.describe(), "python": platform.python_version(), "blocks": args.blocks,
           "replicas": args.replicas, "block_bytes_built": block["built"], "block_bytes_cached": block["cached"],
           "replica_bytes_fixed": replica["fixed"], "bytes_per_block_constant": BYTES_PER_BLOCK,
           "bytes_per_replica_constant": BYTES_PER_REPLICA}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([row])
    if OUT.exists():
        table = pa.concat_tables([pq.read_table(OUT), table], promote_options="default")
    pq.write_table(table, OUT)


if __name__ == "__main__":
    main()
