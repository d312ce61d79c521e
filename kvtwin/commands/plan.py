"""`kvtwin plan`: what fits — groups, blocks, tokens, concurrency, memory, hybrid on vs off.

The numbers come from ``kvtwin.sim.planner.plan.plan`` (vLLM 0.33's planner, semantics
section 7) and the inputs from ``kvtwin.sim.scenario.resolve`` (flags over a scenario file
over vLLM's defaults); this module prints the result as a table or one JSON object. Scenario format: ``scenarios/README.md``.
"""

from __future__ import annotations

import dataclasses

import json
import math
from pathlib import Path
from typing import Optional

import typer

from kvtwin.console import user_errors
from kvtwin.knob_options import knob_flags
from kvtwin.sim.scenario.bundled import find_scenario
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from kvtwin.commands.presets import GPU_CHOICES, MODEL_CHOICES
from kvtwin.sim.planner.hardware import GIB
from kvtwin.sim.planner.plan import HybridComparison, Plan, compare_hybrid as compare_hybrid_layouts, plan as make_plan

# A plan that does not fit is still printed, then exits with this, so scripts can gate on it.
EXIT_DOES_NOT_FIT = 1


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def _n(value: float | int | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if digits else f"{value:,}"


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.2f} GiB"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _group_rows(j: dict) -> list[str]:
    """The KV cache groups table of a plan's JSON, one row per group."""
    lines: list[str] = []
    header = f"  {'id':>3}  {'kind':<15} {'layers':>6} {'pad':>4} {'block':>6} {'page bytes':>12} " \
             f"{'window':>7} {'blocks/req':>10} {'steady':>7}"
    lines.append(header)
    for g in j["groups"]:
        window = g.get("sliding_window") or g.get("attention_chunk_size") or g.get("compute_only_sliding_window") \
            or g.get("compute_only_attention_chunk_size") or ""
        # A uniform-type group's layers may differ in page size (DeepSeek-V3.2's latent and indexer).
        pages = "+".join(f"{b:,}" for b in dict.fromkeys(g.get("layer_page_bytes") or [g["page_bytes"]]))
        lines.append(f"  {g['group_id']:>3}  {g['kind']:<15} {g['num_layers']:>6} {g['num_padding_layers']:>4} "
                     f"{g['block_size']:>6} {pages:>12} {str(window):>7} {g['blocks_per_request']:>10,} "
                     f"{g['steady_state_blocks_per_request']:>7,}")
    return lines


