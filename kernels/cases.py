"""Random paged batches, shared by the tests and the GPU benchmark.

An attention case is laid out the way the executor lays out a real step: every slot
starts as NaN (unwritten), the context of each sequence is already in the cache, the
blocks no query can see are replaced by the null block in the table (as vLLM's sliding
window and chunked local managers do) and never written, and the step's new tokens come
as ``key``/``value`` with their ``slot_mapping``, to be written before attention runs.
Physical blocks are shuffled, so a kernel that ignores the block table cannot pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtwin.kernels import reference
from kvtwin.kernels.layout import NULL_BLOCK, slot_mapping


@dataclass
class AttentionCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    sliding_window: int | None
    chunk_size: int | None
    key: torch.Tensor  # new tokens' K, [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    slot_mapping: torch.Tensor
    dense_k: list[torch.Tensor] = field(default_factory=list)  # per sequence, every position
    dense_v: list[torch.Tensor] = field(default_factory=list)

    def attention_args(self) -> dict:
        return dict(q=self.q, k_cache=self.k_cache, v_cache=self.v_cache, block_tables=self.block_tables,
                    seq_lens=self.seq_lens, query_start_loc=self.query_start_loc, scale=self.scale,
                    sliding_window=self.sliding_window, chunk_size=self.chunk_size)

    def clone_caches(self) -> "AttentionCase":
        """The same case with its own copy of the caches (each backend writes its own)."""
        copy = AttentionCase(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        copy.k_cache, copy.v_cache = self.k_cache.clone(), self.v_cache.clone()
        return copy


def _starts(query_lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32, device=device)


def attention_case(query_lens: list[int], seq_lens: list[int], *, num_kv_heads: int = 2, group: int = 2,
                   head_dim: int = 32, block_size: int = 16, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", seed: int = 0, sliding_window: int | None = None,
                   chunk_size: int | None = None, spare_blocks: int = 3, table_width: int | None = None,
                   fill: float = float("nan")) -> AttentionCase:
    """A batch where sequence ``s`` has ``seq_lens[s]`` tokens, the last ``query_lens[s]``
    of them this step's queries; unwritten slots hold ``fill``."""
    if len(query_lens) != len(seq_lens) or any(q > n for q, n in zip(query_lens, seq_lens)):
        raise ValueError("each sequence needs query_len <= seq_len")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    width = table_width or max(blocks_needed, default=1)
    num_blocks = 1 + sum(blocks_needed) + spare_blocks
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.full((len(seq_lens), width), NULL_BLOCK, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    dense_k, dense_v, new_k, new_v = [], [], [], []
    for s, (q_len, n) in enumerate(zip(query_lens, seq_lens)):
        first_query = n - q_len
        # Blocks entirely before the first key any query sees are nulled, as vLLM does.
        first_kept = reference.first_visible_key(first_query, sliding_window, chunk_size) // block_size
        for b in range(blocks_needed[s]):
            tables[s, b] = physical.pop() if b >= first_kept else NULL_BLOCK
        k = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
        dense_k.append(k.to(device))
        dense_v.append(v.to(device))
        # The context is in the cache already, except what the null block replaced.
        context = torch.arange(first_kept * block_size, first_query)
        blocks = tables[s].to(torch.int64)[context // block_size]
        k_cache[blocks, context % block_size] = k[context]
        v_cache[blocks, context % block_size] = v[context]
        new_k.append(k[first_query:])
        new_v.append(v[first_query:])
    starts = _starts(query_lens, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    tables = tables.to(device)
    num_heads = num_kv_heads * group
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(dtype)
    return AttentionCase(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device), block_tables=tables,
        seq_lens=lens, query_start_loc=starts, scale=head_dim ** -0.5,
        sliding_window=sliding_window, chunk_size=chunk_size,
        key=torch.cat(new_k).to(device), value=torch.cat(new_v).to(device),
        slot_mapping=slot_mapping(tables, lens, starts, block_size), dense_k=dense_k, dense_v=dense_v,
    )


def filled_batch(query_lens: list[int], seq_lens: list[int], *, num_kv_heads: int, group: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> AttentionCase:
    """A large batch for timing, built on the device: every slot of every used block holds
    random data (no NaN, no null blocks, no dense copies), blocks shuffled."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_needed)
    num_blocks = 1 + sum(blocks_needed)
    physical = torch.randperm(num_blocks - 1, generator=gen, device=device).to(torch.int32) + 1
    tables = torch.zeros((len(seq_lens), width), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(blocks_needed):
        tables[s, :n] = physical[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    num_tokens = sum(query_lens)
    q = torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=gen, device=device, dtype=dtype)
    new = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen, device=device, dtype=dtype)
    starts = _starts(query_lens, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return AttentionCase(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=lens,
                         query_start_loc=starts, scale=head_dim ** -0.5, sliding_window=None, chunk_size=None,
                         key=new, value=new.clone(), slot_mapping=slot_mapping(tables, lens, starts, block_size))


@dataclass
class StateCase:
    x: torch.Tensor
    conv_weight: torch.Tensor
    log_decay: torch.Tensor
    beta: torch.Tensor
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_size: int

    def args(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def clone_states(self) -> "StateCase":
        copy = StateCase(**self.args())
        copy.conv_state, copy.ssm_state = self.conv_state.clone(), self.ssm_state.clone()
        return copy


def state_inputs(num_tokens: int, *, num_heads: int, key_dim: int, value_dim: int, conv_width: int,
                 dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``x``, ``conv_weight``, ``log_decay`` (<= 0) and ``beta`` (in (0, 1)) for a step."""
    conv_dim = num_heads * (2 * key_dim + value_dim)
    x = torch.randn((num_tokens, conv_dim), generator=gen).to(dtype)
    weight = (torch.randn((conv_dim, conv_width), generator=gen) / conv_width ** 0.5).to(dtype)
    log_decay = -torch.nn.functional.softplus(torch.randn((num_tokens, num_heads), generator=gen)).to(dtype)
    beta = torch.sigmoid(torch.randn((num_tokens, num_heads), generator=gen)).to(dtype)
    return x, weight, log_decay, beta


def state_case(query_lens: list[int], seq_lens: list[int], *, num_heads: int = 2, key_dim: int = 16,
               value_dim: int = 16, conv_width: int = 4, block_size: int = 8, dtype: torch.dtype = torch.float32,
               state_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
               checkpoint_every_block: bool = False) -> StateCase:
    """A step of the recurrence in Mamba "align" layout: each sequence that has computed
    tokens holds a random (cached) state in the block for its last computed token; the
    table names a fresh block for its last token and, with ``checkpoint_every_block``,
    for every block boundary the step crosses (otherwise those entries are null).
    Unused blocks and the null block hold NaN."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq, default=1)
    num_blocks = 1 + sum(blocks_per_seq) + 2
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    conv_dim = num_heads * (2 * key_dim + value_dim)
    conv_state = torch.full((num_blocks, conv_width - 1, conv_dim), float("nan"), dtype=state_dtype)
    ssm_state = torch.full((num_blocks, num_heads, key_dim, value_dim), float("nan"), dtype=state_dtype)
    tables = torch.full((len(seq_lens), width), NULL_BLOCK, dtype=torch.int32)
    for s, (q_len, n) in enumerate(zip(query_lens, seq_lens)):
        computed = n - q_len
        if computed > 0:
            src = physical.pop()
            tables[s, (computed - 1) // block_size] = src
            conv_state[src] = torch.randn((conv_width - 1, conv_dim), generator=gen).to(state_dtype)
            ssm_state[src] = (torch.randn((num_heads, key_dim, value_dim), generator=gen) * 0.5).to(state_dtype)
        if q_len == 0:
            continue
        wanted = {(n - 1) // block_size}
        if checkpoint_every_block:
            wanted |= {(p - 1) // block_size for p in range(computed + 1, n + 1) if p % block_size == 0}
        for b in sorted(wanted):
            if int(tables[s, b]) == NULL_BLOCK:
                tables[s, b] = physical.pop()
    x, weight, log_decay, beta = state_inputs(sum(query_lens), num_heads=num_heads, key_dim=key_dim,
                                              value_dim=value_dim, conv_width=conv_width, dtype=dtype, gen=gen)
    return StateCase(
        x=x.to(device), conv_weight=weight.to(device), log_decay=log_decay.to(device), beta=beta.to(device),
        conv_state=conv_state.to(device), ssm_state=ssm_state.to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=_starts(query_lens, device), block_size=block_size,
    )
