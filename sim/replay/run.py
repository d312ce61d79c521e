"""A simulated replay: a planned layout, a trace and a cost model, run in SimPy time.

Puts the pieces together: the plan's ``KVCacheConfig`` and its resolved engine config
(the scheduler and cache configs) build the ``EngineCore``; the trace's rows become
requests arriving at their times; the cost model predicts each step's duration and
samples synthetic output tokens; the metrics recorder turns what happened into the three
tables of a run directory. A ``Deployment`` of N replicas builds N engines, each with its
own executor and cost-model clock, behind its router (``router.py``);
``ReplayResult.replicas`` is then the per-replica summary.

With an offload tier (``offload``, a ``ResolvedOffload`` from the scenario's ``[offload]``
table) every replica's engine gets its own CPU tier (``CPUOffloadingManager``), over a disk
tier when ``disk_bytes > 0`` (``TieredOffloadingManager``, its CPU↔disk jobs on a
``TimedPromotions`` queue), with transfers timed on the SimPy clock (``TimedTransfers``:
FIFO per PCIe direction at the GPU's host-link rate); ``sim/planner/offload.py`` sizes
them. ``connector_tiers.py`` builds them, as it builds a P/D replay's connectors.

With a ``Disaggregation`` (the scenario's ``[disaggregation]`` table) the replicas are its
prefill and decode engines, each with a P/D connector tier, and the one ``Cluster`` has
the P/D front (``clock/pd_front.py``, vLLM's P/D proxy) where a plain replay has a router
(``RoutedFront``): the same engines, recorder, clock and tables otherwise. A side of DP
ranks (``pd_sides.py``) runs its own plan, and a MoE side's ranks one lockstep group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import simpy

from kvtwin.sim.replay.cost_model import CostModel, StepCost
from kvtwin.sim.replay.pipeline_cost import PipelineCostModel
from kvtwin.sim.scenario.acceptance import AcceptanceModel
from kvtwin.sim.core.connector_tier import ConnectorTier
from kvtwin.sim.core.window_pricing import WindowPricing
from kvtwin.sim.core.engine import EngineCore, Execution, ModelExecutor
from kvtwin.sim.core.retention import retention_label
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.run_tables import RunSettings, run_tables
from kvtwin.sim.replay.router import make_router
from kvtwin.sim.planner.host_memory import require_host_memory
from kvtwin.sim.planner.offload import ResolvedOffload
from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.core.scheduler import SchedulerOutput
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from kvtwin.sim.replay.clock.cluster import Cluster, Front, RoutedFront
from kvtwin.sim.replay.clock.dp_group import DPGroup, LockstepSettings
from kvtwin.sim.replay.data_parallel import data_parallel
from kvtwin.sim.replay.clock.pd_front import PDFront
from kvtwin.sim.replay.clock.progress import ReplayClock
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.connector_tiers import connector_tiers, link_copies
from kvtwin.sim.replay.pd_router import PDRouter
from kvtwin.sim.replay.pd_sides import PDSide, pd_sides
from kvtwin.sim.calibration.file import Calibration
from kvtwin.sim.scenario.deployment import Deployment
from kvtwin.sim.scenario.disaggregation import Disaggregation
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.scenario.speculative import SpeculativeConfig


def step_cost(cost_model: CostModel, output: SchedulerOutput) -> StepCost:
    """The cost model's prediction for one scheduled batch. A decode is costed by the
    context it ends at; a prefill chunk by its length and start. With drafts
    (docs/semantics.md#speculative-decoding) a row that verifies them is a verify step
    (decode kernel, ``1 + drafts`` queries), and the draft head, if any, drafts for every
    request that samples, from its context after the step."""
    scheduled = output.num_scheduled_tokens
    computed = output.num_computed_tokens
    spec = output.scheduled_spec_decode_tokens
    decode_ends: list[int] = []
    prefill_items: list[tuple[int, int]] = []
    verify_items: list[tuple[int, int]] = []
    for (request_id, n), c in zip(scheduled.items(), computed):
        if n == 1:
            decode_ends.append(c + 1)
            continue
        if spec is not None:
            drafts = spec.get(request_id)
            if drafts and n == 1 + len(drafts):
                verify_items.append((n, c))
                continue
        prefill_items.append((n, c))
    draft_ends = None
    if spec is not None and cost_model.draft_head is not None:
        sampling = output.num_output_tokens
        draft_ends = [c + n for (request_id, n), c in zip(scheduled.items(), computed) if request_id in sampling]
    return cost_model.split_step_cost(decode_ends, prefill_items, draft_ends, verify_items)


class CostModelExecutor:
    """The simulator's model executor: predicted step time, synthetic output tokens.

    Works from the scheduler output alone. Output token ids are unique per request and
    position, so decoded blocks are never shared by accident; what later turns reuse of
    earlier outputs comes from the trace's own prompt identity.

    With speculative decoding (``acceptance``, a seeded ``AcceptanceModel``) a request that
    verifies drafts samples ``1 + accepted`` tokens, ``accepted`` drawn per verify step
    (drafts padded onto an admission are never accepted, as they are placeholders); a
    synchronous engine also gets ``k`` draft ids for every request that sampled (an
    asynchronous scheduler makes its own placeholders).
    """

    def __init__(self, cost_model: CostModel, acceptance: AcceptanceModel | None = None,
                 synchronous_drafts: bool = False):
        self.cost_model = cost_model
        self._token_base: dict[str, int] = {}
        # How each layer class's decodes attend (None: not in a closed form windows know).
        self._key_shapes = cost_model.decode_key_shapes()
        self.acceptance = acceptance
        self._drafts = [-1] * acceptance.config.num_speculative_tokens if acceptance is not None else []
        self.synchronous_drafts = synchronous_drafts and acceptance is not None

    def execute(self, output: SchedulerOutput) -> Execution:
        if not output.num_scheduled_tokens:
            return Execution({}, 0.0)
        cost = step_cost(self.cost_model, output)
        if output.scheduled_spec_decode_tokens is not None and self.acceptance is not None:
            sampled = self.sample_verified(output)
            drafts = None
            if self.synchronous_drafts:
                proposed = self._drafts
                drafts = {request_id: proposed for request_id in output.num_output_tokens}
            return Execution(sampled, cost.total_s, cost, drafts)
        return Execution(self.sample(output), cost.total_s, cost)

    def sample_verified(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """``sample`` with drafts: each sampling request's ``1 + accepted`` tokens, in order."""
        acceptance = self.acceptance
        assert acceptance is not None and output.scheduled_spec_decode_tokens is not None
        spec = output.scheduled_spec_decode_tokens
        admitted = {r.req_id for r in output.scheduled_new_reqs} if output.scheduled_new_reqs else ()
        sampled = {}
        for request_id, num_output_tokens in output.num_output_tokens.items():
            base = self._base_of(request_id)
            drafts = spec.get(request_id)
            accepted = acceptance.num_accepted(len(drafts)) if drafts and request_id not in admitted else 0
            first = base + num_output_tokens
            sampled[request_id] = list(range(first, first + 1 + accepted))
        return sampled

    def sample(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """The token each request of ``output.num_output_tokens`` samples."""
        sampled = {}
        for request_id, num_output_tokens in output.num_output_tokens.items():
            sampled[request_id] = [self._base_of(request_id) + num_output_tokens]
        return sampled

    def _base_of(self, request_id: str) -> int:
        """The request's token base: its tokens are ``base + index`` (a request seen first
        gets the next base, so the ids depend only on the order of first sampling)."""
        bases = self._token_base
        base = bases.get(request_id)
        if base is None:
            base = bases[request_id] = (len(bases) + 1) << 24
        return base

    # -- decode windows (``sim/core/decode_window.py``: ``WindowPricing``) ----------------

    def prices_decode_windows(self) -> bool:
        """Whether a decode window may stand in for executing its batches: their seconds
        have a closed form (``decode_step_cost``) and their tokens are ``token_bases``."""
        return self._key_shapes is not None

    def decode_step_cost(self, num_decodes: int, context_ends_sum: int,
                         prefill_items: list[tuple[int, int]] | None = None) -> StepCost:
        """What ``execute`` predicts for a batch of ``num_decodes`` decodes (and ``prefill_items``)."""
        return self.cost_model.decode_step_cost(num_decodes, context_ends_sum, prefill_items)

    def decode_key_shapes(self) -> list[tuple[int, int]] | None:
        """How each layer class's decodes attend, where a sum of contexts does not price
        them (windowed or recurrent layers); None where it does."""
        if self.cost_model.decodes_cost_by_context_sum:
            return None
        return self._key_shapes

    def decode_step_cost_by_keys(self, num_decodes: int, attended_keys: list[int],
                                 prefill_items: list[tuple[int, int]] | None = None) -> StepCost:
        """``decode_step_cost`` given the keys attended per layer class (``decode_key_shapes``)."""
        return self.cost_model.decode_step_cost_by_keys(num_decodes, attended_keys, prefill_items)

    def token_bases(self, request_ids: list[str]) -> list[int | None]:
        """Each request's token base: its output ``k`` is sampled as ``base + k``."""
        bases = self._token_base
        return [bases.get(request_id) for request_id in request_ids]


def window_pricing(executor: ModelExecutor) -> WindowPricing | None:
    """``executor`` where it prices decode windows in closed form; None for any other
    (a device's, a recording's): their batches are scheduled one by one."""
    if isinstance(executor, CostModelExecutor) and executor.prices_decode_windows():
        return executor
    return None


@dataclass
class ReplayResult:
    requests: pa.Table
    steps: pa.Table
    summary: pa.Table
    end_time_s: float
    # One row per data-parallel replica (``summarize_replicas``; one row with one replica).
    replicas: pa.Table | None = None


def run_replay(plan: Plan, trace: pa.Table, *, deployment: Deployment = Deployment(),
               efficiency: Efficiency = Efficiency(), slo: SLO = SLO(), time_limit_s: float | None = None,
               on_progress: Callable[[ReplayClock], None] | None = None,
               offload: ResolvedOffload | None = None, decode_windows: bool = True,
               disaggregation: Disaggregation | None = None,
               speculative: SpeculativeConfig = SpeculativeConfig(),
               calibration: Calibration | None = None) -> ReplayResult:
    """``kvtwin replay``: the plan and trace with the cost model as the clock; one engine,
    cost model and executor per replica of ``deployment``, each with the offload tiers
    ``offload`` sizes (None: none). With ``disaggregation`` the replicas are its prefill
    and decode replicas instead (``deployment`` is then unused).
    ``speculative`` (enabled: the plan's scheduler drafts, ``ResolvedScenario.plan``) gives
    each replica's executor its acceptance draws (seed plus the replica's index) and its
    cost model the draft head. ``calibration``: the clock's, whose band on each p99 the
    summary then carries (docs/capacity.md#the-band)."""
    pd_sides_run = disaggregation is not None and disaggregation.has_data_parallel_sides
    # With DP sides the plan is the prefill side's (``ResolvedScenario.plan``): its ranks are
    # the side's, not a DP group of the whole run.
    dp = None if pd_sides_run else data_parallel(
        plan, deployment, plan_cost_model(plan, efficiency), offload=offload is not None,
        disaggregation=disaggregation is not None, speculative=speculative.enabled)
    num_replicas = (disaggregation.num_replicas if disaggregation is not None
                    else dp.ranks if dp is not None else deployment.replicas)
    # Refused when the scenario is resolved (docs/architecture.md#features-and-their-combinations).
    assert disaggregation is None or not speculative.enabled, "P/D with speculative decoding is not modelled"
    if pd_sides_run:
        assert disaggregation is not None
        # Each side's engines run its own plan; a MoE side's ranks step together.
        sides = pd_sides(plan, disaggregation, lambda planned: plan_cost_model(planned, efficiency))
        side_executors: list[ModelExecutor] = [
            CostModelExecutor(side.lockstep.moe.rank_model if side.lockstep is not None and side.lockstep.moe is not None
                              else plan_cost_model(side.plan, efficiency))
            for side in sides for _ in range(side.engines)]
        return run_with_executor(plan, trace, side_executors, slo=slo, time_limit_s=time_limit_s,
                                 on_progress=on_progress, decode_windows=decode_windows,
                                 disaggregation=disaggregation, client_overhead_s=efficiency.client_overhead_s,
                                 calibration=calibration, sides=sides)
    _require_pools_fit(plan, num_replicas)
    # A DP MoE group's ranks price their steps without the routed experts; the group adds
    # its MoE part (docs/clock.md#moe-under-data-parallelism).
    moe_group = dp.lockstep.moe if dp is not None and dp.lockstep is not None else None
    executors = [spec_executor(plan, efficiency, speculative, replica) if speculative.enabled
                 else CostModelExecutor(moe_group.rank_model if moe_group is not None
                                        else plan_cost_model(plan, efficiency)) for replica in range(num_replicas)]
    return run_with_executor(plan, trace, executors, router=dp.router if dp is not None else deployment.router,
                             slo=slo, time_limit_s=time_limit_s, on_progress=on_progress, offload=offload,
                             decode_windows=decode_windows, disaggregation=disaggregation,
                             client_overhead_s=efficiency.client_overhead_s, calibration=calibration,
                             lockstep=dp.lockstep if dp is not None else None)


def _require_pools_fit(plan: Plan, num_replicas: int) -> None:
    """Refuse a run whose pools would not fit in memory before any is built (commands
    check it sooner, naming the scenario's setting: ``ResolvedScenario.require_host_memory``)."""
    if num_replicas > 1:
        require_host_memory(plan.num_blocks, num_replicas, field="replicas", got=num_replicas)
    else:
        require_host_memory(plan.num_blocks, num_replicas, field="num_blocks", got=plan.num_blocks)


def plan_cost_model(plan: Plan, efficiency: Efficiency = Efficiency(), draft_head: DraftHead | None = None) -> CostModel:
    """The plan's cost model: the whole model on one TP group, or with pipeline stages
    each stage on its own (``PipelineCostModel``, docs/clock.md#pipeline-parallelism)."""
    eng = plan.engine
    if eng.pipeline_parallel_size > 1:
        assert draft_head is None, "drafts with pipeline parallelism are refused (features.REFUSED)"
        return PipelineCostModel(plan.model, plan.gpu, plan.layers.specs, plan.layers.layer_index,
                                 pipeline_parallel_size=eng.pipeline_parallel_size,
                                 tensor_parallel_size=eng.tensor_parallel_size,
                                 async_scheduling=eng.async_scheduling, efficiency=efficiency)
    return CostModel(plan.model, plan.gpu, plan.layers.specs, tensor_parallel_size=eng.tensor_parallel_size,
                     async_scheduling=eng.async_scheduling, efficiency=efficiency, draft_head=draft_head)


def spec_executor(plan: Plan, efficiency: Efficiency, speculative: SpeculativeConfig, replica: int) -> CostModelExecutor:
    """A replica's executor with speculative decoding: its acceptance draws and draft head."""
    k = speculative.num_speculative_tokens
    if plan.engine.scheduler.num_speculative_tokens != k:
        raise ValueError("the plan's scheduler must draft as speculative says (ResolvedScenario.plan)")
    config = speculative.acceptance_config()
    acceptance = AcceptanceModel(type(config)(k, config.acceptance, config.seed + replica))
    return CostModelExecutor(plan_cost_model(plan, efficiency, speculative.draft_head), acceptance,
                             synchronous_drafts=not plan.engine.async_scheduling)


def run_with_executor(plan: Plan, trace: pa.Table, executors: Sequence[ModelExecutor], *,
                      router: str = Deployment.router, slo: SLO = SLO(), time_limit_s: float | None = None,
                      env: simpy.Environment | None = None, on_progress: Callable[[ReplayClock], None] | None = None,
                      offload: ResolvedOffload | None = None, decode_windows: bool = True,
                      disaggregation: Disaggregation | None = None, client_overhead_s: float = 0.0,
                      calibration: Calibration | None = None,
                      lockstep: LockstepSettings | None = None,
                      sides: tuple[PDSide, PDSide] | None = None) -> ReplayResult:
    """Any clock: the plan's engine replays the trace, each step lasting what its replica's
    executor says (predicted, measured on a device, or replayed from a recording); ``env``
    is the SimPy environment (a ``simpy.rt.RealtimeEnvironment`` paces arrivals in real
    time).

    ``executors`` holds one executor per replica: the run has as many replicas as
    executors, behind the router named ``router`` (``Deployment.router``), or with
    ``disaggregation`` its prefill replicas (the first) and decode replicas behind the P/D
    front (module docstring). ``offload`` gives each replica its offload tiers (module
    docstring). ``decode_windows`` False turns decode windows off
    (``sim/core/decode_window.py``; the results are the same, only slower).
    ``client_overhead_s`` is the time outside the engine a client also sees: the
    client-side columns beside the server's, and the SLO judged on them (``client_side.py``).
    ``calibration``: as in ``run_replay``. ``lockstep``: the replicas are the ranks of one
    data-parallel group that steps together (``data_parallel.py``). ``sides``: with
    ``disaggregation``, its two sides when either is a DP engine (``pd_sides.py``): each
    side's engines run its plan, and a MoE side's ranks are a lockstep group of their own."""
    kv_cache_config = plan.require_fits()
    eng = plan.engine
    env = env if env is not None else simpy.Environment()  # the transfers' clock is the replay's
    if sides is None:
        _require_pools_fit(plan, len(executors))
        tiers = connector_tiers(plan, env, len(executors), offload=offload, disaggregation=disaggregation)
        engines = [EngineCore(kv_cache_config, eng.scheduler, eng.cache, tier) for tier in tiers]
        groups = [DPGroup(lockstep, len(engines))] if lockstep is not None else []
    else:
        assert lockstep is None and disaggregation is not None, "a P/D side's group comes with its side"
        _require_pools_fit(max((side.plan for side in sides), key=lambda p: p.num_blocks), len(executors))
        tiers, engines = [], []
        for side in sides:
            side_tiers = connector_tiers(side.plan, env, side.engines, disaggregation=disaggregation)
            side_config = side.plan.require_fits()
            tiers += side_tiers
            engines += [EngineCore(side_config, eng.scheduler, eng.cache, tier) for tier in side_tiers]
        groups = [DPGroup(side.lockstep, side.engines, side.first) for side in sides if side.lockstep is not None]
        assert len(engines) == len(executors), "one executor per engine of each side"
    roles, label = None, router
    if disaggregation is not None:
        roles = ["prefill"] * disaggregation.prefill_engines + ["decode"] * disaggregation.decode_engines
        label = f"pd:{disaggregation.prefill_router}/{disaggregation.decode_router}"
    metrics = MetricsRecorder(len(kv_cache_config.groups), len(engines), offload=offload, roles=roles,
                              num_speculative_tokens=eng.scheduler.num_speculative_tokens,
                              moe_group=any(group.settings.moe is not None for group in groups))
    # A lockstep group's ranks schedule batch by batch: its forwards are collectives that
    # pair every rank's k-th batch (docs/semantics.md#asynchronous-scheduling-in-a-group).
    windows = decode_windows and not groups
    replicas = [Replica(engine, executor, window_pricing(executor) if windows else None)
                for engine, executor in zip(engines, executors)]
    cluster = Cluster(env, replicas, _front(plan, router, engines, tiers, disaggregation), metrics,
                      time_limit_s=time_limit_s, on_progress=on_progress, dp_groups=groups)
    end_s = cluster.run(arrivals_from_trace(trace))
    tables = run_tables(metrics, end_s, RunSettings(
        slo, trace, label, retention_label(eng.cache.prefix_cache_retention_interval), client_overhead_s,
        offload=offload.describe() if offload is not None else None, disaggregation=disaggregation,
        calibration=calibration, dp_groups=tuple(groups)))
    return ReplayResult(tables.requests, tables.steps, tables.summary, end_s, tables.replicas)


def _front(plan: Plan, router: str, engines: Sequence[EngineCore], tiers: Sequence[ConnectorTier | None],
           disaggregation: Disaggregation | None) -> Front:
    """What sits in front of ``engines``: the router named ``router``, or with
    ``disaggregation`` the P/D front over its prefill and decode engines and their tiers."""
    if disaggregation is None:
        return RoutedFront(make_router(router, engines))
    num_prefill = disaggregation.prefill_engines
    pairs = PDRouter(engines[:num_prefill], engines[num_prefill:], disaggregation.prefill_router,
                     disaggregation.decode_router)
    return PDFront(tiers, pairs, copies=link_copies(plan))


class RecordedClockExecutor(CostModelExecutor):
    """The simulator on another run's clock: step ``i`` lasts the ``i``-th recorded duration
    (e.g. a device run's measured ones), tokens as the cost-model executor makes them. Steps
    past the recording (the runs diverged) take the cost model's prediction."""

    def prices_decode_windows(self) -> bool:
        return False  # every step takes its own recorded duration

    def __init__(self, cost_model: CostModel, durations_s: list[float]):
        super().__init__(cost_model)
        self.durations_s = durations_s
        self.num_steps = 0

    def execute(self, output: SchedulerOutput) -> Execution:
        execution = super().execute(output)
        if output.num_scheduled_tokens:
            if self.num_steps < len(self.durations_s):
                execution.duration_s = self.durations_s[self.num_steps]
            self.num_steps += 1
        return execution
