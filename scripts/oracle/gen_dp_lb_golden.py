"""Golden cases for vLLM's data-parallel load balancer (the ``dp_lb`` router's choice).

Run with the oracle venv (scripts/oracle/README.md#gen_dp_lb_goldenpy-the-dp-load-balancer)::

    ~/.cache/kvtwin-oracle-venv/bin/python scripts/oracle/gen_dp_lb_golden.py [--out DIR] [--check]

A real ``DPLBAsyncMPClient`` (vllm/v1/engine/core_client.py) is built without processes
or sockets: its parent's constructor, which starts engines and the stats task, is replaced
for the construction only by one that sets the two attributes the balancer's own
constructor reads (``core_engines``, ``client_index``) and the per-engine table the
parent would make (``lb_engines``, all zeros). The balancer's constructor, its
``get_core_engine_for_request`` and its ``process_engine_outputs`` then run unmodified.
A publication is handed over as the stats task hands it (a freshly decoded msgpack list
that replaces ``lb_engines``).

Each case is a list of events: ``publish`` (the counts every engine is published with),
``route`` (a request, ``rank`` the rank it names or null; ``expect`` the rank vLLM picked)
and ``finish`` (requests whose outputs say they finished). Written to
``tests/golden/dp_lb/<case>.json``; ``tests/replay/test_dp_lb.py`` replays them through
``kvtwin.sim.replay.router.DPBalancer``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_common import REPO, atomic_write, prepare_environment  # noqa: E402

OUT = os.path.join(REPO, "tests", "golden", "dp_lb")


def make_client(num_ranks: int, client_count: int, client_index: int):
    from vllm.v1.engine.core_client import DPAsyncMPClient, DPLBAsyncMPClient

    def parent_init(self, vllm_config, executor_class, log_stats, client_addresses=None,
                    client_count=1, client_index=0, renderer=None):
        # Only what DPLBAsyncMPClient.__init__ and get_core_engine_for_request read.
        self.core_engines = [rank.to_bytes(2, "little") for rank in range(num_ranks)]
        self.client_index = client_index
        self.lb_engines = [[0, 0, 0.0] for _ in self.core_engines]

    with mock.patch.object(DPAsyncMPClient, "__init__", parent_init):
        return DPLBAsyncMPClient(None, None, False, None, client_count, client_index)


def run_case(num_ranks: int, client_count: int, client_index: int, script: list[dict]) -> list[dict]:
    """Replays ``script`` through vLLM's balancer; returns the events with ``expect`` filled in."""
    import msgspec
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    client = make_client(num_ranks, client_count, client_index)
    engines = client.core_engines
    events = []
    for event in script:
        if "publish" in event:
            # The stats task's path: a decoded message replaces the table (core_client.py:1588-1598).
            client.lb_engines = msgspec.msgpack.decode(msgspec.msgpack.encode(event["publish"]))
            events.append({"publish": event["publish"]})
        elif "route" in event:
            request = SimpleNamespace(request_id=event["route"], resumable=False,
                                      data_parallel_rank=event["rank"], pooling_params=None)
            engine = client.get_core_engine_for_request(request)
            events.append({"route": event["route"], "rank": event["rank"], "expect": engines.index(engine)})
        else:
            outputs = SimpleNamespace(finished_requests=list(event["finish"]))
            asyncio.run(DPLBAsyncMPClient.process_engine_outputs(client, outputs))
            events.append({"finish": event["finish"]})
    return events


def _route(ids: list[str], rank: int | None = None) -> dict:
    rid = f"r{len(ids)}"
    ids.append(rid)
    return {"route": rid, "rank": rank}


