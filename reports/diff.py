"""``kvtwin diff RUN_A RUN_B``: two replay run directories side by side.

Every figure a replay reports (latency percentiles, throughput, hit rate, SLO attainment,
preemptions, KV usage, and the plan's blocks and concurrency) with its change from A to B,
absolute and relative, and the settings that differ between the two runs (what ran, as the
run directories recorded it: ``run_facts.run_settings``, and the plan's engine settings).
``diff_table`` is ``diff.parquet`` (one row per figure); ``render_diff_html`` the page with
the two runs' plots overlaid (``reports.diff_plots``, loaded only there: the console diff
draws nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from kvtwin.reports.paths import REPLAY_FILES
from kvtwin.reports.run_facts import run_settings
from kvtwin.reports.run_files import directory_kind, read_json, read_metadata, read_table, what_is_there
from kvtwin.reports.summary_text import (format_duration_ms, format_duration_s, format_percent, missing,
                                         run_headline)
from kvtwin.sim.core.errors import ConfigError

__all__ = ["FigureChange", "Run", "check_diff_out", "compare", "diff_table", "differing_settings", "format_change", "format_relative",
           "format_value", "read_run", "render_diff_html"]

# (summary column, label, unit): the run's figures, in the order they are shown. Units:
# ms and s (durations), share (a fraction, changes in percentage points), per_s, count, x.
SUMMARY_FIGURES: tuple[tuple[str, str, str], ...] = (
    *((f"{stat}_{key}_ms", f"{name} {label}", "ms")
      for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E latency", "e2el"))
      for stat, label in (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99"))),
    ("p99_itl_ms", "ITL p99", "ms"),
    ("p99_queue_delay_ms", "queue delay p99", "ms"),
    ("request_throughput", "request throughput (req/s)", "per_s"),
    ("output_throughput", "output tokens per s", "per_s"),
    ("total_token_throughput", "all tokens per s", "per_s"),
    ("prefix_cache_hit_rate", "prefix cache hit rate (GPU)", "share"),
    ("hit_rate_total", "prefix hits, all offload tiers", "share"),
    ("prefix_reuse_upper_bound", "infinite-cache bound", "share"),
    ("slo_attainment", "SLO attainment (all requests)", "share"),
    ("rejected_share", "rejected share", "share"),
    ("request_goodput", "goodput (req/s within the SLO)", "per_s"),
    ("num_requests", "requests arrived", "count"),
    ("completed", "completed", "count"),
    ("rejected", "rejected", "count"),
    ("unfinished", "unfinished", "count"),
    ("num_preemptions", "preemptions", "count"),
    ("recomputed_tokens", "recomputed tokens", "count"),
    ("num_evictions", "evicted cached blocks", "count"),
    ("kv_cache_usage_peak", "KV cache usage peak", "share"),
    ("kv_cache_usage_mean", "KV cache usage mean", "share"),
    ("duration_s", "simulated duration", "s"),
)
# (plan.json key, label, unit): the KV cache plan of one replica.
PLAN_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("num_usable_blocks", "KV blocks (usable, per replica)", "count"),
    ("kv_cache_tokens", "KV cache tokens (per replica)", "count"),
    ("max_concurrency", "max concurrency (requests of max_model_len)", "x"),
    ("steady_state_concurrency", "steady-state concurrency", "x"),
    ("concurrency_limit", "requests of max_model_len at once", "count"),
)
# plan.json's engine settings compared beside what ran.
PLAN_SETTINGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_dtype",
                 "enable_prefix_caching", "prefix_cache_retention", "async_scheduling", "hybrid_kv_cache_manager",
                 "num_groups")
# What the overlaid plots read of the two tables.
REQUEST_COLUMNS = ("status", "ttft_s", "tpot_s", "e2el_s", "first_scheduled_time_s", "prefix_cache_hits",
                   "prefix_cache_queries")
STEP_COLUMNS = ("time_s", "duration_s", "kv_cache_usage", "replica")


@dataclass(frozen=True)
class Run:
    """One replay run directory, read back."""

    directory: Path
    summary: dict
    plan: dict
    metadata: dict

    @property
    def settings(self) -> dict:
        return run_settings(self.metadata, self.plan, self.summary)

    @property
    def headline(self) -> str:
        return run_headline(self.settings)


def read_run(directory: str | Path, field: str) -> Run:
    """The run directory ``directory``, or one ``ConfigError`` naming ``field`` (RUN_A,
    RUN_B) and what is there instead."""
    directory = Path(directory)
    if directory_kind(directory) != "replay":
        raise ConfigError(field, f"a replay run directory ({', '.join(REPLAY_FILES)}: kvtwin replay --out DIR)",
                          f"{directory} ({what_is_there(directory)})")
    rows = read_table(directory / "summary.parquet").to_pylist()
    if len(rows) != 1:
        raise ConfigError(str(directory / "summary.parquet"), "one summary row", len(rows))
    plan = read_json(directory / "plan.json")
    return Run(directory, rows[0], plan.get("hybrid_on", plan), read_metadata(directory / "summary.parquet"))


def check_diff_out(out: Path) -> None:
    """Refuse an ``--out`` that holds a run: the directory is replaced whole, and it may be
    RUN_A or RUN_B itself."""
    kind = directory_kind(out)
    if kind is not None:
        raise ConfigError("--out", f"a new or empty directory or a previous diff directory (this is a {kind} "
                                   f"directory, which diff.parquet and diff.html would replace)", str(out))


@dataclass(frozen=True)
class FigureChange:
    name: str  # the summary column, or ``plan.KEY``
    label: str
    unit: str
    a: float
    b: float

    @property
    def change(self) -> float:
        return self.b - self.a

    @property
    def relative_change(self) -> float:
        """``(b - a) / |a|``; NaN where A is 0 or missing."""
        return self.change / abs(self.a) if self.a and not math.isnan(self.a) else math.nan


def _number(value) -> float:
    if value is None or isinstance(value, str):
        return math.nan
    return float(value)


def compare(a: Run, b: Run) -> list[FigureChange]:
    """Every figure either run has, A's value, B's (NaN where a run lacks it)."""
    out = [FigureChange(column, label, unit, _number(a.summary.get(column)), _number(b.summary.get(column)))
           for column, label, unit in SUMMARY_FIGURES if column in a.summary or column in b.summary]
    out += [FigureChange(f"plan.{key}", label, unit, _number(a.plan.get(key)), _number(b.plan.get(key)))
            for key, label, unit in PLAN_FIGURES if key in a.plan or key in b.plan]
    return out


def _flat(settings: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = None if value == {} else value
    return out


def differing_settings(a: Run, b: Run) -> list[tuple[str, object, object]]:
    """(setting, A's, B's) for each setting the two runs ran with differently (None: the
    run has no such setting, e.g. no offload tier)."""
    first = {**_flat(a.settings), **{f"plan.{k}": a.plan.get(k) for k in PLAN_SETTINGS}}
    second = {**_flat(b.settings), **{f"plan.{k}": b.plan.get(k) for k in PLAN_SETTINGS}}
    return [(key, first.get(key), second.get(key)) for key in dict.fromkeys([*first, *second])
            if first.get(key) != second.get(key)]


def diff_table(changes: Sequence[FigureChange]) -> pa.Table:
    """``diff.parquet``: one row per figure (``reports/SCHEMA.md``)."""
    return pa.table({
        "name": pa.array([c.name for c in changes], pa.string()),
        "label": pa.array([c.label for c in changes], pa.string()),
        "unit": pa.array([c.unit for c in changes], pa.string()),
        "a": pa.array([c.a for c in changes], pa.float64()),
        "b": pa.array([c.b for c in changes], pa.float64()),
        "change": pa.array([c.change for c in changes], pa.float64()),
        "relative_change": pa.array([c.relative_change for c in changes], pa.float64()),
    })


def format_value(unit: str, value: float) -> str:
    if missing(value):
        return "-"
    if unit == "ms":
        return format_duration_ms(value)
    if unit == "s":
        return format_duration_s(value)
    if unit == "share":
        return format_percent(value)
    if unit == "x":
        return f"{value:,.2f}x"
    if unit == "count" or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.4g}"


def format_change(unit: str, change: float) -> str:
    """A change with its sign, in the figure's unit (a share's in percentage points)."""
    if missing(change):
        return "-"
    if unit == "share":
        return f"{_sign(change)}{abs(change) * 100:.1f} pt"
    return _sign(change) + format_value(unit, abs(change))


def _sign(change: float) -> str:
    return "+" if change > 0 else "−" if change < 0 else "±"


def format_relative(relative: float) -> str:
    return "-" if missing(relative) else f"{_sign(relative)}{abs(relative) * 100:.1f} %"


def _shown(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def settings_line(settings: Sequence[tuple[str, object, object]]) -> str:
    if not settings:
        return "settings: the same"
    return "settings that differ (A → B): " + "; ".join(f"{k} {_shown(x)} → {_shown(y)}" for k, x, y in settings)


def render_diff_html(a: Run, b: Run, changes: Sequence[FigureChange],
                     settings: Sequence[tuple[str, object, object]]) -> str:
    """``diff.html``: both runs named, the settings that differ, the figures and the plots
    overlaid (latency CDFs, KV cache usage and hit rate over time)."""
    from kvtwin.reports.diff_plots import diff_figures  # matplotlib, only for the page
    from kvtwin.reports.html_page import escape, page
    from kvtwin.reports.html_tables import kv_table, rows_table

    runs = [(name, run, read_table(run.directory / "requests.parquet", REQUEST_COLUMNS),
             read_table(run.directory / "steps.parquet", STEP_COLUMNS)) for name, run in (("A", a), ("B", b))]
    head = kv_table([(f"run {name}", f"{run.directory}: {run.headline}") for name, run, _, _ in runs])
    shown_settings = (rows_table(["setting", "A", "B"], [[k, _shown(x), _shown(y)] for k, x, y in settings])
                      if settings else '<p class="note">The two runs ran the same settings.</p>')
    figures = rows_table(["figure", "A", "B", "change", "relative"],
                         [[c.label, format_value(c.unit, c.a), format_value(c.unit, c.b),
                           format_change(c.unit, c.change), format_relative(c.relative_change)] for c in changes])
    sections = ["<h1>kvtwin diff</h1>", f'<p class="note">A: {escape(a.headline)}<br>B: {escape(b.headline)}</p>',
                head, "<h2>Settings that differ</h2>", shown_settings, "<h2>Figures (change from A to B)</h2>",
                figures, "<h2>Plots</h2>", *diff_figures(runs)]
    return page(f"kvtwin diff: {a.headline} vs {b.headline}", sections)
