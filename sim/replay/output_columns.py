"""The columns each optional feature adds to a run directory's tables, in one table
(docs/architecture.md#outputs; ``reports/SCHEMA.md`` says what each one means).

Every run writes the base columns of ``requests.parquet``, ``steps.parquet`` and
``summary.parquet``; a feature that is on adds its ``ColumnSet``. Each table has one author:
``MetricsRecorder.requests_table`` and ``steps_table``, and ``run_tables.run_tables`` (the summary).
An author builds its base columns, takes each feature's columns from the code that owns the
feature, and hands them to ``assemble``, which places every set as ``COLUMN_SETS`` orders
it and refuses a column no set declares or a set that comes back short. So a new column is
its name here, its values where its feature computes them, and its line in SCHEMA.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow as pa

from kvtwin.sim.calibration.file import BANDED_FIGURES


@dataclass(frozen=True)
class ColumnSet:
    """One feature's columns in each table, in their order. ``requests_after``: the base
    column its request columns follow (None: after the base columns). ``optional``: columns
    a feature may leave out where a part of it is off (a disk tier's, for one)."""

    feature: str
    requests: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()
    summary: Mapping[str, pa.DataType] = field(default_factory=dict)
    requests_after: str | None = None
    optional: frozenset[str] = frozenset()


def _stats(name: str) -> dict[str, pa.DataType]:
    """The mean, median, p90 and p99 of one latency, as ``summaries._stats`` names them."""
    return {f"{stat}_{name}": pa.float64() for stat in ("mean", "median", "p90", "p99")}


_INT, _FLOAT, _STRING = pa.int64(), pa.float64(), pa.string()

# The offload tiers' step counters: deltas over the step, but the gauges (chunks in use).
OFFLOAD_CPU_STEP_COLUMNS = ("offload_cpu_loaded_keys", "offload_cpu_stored_keys", "offload_cpu_evicted_keys",
                            "offload_cpu_used_chunks")
OFFLOAD_DISK_STEP_COLUMNS = ("offload_disk_loaded_keys", "offload_disk_stored_keys", "offload_disk_evicted_keys",
                             "offload_disk_used_chunks")
OFFLOAD_BYTES_STEP_COLUMNS = ("offload_load_bytes", "offload_store_bytes")
# Kept by the recorder itself from the requests' waits, after the tiers' counters.
OFFLOAD_WAITING_COLUMN = "num_waiting_for_kv"

SPECULATIVE = ColumnSet(
    "speculative",
    requests=("draft_tokens", "accepted_draft_tokens", "verify_steps"),
    # Per draft position, the verify rows that accepted it.
    steps=("spec_accepted_by_position",),
    summary={"spec_draft_tokens": _INT, "spec_accepted_tokens": _INT, "spec_acceptance_rate": _FLOAT,
             "mean_acceptance_length": _FLOAT, "spec_acceptance_by_position": pa.list_(_FLOAT)},
)

OFFLOAD = ColumnSet(
    "offload",
    requests=("gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens", "load_wait_s", "load_transfer_s",
              "load_defer_s"),
    steps=OFFLOAD_CPU_STEP_COLUMNS + OFFLOAD_DISK_STEP_COLUMNS + OFFLOAD_BYTES_STEP_COLUMNS + (OFFLOAD_WAITING_COLUMN,),
    summary={
        "offload_policy": _STRING, "offload_cpu_bytes": _INT, "offload_cpu_chunks": _INT,
        "offload_chunk_bytes": _INT, "offload_disk_bytes": _INT, "offload_disk_chunks": _INT,
        "gpu_hit_tokens": _INT, "cpu_hit_tokens": _INT, "disk_hit_tokens": _INT,
        "hit_rate_gpu": _FLOAT, "hit_rate_cpu": _FLOAT, "hit_rate_disk": _FLOAT, "hit_rate_total": _FLOAT,
        "num_loads": _INT, "num_load_waits": _INT,
        **_stats("load_wait_ms"), **_stats("load_transfer_ms"), **_stats("load_defer_ms"),
        "kv_offload_load_bytes": _INT, "kv_offload_store_bytes": _INT,
        **{f"offload_{tier}_{what}_keys": _INT for tier in ("cpu", "disk") for what in ("loaded", "stored", "evicted")},
    },
    optional=frozenset(OFFLOAD_DISK_STEP_COLUMNS),
)

DISAGGREGATION = ColumnSet(
    "disaggregation",
    requests=("prefill_replica", "decode_replica", "decode_prefix_hit_tokens", "decode_prefix_cache_queries",
              "decode_prefix_cache_hits", "prefill_finish_time_s", "transfer_bytes", "transfer_s"),
    steps=("role",),
    summary={"pd_prefill_replicas": _INT, "pd_decode_replicas": _INT, "pd_link": _STRING,
             "pd_transfer_mean_ms": _FLOAT, "pd_transfer_bytes_mean": _FLOAT,
             "pd_transfer_share_of_ttft": _FLOAT, "pd_transfer_share_of_ttft_total": _FLOAT},
)

# Every run has these: the latency a client sees, the server's plus the time outside the
# engine (``client_side.py``; equal to the server's when that is 0).
CLIENT_SIDE = ColumnSet(
    "client_side",
    requests=("ttft_client_s", "e2el_client_s"),
    requests_after="e2el_s",
    summary={**_stats("ttft_client_ms"), **_stats("e2el_client_ms"), "client_overhead_ms": _FLOAT},
)

# ``kvtwin replay``'s clock and the band its calibration puts on each p99 (docs/capacity.md#the-band).
BAND = ColumnSet(
    "band",
    summary={"calibration": _STRING, "calibration_note": _STRING,
             **{name: _FLOAT for figure in BANDED_FIGURES
                for name in (f"p99_{figure}_low", f"p99_{figure}_high", f"error_{figure.removesuffix('_ms')}")}},
)

# A data-parallel group that steps together (docs/semantics.md#data-parallel-lockstep): its
# steps, its waves, and the dummy batches its ranks ran (each rank's in replicas.parquet);
# priced by a cost model, each step's MoE collectives and their share of the group's busy
# time, and which measured table (or the bandwidth model) priced them
# (docs/clock.md#moe-under-data-parallelism).
DATA_PARALLEL = ColumnSet(
    "data_parallel",
    steps=("moe_communication_s",),
    summary={"dp_group_steps": _INT, "dp_waves": _INT, "dummy_steps": _INT, "moe_communication_share": _FLOAT,
             "moe_communication_pricing": _STRING},
    optional=frozenset({"moe_communication_share", "moe_communication_pricing"}),
)

# In the order their columns follow the base columns of each table.
COLUMN_SETS: tuple[ColumnSet, ...] = (SPECULATIVE, OFFLOAD, DISAGGREGATION, DATA_PARALLEL, CLIENT_SIDE, BAND)

V = TypeVar("V")


def _checked(column_set: ColumnSet, declared: tuple[str, ...], given: Mapping[str, V], table: str) -> list[tuple[str, V]]:
    missing = [name for name in declared if name not in given and name not in column_set.optional]
    unknown = [name for name in given if name not in declared]
    if missing or unknown:
        raise AssertionError(f"{column_set.feature}'s {table} columns: missing {missing}, not declared {unknown} "
                             f"(sim/replay/output_columns.py)")
    return [(name, given[name]) for name in declared if name in given]


def assemble(table: str, base: Mapping[str, V], features: Mapping[str, Mapping[str, V]]) -> dict[str, V]:
    """One table's columns (``table``: "requests", "steps" or "summary") in their order:
    ``base``, then each set of ``features`` (by feature name) where ``COLUMN_SETS`` puts it.
    A set may only give its declared columns, and all of them but its optional ones."""
    by_name = {column_set.feature: column_set for column_set in COLUMN_SETS}
    unknown = [name for name in features if name not in by_name]
    if unknown:
        raise AssertionError(f"no column set named {unknown} (sim/replay/output_columns.py)")
    inserted: dict[str, list[tuple[str, V]]] = {}
    appended: list[tuple[str, V]] = []
    for column_set in COLUMN_SETS:
        if column_set.feature not in features:
            continue
        declared = tuple(getattr(column_set, table))
        columns = _checked(column_set, declared, features[column_set.feature], table)
        anchor = column_set.requests_after if table == "requests" else None
        if anchor is not None:
            inserted.setdefault(anchor, []).extend(columns)
        else:
            appended.extend(columns)
    out: dict[str, V] = {}
    for name, value in base.items():
        out[name] = value
        for extra, extra_value in inserted.pop(name, ()):
            out[extra] = extra_value
    if inserted:
        raise AssertionError(f"no base column {sorted(inserted)} to place a column set after")
    for name, value in appended:
        if name in out:
            raise AssertionError(f"column {name} is both a base column and a feature's")
        out[name] = value
    return out
