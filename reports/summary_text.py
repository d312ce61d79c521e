"""The words of a run summary: figures in the unit that reads best, and the one-line verdicts.

Shared by every command that prints a run (``kvtwin replay`` now, sweeps and reports
later), so the same figure reads the same everywhere. Inputs are ``summary.parquet`` rows
as dicts (``reports/SCHEMA.md``) and the planner's ``Plan``.
"""

from __future__ import annotations

import json
import math

from kvtwin.sim.scenario.slo import admitted_attainment

# Tried in order: the first unit in which the value is at least 1 is the one it reads best in.
_UNITS_S = ((3600.0, "h"), (60.0, "min"), (1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))


def missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def format_duration_s(seconds: float | None) -> str:
    """``52.1 min``, ``3.2 s``, ``41 ms``: three significant figures at most, ``-`` for none."""
    if missing(seconds):
        return "-"
    if seconds == 0:
        return "0 s"
    size = abs(seconds)
    for scale, unit in _UNITS_S:
        # Rounded first, so 0.9996 s reads "1.0 s", not "1,000 ms" (and 59 min stays minutes).
        if round(size / scale, 3) >= 1 or unit == "µs":
            value = seconds / scale
            # Judged on the value as shown to one decimal, so 99.96 s reads "100 s", not "100.0 s".
            shown = round(abs(value), 1)
            digits = 0 if shown >= 100 or unit in ("ms", "µs") and shown >= 10 else 1
            return f"{value:,.{digits}f} {unit}"
    raise AssertionError("unreachable")


def format_duration_ms(milliseconds: float | None) -> str:
    """A summary's ``_ms`` column in the unit that reads best."""
    return "-" if missing(milliseconds) else format_duration_s(milliseconds / 1000)


def format_percent(fraction: float | None, digits: int = 1) -> str:
    return "-" if missing(fraction) else f"{fraction * 100:.{digits}f} %"


def run_headline(resolved: dict) -> str:
    """What ran, in one line, from the resolved settings (``ResolvedScenario.describe``):
    ``qwen3-8b on 2 replicas of 2x h200 behind prefix_aware, CPU KV offload 1.0 TB (lru)``;
    ``gpt-oss-20b on DP 4 (ranks in lockstep) of 1x h100 behind dp_lb``; ``llama-3.1-8b on
    2x h100 (TP 1, PP 2)``."""
    tp = resolved.get("tensor_parallel_size") or 1
    parallel = resolved.get("parallel") or {}
    pp = parallel.get("pipeline_parallel_size") or 1
    gpus = f"{tp * pp}x {resolved.get('gpu')}" + (f" (TP {tp}, PP {pp})" if pp > 1 else "")
    pd = resolved.get("disaggregation")
    dp = parallel.get("data_parallel_size") or 1
    if pd:
        where = f"{pd['prefill_replicas']}P{pd['decode_replicas']}D of {gpus} over {pd['link']}"
    elif dp > 1:
        how = "ranks in lockstep" if parallel.get("dp_lockstep") else "independent ranks"
        ep = " + EP" if parallel.get("enable_expert_parallel") else ""
        where = f"DP {dp}{ep} ({how}) of {gpus} behind {parallel.get('dp_router')}"
    elif (resolved.get("replicas") or 1) > 1:
        where = f"{resolved['replicas']} replicas of {gpus} behind {resolved.get('router')}"
    else:
        where = gpus
    parts = [f"{resolved.get('model')} on {where}"]
    offload = resolved.get("offload")
    if offload:
        tiers = f"CPU KV offload {format_bytes(offload['cpu_bytes'])}"
        if offload.get("disk_bytes"):
            tiers += f" + disk {format_bytes(offload['disk_bytes'])}"
        parts.append(f"{tiers} ({offload['policy']})")
    spec = resolved.get("speculative")
    if spec:
        k = spec.get("num_speculative_tokens")
        parts.append(f"speculative {spec['method']}" + (f" k={k}" if k else ""))
    return ", ".join(parts)


def plan_line(plan) -> str:
    """The KV cache layout a run used, in one line: blocks, KV tokens, max concurrency."""
    usable = max(plan.num_blocks - 1, 0)
    line = f"plan: {usable:,} KV blocks (+ the null block)"
    if plan.fits:
        line += (f", {plan.kv_cache_tokens:,} KV cache tokens, max concurrency {plan.max_concurrency:,.2f}x "
                 f"requests of {plan.engine.max_model_len:,} tokens")
    if plan.thins_prefix_cache:
        line += f"; prefix-cache retention: {plan.retention}"
    return line


