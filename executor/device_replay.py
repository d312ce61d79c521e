"""Executor mode: a plan and a trace run on a device, with a measured or a wall clock.

The same ``run_with_executor`` as ``kvtwin replay`` (SimPy arrivals, the engine's step
loop, the metrics recorder), with a ``DeviceExecutor`` in place of the cost model:

- ``measured``: simulated time advances by each step's measured device time, so the
  scheduler's decisions are deterministic given the timings and runs are comparable;
- ``wall``: a ``simpy.rt.RealtimeEnvironment`` paces arrivals in real time (not strict:
  a step longer than the gap to the next event delays it rather than failing).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import simpy
import simpy.rt
import torch

from kvtwin.executor.device_executor import DeviceExecutor, ExecutorState, Faults
from kvtwin.executor.shapes import ModelShape, model_shape, pool_page_bytes
from kvtwin.kernels.backends import Backend, select_backend
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.replay.run import ReplayResult, plan_cost_model, run_with_executor

CLOCKS = ("measured", "wall")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ExecutorOptions:
    device: str = "cpu"
    clock: str = "measured"
    scaled: bool | None = None  # None: scaled on CPU, real size on a GPU
    layers_per_group: int = 2
    seed: int = 0
    audit: bool = True
    faults: Faults = Faults()

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError("--device", f"one of {', '.join(DEVICES)}", self.device)
        if self.clock not in CLOCKS:
            raise ConfigError("--clock", f"one of {', '.join(CLOCKS)}", self.clock)

    @property
    def is_scaled(self) -> bool:
        return self.device == "cpu" if self.scaled is None else self.scaled


@dataclass
class ExecutorRun:
    result: ReplayResult
    state: ExecutorState
    shape: ModelShape
    kernels: Backend


def torch_dtype(plan: Plan, options: ExecutorOptions) -> torch.dtype:
    """fp32 for the scaled CPU model (exact enough to compare), the model's 16-bit type on a GPU."""
    if options.device == "cpu":
        return torch.float32
    return torch.float16 if plan.model.dtype == "float16" else torch.bfloat16


def require_device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", "a CUDA device (torch sees none here); use --device cpu", device)
    return torch.device(device)


# A scaled CPU pool larger than this is a scenario meant for a GPU: say so before allocating.
MAX_CPU_POOL_BYTES = 4 << 30


def check_pool_fits(plan: Plan, options: ExecutorOptions) -> int:
    """The executor's KV pool bytes for ``plan``; on a CPU, refuse a pool it cannot hold."""
    config = plan.require_fits()
    dtype = torch_dtype(plan, options)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    shape = _shape(plan, options, dtype_bytes)
    pool_bytes = config.num_blocks * sum(pool_page_bytes(shape, config, dtype_bytes))
    if options.device == "cpu" and pool_bytes > MAX_CPU_POOL_BYTES:
        raise ConfigError("engine.kv_cache_memory_bytes",
                          f"a KV pool a CPU can hold: the plan's {config.num_blocks:,} blocks need "
                          f"{pool_bytes / (1 << 30):,.1f} GiB even in the scaled model (limit "
                          f"{MAX_CPU_POOL_BYTES >> 30} GiB); set a smaller kv_cache_memory_bytes in the scenario's "
                          "[engine] table, or use --device cuda", plan.num_blocks)
    return pool_bytes


def _shape(plan: Plan, options: ExecutorOptions, dtype_bytes: int) -> ModelShape:
    return model_shape(plan.model, plan.require_fits(), plan.layers.layer_index,
                       tensor_parallel_size=plan.engine.tensor_parallel_size, scaled=options.is_scaled,
                       layers_per_group=options.layers_per_group, dtype_bytes=dtype_bytes)


def build_executor(plan: Plan, options: ExecutorOptions, *, efficiency: Efficiency = Efficiency()
                   ) -> DeviceExecutor:
    config = plan.require_fits()
    device = require_device(options.device)
    dtype = torch_dtype(plan, options)
    check_pool_fits(plan, options)
    shape = _shape(plan, options, torch.empty((), dtype=dtype).element_size())
    return DeviceExecutor(shape, config, device=device, dtype=dtype, kernels=select_backend(device.type),
                          seed=options.seed, cost_model=plan_cost_model(plan, efficiency), audit=options.audit,
                          faults=options.faults)


def run_executor(plan: Plan, trace: pa.Table, options: ExecutorOptions = ExecutorOptions(), *,
                 efficiency: Efficiency = Efficiency(), slo: SLO = SLO(), time_limit_s: float | None = None,
                 executor: DeviceExecutor | None = None) -> ExecutorRun:
    executor = executor or build_executor(plan, options, efficiency=efficiency)
    env = simpy.rt.RealtimeEnvironment(strict=False) if options.clock == "wall" else simpy.Environment()
    result = run_with_executor(plan, trace, [executor], slo=slo, time_limit_s=time_limit_s, env=env)
    return ExecutorRun(result, executor.state, executor.shape, executor.kernels)
