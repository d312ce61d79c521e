"""The engine step: schedule → execute → update, the one function every clock drives.

DESIGN.md "One core, two clocks". The lockstep runner (one step per tick, a scripted
model), the SimPy replay (a cost model predicts each step's seconds) and the GPU executor
(kernels run and are timed) all call ``EngineCore.step`` with their own ``ModelBackend``;
nothing here knows which clock is running.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler import Scheduler, SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig


@dataclass
class Execution:
    """What running one batch produced: the tokens sampled per request, and how long it took
    (predicted by a cost model, measured on a device, or one tick on the step clock)."""

    sampled: dict[str, list[int]]
    duration_s: float = 0.0
    cost: object | None = None  # the backend's breakdown of duration_s, if it has one


class Backend(Protocol):
    """Runs one scheduled batch. ``ready_to_sample`` are the scheduled requests whose
    computed tokens caught up with all their tokens: only they sample a token."""

    def execute(self, output: SchedulerOutput, ready_to_sample: list[Request]) -> Execution:
        ...


@dataclass
class StepResult:
    output: SchedulerOutput
    finished: list[Request]
    execution: Execution


_IDLE = Execution({}, 0.0)


class EngineCore:
    def __init__(self, kv_cache_config: KVCacheConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig = CacheConfig()):
        self.scheduler = Scheduler(kv_cache_config, scheduler_config, cache_config)
        self.kv_cache_manager = self.scheduler.kv_cache_manager
        self.rejected: list[tuple[Request, str]] = []

    def add_request(self, request: Request) -> bool:
        """Queue a request, or reject it (counted, with a reason) if it can never run."""
        max_model_len = self.scheduler.config.max_model_len
        if request.num_prompt_tokens >= max_model_len:
            return self._reject(request, f"prompt of {request.num_prompt_tokens} tokens leaves no room for "
                                         f"output within max_model_len {max_model_len}")
        if request.max_tokens <= 0:
            return self._reject(request, f"max_tokens must be positive, got {request.max_tokens}")
        total_tokens = request.num_prompt_tokens + request.max_tokens
        if total_tokens > max_model_len:
            return self._reject(request, f"prompt + output = {total_tokens} tokens exceeds max_model_len "
                                         f"{max_model_len}")
        # vLLM would keep such a request at the head of the queue forever.
        kvm = self.kv_cache_manager
        needed = kvm.coordinator.get_num_blocks_to_allocate(request.request_id, total_tokens, kvm.empty_blocks, 0,
                                                            total_tokens, apply_admission_cap=True)
        usable = kvm.block_pool.num_gpu_blocks - 1
        if needed > usable:
            return self._reject(request, f"needs {needed} KV blocks, more than the pool's {usable}")
        self.scheduler.add_request(request)
        return True

    def _reject(self, request: Request, reason: str) -> bool:
        request.status = RequestStatus.REJECTED
        self.rejected.append((request, reason))
        return False

    def step(self, backend: Backend) -> StepResult:
        output = self.scheduler.schedule()
        if not output.num_scheduled_tokens:
            return StepResult(output, [], _IDLE)
        requests = self.scheduler.requests
        # A request samples only once its computed tokens catch up with all it has:
        # a partial prefill chunk (or part of a recompute) samples nothing.
        ready = [r for rid in output.num_scheduled_tokens
                 if (r := requests[rid]).num_computed_tokens >= r.num_tokens]
        execution = backend.execute(output, ready)
        finished = self.scheduler.update_from_output(output, execution.sampled)
        return StepResult(output, finished, execution)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()