def replicas_line(row: dict, replicas) -> str | None:
    """``replicas: 2 behind prefix_aware: requests 6,137 / 5,894 (imbalance 1.02), hit rate ...``;
    None with one replica. ``replicas`` is the per-replica table (``replicas.parquet``); with
    a ``role`` column (P/D) each side is summed up on its own."""
    if (row.get("num_replicas") or 1) <= 1:
        return None
    per = replicas.to_pylist()
    if "role" in replicas.column_names:
        return _pd_replicas_line(row, per)
    counts = " / ".join(f"{r['num_requests']:,}" for r in per)
    hits = " / ".join(format_percent(r["prefix_cache_hit_rate"]) for r in per)
    line = (f"replicas: {row['num_replicas']} behind {row['router']}: requests {counts} (imbalance "
            f"{row['load_imbalance']:.2f}), prefix cache hit rate {hits}")
    if "dummy_steps" in replicas.column_names and not missing(row.get("dp_group_steps")):
        dummies = " / ".join(f"{r['dummy_steps']:,}" for r in per)
        line += (f"; in lockstep: {int(row['dp_group_steps']):,} group steps in {int(row['dp_waves']):,} waves, "
                 f"dummy batches {dummies}, MoE collectives {format_percent(row.get('moe_communication_share'))} "
                 f"of busy time")
        if not missing(row.get("moe_communication_pricing")):
            line += f" ({row['moe_communication_pricing']})"
    if len(per) > 1 and "kv_cache_usage_peak" in replicas.column_names:
        line += "; KV cache usage peak " + " / ".join(format_percent(r["kv_cache_usage_peak"], 0) for r in per)
    return line


def _pd_replicas_line(row: dict, per: list[dict]) -> str:
    """``replicas: 2 prefill + 1 decode behind pd:...: prefill requests 520 / 480 (imbalance
    1.04), prefix cache hit rate ...; decode requests 1,000 (imbalance 1.00), ...``: each side
    on its own, since every request visits one replica of each (their counts are not
    comparable across sides)."""
    sides = []
    for role in ("prefill", "decode"):
        mine = [r for r in per if r["role"] == role]
        counts = " / ".join(f"{r['num_requests']:,}" for r in mine)
        ratios = [r["load_ratio"] for r in mine if not missing(r["load_ratio"])]
        imbalance = f"{max(ratios):.2f}" if ratios else "-"
        hits = " / ".join(format_percent(r["prefix_cache_hit_rate"]) for r in mine)
        sides.append((role, len(mine), f"{role} requests {counts} (imbalance {imbalance}), prefix cache hit "
                                       f"rate {hits}"))
    shape = " + ".join(f"{count} {role}" for role, count, _ in sides)
    return f"replicas: {shape} behind {row['router']}: " + "; ".join(text for _, _, text in sides)


def prefix_line(row: dict) -> str:
    """The hit rate next to what an infinite cache could have hit on the same requests.
    With offload tiers it is every tier's hits (GPU prefix caching may be off, and then
    each hit is a load), with the GPU's part named."""
    hit = format_percent(row["prefix_cache_hit_rate"])
    if row.get("hit_rate_total") is not None:
        hit = f"{format_percent(row['hit_rate_total'])} (GPU {format_percent(row['hit_rate_gpu'])})"
    bound = row.get("prefix_reuse_upper_bound")
    if missing(bound):
        return f"{hit} (no bound: no content identity)"
    return f"{hit} of {format_percent(bound)} possible"


def format_bytes(num_bytes: float | None) -> str:
    """``200 GB``, ``1.5 TB``: decimal units, three significant figures at most."""
    if missing(num_bytes):
        return "-"
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(num_bytes) >= scale:
            value = num_bytes / scale
            return f"{value:,.{0 if round(abs(value), 1) >= 100 else 1}f} {unit}"
    return f"{num_bytes:,.0f} B"


