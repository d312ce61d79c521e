"""A plan with ``data_parallel_size`` > 1 in the replay, as vLLM 0.33 runs it
(docs/semantics.md#data-parallel-lockstep).

vLLM starts one engine core per DP rank, each with the plan's ``num_blocks``. With a MoE
model the ranks are a ``DPEngineCoreProc`` group that steps together (``dp_group.py``);
with a dense model each rank is an independent engine (``reconfigure_for_independent_dp_rank``)
and the replay runs them as independent replicas. Either way a front picks each request's
rank: vLLM's balancer (the ``dp_lb`` router) unless ``dp_rank_routing`` names another
router.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.replay.clock.dp_group import LockstepSettings
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.replay.moe_group_cost import moe_dp_group
from kvtwin.sim.scenario.deployment import Deployment


@dataclass(frozen=True)
class DataParallel:
    """How the replay runs the plan's DP ranks: how many, behind which router, and the
    lockstep group's settings (None: independent ranks)."""

    ranks: int
    router: str
    lockstep: LockstepSettings | None


def is_lockstep(plan: Plan) -> bool:
    """vLLM runs DP ranks in lockstep only for a MoE model (``run_engine_core``)."""
    return plan.engine.data_parallel_size > 1 and plan.model.num_experts > 0


def data_parallel(plan: Plan, deployment: Deployment, cost_model: CostModel | None, *, offload: bool = False,
                  disaggregation: bool = False, speculative: bool = False) -> DataParallel | None:
    """The plan's DP ranks in the replay (None: ``data_parallel_size`` 1, the deployment's
    replicas as they are). What a DP run does not model (several copies of the DP engine; in
    a lockstep group pipeline stages or drafts) the features table refused already; a P/D
    side's DP ranks are ``pd_sides.py``'s. ``offload``: a KV connector on every rank, which
    a group runs (docs/semantics.md#a-kv-connector-in-a-group). ``cost_model`` prices the dummy batch (None: 0 s,
    a clock whose batches are not priced by a cost model)."""
    eng = plan.engine
    dp = eng.data_parallel_size
    if dp == 1:
        return None
    # The table refuses these pairs when the scenario is resolved
    # (docs/architecture.md#features-and-their-combinations); a library caller gets them here.
    assert deployment.replicas == 1, "several DP engines are not modelled"
    assert not disaggregation, "DP ranks in P/D roles are not modelled"
    if not is_lockstep(plan):
        # A prefill cadence needs a lockstep group: EngineConfig.resolve refused it otherwise.
        return DataParallel(dp, deployment.dp_router, None)
    assert eng.pipeline_parallel_size == 1 and not speculative, \
        "pipeline stages or drafts in a lockstep group are not modelled"
    return DataParallel(dp, deployment.dp_router, lockstep_settings(plan, cost_model))


def lockstep_settings(plan: Plan, cost_model: CostModel | None) -> LockstepSettings:
    """How a MoE plan's DP ranks step together: its prefill cadence, the dummy batch's
    seconds (``cost_model``'s; None: 0 s) and the group's MoE pricing."""
    eng = plan.engine
    scheduler = eng.scheduler
    dummy_s = cost_model.split_step_cost([1], []).total_s if cost_model is not None else 0.0
    # The group prices its MoE layers for all ranks (docs/clock.md#moe-under-data-parallelism).
    moe = (moe_dp_group(plan, cost_model.eff) if cost_model is not None and eng.pipeline_parallel_size == 1
           else None)
    return LockstepSettings(prefill_schedule_interval=scheduler.prefill_schedule_interval, dummy_batch_s=dummy_s,
                            moe=moe)
