"""One step's device inputs, built from the scheduler output and the kept block tables,
the way vLLM's GPU model runner prepares them (``_prepare_inputs``).

- token ids and positions of every scheduled token, requests in output order;
- ``query_start_loc`` and ``seq_lens`` (tokens including this step's);
- per group, a block table ``[num_seqs, max_blocks]`` (the null block, 0, pads short
  rows and stands where a window or chunk skipped blocks), and for attention groups the
  slot of every new token (``block * block_size + offset``);
- for align-mode state groups, the kernel's table: the column the state is read from
  points at the running state's block, into which ``BlockTables.state_copies`` copied it.

Chunked-local groups need no table of their own here: the kernels take ``chunk_size``
(and the flash adapter re-cuts the batch into per-chunk virtual sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtwin.executor.block_tables import NULL_BLOCK, BlockTables
from kvtwin.executor.tokens import RequestTokens
from kvtwin.kernels.layout import slot_mapping
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig, MambaSpec


@dataclass
class BatchInputs:
    request_ids: list[str]
    computed: list[int]  # tokens computed before the step, per request
    scheduled: list[int]  # tokens scheduled, per request
    token_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    host_tables: list[list[list[int]]]  # per group, per request: the table the kernels get
    block_tables: list[torch.Tensor]  # per group [num_seqs, max_blocks] int32
    slot_mappings: list[torch.Tensor | None]  # per group: attention groups only
    sample_rows: torch.Tensor  # [num_sampling] int64: the last token of each sampling request
    samples: list[tuple[str, int]]  # (request id, output index) per sample row

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def build_inputs(output: SchedulerOutput, tables: BlockTables, tokens: dict[str, RequestTokens],
                 config: KVCacheConfig, device: torch.device, *, vocab_size: int) -> BatchInputs:
    request_ids = list(output.num_scheduled_tokens)
    scheduled = list(output.num_scheduled_tokens.values())
    computed = list(output.num_computed_tokens)
    ids: list[int] = []
    positions: list[int] = []
    starts = [0]
    sample_rows: list[int] = []
    samples: list[tuple[str, int]] = []
    for rid, c, n in zip(request_ids, computed, scheduled):
        ids += tokens[rid].ids(c, c + n)
        positions += range(c, c + n)
        starts.append(starts[-1] + n)
        k = output.num_output_tokens.get(rid)
        if k is not None:
            sample_rows.append(starts[-1] - 1)
            samples.append((rid, k))
    seq_lens = [c + n for c, n in zip(computed, scheduled)]
    host_tables = []
    for gid, group in enumerate(config.groups):
        rows = [tables.tables[rid][gid] for rid in request_ids]
        if gid in tables.align_groups:
            rows = [_kernel_state_row(row, c, tables.state_idx[gid][rid], group.spec.block_size)
                    for row, rid, c in zip(rows, request_ids, computed)]
        host_tables.append(rows)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    query_start_loc = tensor(starts, torch.int32)
    seq_lens_t = tensor(seq_lens, torch.int32)
    block_tables = []
    slot_mappings: list[torch.Tensor | None] = []
    for gid, group in enumerate(config.groups):
        rows = host_tables[gid]
        width = max((len(r) for r in rows), default=1) or 1
        padded = [r + [NULL_BLOCK] * (width - len(r)) for r in rows]
        table = tensor(padded, torch.int32)
        block_tables.append(table)
        if isinstance(group.spec, MambaSpec):
            slot_mappings.append(None)
        else:
            slot_mappings.append(slot_mapping(table, seq_lens_t, query_start_loc, group.spec.block_size))
    # Token ids index the embedding modulo the (executor's) vocabulary.
    token_ids = tensor([t % vocab_size for t in ids], torch.int64)
    return BatchInputs(request_ids, computed, scheduled, token_ids, tensor(positions, torch.int64),
                       query_start_loc, seq_lens_t, host_tables, block_tables, slot_mappings,
                       tensor(sample_rows, torch.int64), samples)


def _kernel_state_row(row: list[int], computed: int, state_column: int, block_size: int) -> list[int]:
    """The state kernel reads column ``(computed - 1) // block_size``; point it at the
    running state's block when the step starts on a block boundary (the state was copied
    there). A step starting inside a block reads the block it left off in (the same one)."""
    if computed == 0 or computed % block_size:
        return row
    read_column = (computed - 1) // block_size
    if read_column == state_column:
        return row
    row = list(row)
    row[read_column] = row[state_column]
    return row
