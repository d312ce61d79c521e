"""The ``OffloadingManager`` interface (``sim/core/offload/manager.py``): both managers
implement every method it names, the connector calls nothing else of its manager, and each
manager's step columns come through ``counters`` (docs/semantics.md#kv-offloading)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from kvtwin.sim.core.engine_stats import offload_tier_counters
from kvtwin.sim.core.offload.base import ReqContext, make_offload_key
from kvtwin.sim.core.offload.cpu_manager import CPUOffloadingManager
from kvtwin.sim.core.offload.promotion_clock import StepPromotions
from kvtwin.sim.core.offload.tiered_manager import TieredOffloadingManager
from kvtwin.sim.core.offload.transfers import StepTransfers

CPU_COLUMNS = ("offload_cpu_loaded_keys", "offload_cpu_stored_keys", "offload_cpu_evicted_keys",
               "offload_cpu_used_chunks")
DISK_COLUMNS = ("offload_disk_loaded_keys", "offload_disk_stored_keys", "offload_disk_evicted_keys",
                "offload_disk_used_chunks")


OFFLOAD = Path(__file__).resolve().parents[3] / "sim" / "core" / "offload"


def _source(name: str) -> ast.Module:
    # Read from the repository: a compiled build's module file is its extension.
    return ast.parse((OFFLOAD / name).read_text())


def interface_methods() -> dict[str, list[str]]:
    """The interface's methods and their parameter names, read from its source."""
    tree = _source("manager.py")
    (protocol,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OffloadingManager"]
    return {f.name: [a.arg for a in f.args.args] for f in protocol.body if isinstance(f, ast.FunctionDef)}


def test_the_interface_names_what_the_connector_calls_and_what_the_stats_read():
    # Every ``self.manager.<name>`` the connector and its lookup side use (getattr'd speed
    # paths aside) is in the interface, and the interface holds nothing besides those,
    # ``counters`` (the step columns) and ``next_finish_s`` (the tier's next event on a
    # timed clock).
    called_by = {name: {node.attr for node in ast.walk(_source(name))
                        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                        and node.value.attr == "manager"}
                 for name in ("connector.py", "connector_lookup.py")}
    for name, called in called_by.items():
        assert called, f"the scan found no manager call in {name}"
    called = set().union(*called_by.values())
    assert set(interface_methods()) == called | {"counters", "next_finish_s"}


@pytest.mark.parametrize("cls", [CPUOffloadingManager, TieredOffloadingManager])
def test_each_manager_implements_the_interface(cls):
    for name, params in interface_methods().items():
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} lacks {name}"
        if inspect.isfunction(method):  # interpreted: the parameters agree by name too
            assert list(inspect.signature(method).parameters) == params, (cls.__name__, name)


def keys(n: int) -> list:
    return [make_offload_key(i, 0) for i in range(n)]


def test_cpu_counters_are_the_cpu_columns():
    cpu = CPUOffloadingManager(2, "lru")
    ctx = ReqContext("r")
    cpu.on_new_request(ctx)
    cpu.prepare_store(keys(2), ctx)
    cpu.complete_store(keys(2), ctx)
    assert cpu.counters() == dict(zip(CPU_COLUMNS, (0, 2, 0, 2)))
    # A third key into two chunks evicts the least recently used one.
    cpu.prepare_store(keys(3)[2:], ctx)
    assert cpu.counters() == dict(zip(CPU_COLUMNS, (0, 3, 1, 2)))


def test_tiered_counters_add_the_disk_columns_only_with_a_disk():
    assert list(TieredOffloadingManager(CPUOffloadingManager(2, "lru"), 0, "lru", StepPromotions(1)).counters()) \
        == list(CPU_COLUMNS)
    tiered = TieredOffloadingManager(CPUOffloadingManager(2, "lru"), 4, "lru", StepPromotions(1))
    ctx = ReqContext("r")
    tiered.on_new_request(ctx)
    tiered.prepare_store(keys(2), ctx)
    tiered.complete_store(keys(2), ctx)  # ready on CPU: cascaded to disk, written a step later
    tiered.on_schedule_end()
    tiered.on_schedule_end()
    counters = tiered.counters()
    assert list(counters) == list(CPU_COLUMNS + DISK_COLUMNS)
    assert [counters[c] for c in CPU_COLUMNS] == [0, 2, 0, 2]
    assert [counters[c] for c in DISK_COLUMNS] == [0, 2, 0, 2]


def test_the_tier_counters_are_the_managers_and_the_bytes_moved():
    cpu = CPUOffloadingManager(4, "lru")
    counters = offload_tier_counters(cpu, StepTransfers())
    # A step clock moves no bytes it counts.
    assert counters == {**dict(zip(CPU_COLUMNS, (0, 0, 0, 0))), "offload_load_bytes": 0, "offload_store_bytes": 0}