def render_plan(p: Plan) -> str:
    j = p.to_json()
    eng = p.engine
    lines: list[str] = []
    tp = eng.tensor_parallel_size
    layout = eng.layout
    sizes = [f"TP {tp}"] + [f"{name} {n}" for name, n in (("PP", layout.pipeline_parallel_size),
                                                          ("DP", layout.data_parallel_size),
                                                          ("EP", layout.expert_parallel_size)) if n > 1]
    sizes += [f"EPLB, {layout.num_redundant_experts} redundant experts"] if layout.enable_eplb else []
    where = f"{layout.num_gpus} x {p.gpu.name} ({', '.join(sizes)})" if layout.num_gpus > 1 else p.gpu.name
    lines.append(f"kvtwin plan: {p.model.name} on {where} - vLLM 0.33 KV cache layout")
    default = "vLLM default" if eng.hybrid_kv_cache_is_default else "not vLLM's default"
    lines.append(f"  max_model_len {_n(eng.max_model_len)} | max_num_batched_tokens {_n(eng.max_num_batched_tokens)}"
                 f" | max_num_seqs {_n(eng.max_num_seqs)} | KV cache {eng.kv_cache_dtype} "
                 f"({eng.kv_cache_dtype_bytes} B/elem)")
    lines.append(f"  hybrid KV cache manager {_on(eng.hybrid_kv_cache)} ({default}) | async scheduling "
                 f"{_on(eng.async_scheduling)} ({_n(eng.max_in_flight_tokens)} tokens in flight) | prefix caching "
                 f"{_on(eng.enable_prefix_caching)}"
                 + (f" | mamba cache mode {eng.mamba_cache_mode}" if p.model.state is not None else ""))
    if eng.enable_prefix_caching:
        lines.append(f"  prefix-cache retention {p.retention}")
    if p.layers.hybrid_block is not None:
        hb = p.layers.hybrid_block
        lines.append(f"  attention block size {hb.block_size} tokens so one page ({_n(hb.attention_page_bytes)} B) "
                     f"holds a state of {_n(hb.mamba_page_bytes)} B (alignment {hb.alignment_tokens})")
    lines.append("")
    lines.append(f"KV cache groups ({j['grouping']}, group size {j['group_size']}, "
                 f"{j['waste']['num_padding_layers']} padding layers)")
    lines += _group_rows(j)
    lines.append("")
    lines.append("Pool (per GPU" + (", per DP rank" if layout.data_parallel_size > 1 else "") + ")")
    lines.append(f"  bytes per block       {_n(p.bytes_per_block)}")
    lines.append(f"  num_blocks            {_n(p.num_blocks)} "
                 f"(null block included; {_n(max(0, p.num_blocks - 1))} usable)")
    if p.fits:
        lines.append(f"  KV cache tokens       {_n(p.kv_cache_tokens)}  (vLLM's \"GPU KV cache size\")")
        lines.append(f"  max concurrency       {p.max_concurrency:,.2f}x requests of {_n(eng.max_model_len)} tokens "
                     f"(vLLM's figure; {_n(p.blocks_per_request)} blocks per request)")
        lines.append(f"  steady state          {p.steady_state_concurrency:,.2f}x requests of {_n(eng.max_model_len)} "
                     f"tokens once prefills are done ({_n(p.steady_state_blocks_per_request)} blocks per request)")
        lines.append(f"  at once               {_at_once(j['concurrency_limit'], p.steady_state_concurrency, eng)}")
    if len(p.stages) > 1:
        lines.append(f"  pipeline stages       every stage allocates the fewest blocks any stage's memory gives "
                     f"(stage {p.limiting_stage}'s)")
        for st in p.stages:
            lines.append(f"    stage {st.stage}: layers {st.layer_start}-{st.layer_end - 1}, {_n(st.bytes_per_block)} "
                         f"bytes per block, {_n(st.num_blocks)} blocks alone, weights {_gib(st.memory.weights_bytes)}")
    lines.append("")
    lines += _memory_lines(p, j)
    w = j["waste"]
    if w["bytes_per_request"]:
        lines.append("")
        lines.append("Waste (per request of max_model_len)")
        lines.append(f"  padding layers        {_n(w['padding_layer_bytes_per_request'])} bytes")
        lines.append(f"  padded pages          {_n(w['page_padding_bytes_per_request'])} bytes")
        lines.append(f"  share of the request  {w['fraction_of_request'] * 100:.2f}%")
        for text in w["vllm_padding_warnings"]:
            lines.append(f"  vLLM: {text}")
    if not p.fits:
        lines.append("")
        lines.append(f"DOES NOT FIT: one request of {_n(eng.max_model_len)} tokens needs {_gib(p.needed_bytes)} of KV "
                     f"cache; {_gib(max(0, p.memory.kv_cache_bytes - p.bytes_per_block))} is available "
                     f"(short by {_gib(p.shortfall_bytes)}). vLLM would refuse to start.")
        for s in p.suggestions:
            extra = f" (max concurrency {s['max_concurrency']:,.2f}x)" if "max_concurrency" in s else ""
            lines.append(f"  would fit: {s['change']} = {s['value']}{extra}")
        if not p.suggestions:
            lines.append("  nothing simple fits: try a smaller model or a larger GPU")
    for text in p.warnings:
        lines.append(f"warning: {text}")
    return "\n".join(lines)


