"""Small inline-model scenarios for the executor tests.

``scenario(kind, tmp_path, ...)`` writes a scenario TOML (an 8-layer toy model planned on
an H200, synthetic requests that share prefixes) into ``tmp_path`` and returns its
``ResolvedScenario`` with the KV pool cut to ``pool`` times the plan's
``blocks_per_request`` (plus the null block), so a few requests fill it: the default
workload evicts cached blocks and preempts.

By default the requests arrive in one burst. The executor's clock is the measured step
time, which differs from run to run (and with the machine's load), but a burst's schedule
does not depend on it, so a test can count on the hits, evictions and preemptions it
asserts.

Kinds (the KV cache groups the planner makes of them):

- ``full``: full attention only;
- ``swa``: sliding window (64) x 3 groups + full;
- ``chunked``: chunked local attention (chunks of 64) x 3 + full; the kind sets
  ``hybrid_kv_cache = true``, without which the planner promotes chunked layers to full
  attention;
- ``mla``: MLA only (one latent cache, full attention);
- ``mamba2``: Mamba-2 x 3 + full, align mode; its state spec has one prefill checkpoint block;
- ``mamba1``: Mamba-1 x 3 + full, align mode; no prefill checkpoints;
- ``three``: sliding, full and Mamba-2 layers, in 5 groups (2 sliding, 2 full, 1 state).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import kvtwin.executor.validate as validate_module
from kvtwin.sim.scenario.resolve import ResolvedScenario, resolve_scenario

_MAMBA2 = 'kind = "mamba2"\nd_state = 16\nd_conv = 4\nnum_heads = 8\nhead_dim = 16\nn_groups = 1\n'
_MAMBA1 = 'kind = "mamba1"\nd_state = 16\nd_conv = 4\nexpand = 1\n'

# kind -> ([model] lines, [model.state] table body or "", [engine] lines)
KINDS: dict[str, tuple[str, str, str]] = {
    "full": ('layer_pattern = "F"\n', "", ""),
    "swa": ('layer_pattern = "SSSF"\nsliding_window = 64\n', "", ""),
    "chunked": ('layer_pattern = "CCCF"\nattention_chunk_size = 64\n', "", "hybrid_kv_cache = true\n"),
    "mla": ('layer_pattern = "A"\nkv_lora_rank = 512\nqk_rope_head_dim = 64\n', "", ""),
    "mamba2": ('layer_pattern = "MMMF"\n', _MAMBA2, ""),
    "mamba1": ('layer_pattern = "MMMF"\n', _MAMBA1, ""),
    "three": ('layer_pattern = "SFM"\nsliding_window = 64\n', _MAMBA2, ""),
}

BURST = 1e6  # requests per second: all of them arrive before the first step ends


def scenario_text(kind: str, *, num_requests: int = 10, rate: float = BURST, seed: int = 3, shared_tokens: int = 64,
                  prompt_mean: int = 40, output_mean: int = 16, async_scheduling: bool = True,
                  max_model_len: int = 320, max_num_seqs: int = 8, max_num_batched_tokens: int = 256) -> str:
    """The scenario TOML: ``num_requests`` requests arriving at ``rate`` per second, each one
    of two shared prefixes of ``shared_tokens`` tokens (Zipf) and ``prompt_mean`` tokens of
    its own (lognormal, capped to leave room for the output within ``max_model_len``)."""
    model, state, engine = KINDS[kind]
    state_table = f"[model.state]\n{state}" if state else ""
    own_max = max_model_len - shared_tokens - 4 * output_mean
    return f'''description = "toy {kind}"
[model]
name = "toy-{kind}"
num_layers = 8
{model}hidden_size = 256
num_attention_heads = 4
num_kv_heads = 2
head_dim = 64
intermediate_size = 512
vocab_size = 1000
max_position_embeddings = 8192
params_total = 1e8
{state_table}
[hardware]
gpu = "h200"

[engine]
max_model_len = {max_model_len}
max_num_batched_tokens = {max_num_batched_tokens}
max_num_seqs = {max_num_seqs}
async_scheduling = {str(async_scheduling).lower()}
{engine}
[workload]
kind = "requests"
seed = {seed}
num_requests = {num_requests}
block_tokens = 16
arrival = {{ process = "poisson", rate_per_s = {rate} }}
shared_prefix = {{ count = 2, tokens = {shared_tokens}, zipf_s = 1.0 }}
prompt_tokens = {{ dist = "lognormal", mean = {prompt_mean}, sigma = 0.5, max = {own_max} }}
output_tokens = {{ dist = "lognormal", mean = {output_mean}, sigma = 0.5 }}
'''


def scenario(kind: str, tmp_path: Path, *, pool: float = 1.1, **workload) -> ResolvedScenario:
    """The ``kind`` scenario, written to ``tmp_path``, its pool cut to ``pool`` x
    ``blocks_per_request`` blocks (``pool`` >= 1: one longest request must fit);
    ``workload``: ``scenario_text``'s keywords."""
    path = Path(tmp_path) / f"toy-{kind}.toml"
    path.write_text(scenario_text(kind, **workload))
    resolved = resolve_scenario(path)
    planned = resolved.plan()
    blocks = int(planned.blocks_per_request * pool) + 1
    engine = dataclasses.replace(resolved.engine, kv_cache_memory_bytes=planned.bytes_per_block * blocks)
    return dataclasses.replace(resolved, engine=engine)


def validate_with_runs(resolved: ResolvedScenario, options: validate_module.ValidateOptions):
    """``validate`` on the scenario's workload, and the executor runs checks 1 and 2 made:
    ``(validation, runs)``, ``runs["on"]`` the run under test (prefix caching on, faults
    armed) and ``runs["off"]`` check 1's reference (everything recomputed), where run."""
    runs = {}
    real = validate_module.run_executor

    def spy(plan, *args, **kwargs):
        run = real(plan, *args, **kwargs)
        # Validate's first run is the one under test (prefix caching on); check 4's come later.
        key = "on" if plan.engine.cache.enable_prefix_caching else "off"
        runs.setdefault(key, run)
        return run

    with mock.patch.object(validate_module, "run_executor", spy):
        validation = validate_module.validate(resolved, resolved.workload.load(), options)
    return validation, runs
