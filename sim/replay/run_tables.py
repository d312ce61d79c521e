"""A replay's tables, each made once, from what its recorder collected: ``requests`` and
``steps`` (the recorder's), ``summary`` (``run_summary``) and ``replicas``
(``summaries.summarize_replicas``). Which column sets they carry follows from the features
the run had (``output_columns``; docs/architecture.md#outputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvtwin.sim.calibration.band import band_columns
from kvtwin.sim.replay.client_side import client_summary
from kvtwin.sim.replay.clock.dp_group import DPGroup
from kvtwin.sim.replay.output_columns import BAND, CLIENT_SIDE, DATA_PARALLEL, DISAGGREGATION, assemble
from kvtwin.sim.replay.pd_summaries import pd_load_imbalance, pd_replica_requests, pd_summary_columns
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.summaries import summarize_replicas, summary_parts
from kvtwin.sim.calibration.file import Calibration
from kvtwin.sim.scenario.disaggregation import Disaggregation
from kvtwin.sim.scenario.slo import SLO


@dataclass(frozen=True)
class RunSettings:
    """What a run's tables say about how it ran, beside what its recorder saw: the SLO, the
    trace, the deployment's name for its router, the engine's retention label, the time a
    client sees outside the engine, the offload tiers' settings (``ResolvedOffload.describe``;
    None: no tier), the P/D deployment (None: aggregated) and the calibration whose band the
    summary carries (None: no band columns)."""

    slo: SLO
    trace: pa.Table | None
    router: str
    prefix_cache_retention: str
    client_overhead_s: float = 0.0
    offload: dict | None = None
    disaggregation: Disaggregation | None = None
    calibration: Calibration | None = None
    # The DP groups that stepped replicas together (none: each stepped alone), for their
    # columns: one over every replica, or one per P/D side with DP ranks.
    dp_groups: tuple[DPGroup, ...] = ()


@dataclass(frozen=True)
class RunTables:
    requests: pa.Table
    steps: pa.Table
    summary: pa.Table
    replicas: pa.Table


def run_tables(metrics: MetricsRecorder, end_s: float, settings: RunSettings) -> RunTables:
    """The four tables of a run that ended at ``end_s`` (``reports/SCHEMA.md``)."""
    requests = metrics.requests_table(settings.client_overhead_s)
    steps = metrics.steps_table()
    disaggregation = settings.disaggregation
    base, features = summary_parts(requests, steps, metrics.all_itl_s(), settings.slo, end_s, trace=settings.trace,
                                   num_replicas=metrics.num_replicas, router=settings.router,
                                   offload=settings.offload,
                                   prefix_cache_retention=settings.prefix_cache_retention,
                                   client_overhead_s=settings.client_overhead_s)
    if disaggregation is None:
        replicas = summarize_replicas(requests, steps, metrics.itl_by_replica, settings.slo, end_s,
                                      trace=settings.trace, offload=settings.offload,
                                      cluster_summary=pa.Table.from_pylist([assemble("summary", base, features)]),
                                      client_overhead_s=settings.client_overhead_s)
    else:
        # Each replica's own share: the requests it prefilled or decoded, with the prefix
        # hits found there.
        replicas = summarize_replicas(requests, steps, metrics.itl_by_replica, settings.slo, end_s,
                                      trace=settings.trace, roles=metrics.roles,
                                      per_replica=pd_replica_requests(requests, disaggregation),
                                      client_overhead_s=settings.client_overhead_s)
        # The balance that means something here: each side's own (requests by prefill and
        # by decode replica), the worse of the two.
        base["load_imbalance"] = pd_load_imbalance(requests, disaggregation)
        features[DISAGGREGATION.feature] = {**disaggregation.describe(), **pd_summary_columns(requests)}
    features[CLIENT_SIDE.feature] = client_summary(requests, settings.client_overhead_s)
    if settings.calibration is not None:
        features[BAND.feature] = band_columns(base, settings.calibration)
    groups = settings.dp_groups
    if groups:
        # Several groups (P/D sides) sum their steps, waves and dummies (reports/SCHEMA.md).
        features[DATA_PARALLEL.feature] = {"dp_group_steps": sum(group.group_steps for group in groups),
                                           "dp_waves": sum(group.waves for group in groups),
                                           "dummy_steps": sum(sum(group.dummy_steps) for group in groups),
                                           **moe_communication_share(steps)}
        pricing = next((group.settings.moe.moe.pricing for group in groups if group.settings.moe is not None), None)
        if pricing is not None:
            features[DATA_PARALLEL.feature]["moe_communication_pricing"] = pricing
        # A replica outside every group (a P/D side of plain engines) ran no dummies.
        dummies = [0] * replicas.num_rows
        for group in groups:
            dummies[group.first:group.first + group.num_ranks] = group.dummy_steps
        replicas = replicas.append_column("dummy_steps", pa.array(dummies, pa.int64()))
    summary = pa.Table.from_pylist([assemble("summary", base, features)])
    return RunTables(requests, steps, summary, replicas)


def moe_communication_share(steps: pa.Table) -> dict[str, float]:
    """A DP MoE group's MoE collectives over its busy seconds, each group step counted once
    (its ranks' rows share the step's start; docs/clock.md#moe-under-data-parallelism).
    Empty where the steps carry no ``moe_communication_s``."""
    if "moe_communication_s" not in steps.column_names:
        return {}
    # A row of a batch that ran no tokens (it only dropped finished requests) has no cost.
    communication_s = steps.column("moe_communication_s").to_numpy()
    priced = ~np.isnan(communication_s)
    _, first = np.unique(steps.column("time_s").to_numpy()[priced], return_index=True)
    busy = float(steps.column("duration_s").to_numpy()[priced][first].sum())
    communication = float(communication_s[priced][first].sum())
    return {"moe_communication_share": communication / busy if busy > 0 else math.nan}