def _at_once(limit: int, steady: float, eng) -> str:
    """How many requests run together, said as what bounds it: the pool holds ``limit``
    requests of max_model_len (a request that size is rare; shorter ones fit more), or
    max_num_seqs is the cap whatever their length. Read as a cap, the pool's figure made
    users think a server of 3 "max_model_len requests" ran 3 requests."""
    if limit < eng.max_num_seqs:
        return (f"{_n(limit)} requests of {_n(eng.max_model_len)} tokens fit together once prefilled "
                f"(shorter ones: more, up to max_num_seqs {_n(eng.max_num_seqs)})")
    return (f"max_num_seqs {_n(eng.max_num_seqs)} running requests at most (the pool would hold "
            f"{_n(math.floor(steady))} of {_n(eng.max_model_len)} tokens once prefilled)")


def _memory_lines(p: Plan, j: dict) -> list[str]:
    """The memory section: where a GPU's bytes go, down to the KV cache."""
    eng = p.engine
    lines: list[str] = []
    m = p.memory
    lines.append(f"Memory per GPU ({p.gpu.description or p.gpu.name}: {_gib(m.total_bytes)})")
    if m.kv_cache_source == "kv_cache_memory_bytes":
        lines.append(f"  KV cache              {_gib(m.kv_cache_bytes)}  "
                     f"(--kv-cache-memory-bytes {m.kv_cache_bytes:,}; no memory estimate)")
    else:
        lines.append(f"  {'usable (x ' + format(m.gpu_memory_utilization, 'g') + ')':<21} {_gib(m.requested_bytes)}")
        lines.append(f"  - weights             {_gib(m.weights_bytes)}")
        lines.append(f"  - activation peak     {_gib(m.activation_peak_bytes)}  (estimate at "
                     f"{_n(eng.max_num_batched_tokens)} tokens)")
        lines.append(f"  - CUDA graphs         {_gib(m.cuda_graph_bytes)}  (estimate)")
        lines.append(f"  - non-torch           {_gib(m.non_torch_bytes)}  (estimate)")
        lines.append(f"  = KV cache            {_gib(m.kv_cache_bytes)}")
    lines.append(f"  in blocks             {_gib(j['memory']['kv_cache_used_bytes'])} "
                 f"({_n(j['memory']['kv_cache_unused_bytes'])} bytes left over)")
    return lines


def _bytes_per_request(p: Plan) -> int:
    return p.blocks_per_request * p.bytes_per_block


def render_compare(comparison: HybridComparison) -> str:
    on, off, off_error = comparison.on, comparison.off, comparison.off_error
    lines = [f"kvtwin plan --compare-hybrid: {on.model.name} on {on.gpu.name} (TP {on.engine.tensor_parallel_size}), "
             f"max_model_len {_n(on.engine.max_model_len)}"]
    if off is None:
        lines.append(render_plan(on))
        lines.append("")
        lines.append(f"hybrid KV cache manager off: not possible; it must stay {off_error}")
        return "\n".join(lines)
    rows = [
        ("KV cache groups", len(on.groups), len(off.groups)),
        ("block size", on.layers.attention_block_size, off.layers.attention_block_size),
        ("bytes per block", on.bytes_per_block, off.bytes_per_block),
        ("num_blocks", on.num_blocks, off.num_blocks),
        ("blocks per request", on.blocks_per_request, off.blocks_per_request),
        ("KV bytes per request", _bytes_per_request(on), _bytes_per_request(off)),
        ("KV cache tokens", on.kv_cache_tokens, off.kv_cache_tokens),
        ("max concurrency (vLLM)", on.max_concurrency, off.max_concurrency),
        ("steady-state concurrency", on.steady_state_concurrency, off.steady_state_concurrency),
    ]
    lines.append(f"  {'':<26} {'hybrid on':>16} {'hybrid off':>16}")
    for label, a, b in rows:
        digits = 2 if isinstance(a, float) or isinstance(b, float) else 0
        lines.append(f"  {label:<26} {_n(a, digits):>16} {_n(b, digits):>16}")
    saving = comparison.kv_bytes_per_request_saving
    lines.append(f"  the hybrid manager saves {saving * 100:.1f}% of a max_model_len request's KV bytes")
    default = "on" if on.model.default_hybrid_kv_cache else "off"
    lines.append(f"  (vLLM 0.33's default for {on.model.name}: {default})")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