def offload_line(row: dict) -> str | None:
    """``offload: 200 GB CPU (lru, 12,207 chunks): hits GPU 17.1 % + CPU 9.8 % = 26.9 % of
    prompt tokens; 1,234 loads, 1,240 waits for KV: p50 8 ms, p99 15 ms (before the load p99
    0 s, transfer p99 9 ms); 1.2 TB loaded, 3.4 TB stored``; None without offload tiers. A
    wait runs from the first lookup that found the hit in a tier (``load_wait_s``): "before
    the load" is a disk promotion's or a store's time before the load could start."""
    if row.get("hit_rate_total") is None:
        return None
    tiers = f"{format_bytes(row['offload_cpu_bytes'])} CPU"
    if row.get("offload_disk_chunks"):
        tiers += f" + {format_bytes(row['offload_disk_bytes'])} disk"
    hits = f"GPU {format_percent(row['hit_rate_gpu'])} + CPU {format_percent(row['hit_rate_cpu'])}"
    if row.get("offload_disk_chunks"):
        hits += f" + disk {format_percent(row['hit_rate_disk'])}"
    line = (f"offload: {tiers} ({row['offload_policy']}, {row['offload_cpu_chunks']:,} chunks): hits {hits} = "
            f"{format_percent(row['hit_rate_total'])} of prompt tokens")
    if row.get("num_load_waits") or row["num_loads"]:
        line += (f"; {row['num_loads']:,} loads, {row.get('num_load_waits', row['num_loads']):,} waits for KV: "
                 f"p50 {format_duration_ms(row['median_load_wait_ms'])}, "
                 f"p99 {format_duration_ms(row['p99_load_wait_ms'])} (before the load p99 "
                 f"{format_duration_ms(row.get('p99_load_defer_ms'))}, transfer p99 "
                 f"{format_duration_ms(row['p99_load_transfer_ms'])})")
    return (line + f"; {format_bytes(row['kv_offload_load_bytes'])} loaded, "
            f"{format_bytes(row['kv_offload_store_bytes'])} stored")


def spec_line(row: dict) -> str | None:
    """``speculative decoding: acceptance rate 62.1 % (1,234 of 1,987 drafts), mean
    acceptance length 2.86 tokens per verify step; by draft position 81.0 % / 62.3 % /
    43.9 %``; None without drafts."""
    if "spec_acceptance_rate" not in row:
        return None
    line = (f"speculative decoding: acceptance rate {format_percent(row['spec_acceptance_rate'])} "
            f"({row['spec_accepted_tokens']:,} of {row['spec_draft_tokens']:,} drafts), mean acceptance length "
            f"{format_acceptance_length(row['mean_acceptance_length'])} tokens per verify step")
    by_position = row.get("spec_acceptance_by_position")
    if by_position:
        line += "; by draft position " + " / ".join(format_percent(rate) for rate in by_position)
    return line


def format_acceptance_length(value: float | None) -> str:
    return "-" if missing(value) else f"{value:.2f}"


