"""``validate`` check 3: does the planned memory budget hold on the real device?

The planner sizes the KV pool from a GPU preset's memory and its estimates of weights,
activations, CUDA graphs and non-torch memory (``sim/planner/memory_budget.py``). Here
the same budget is applied to the device's real total memory, then the weights (random,
real size: the executed layers plus a ballast for what the model-shaped pass does not
run, such as unrouted experts) and the KV pool at the planned ``num_blocks`` are
allocated, and a profiling step runs at ``max_num_batched_tokens`` (vLLM's profile run:
the tokens spread over up to ``max_num_seqs`` prefills, every request sampling).
Measured peaks come from torch's allocator (``max_memory_allocated``) and the device's
free memory (``mem_get_info``); a measured peak above the plan is an out-of-memory risk.
"""

from __future__ import annotations

import dataclasses

import torch

from kvtwin.executor.device_executor import DeviceExecutor
from kvtwin.executor.device_replay import ExecutorOptions, build_executor
from kvtwin.executor.inputs import BatchInputs
from kvtwin.executor.verdicts import Verdict
from kvtwin.kernels.layout import slot_mapping
from kvtwin.sim.core.spec import MambaSpec, cdiv
from kvtwin.sim.planner.memory_budget import weights_bytes_per_gpu
from kvtwin.sim.planner.plan import plan as make_plan
from kvtwin.sim.scenario.resolve import ResolvedScenario


def profile_inputs(executor: DeviceExecutor, num_tokens: int, num_reqs: int) -> BatchInputs:
    """A batch of ``num_reqs`` fresh prefills sharing ``num_tokens`` tokens, each with its
    own blocks, every request sampling; block ids wrap around the pool (contents do not
    matter, only sizes)."""
    config, device = executor.config, executor.device
    num_reqs = max(1, min(num_reqs, num_tokens))
    lens = [num_tokens // num_reqs + (1 if i < num_tokens % num_reqs else 0) for i in range(num_reqs)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    usable = config.num_blocks - 1
    next_block = 0
    host_tables, block_tables, slot_mappings = [], [], []
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    for group in config.groups:
        bs = group.spec.block_size
        rows = []
        for n in lens:
            width = cdiv(n, bs)
            if isinstance(group.spec, MambaSpec):
                row = [0] * (width - 1) + [next_block % usable + 1]
                next_block += 1
            else:
                row = [(next_block + j) % usable + 1 for j in range(width)]
                next_block += width
            rows.append(row)
        host_tables.append(rows)
        width = max(len(r) for r in rows)
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)
        block_tables.append(table)
        slot_mappings.append(None if isinstance(group.spec, MambaSpec)
                             else slot_mapping(table, seq_lens, query_start_loc, bs))
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    token_ids = torch.remainder(positions * 7919 + 17, executor.shape.vocab_size)
    sample_rows = torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int64, device=device)
    return BatchInputs([f"profile-{i}" for i in range(num_reqs)], [0] * num_reqs, lens, token_ids, positions,
                       query_start_loc, seq_lens, host_tables, block_tables, slot_mappings, sample_rows,
                       [(f"profile-{i}", 0) for i in range(num_reqs)])


def profile_step(executor: DeviceExecutor, num_tokens: int, num_reqs: int) -> torch.Tensor:
    """Run one profiling forward pass; returns its logits."""
    inputs = profile_inputs(executor, num_tokens, num_reqs)
    return executor.model.forward(inputs, executor.pool, executor.kernels)


def check_memory(out, resolved: ResolvedScenario, options: ExecutorOptions) -> None:
    """Check 3 on a CUDA device; adds rows and a verdict to ``out`` (a ``Validation``)."""

    name = "memory"
    props = torch.cuda.get_device_properties(0)
    total = int(props.total_memory)
    gpu = dataclasses.replace(resolved.gpu, memory_bytes=total)
    planned = make_plan(resolved.model, gpu, resolved.engine)
    budget = planned.memory
    out.row(name, "device", "total_memory_bytes", resolved.gpu.memory_bytes, total,
            total - resolved.gpu.memory_bytes, None, f"{props.name}; the preset's figure vs the device's")
    if not planned.fits:
        out.verdicts.append(Verdict(name, "fail", f"memory: FAIL — on this device's {total / 2**30:,.1f} GiB the plan "
                                    "does not fit one request of max_model_len"))
        return
    out.row(name, "plan", "num_blocks", resolved.plan().num_blocks, planned.num_blocks, None, None,
            "planned on the preset's memory vs on the device's")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start_allocated = torch.cuda.memory_allocated()
    executor = build_executor(planned, dataclasses.replace(options, scaled=False, audit=False))
    weights_target = weights_bytes_per_gpu(planned.model, tp=planned.engine.tensor_parallel_size)
    ballast = None
    if weights_target > executor.model.nbytes:
        ballast = torch.empty(weights_target - executor.model.nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    after_alloc = torch.cuda.memory_allocated()
    eng = planned.engine
    profile_step(executor, eng.max_num_batched_tokens, eng.max_num_seqs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start_allocated
    free, _ = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    non_torch = max(0, (total - free) - reserved)
    kv_planned = planned.num_blocks * planned.bytes_per_block
    activation = peak - (after_alloc - start_allocated)
    predicted_peak = budget.weights_bytes + kv_planned + budget.activation_peak_bytes
    rows = [
        ("weights_bytes", budget.weights_bytes, executor.model.nbytes + (ballast.numel() if ballast is not None else 0),
         "executed layers plus ballast"),
        ("kv_pool_bytes", kv_planned, executor.pool.nbytes, f"{planned.num_blocks:,} blocks"),
        ("activation_peak_bytes", budget.activation_peak_bytes, activation,
         f"profiling step at {eng.max_num_batched_tokens:,} tokens, {eng.max_num_seqs} requests"),
        ("peak_allocated_bytes", predicted_peak, peak, "torch's max_memory_allocated"),
        ("non_torch_bytes", budget.non_torch_bytes, non_torch, "device used minus torch reserved"),
    ]
    for metric, expected, observed, detail in rows:
        out.row(name, "device", metric, expected, observed, observed - expected, None, detail)
    requested = budget.requested_bytes
    used = peak + non_torch + budget.cuda_graph_bytes
    fits = used <= requested
    risk = peak > predicted_peak
    out.row(name, "device", "fits_gpu_memory_utilization", requested, used, used - requested, fits,
            "peak + non-torch + planned CUDA graphs vs gpu_memory_utilization x total")
    out.row(name, "device", "oom_risk", predicted_peak, peak, peak - predicted_peak, not risk,
            "measured peak above the plan" if risk else "measured peak within the plan")
    del executor, ballast
    torch.cuda.empty_cache()
    status = "pass" if fits and not risk else "fail"
    out.verdicts.append(Verdict(name, status, (
        f"memory: {'pass' if status == 'pass' else 'FAIL'} — {planned.num_blocks:,} blocks planned on "
        f"{total / 2**30:,.1f} GiB; measured peak {peak / 2**30:,.2f} GiB vs planned {predicted_peak / 2**30:,.2f} "
        f"GiB (activations {activation / 2**30:,.2f} vs {budget.activation_peak_bytes / 2**30:,.2f}), "
        f"non-torch {non_torch / 2**30:,.2f} GiB; {'fits' if fits else 'does NOT fit'} "
        f"gpu_memory_utilization {budget.gpu_memory_utilization:g}"
        + ("; OUT-OF-MEMORY RISK: the measured peak exceeds the plan" if risk else ""))))