@knob_flags("engine.tensor_parallel_size", "engine.data_parallel_size", "engine.enable_expert_parallel",
            "engine.enable_eplb", "engine.num_redundant_experts",
            "engine.pipeline_parallel_size", "engine.max_model_len", "engine.max_num_batched_tokens",
            "engine.max_num_seqs", "engine.block_size", "engine.kv_cache_dtype", "engine.gpu_memory_utilization",
            "engine.kv_cache_memory_bytes", "engine.hybrid_kv_cache", "engine.async_scheduling",
            "engine.enable_prefix_caching", "engine.prefix_cache_retention_interval", "engine.mamba_cache_mode",
            "engine.mamba_cache_dtype",
            "engine.mamba_ssm_cache_dtype")
def plan(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=f"Model preset: {MODEL_CHOICES}."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help=f"GPU preset: {GPU_CHOICES}."),
    scenario: Optional[Path] = typer.Option(None, "--scenario", help="Scenario TOML with [model], [hardware], "
                                                                      "[engine] (scenarios/README.md), or a "
                                                                      "bundled scenario's name (kvtwin scenarios)."),
    hf_config: Optional[Path] = typer.Option(None, "--hf-config", help="A local Hugging Face config.json (or its "
                                                                       "directory) instead of a preset."),
    knobs: Optional[dict] = None,
    compare_hybrid: bool = typer.Option(False, "--compare-hybrid", help="Show hybrid manager on vs off."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """What fits: KV cache groups, blocks, tokens, concurrency and memory, as vLLM 0.33 plans them."""
    with user_errors():
        overrides = Overrides.from_knobs(knobs or {}, model=model, hf_config=hf_config, gpu=gpu)
        resolved = resolve_scenario(find_scenario(scenario, "--scenario"), overrides)
        chosen_model, chosen_gpu, engine = resolved.model, resolved.gpu, resolved.engine
        if compare_hybrid:
            comparison = compare_hybrid_layouts(chosen_model, chosen_gpu, engine)
            print(json.dumps(comparison.to_json(), indent=1) if as_json else render_compare(comparison))
            on = comparison.on
            if not on.fits:
                raise typer.Exit(code=EXIT_DOES_NOT_FIT)
            return
        pd = resolved.disaggregation
        if pd is not None and pd.has_data_parallel_sides:
            # Wide-EP P/D: each side is a DP engine of its own size, planned on its own
            # (docs/semantics.md#data-parallel-pd-sides).
            sides = {role: make_plan(chosen_model, chosen_gpu, dataclasses.replace(engine, data_parallel_size=size))
                     for role, size in (("prefill", pd.prefill_data_parallel_size),
                                        ("decode", pd.decode_data_parallel_size))}
            print(json.dumps({role: side.to_json() for role, side in sides.items()}, indent=1) if as_json else
                  "\n\n".join(f"{role} side:\n{render_plan(side)}" for role, side in sides.items()))
            if not all(side.fits for side in sides.values()):
                raise typer.Exit(code=EXIT_DOES_NOT_FIT)
            return
        result = make_plan(chosen_model, chosen_gpu, engine)
        print(json.dumps(result.to_json(), indent=1) if as_json else render_plan(result))
    if not result.fits:
        raise typer.Exit(code=EXIT_DOES_NOT_FIT)
