"""The replay report: what ran, the plan, the key metrics of ``summary.parquet`` and the
plots of the steps and requests (``reports.replay_plots``)."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from kvtwin.reports.html_page import page
from kvtwin.reports.html_tables import fmt_cell, kv_table, rows_table
from kvtwin.reports.paths import REPLAY_FILES
from kvtwin.reports.replay_plots import replay_figures
from kvtwin.reports.run_facts import clock_note, header, plan_section, run_settings
from kvtwin.reports.summary_text import (format_acceptance_length, format_bytes, format_duration_ms, format_duration_s,
                                         format_percent, latency_rows, missing, run_headline)
from kvtwin.sim.calibration.band import uncalibrated_line
from kvtwin.sim.calibration.file import UNCALIBRATED



def render_replay_report(requests: pa.Table, steps: pa.Table, summary, plan: dict, metadata: dict, *,
                         sources: Sequence[str] = REPLAY_FILES, replicas: pa.Table | None = None) -> str:
    """The replay report as one HTML string (tables as written to a run directory);
    ``replicas`` (``replicas.parquet``) adds a table of each replica or DP rank."""
    s = _summary_row(summary)
    metadata = metadata or {}
    extra = [("requests replayed", fmt_cell(s.get("num_requests")))]
    if s.get("num_trace_requests") is not None:
        extra.append(("trace requests (after the scenario's cuts)", fmt_cell(s.get("num_trace_requests"))))
    headline = run_headline(run_settings(metadata, plan, s))
    sections = [header("replay", metadata, sources, extra, headline=headline), clock_note(_clock_lines(s)),
                plan_section(plan),
                "<h2>Key metrics</h2>" + kv_table(_replay_metrics(s), "meta"),
                *_replica_section(replicas), "<h2>Plots</h2>", *replay_figures(requests, steps, s, plan)]
    return page(f"kvtwin replay report: {headline}", sections)


def _summary_row(summary) -> dict:
    if isinstance(summary, pa.Table):
        rows = summary.to_pylist()
        return rows[0] if rows else {}
    return dict(summary)


def _clock_lines(s: dict) -> list[str]:
    """The uncalibrated line, when the clock ran on the default factors (none otherwise)."""
    if s.get("calibration") == UNCALIBRATED or s.get("calibration_note"):
        return [uncalibrated_line(s.get("calibration_note") or "")]
    return []


def _clock_text(s: dict) -> str:
    """The calibration and the band on each p99 (summary.parquet's band columns)."""
    name = s.get("calibration")
    if missing(name):
        return "-"
    if s.get("calibration_note"):
        return f"{name}: {s['calibration_note']}"
    bands = [f"{label} {format_duration_ms(s[f'p99_{key}_ms_low'])}-{format_duration_ms(s[f'p99_{key}_ms_high'])}"
             for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2el"))
             if not missing(s.get(f"p99_{key}_ms_low"))]
    return f"{name}" + (f"; p99 band (server-side): {', '.join(bands)}" if bands else "")


def _ms(s: dict, name: str) -> str:
    """Mean / p50 / p90 / p99 of one latency of the summary, in milliseconds."""
    return " / ".join(format_duration_ms(s.get(f"{stat}_{name}_ms")) for stat in ("mean", "median", "p90", "p99"))


def _replay_metrics(s: dict) -> list[tuple[str, str]]:
    rows = [("requests: completed / rejected / unfinished",
             f"{fmt_cell(s.get('completed'))} / {fmt_cell(s.get('rejected'))} / {fmt_cell(s.get('unfinished'))}"),
            ("simulated duration", format_duration_s(s.get("duration_s"))),
            ("request throughput (req/s)", fmt_cell(s.get("request_throughput"))),
            ("output / all tokens per s",
             f"{fmt_cell(s.get('output_throughput'))} / {fmt_cell(s.get('total_token_throughput'))}"),
            *((f"{name} mean / p50 / p90 / p99", _ms(s, key.removesuffix("_ms")))
              for name, key in latency_rows(s) if not key.startswith("queue")),
            ("clock calibration", _clock_text(s)),
            ("queue delay mean / p50 / p90 / p99", _ms(s, "queue_delay")),
            ("prefix cache hit rate (tokens)", format_percent(s.get("prefix_cache_hit_rate"))),
            ("infinite-cache bound (trace)", format_percent(s.get("prefix_reuse_upper_bound"))),
            ("preemptions / recomputed tokens",
             f"{fmt_cell(s.get('num_preemptions'))} / {fmt_cell(s.get('recomputed_tokens'))}"),
            ("evicted cached blocks", fmt_cell(s.get("num_evictions"))),
            ("KV cache usage peak / mean",
             f"{format_percent(s.get('kv_cache_usage_peak'))} / {format_percent(s.get('kv_cache_usage_mean'))}")]
    if any(not missing(s.get(k)) for k in ("slo_ttft_ms", "slo_tpot_ms")):
        rows += [("SLO: TTFT (as a client sees it) / TPOT at most",
                  f"{format_duration_ms(s.get('slo_ttft_ms'))} / {format_duration_ms(s.get('slo_tpot_ms'))}"),
                 ("SLO attainment (all requests) / rejected",
                  f"{format_percent(s.get('slo_attainment'))} / {format_percent(s.get('rejected_share'))}"),
                 ("goodput (req/s within the SLO)", fmt_cell(s.get("request_goodput")))]
    if s.get("hit_rate_total") is not None:
        rows += _offload_metrics(s)
    if "spec_acceptance_rate" in s:
        rows += _spec_metrics(s)
    if not missing(s.get("dp_group_steps")):
        rows += _lockstep_metrics(s)
    if "saturated" in s:
        rows.append(("saturated", ("yes: " + str(s.get("saturation_reason") or "")) if s.get("saturated") else "no"))
    if s.get("rejected_by_reason") not in (None, "", "{}"):
        rows.append(("rejected by reason", s["rejected_by_reason"]))
    return rows


def _lockstep_metrics(s: dict) -> list[tuple[str, str]]:
    """A DP MoE group stepping together: its steps, the dummy batches, the MoE collectives'
    share of the busy time (docs/clock.md#moe-under-data-parallelism)."""
    return [("DP ranks in lockstep: group steps / waves / dummy batches",
             f"{fmt_cell(s.get('dp_group_steps'))} / {fmt_cell(s.get('dp_waves'))} / {fmt_cell(s.get('dummy_steps'))}"),
            ("MoE collectives (dispatch and combine), share of busy time",
             format_percent(s.get("moe_communication_share")))]


# Each replica's row of the report: a label and how its ``replicas.parquet`` columns read.
_REPLICA_COLUMNS = (
    ("requests", lambda r: fmt_cell(r.get("num_requests"))),
    ("load ratio", lambda r: fmt_cell(r.get("load_ratio"))),
    ("prefix cache hit rate", lambda r: format_percent(r.get("prefix_cache_hit_rate"))),
    ("KV cache usage peak / mean",
     lambda r: f"{format_percent(r.get('kv_cache_usage_peak'))} / {format_percent(r.get('kv_cache_usage_mean'))}"),
    ("preemptions", lambda r: fmt_cell(r.get("num_preemptions"))),
    ("p99 TTFT", lambda r: format_duration_ms(r.get("p99_ttft_ms"))),
    ("p99 TPOT", lambda r: format_duration_ms(r.get("p99_tpot_ms"))),
)


def _replica_section(replicas: pa.Table | None) -> list[str]:
    """One row per replica or DP rank (its role with P/D, its dummy batches in a lockstep
    group); nothing with a single replica."""
    if replicas is None or replicas.num_rows <= 1:
        return []
    rows = replicas.to_pylist()
    names = ["replica", *(("role",) if "role" in replicas.column_names else ()),
             *(label for label, _ in _REPLICA_COLUMNS)]
    dummies = "dummy_steps" in replicas.column_names
    if dummies:
        names.append("dummy batches")
    body = [[r["replica"], *((r["role"],) if "role" in r else ()), *(read(r) for _, read in _REPLICA_COLUMNS),
             *((r["dummy_steps"],) if dummies else ())] for r in rows]
    return ["<h2>Replicas</h2>", rows_table(names, body)]


def _spec_metrics(s: dict) -> list[tuple[str, str]]:
    """Speculative decoding: how many drafts were accepted, overall and by position."""
    rows = [("speculative decoding: acceptance rate (accepted / draft tokens)",
             f"{format_percent(s.get('spec_acceptance_rate'))} ({fmt_cell(s.get('spec_accepted_tokens'))} / "
             f"{fmt_cell(s.get('spec_draft_tokens'))})"),
            ("mean acceptance length (tokens per verify step)",
             format_acceptance_length(s.get("mean_acceptance_length")))]
    by_position = s.get("spec_acceptance_by_position")
    if by_position:
        rows.append(("acceptance rate by draft position (1st, 2nd, ...)",
                     " / ".join(format_percent(rate) for rate in by_position)))
    return rows


def _offload_metrics(s: dict) -> list[tuple[str, str]]:
    """Offload tiers: hits per tier, the loads, the traffic."""
    return [("offload tiers (policy)", f"{format_bytes(s.get('offload_cpu_bytes'))} CPU"
             + (f" + {format_bytes(s.get('offload_disk_bytes'))} disk" if s.get("offload_disk_chunks") else "")
             + f" ({s.get('offload_policy')})"),
            ("hit rate GPU / CPU / disk / total (prompt tokens)",
             " / ".join(format_percent(s.get(f"hit_rate_{t}")) for t in ("gpu", "cpu", "disk", "total"))),
            ("loads / waits for KV; wait mean / p50 / p90 / p99",
             f"{fmt_cell(s.get('num_loads'))} / {fmt_cell(s.get('num_load_waits'))}; {_ms(s, 'load_wait')}"),
            ("of which before the load was issued (disk promotion, store) mean / p50 / p90 / p99",
             _ms(s, "load_defer")),
            ("of which the transfer mean / p50 / p90 / p99", _ms(s, "load_transfer")),
            ("KV loaded / stored over PCIe",
             f"{format_bytes(s.get('kv_offload_load_bytes'))} / {format_bytes(s.get('kv_offload_store_bytes'))}")]
