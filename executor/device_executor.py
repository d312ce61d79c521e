"""The device model executor: the engine's ``ModelExecutor`` with real paged kernels.

``DeviceExecutor.execute(output)`` is all the engine sees, exactly as with the cost model:
the same ``EngineCore`` step loop (synchronous or two batches in flight) drives it, from
the lockstep clock, the SimPy workload or a wall clock. Per output it

1. keeps the block tables (``block_tables.BlockTables``) and each request's tokens;
2. moves align-mode recurrent states to the column the step writes (vLLM's pre-copy);
3. builds the step's inputs (``inputs.build_inputs``) and runs the forward pass
   (``model.RandomModel``) through the pool (``kv_pool.KVPool``), timed on the device;
4. returns the scripted output tokens (``tokens.output_token_id``) and keeps the logits
   of every sampled position for the checks.

The optional ``BlockAudit`` checks every block a step reads against what was last written
into it. ``Faults`` exist for tests only: each breaks one rule the way a buggy executor
or pool would, so the checks can be shown to catch it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvtwin.executor.audit import BlockAudit, Finding
from kvtwin.executor.block_tables import NULL_BLOCK, BlockTables, StateCopy
from kvtwin.executor.inputs import BatchInputs, build_inputs
from kvtwin.executor.kv_pool import KVPool
from kvtwin.executor.model import RandomModel
from kvtwin.executor.shapes import ModelShape, pool_page_bytes
from kvtwin.executor.tokens import RequestTokens, output_token_id
from kvtwin.kernels.backends import Backend
from kvtwin.kernels.reference import first_visible_key
from kvtwin.sim.core.engine import Execution
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import FullAttentionSpec, KVCacheConfig, MambaSpec
from kvtwin.sim.replay.cost_model import CostModel, StepCost
from kvtwin.sim.replay.run import step_cost

# Logits kept per sampled position: enough that a wrong block moves some of them.
KEPT_LOGITS = 256


@dataclass(frozen=True)
class Faults:
    """Test-only breakage. ``corrupt_table``: the first admission with a prefix hit gets a
    wrong block in place of its hit's last block, in the first group where that is real. ``stale_block``: the
    first block handed to a request that held another request's tokens is not rewritten.
    ``drop_state_copy``: the first recurrent-state copy is skipped."""

    corrupt_table: bool = False
    stale_block: bool = False
    drop_state_copy: bool = False


@dataclass
class StepRecord:
    """One executed batch: its shape, the measured seconds and the cost model's prediction."""

    step: int
    num_requests: int
    num_tokens: int
    num_decode_tokens: int
    num_prefill_tokens: int
    device_s: float
    host_s: float
    predicted: StepCost | None = None


@dataclass
class ExecutorState:
    """What a run leaves for the checks."""

    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # (request, output index)
    sampled_at: dict[tuple[str, int], int] = field(default_factory=dict)  # -> step
    steps: list[StepRecord] = field(default_factory=list)
    faults_fired: list[str] = field(default_factory=list)
    preemptions: list[tuple[int, str]] = field(default_factory=list)  # (steps executed so far, request)
    findings: list[Finding] = field(default_factory=list)  # the block audit's, in step order

    def first_finding(self, request_id: str) -> str | None:
        finding = next((f for f in self.findings if f.request_id == request_id), None)
        return finding.describe() if finding is not None else None