def rejections_line(row: dict) -> str | None:
    """``rejected 3: exceeds_max_model_len 2, prompt_too_long 1``; None when nothing was rejected."""
    if not row["rejected"]:
        return None
    counts = json.loads(row.get("rejected_by_reason") or "{}")
    detail = ", ".join(f"{code} {count:,}" for code, count in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"rejected {row['rejected']:,}" + (f": {detail}" if detail else "")


def not_arrived_line(row: dict) -> str | None:
    """What a time limit cut: requests of the trace that never arrived."""
    missing = row.get("not_arrived") or 0
    if not missing:
        return None
    return (f"time limit: the run stopped at {format_duration_s(row['duration_s'])} simulated; "
            f"{missing:,} of the trace's {row['num_trace_requests']:,} requests never arrived "
            f"and are not in the figures")


def has_client_side(row: dict) -> bool:
    """Whether the row has the client-side figures (every run since they were added;
    docs/capacity.md#client-side-latency)."""
    return not missing(row.get("client_overhead_ms"))


def outside_engine(row: dict) -> str:
    """The time outside the engine a client also waits for: ``+8 ms outside the engine``,
    or ``none outside the engine`` when the calibration sets 0."""
    overhead = row.get("client_overhead_ms")
    return (f"+{format_duration_ms(overhead)} outside the engine" if overhead
            else "no time outside the engine")


def client_and_server(row: dict, stat: str, key: str) -> str:
    """One latency figure with its side named: ``120 ms (server; 128 ms as a client sees
    it, +8 ms outside the engine)``; the server's alone, named so, without client columns."""
    server = format_duration_ms(row.get(f"{stat}_{key}_ms"))
    if not has_client_side(row):
        return f"{server} (server)"
    client = format_duration_ms(row.get(f"{stat}_{key}_client_ms"))
    return f"{server} (server; {client} as a client sees it, {outside_engine(row)})"


def latency_rows(row: dict) -> list[tuple[str, str]]:
    """The latency table's rows (label, summary column stem), TTFT and E2E named as the
    server's and followed by the client's (docs/capacity.md#client-side-latency)."""
    client = has_client_side(row)
    server = " (server)" if client else ""
    overhead = row.get("client_overhead_ms")
    added = f"+{format_duration_ms(overhead)}" if client and overhead else "the same"
    rows = [(f"TTFT{server}", "ttft_ms")]
    if client:
        rows.append((f"TTFT (client, {added})", "ttft_client_ms"))
    rows += [("TPOT", "tpot_ms"), ("ITL", "itl_ms"), (f"E2E latency{server}", "e2el_ms")]
    if client:
        rows.append((f"E2E latency (client, {added})", "e2el_client_ms"))
    rows.append(("queue delay (to first schedule)", "queue_delay_ms"))
    return rows


def slo_verdict(row: dict) -> str:
    """The run against its SLO in one line, from a ``summary.parquet`` row: ``SLO met: p99
    TTFT 1.4 s ≤ 2.0 s, p99 TPOT 16 ms ≤ 100 ms (99.5 % of requests within both)``, or ``SLO
    not met:`` and what binds, the bound exceeded by the largest factor first, then the
    requests refused or left unfinished (misses too, as in ``slo_attainment``), or ``no SLO
    set``; a saturated run says so at the end.

    The TTFT judged is the client's (``p99_ttft_client_ms``; docs/capacity.md#client-side-latency),
    and the line says so with the server's figure beside it; a row from before the
    client-side columns is judged on the server's."""
    client = has_client_side(row)
    bounds = [(name, row.get(f"p99_{key}_client_ms" if client and key == "ttft" else f"p99_{key}_ms"),
               row.get(f"slo_{key}_ms")) for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"))
              if not missing(row.get(f"slo_{key}_ms"))]
    saturated = "; the deployment is saturated" if row.get("saturated") else ""
    if not bounds:
        return "no SLO set" + saturated
    # A TPOT no request has (every output one token) bounds nothing, as in the rate search.
    held = [(name, p99, bound) for name, p99, bound in bounds if missing(p99) or p99 <= bound]
    exceeded = sorted(((name, p99, bound) for name, p99, bound in bounds if not (missing(p99) or p99 <= bound)),
                      key=lambda b: -b[1] / b[2])
    within = (f"{format_percent(row.get('slo_attainment'))} of requests within "
              f"{'both' if len(bounds) == 2 else 'it'}")
    refused = []
    if row.get("rejected"):
        share = row.get("rejected_share")
        refused.append(f"{row['rejected']:,} rejected" + ("" if missing(share) else f" ({format_percent(share)})"))
    if row.get("unfinished"):
        refused.append(f"{row['unfinished']:,} unfinished at the time limit")
    if not row.get("completed"):
        refused.append("no request completed")
    def side(name: str) -> str:
        # Which TTFT was judged: the client's, with the server's and the difference.
        if name != "TTFT" or not client:
            return ""
        return (f" as a client sees it (server {format_duration_ms(row.get('p99_ttft_ms'))}, "
                f"{outside_engine(row)})")

    if not exceeded and not refused:
        shown = ", ".join(f"p99 {name} {format_duration_ms(p99)} ≤ {format_duration_ms(bound)}{side(name)}"
                          for name, p99, bound in held if not missing(p99))
        return f"SLO met: {shown} ({within}){saturated}"
    binding = [f"p99 {name} {format_duration_ms(p99)} > {format_duration_ms(bound)}{side(name)}"
               for name, p99, bound in exceeded]
    return f"SLO not met: {', '.join(binding + refused)} ({within}){saturated}"


def saturation_hint(row: dict) -> str | None:
    """Why the run counts as saturated (``saturation_reason``), in words; None when it does not."""
    if not row.get("saturated"):
        return None
    reasons = [r for r in (row.get("saturation_reason") or "").split(",") if r]
    words = []
    if "queueing" in reasons:
        words.append(f"p90 wait to be first scheduled {format_duration_ms(row['p90_queue_delay_ms'])}")
    if "slo" in reasons:
        words.append(f"only {format_percent(admitted_attainment(row))} of the requests admitted met the SLO")
    if "drain" in reasons:
        words.append(f"the last request arrived at {format_duration_s(row['last_arrival_s'])} but the engine "
                     f"needed until {format_duration_s(row['duration_s'])}")
    # The sustained-load rules (docs/capacity.md#sustained-load), with the steady window's figures.
    if "falling_behind" in reasons:
        words.append(f"in the steady window {row['steady_completion_rate']:,.3g} requests/s finished of "
                     f"{row['steady_arrival_rate']:,.3g} arriving")
    if "queue_growth" in reasons:
        words.append(f"the requests in the system grew by {row['steady_queue_growth']:,.1f} over the steady window")
    if "long_drain" in reasons and "drain" not in reasons:
        words.append(f"the engine ran {format_duration_s(row['drain_s'])} past the last arrival")
    return (f"saturated: {'; '.join(words)}. Try more GPUs (--tp), another --gpu or --model, "
            f"or --rate-scale < 1")
