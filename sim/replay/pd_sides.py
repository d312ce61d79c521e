"""A P/D replay's two sides, each a set of engines: plain replicas, or one vLLM DP engine's
ranks (wide-EP P/D: docs/semantics.md#data-parallel-pd-sides).

``[disaggregation] prefill_data_parallel_size`` and ``decode_data_parallel_size`` make a
side one DP engine of that many ranks. Its pool is planned with its own DP size (with
expert parallelism the experts spread over that side's DP x TP GPUs, so each side has its
own ``num_blocks``); a MoE model's ranks step together as one lockstep group per side,
priced with the side's own MoE part (docs/clock.md#moe-under-data-parallelism). The P/D
table's routers name the rank on each side, as an external router names a DP rank
(``dp_lb`` among them is vLLM's own balancer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kvtwin.sim.planner.plan import Plan, plan_resolved
from kvtwin.sim.replay.clock.dp_group import LockstepSettings
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.replay.data_parallel import is_lockstep, lockstep_settings
from kvtwin.sim.scenario.disaggregation import Disaggregation


@dataclass(frozen=True)
class PDSide:
    """One side of a P/D run: its role, the cluster index of its first engine, how many
    engines it has, the plan they run, and its lockstep group's settings (None: its
    engines step on their own)."""

    role: str
    first: int
    engines: int
    plan: Plan
    lockstep: LockstepSettings | None


def side_plan(plan: Plan, data_parallel_size: int) -> Plan:
    """``plan`` re-planned for a side of ``data_parallel_size`` DP ranks (the same plan at 1).
    The scheduler config stays the plan's: a prefill cadence is refused beside P/D, so
    the DP size it would see changes nothing (docs/semantics.md#local-prefill-cadence)."""
    if data_parallel_size == plan.engine.data_parallel_size:
        return plan
    return plan_resolved(plan.model, plan.gpu, dataclasses.replace(plan.engine, data_parallel_size=data_parallel_size))


def pd_sides(plan: Plan, disaggregation: Disaggregation,
             cost_model_of: Callable[[Plan], CostModel]) -> tuple[PDSide, PDSide]:
    """The prefill side (cluster indexes from 0) and the decode side (after it).
    ``cost_model_of(plan)``: a side plan's cost model (its dummy batch and MoE part)."""
    sides = []
    first = 0
    for role, engines, dp in (("prefill", disaggregation.prefill_engines, disaggregation.prefill_data_parallel_size),
                              ("decode", disaggregation.decode_engines, disaggregation.decode_data_parallel_size)):
        planned = side_plan(plan, dp)
        lockstep = lockstep_settings(planned, cost_model_of(planned)) if is_lockstep(planned) else None
        sides.append(PDSide(role, first, engines, planned, lockstep))
        first += engines
    return sides[0], sides[1]

