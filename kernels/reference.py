"""The torch reference of the three paged operations: the definition the other backends
are tested against, and the backend of the CPU executor.

Written to be read, not to be fast: one sequence (and for the recurrence one token) at a
time, everything computed in float32. Layouts and batch metadata: ``kernels.layout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtwin.kernels.layout import NULL_BLOCK, check_attention_args

# Query tokens per slice of one sequence's attention (bounds the score matrix's memory).
QUERY_SLICE = 512


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new tokens' K and V (``[num_tokens, num_kv_heads, head_dim]``) into their
    slots, in place. A negative slot means "do not store this token" (vLLM's padding)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_positions(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The cache rows ``[len(positions), num_kv_heads, head_dim]`` of one sequence."""
    block_size = cache.shape[1]
    blocks = block_table.to(torch.int64)[positions // block_size]
    return cache[blocks, positions % block_size]


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None,
                 chunk_size: int | None) -> torch.Tensor:
    """``[num_queries, num_keys]``: may the query at ``query_pos`` see the key at ``key_pos``?

    Causal; a sliding window of ``W`` keeps the ``W`` latest positions (the query's own
    included, as vLLM's ``window_size = (W - 1, 0)``); chunked local keeps the keys of the
    query's own chunk.
    """
    q, k = query_pos[:, None], key_pos[None, :]
    visible = k <= q
    if sliding_window is not None:
        visible &= k > q - sliding_window
    if chunk_size is not None:
        visible &= (k // chunk_size) == (q // chunk_size)
    return visible


def first_visible_key(query_pos: int, sliding_window: int | None, chunk_size: int | None) -> int:
    """The earliest key position any query at or after ``query_pos`` can see."""
    first = 0
    if sliding_window is not None:
        first = max(first, query_pos - sliding_window + 1)
    if chunk_size is not None:
        first = max(first, query_pos // chunk_size * chunk_size)
    return first


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """Causal attention of variable-length queries over a paged K/V cache.

    ``q``: ``[num_tokens, num_heads, head_dim]``, sequence ``s`` owning tokens
    ``query_start_loc[s]:query_start_loc[s+1]``, which sit at the last positions of its
    ``seq_lens[s]`` tokens (a decode is a query of one). Query head ``h`` reads kv head
    ``h // (num_heads // num_kv_heads)``. Returns ``[num_tokens, num_heads, head_dim]`` in
    ``q``'s dtype. Only positions some query can see are read, so the null block and
    never-written slots (whatever they hold) do not reach the result.
    """
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        first_query = seq_len - (starts[s + 1] - starts[s])
        # Queries a slice at a time, so a long prefill's score matrix stays small.
        for q0 in range(starts[s], starts[s + 1], QUERY_SLICE):
            q1 = min(q0 + QUERY_SLICE, starts[s + 1])
            first = first_query + (q0 - starts[s])
            query_pos = torch.arange(first, first + q1 - q0, device=q.device)
            key_pos = torch.arange(first_visible_key(first, sliding_window, chunk_size), first + q1 - q0,
                                   device=q.device)
            k = gather_positions(k_cache, block_tables[s], key_pos).float()  # [keys, kv_heads, dim]
            v = gather_positions(v_cache, block_tables[s], key_pos).float()
            # Query head h = n * group + g reads kv head n.
            queries = q[q0:q1].float().unflatten(1, (k.shape[1], group))  # [q, kv_heads, group, dim]
            scores = torch.einsum("qngd,knd->ngqk", queries, k) * scale
            scores = scores.masked_fill(~visible_keys(query_pos, key_pos, sliding_window, chunk_size), float("-inf"))
            mixed = torch.einsum("ngqk,knd->qngd", scores.softmax(dim=-1), v)
            out[q0:q1] = mixed.flatten(1, 2).to(q.dtype)
    return out


def state_update(x: torch.Tensor, conv_weight: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
                 conv_state: torch.Tensor, ssm_state: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int) -> torch.Tensor:
    """A gated linear recurrence behind a short causal convolution, with paged state.

    Per sequence, token by token (``H`` heads, key dim ``K``, value dim ``V``):

    - ``x_t`` (``[conv_dim]``, ``conv_dim = H*(2K+V)``) goes through a depthwise causal
      convolution of width ``W`` (``conv_weight [conv_dim, W]``, the last tap on the current
      token) over the ``W-1`` previous inputs, then SiLU; the result splits into ``q`` (the
      first ``H*K`` channels), ``k`` (next ``H*K``) and ``v`` (last ``H*V``), head-major;
    - per head, ``S = exp(log_decay_t) * S + beta_t * outer(k, v)`` (``S [K, V]``; Mamba-2's
      scalar decay, gated-linear-attention style), and ``y_t = q @ S``.

    State paging (vLLM's Mamba "align" mode): the state after the first ``n`` tokens of a
    sequence belongs in block ``block_tables[s, (n - 1) // block_size]``. A sequence that
    already computed ``n = seq_len - query_len > 0`` tokens starts from that block (a fresh
    one starts from zeros). While running, the state is written after every token that ends
    a block and after the last token, to the block the table names for it; entries that are
    the null block are skipped. So one call both resumes from a cached state and leaves a
    checkpoint at each block boundary the table asks for.

    The conv state holds the last ``W-1`` inputs (oldest first). Returns ``y``
    ``[num_tokens, H, V]`` in ``x``'s dtype; the states are updated in place.
    """
    num_heads, key_dim, value_dim = ssm_state.shape[1:]
    width = conv_weight.shape[1]
    if x.shape[1] != num_heads * (2 * key_dim + value_dim) or conv_state.shape[1:] != (width - 1, x.shape[1]):
        raise ValueError(f"state_update shapes disagree: x {tuple(x.shape)}, conv_weight {tuple(conv_weight.shape)}, "
                         f"conv_state {tuple(conv_state.shape)}, ssm_state {tuple(ssm_state.shape)}")
    y = torch.zeros((x.shape[0], num_heads, value_dim), dtype=x.dtype, device=x.device)
    weight = conv_weight.float()
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        table = block_tables[s].tolist()
        computed = seq_len - (q1 - q0)
        if computed > 0:
            block = table[(computed - 1) // block_size]
            history = conv_state[block].float().clone()
            state = ssm_state[block].float().clone()
        else:
            history = torch.zeros((width - 1, x.shape[1]), device=x.device)
            state = torch.zeros((num_heads, key_dim, value_dim), device=x.device)
        for t in range(q0, q1):
            window = torch.cat([history, x[t:t + 1].float()])  # [W, conv_dim], oldest first
            mixed = F.silu((window.T * weight).sum(dim=1))
            q, k, v = mixed.split([num_heads * key_dim, num_heads * key_dim, num_heads * value_dim])
            q, k, v = q.view(num_heads, key_dim), k.view(num_heads, key_dim), v.view(num_heads, value_dim)
            decay = log_decay[t].float().exp()[:, None, None]
            state = decay * state + beta[t].float()[:, None, None] * k[:, :, None] * v[:, None, :]
            y[t] = torch.einsum("hk,hkv->hv", q, state).to(x.dtype)
            history = window[1:]
            done = computed + (t - q0) + 1
            if done % block_size == 0 or done == seq_len:
                block = table[(done - 1) // block_size]
                if block != NULL_BLOCK:
                    conv_state[block] = history.to(conv_state.dtype)
                    ssm_state[block] = state.to(ssm_state.dtype)
    return y