def hand_written() -> dict[str, tuple[int, int, int, list[dict]]]:
    cases: dict[str, tuple[int, int, int, list[dict]]] = {}
    ids: list[str] = []
    # Nothing published: increments and rotation spread a burst.
    cases["burst_unpublished"] = (4, 1, 0, [_route(ids) for _ in range(10)])
    ids = []
    # A skewed publication, a burst on it, then a publication that resets the increments.
    script = [{"publish": [[3, 2, 0.2], [0, 1, 0.1], [1, 5, 0.3], [0, 0, 0.0]]}]
    script += [_route(ids) for _ in range(8)]
    script += [{"publish": [[0, 4, 0.2], [2, 2, 0.1], [0, 6, 0.3], [1, 1, 0.0]]}]
    script += [_route(ids) for _ in range(6)]
    cases["skewed_then_reset"] = (4, 1, 0, script)
    ids = []
    # Waiting requests weigh more on an engine whose KV cache is over half full.
    script = [{"publish": [[4, 2, 0.95], [4, 2, 0.5], [4, 2, 0.75], [0, 7, 1.0]]}]
    script += [_route(ids) for _ in range(8)]
    cases["kv_pressure"] = (4, 1, 0, script)
    ids = []
    # Requests that name their rank, in-flight floors, and finishes lowering them.
    script = [_route(ids, 2), _route(ids, 2), _route(ids, 2), _route(ids), _route(ids),
              {"publish": [[0, 0, 0.0], [0, 0, 0.0], [0, 0, 0.0]]}, _route(ids), _route(ids), _route(ids),
              {"finish": ["r0", "r1", "r2"]}, _route(ids), _route(ids), _route(ids, 0), _route(ids)]
    cases["named_ranks_and_inflight"] = (3, 1, 0, script)
    ids = []
    # Two front ends: this one starts its scan elsewhere and counts for both.
    script = [_route(ids) for _ in range(4)] + [{"publish": [[1, 1, 0.6], [0, 3, 0.2], [2, 0, 0.9]]}]
    script += [_route(ids) for _ in range(5)] + [{"finish": ["r1"]}] + [_route(ids) for _ in range(3)]
    cases["two_clients"] = (3, 2, 1, script)
    return cases


def random_case(seed: int) -> tuple[int, int, int, list[dict]]:
    rng = random.Random(seed)
    num_ranks = rng.randint(2, 8)
    client_count = rng.choice([1, 1, 2, 3])
    client_index = rng.randrange(client_count)
    usages = [0.0, 0.25, 0.5, 0.6, 0.75, 0.9, 1.0]
    script: list[dict] = []
    ids: list[str] = []
    live: list[str] = []
    for _ in range(120):
        roll = rng.random()
        if roll < 0.15:
            script.append({"publish": [[rng.randint(0, 6), rng.randint(0, 12),
                                        rng.choice(usages) if rng.random() < 0.7 else round(rng.random(), 3)]
                                       for _ in range(num_ranks)]})
        elif roll < 0.3 and live:
            done = rng.sample(live, rng.randint(1, min(3, len(live))))
            live = [rid for rid in live if rid not in done]
            script.append({"finish": done})
        else:
            event = _route(ids, rng.randrange(num_ranks) if rng.random() < 0.15 else None)
            live.append(event["route"])
            script.append(event)
    return num_ranks, client_count, client_index, script


def all_cases() -> dict[str, tuple[int, int, int, list[dict]]]:
    cases = hand_written()
    for seed in range(4):
        cases[f"random_{seed}"] = random_case(seed)
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = parser.parse_args()
    prepare_environment("kvtwin-dp-lb-oracle")
    import vllm

    differ = 0
    os.makedirs(args.out, exist_ok=True)
    for name, (num_ranks, client_count, client_index, script) in all_cases().items():
        case = {"vllm": vllm.__version__,
                "source": "vllm/v1/engine/core_client.py DPLBAsyncMPClient.get_core_engine_for_request",
                "num_ranks": num_ranks, "client_count": client_count, "client_index": client_index,
                "events": run_case(num_ranks, client_count, client_index, script)}
        text = json.dumps(case, indent=1) + "\n"
        path = os.path.join(args.out, f"{name}.json")
        picks = [e["expect"] for e in case["events"] if "route" in e]
        if args.check:
            same = os.path.exists(path) and open(path).read() == text
            differ += not same
            print(f"{name}: {'SAME' if same else 'DIFFERENT'}")
        else:
            atomic_write(path, text)
            print(f"{name}: {num_ranks} ranks, {len(picks)} requests, picks {picks[:12]}{'...' if len(picks) > 12 else ''}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