class DeviceExecutor:
    def __init__(self, shape: ModelShape, config: KVCacheConfig, *, device: torch.device, dtype: torch.dtype,
                 kernels: Backend, seed: int = 0, cost_model: CostModel | None = None, audit: bool = True,
                 faults: Faults = Faults()):
        self.shape = shape
        self.config = config
        self.device = device
        self.kernels = kernels
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        self.model = RandomModel(shape, device=device, dtype=dtype, seed=seed)
        self.pool = KVPool(shape, config.num_blocks, pool_page_bytes(shape, config, dtype_bytes), dtype=dtype,
                           device=device)
        self.tables = BlockTables(config)
        self.tokens: dict[str, RequestTokens] = {}
        self.cost_model = cost_model
        self.audit = BlockAudit(len(config.groups), config.num_blocks) if audit else None
        self.faults = faults
        self._armed = {name for name in ("corrupt_table", "stale_block", "drop_state_copy") if getattr(faults, name)}
        self.state = ExecutorState()
        if self.audit is not None:
            self.state.findings = self.audit.findings
        self.num_steps = 0
        self._state_layers = {gid: [layer.name for layer in shape.layers_of_group(gid)]
                              for gid in self.tables.align_groups}
        self._timed = device.type == "cuda"

    # -- the protocol ----------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> Execution:
        host_start = time.perf_counter()
        new_ids = self.tables.apply(output)
        self.state.preemptions += [(self.num_steps, rid) for rid in output.preempted]
        for rid in output.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in output.scheduled_new_reqs:
            if new.req_id not in self.tokens:
                self.tokens[new.req_id] = RequestTokens(new.req_id, new.prompt)
        if not output.num_scheduled_tokens:
            return Execution({}, 0.0)
        self.num_steps += 1
        step = self.num_steps
        if "corrupt_table" in self._armed:
            self._corrupt_table(output)
        copies = self._performed(self.tables.state_copies(output, new_ids))
        inputs = build_inputs(output, self.tables, self.tokens, self.config, self.device,
                              vocab_size=self.shape.vocab_size)
        skipped_writes = self._stale_block(inputs) if "stale_block" in self._armed else []
        if self.audit is not None:
            for c in copies:
                self.audit.copied(c.group_id, c.src_block, c.dst_block)
            self._record_kv_writes(inputs, skipped_writes)
            self._check_reads(step, inputs)
        host_s = time.perf_counter() - host_start
        device_s, logits = self._run(inputs, copies)
        if self.audit is not None:
            self._record_state_writes(inputs)
        self.tables.advance(output)
        sampled = {}
        for row, (rid, index) in enumerate(inputs.samples):
            sampled[rid] = [output_token_id(rid, index)]
            self.state.logits[(rid, index)] = logits[row, :KEPT_LOGITS].to("cpu", copy=True)
            self.state.sampled_at[(rid, index)] = step
        num_decode = sum(1 for n in inputs.scheduled if n == 1)
        record = StepRecord(step, len(inputs.request_ids), inputs.num_tokens, num_decode,
                            inputs.num_tokens - num_decode, device_s, host_s,
                            step_cost(self.cost_model, output) if self.cost_model is not None else None)
        self.state.steps.append(record)
        # The steps table shows the prediction's terms beside the measured duration.
        return Execution(sampled, device_s, record.predicted)

    # -- running -------------------------------------------------------------------------

    def _run(self, inputs: BatchInputs, copies: list[StateCopy]) -> tuple[float, torch.Tensor]:
        """Copy states, run the forward pass; seconds on the device (CUDA events on a GPU)."""
        if self._timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            started = time.perf_counter()
        if copies:
            self._copy_states(copies)
        logits = self.model.forward(inputs, self.pool, self.kernels)
        if self._timed:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, logits
        return time.perf_counter() - started, logits

    def _performed(self, copies: list[StateCopy]) -> list[StateCopy]:
        """The copies this step makes (all of them, unless a test drops one)."""
        if copies and "drop_state_copy" in self._armed:
            dropped = copies[0]
            self._fired("drop_state_copy", f"the state copy of {dropped.request_id}, group {dropped.group_id}, "
                        f"block {dropped.src_block} -> {dropped.dst_block}, was skipped")
            return copies[1:]
        return copies

    def _copy_states(self, copies: list[StateCopy]) -> None:
        by_group: dict[int, list[StateCopy]] = {}
        for copy in copies:
            by_group.setdefault(copy.group_id, []).append(copy)
        for gid, group_copies in by_group.items():
            src = torch.tensor([c.src_block for c in group_copies], dtype=torch.int64, device=self.device)
            dst = torch.tensor([c.dst_block for c in group_copies], dtype=torch.int64, device=self.device)
            self.pool.copy_states(self._state_layers[gid], src, dst)

    # -- the audit ------------------------------------------------------------------------

    def _check_reads(self, step: int, inputs: BatchInputs) -> None:
        """Every block the step reads holds the reading request's prefix: attention keys up to
        the step's last token (this step's writes included), and for state groups the block
        the kernel resumes from, after this step's copies."""
        audit = self.audit
        for gid, group in enumerate(self.config.groups):
            spec = group.spec
            bs = spec.block_size
            for i, (rid, c) in enumerate(zip(inputs.request_ids, inputs.computed)):
                tokens = self.tokens[rid]
                row = inputs.host_tables[gid][i]
                if isinstance(spec, MambaSpec):
                    if c > 0:
                        column = (c - 1) // bs
                        audit.check_state(step, rid, gid, column, row[column], c, tokens)
                else:
                    first = first_visible_key(c, getattr(spec, "sliding_window", None),
                                              getattr(spec, "attention_chunk_size", None))
                    audit.check_reads(step, rid, gid, row, bs, first, c + inputs.scheduled[i], tokens)

    def _record_kv_writes(self, inputs: BatchInputs, skipped: list[tuple[int, int]]) -> None:
        """Every layer writes the step's K/V before it attends, so the step's reads see them."""
        audit = self.audit
        for gid, group in enumerate(self.config.groups):
            if isinstance(group.spec, MambaSpec):
                continue
            bs = group.spec.block_size
            for i, (rid, c, n) in enumerate(zip(inputs.request_ids, inputs.computed, inputs.scheduled)):
                table = inputs.host_tables[gid][i]
                if skipped:
                    table = [NULL_BLOCK if (gid, b) in skipped else b for b in table]
                audit.wrote_tokens(gid, table, bs, c, c + n, self.tokens[rid])

    def _record_state_writes(self, inputs: BatchInputs) -> None:
        """The state kernel leaves a state at every block end it passes and after the last token."""
        audit = self.audit
        for gid, group in enumerate(self.config.groups):
            if not isinstance(group.spec, MambaSpec):
                continue
            bs = group.spec.block_size
            for i, (rid, c, n) in enumerate(zip(inputs.request_ids, inputs.computed, inputs.scheduled)):
                table, tokens, end = inputs.host_tables[gid][i], self.tokens[rid], c + n
                for done in range((c // bs + 1) * bs, end, bs):
                    audit.wrote_state(gid, table[(done - 1) // bs], done, tokens)
                audit.wrote_state(gid, table[(end - 1) // bs], end, tokens)

    # -- test-only faults --------------------------------------------------------------

    def _fired(self, name: str, detail: str) -> None:
        self._armed.discard(name)
        self.state.faults_fired.append(f"{name}: {detail}")

    def _corrupt_table(self, output: SchedulerOutput) -> None:
        """Point the last block of a prefix hit (which the request reads) elsewhere."""
        for new in output.scheduled_new_reqs:
            for gid, group in enumerate(self.config.groups):
                position = new.num_computed_tokens // group.spec.block_size - 1
                table = self.tables.tables[new.req_id][gid]
                if isinstance(group.spec, MambaSpec) or position < 0 or table[position] == NULL_BLOCK:
                    continue
                good = table[position]
                table[position] = good % (self.config.num_blocks - 1) + 1  # another real block
                self._fired("corrupt_table", f"{new.req_id}, group {gid}, position {position}: block {good} -> "
                            f"{table[position]}")
                return

    def _stale_block(self, inputs: BatchInputs) -> list[tuple[int, int]]:
        """Find the first block this step writes that last held another request's tokens
        (a block just handed out), and drop its writes (slot mapping -1) in every layer of
        its group, as if the pool gave it out without it being rewritten."""
        audit = self.audit
        if audit is None:
            return []
        for gid, group in enumerate(self.config.groups):
            spec = group.spec
            # A group that keeps every block, so the stale one is sure to be read again.
            if type(spec) is not FullAttentionSpec or spec.sliding_window or spec.attention_chunk_size:
                continue
            bs = spec.block_size
            for i, (rid, c, n) in enumerate(zip(inputs.request_ids, inputs.computed, inputs.scheduled)):
                row = inputs.host_tables[gid][i]
                for column in range(c // bs, (c + n - 1) // bs + 1):
                    block = row[column]
                    held = int(audit.num_tokens[gid, block])
                    own = held > column * bs and int(audit.fingerprint[gid, block]) == \
                        self.tokens[rid].fingerprint(held)
                    if block == NULL_BLOCK or held < 0 or own:
                        continue
                    mapping = inputs.slot_mappings[gid]
                    inputs.slot_mappings[gid] = torch.where(mapping // bs != block, mapping,
                                                            torch.full_like(mapping, -1))
                    self._fired("stale_block", f"{rid}, group {gid}, block {block} (table position {column}) "
                                "handed out without being rewritten")
                    return [(gid, block)]
        return []

