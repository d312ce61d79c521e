"""The sections both reports open with: what was run (scenario, trace, overrides,
versions, source files) and the plan it ran on (the engine's sizes and its KV cache
groups)."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence

from kvtwin import __version__
from kvtwin.reports.html_page import escape
from kvtwin.reports.html_tables import fmt_cell, kv_table, rows_table


def scenario_facts(metadata: dict) -> tuple[str, str]:
    """(description, trace) from the run metadata's scenario text and overrides."""
    try:
        scenario = tomllib.loads(metadata.get("scenario") or "")
    except tomllib.TOMLDecodeError:
        scenario = {}
    overrides = metadata.get("overrides") or {}
    description = scenario.get("description") or "(no description)"
    workload = scenario.get("workload") if isinstance(scenario.get("workload"), dict) else {}
    trace = overrides.get("trace") or workload.get("trace") or "(none named)"
    return str(description), str(trace)


def run_settings(metadata: dict, plan: dict | None, summary: dict) -> dict:
    """What a replay ran (``ResolvedScenario.describe``'s keys): as its run directory
    recorded it (metadata ``resolved``), else, for a directory written before kvtwin recorded
    it, what ``plan.json`` and the summary columns still tell."""
    if isinstance(metadata.get("resolved"), dict):
        return metadata["resolved"]
    plan = (plan or {}).get("hybrid_on", plan) or {}
    pd = None
    if summary.get("pd_prefill_replicas") is not None:
        prefill_router, _, decode_router = str(summary.get("router") or "").removeprefix("pd:").partition("/")
        pd = {"prefill_replicas": summary["pd_prefill_replicas"], "decode_replicas": summary["pd_decode_replicas"],
              "link": summary.get("pd_link"), "prefill_router": prefill_router, "decode_router": decode_router}
    offload = None
    if summary.get("offload_cpu_bytes"):
        offload = {"cpu_bytes": summary["offload_cpu_bytes"], "disk_bytes": summary.get("offload_disk_bytes") or 0,
                   "policy": summary.get("offload_policy")}
    head = plan.get("draft_head")
    _, trace = scenario_facts(metadata)
    return {"model": plan.get("model"), "gpu": plan.get("gpu"), "tensor_parallel_size": plan.get("tensor_parallel_size"),
            "replicas": None if pd else summary.get("num_replicas"), "router": None if pd else summary.get("router"),
            "disaggregation": pd, "offload": offload,
            "speculative": {"method": head["method"], "num_speculative_tokens": None} if head else None,
            "workload": trace}


def header(kind: str, metadata: dict, sources: Sequence[str], extra: Sequence[tuple[str, object]] = (),
           headline: str | None = None) -> str:
    """What was run. ``headline`` (a replay's: the run itself, ``summary_text.run_headline``)
    leads where given; the scenario file's description is shown as the file's words."""
    description, trace = scenario_facts(metadata)
    overrides = metadata.get("overrides") or {}
    rows = [*((("what ran", headline),) if headline else ()),
            ("scenario file's description", description),
            ("scenario file", metadata.get("scenario_file") or "-"),
            ("trace", trace),
            ("command-line overrides", ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "none"),
            ("kvtwin version (run)", metadata.get("kvtwin_version") or "-"),
            ("kvtwin version (report)", __version__),
            ("generated from", ", ".join(sources)),
            *extra]
    lead = headline or description
    out = f"<h1>kvtwin {escape(kind)} report</h1><p class=\"note\">{escape(lead)}</p>" + kv_table(rows)
    if metadata.get("scenario"):
        out += ("<details><summary>scenario file text</summary><pre>" + escape(metadata["scenario"]) + "</pre></details>")
    return out


def clock_note(lines: Sequence[str]) -> str:
    """What the command printed about a clock that is not calibrated, under the header: the
    figures below use default factors and have no band (empty when every clock is calibrated)."""
    return "".join(f'<p class="note warning">{escape(line)}</p>' for line in lines)


def plan_section(plan: dict | None) -> str:
    if not plan:
        return "<h2>Plan</h2><p class=\"note\">no plan recorded</p>"
    if "hybrid_on" in plan:  # a --compare-hybrid plan: the layout the run used is the hybrid one
        plan = plan["hybrid_on"]

    def get(key):
        value = plan.get(key)
        return "-" if value is None else value

    rows = [("model", get("model")), ("GPU", get("gpu")), ("tensor parallel", get("tensor_parallel_size")),
            ("max_model_len", fmt_cell(plan.get("max_model_len"))),
            ("max_num_seqs / max_num_batched_tokens",
             f"{fmt_cell(plan.get('max_num_seqs'))} / {fmt_cell(plan.get('max_num_batched_tokens'))}"),
            ("KV cache dtype", get("kv_cache_dtype")),
            ("prefix caching", fmt_cell(plan.get("enable_prefix_caching"))),
            ("hybrid KV cache manager", fmt_cell(plan.get("hybrid_kv_cache_manager"))),
            ("KV cache groups", fmt_cell(plan.get("num_groups"))),
            ("num_blocks (incl. the null block)", fmt_cell(plan.get("num_blocks"))),
            ("bytes per block", fmt_cell(plan.get("bytes_per_block"))),
            ("KV cache tokens", fmt_cell(plan.get("kv_cache_tokens"))),
            ("max concurrency (requests of max_model_len)", fmt_cell(plan.get("max_concurrency"))),
            ("steady-state concurrency", fmt_cell(plan.get("steady_state_concurrency"))),
            ("requests of max_model_len at once (steady state, at most max_num_seqs)",
             fmt_cell(plan.get("concurrency_limit"))),
            ("fits", fmt_cell(plan.get("fits")))]
    out = "<h2>Plan</h2>" + kv_table([(k, v) for k, v in rows if str(v) not in ("-", "- / -")])
    return out + _groups_table(plan.get("groups") or [])


def _groups_table(groups: list[dict]) -> str:
    if not groups:
        return ""
    skip = {"layer_indices", "layer_page_bytes"}
    columns = ["group_id", "kind", "num_layers", "block_size"]
    # Sorted: plan.json is written with sorted keys, the in-memory plan is not.
    for g in groups:
        columns += sorted(k for k, v in g.items() if k not in skip and k not in columns
                          and not isinstance(v, (list, dict)))
    columns = [c for c in columns if any(c in g for g in groups)]
    return "<h3>KV cache groups</h3>" + rows_table(columns, [[g.get(c) for c in columns] for g in groups])
