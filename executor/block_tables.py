"""The executor's copy of every running request's block tables, kept from the scheduler
output alone, as vLLM's GPU model runner keeps its ``InputBatch`` block tables.

The rules are ``sim/core/scheduler_output.py``'s, in its order: drop finished and
preempted requests, set new (or resumed) requests' whole tables, apply in-place
replacements, then appended blocks. The same stream gives positions: a request's
computed tokens advance by what each output schedules.

Recurrent groups in align mode also keep vLLM's ``mamba_state_idx``: the table column
holding a request's running state. When a step moves the running state to a new column
(a block boundary was crossed, or a prefix hit supplied the state), the state is first
copied from the old column's block into the new one (``StateCopy``), and the kernel then
reads and updates it in place (``mamba_utils.preprocess_mamba`` in vLLM 0.33).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig, MambaSpec, cdiv

NULL_BLOCK = 0


class TableError(RuntimeError):
    """The scheduler output contradicts the tables kept so far (a contract bug)."""


@dataclass(frozen=True)
class StateCopy:
    group_id: int
    request_id: str
    src_block: int
    dst_block: int


class BlockTables:
    def __init__(self, config: KVCacheConfig):
        self.num_groups = len(config.groups)
        self.block_sizes = [g.spec.block_size for g in config.groups]
        self.align_groups = [gid for gid, g in enumerate(config.groups)
                             if isinstance(g.spec, MambaSpec) and g.spec.mamba_cache_mode == "align"]
        self.tables: dict[str, tuple[list[int], ...]] = {}
        self.num_computed_tokens: dict[str, int] = {}
        # Per align-mode state group: request -> the table column of its running state.
        self.state_idx: dict[int, dict[str, int]] = {gid: {} for gid in self.align_groups}
        # Preempted and not resumed: a late finish (async) reports them with no table.
        self._dropped: set[str] = set()

    def apply(self, output: SchedulerOutput) -> list[str]:
        """Apply one output's table changes; returns the requests that are new this step."""
        for rid in output.finished_req_ids:
            if rid in self._dropped:
                self._dropped.discard(rid)
                continue
            self._drop(rid, "finished")
        for rid in output.preempted:
            self._drop(rid, "preempted")
            self._dropped.add(rid)
        new_ids = []
        for new in output.scheduled_new_reqs:
            rid = new.req_id
            if rid in self.tables:
                raise TableError(f"new request {rid} already has a table")
            self.tables[rid] = tuple(list(ids) for ids in new.block_ids)
            self.num_computed_tokens[rid] = new.num_computed_tokens
            self._dropped.discard(rid)
            new_ids.append(rid)
        cached = output.scheduled_cached_reqs
        for rid, changes in cached.replaced_block_ids.items():
            tables = self._table(rid)
            for gid, position, block_id in changes:
                tables[gid][position] = block_id
        for rid, per_group in cached.new_block_ids.items():
            tables = self._table(rid)
            for gid, ids in enumerate(per_group):
                tables[gid].extend(ids)
        return new_ids

    def state_copies(self, output: SchedulerOutput, new_ids: list[str]) -> list[StateCopy]:
        """Move each scheduled request's running state to the column this step writes.

        Call after ``apply`` and before the step runs; updates ``state_idx``."""
        if not self.align_groups:
            return []
        copies = []
        fresh = set(new_ids)
        for (rid, num_new), computed in zip(output.num_scheduled_tokens.items(), output.num_computed_tokens):
            for gid in self.align_groups:
                block_size = self.block_sizes[gid]
                state_idx = self.state_idx[gid]
                previous = state_idx.get(rid) if rid not in fresh else None
                if previous is None:
                    previous = (computed - 1) // block_size  # -1: a fresh start, nothing to copy
                current = cdiv(computed + num_new, block_size) - 1
                state_idx[rid] = current
                if previous != -1 and previous != current:
                    table = self.tables[rid][gid]
                    copies.append(StateCopy(gid, rid, table[previous], table[current]))
        return copies

    def advance(self, output: SchedulerOutput) -> None:
        """Count the step's tokens as computed (after it ran)."""
        for rid, num_new in output.num_scheduled_tokens.items():
            self.num_computed_tokens[rid] += num_new

    def _table(self, rid: str) -> tuple[list[int], ...]:
        table = self.tables.get(rid)
        if table is None:
            raise TableError(f"request {rid} changes a table it does not have")
        return table

    def _drop(self, rid: str, why: str) -> None:
        if self.tables.pop(rid, None) is None:
            raise TableError(f"{why} request {rid} has no table to drop")
        self.num_computed_tokens.pop(rid, None)
        for state_idx in self.state_idx.values():
            state_idx.pop(rid, None)
