"""The offloading connector's store pass, step by step: each computed prompt chunk is
stored once, at the step that computes it; decode steps (a settled request, which the
pass skips after a few comparisons) and output tokens store nothing; a chunk the tier
holds already (a prefix another request stored) is not stored again."""

from __future__ import annotations

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.offload.build import build_offload_tier
from kvtwin.sim.core.offload.connector_metadata import OffloadingConnectorMetadata
from kvtwin.sim.core.offload.transfers import StepTransfers

from ..builders import BS, EchoModel, full, kv_config, new_request, tokens


def _engine(num_blocks: int = 64, budget: int = 64) -> EngineCore:
    kv = kv_config(full(), num_blocks=num_blocks)
    tier = build_offload_tier(kv, CacheConfig(), StepTransfers(), num_cpu_chunks=64, policy="lru")
    return EngineCore(kv, SchedulerConfig(max_model_len=4096, max_num_batched_tokens=budget,
                                          async_scheduling=False), CacheConfig(), tier)


def _stored_keys_per_step(engine: EngineCore, max_steps: int = 100) -> list[list]:
    """Each step's stored keys (their block hashes' chunk order), until the engine is idle."""
    steps: list[list] = []
    model = EchoModel()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests() and not engine.has_pending_transfers():
            break
        result = engine.step(model)
        meta = result.output.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        steps.append([key for job in meta.store_jobs.values() for key in job.keys])
    return steps


def test_each_prompt_chunk_is_stored_once_at_the_step_that_computes_it():
    engine = _engine(budget=64)  # 4 blocks a step: a 10-block prompt is prefilled in 3 steps
    engine.add_request(new_request("a", tokens(0, 10 * BS), max_tokens=40))
    steps = _stored_keys_per_step(engine)
    # Steps 1-2 compute 4 full blocks each, step 3 the last 2 (and samples the first token).
    assert [len(keys) for keys in steps[:3]] == [4, 4, 2]
    # 39 decode steps follow (40 output tokens, 2.5 blocks of them): none stores anything,
    # the output's blocks included (only the prompt is offloaded).
    assert all(not keys for keys in steps[3:])
    assert len(steps) >= 3 + 39
    stored = [key for keys in steps for key in keys]
    assert len(set(stored)) == len(stored) == 10


def test_a_prompt_tail_shorter_than_a_chunk_is_never_stored():
    engine = _engine(budget=4096)
    engine.add_request(new_request("a", tokens(0, 3 * BS + 5), max_tokens=30))
    steps = _stored_keys_per_step(engine)
    assert [len(keys) for keys in steps if keys] == [3]  # the partial 4th block stays on the GPU


def test_a_second_request_sharing_the_prefix_stores_only_its_own_chunks():
    engine = _engine(budget=4096)
    engine.add_request(new_request("a", tokens(0, 6 * BS), max_tokens=3))
    first = _stored_keys_per_step(engine)
    engine.add_request(new_request("b", tokens(0, 4 * BS) + tokens(9000, 4 * BS), max_tokens=3))
    second = _stored_keys_per_step(engine)
    first_keys = {key for keys in first for key in keys}
    second_keys = [key for keys in second for key in keys]
    assert len(first_keys) == 6
    # b's first 4 chunks are a's (a GPU prefix hit, in the tier already): only its 4 own.
    assert len(second_keys) == 4 and not first_keys & set(second_keys)


class _TierPerKey:
    """A manager stand-in that reports each key's tier from a table (the connector asks
    ``get_load_source`` only after a load)."""

    def __init__(self, tiers: dict):
        self.tiers = tiers

    def on_new_request(self, req_context):
        from kvtwin.sim.core.offload.base import RequestOffloadingContext

        return RequestOffloadingContext()  # as OffloadingManager says (a compiled connector checks it)

    def get_load_source(self, key, req_context) -> str:
        return self.tiers[key]


_ORDER = {"unspecified": -1, "gpu": 0, "cpu": 1, "disk": 2}


def _per_token_sources(ranges, tiers: dict, start: int, end: int) -> list[tuple[str, int]]:
    """The split token by token: the outermost tier among the keys covering it."""
    sources: dict[str, int] = {}
    for token in range(start, end):
        covering = [tiers[key] for lo, hi, key in ranges if lo <= token < hi]
        outer = max(covering, key=_ORDER.__getitem__) if covering else "unspecified"
        sources[outer] = sources.get(outer, 0) + 1
    return list(sources.items())


def test_the_external_hit_splits_by_the_outermost_tier_covering_each_token():
    import random

    from kvtwin.sim.core.offload.connector import OffloadingConnector

    rng = random.Random(7)
    for trial in range(60):
        num_keys = rng.randint(1, 12)
        tiers = {(k, trial): rng.choice(["cpu", "cpu", "disk", "gpu"]) for k in range(num_keys)}
        connector = OffloadingConnector(kv_config(full()), _TierPerKey(tiers))
        request = new_request(f"r{trial}", tokens(0, 400))
        connector.on_new_request(request)
        # Chunks of 16 tokens, mostly back to back, some overlapping (two groups) or with gaps.
        ranges, position = [], rng.randint(0, 40)
        for key in tiers:
            position += rng.choice([0, 0, 0, -8, 5])
            ranges.append((max(0, position), max(0, position) + 16, key))
            position += 16
        start = rng.randint(0, 48)
        num_external = rng.randint(1, max(1, position - start + 20))
        state = connector._req_status[request.request_id]
        state.num_locally_computed_tokens = start
        state.load_key_ranges[:] = ranges
        got = connector.get_external_cache_hit_sources(request, num_external)
        assert list(got.items()) == _per_token_sources(ranges, tiers, start, start + num_external)
