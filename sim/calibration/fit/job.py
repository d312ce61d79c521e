"""One calibration job: read and check the measurements, fit, and write the file.

``prepare`` does every check a user's input needs before the first (slow) replay: the
scenario and its plan, each measurement file, the trace. ``CalibrationJob.run`` fits;
``write`` writes the calibration TOML whole, with the held-out error under ``[error]``
and the measurement files as its sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pyarrow as pa

from kvtwin.sim.calibration.fit.bench_serve import BenchServeResult, read_bench_serve_all
from kvtwin.sim.calibration.fit.prometheus import ServerMetrics, read_scrape, scrape_delta
from kvtwin.sim.calibration.fit.serving import ServingFit, fit_bench_serve, fit_scrape, measured_requests
from kvtwin.sim.calibration.fit.steps_device import device_warning, read_measured_on
from kvtwin.sim.calibration.fit.steps import StepsFit, fit_steps, read_steps
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.calibration.fit.step_model import StepSample, write_calibration
from kvtwin.sim.scenario.resolve import Overrides, ResolvedScenario, resolve_scenario
from kvtwin.traces.bundled import resolve as resolve_trace
from kvtwin.traces.load import load_trace


@dataclass
class CalibrationJob:
    resolved: ResolvedScenario
    kind: str  # "bench serve", "scrape", "steps"
    sources: tuple[str, ...]
    bench: tuple[BenchServeResult, ...] = ()
    metrics: ServerMetrics | None = None
    steps: list[StepSample] | None = None
    trace: pa.Table | None = None
    # Why the measurements may not describe the scenario's GPU (steps timed on a CPU or on
    # another device: ``steps_device``); None when nothing is known against them.
    warning: str | None = None
    measured_on: str | None = None  # the device that measured the steps, as the file says

    def run(self, on_replay: Callable[[int, float], None] | None = None) -> CalibrationResult:
        resolved = self.resolved
        planned = resolved.plan()
        base = resolved.efficiency
        if self.kind == "steps":
            fit = fit_steps(self.steps, flops_per_s=resolved.gpu.bf16_flops,
                            bytes_per_s=resolved.gpu.hbm_bandwidth_bytes_per_s,
                            async_scheduling=resolved.engine.async_scheduling, base=base)
        elif self.kind == "scrape":
            fit = fit_scrape(planned, self.trace, self.metrics, base, deployment=resolved.deployment,
                             on_replay=on_replay)
        else:
            fit = fit_bench_serve(planned, measured_requests(self.bench, self.trace), base,
                                  deployment=resolved.deployment, on_replay=on_replay)
        return CalibrationResult(self, fit)


@dataclass
class CalibrationResult:
    job: CalibrationJob
    fit: ServingFit | StepsFit

    @property
    def label(self) -> str:
        r = self.job.resolved
        label = f"kvtwin calibrate ({self.job.kind}) for {r.model.name} on {r.gpu.name}"
        if self.job.warning is not None:
            # Every replay on the file prints its label: the device goes with it.
            label += f" (measured on {self.job.measured_on or 'an unknown device'})"
        return label

    def errors(self) -> dict[str, float]:
        return self.fit.p90_errors()

    def lines(self) -> list[str]:
        r = self.job.resolved
        fit = self.fit
        calibration = r.calibration
        if calibration is not None and calibration.calibrated:
            started = calibration.label
        else:
            started = "the default factors" + (f" ({calibration.note})" if calibration and calibration.note else "")
        out = [f"calibrated {r.model.name} on {r.engine.tensor_parallel_size}x {r.gpu.name} from "
               f"{len(self.job.sources)} file(s) ({self.job.kind}); started from {started}"]
        if self.job.warning is not None:
            out.append(f"warning: {self.job.warning}")
        if isinstance(fit, ServingFit):
            k = fit.knobs
            out.append(f"fit after {fit.replays} replays: prefill x{k.prefill_scale:.3f}, decode x{k.decode_scale:.3f}"
                       + (f", client overhead {k.client_overhead_s * 1000:.1f} ms" if k.client_overhead_s else ""))
            if self.job.kind == "scrape":
                out.append(f"client overhead kept from the base: {fit.efficiency.client_overhead_s * 1000:.1f} ms "
                           f"(a server's histograms leave the time outside the engine out)")
            out.append(f"held out: {fit.fold}")
            for kind, (median, p90, count) in fit.held_out.items():
                out.append(f"  {kind:<5} median |error| {_pct(median)}, p90 {_pct(p90)} over {count} "
                           f"{'quantiles' if self.job.kind == 'scrape' else 'requests'}")
        else:
            out.append(f"fit: identified {', '.join(fit.fit.identified) or 'nothing'}")
            out += [f"  note: {note}" for note in fit.fit.notes]
            if self.job.kind == "scrape":
                out.append(f"client overhead kept from the base: {fit.efficiency.client_overhead_s * 1000:.1f} ms "
                           f"(a server's histograms leave the time outside the engine out)")
            out.append(f"held out: {fit.fold}")
            for row in fit.held_out:
                out.append(f"  {row['kind']:<13} median |error| {_pct(row['median_ape'])}, p90 {_pct(row['p90_ape'])}"
                           f" over {row['count']} steps")
        return out


def _pct(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1%}"


def prepare(scenario_path: Path, *, bench_serve: Sequence[Path] = (), metrics_before: Path | None = None,
            metrics_after: Path | None = None, model_name: str | None = None, steps: Path | None = None,
            trace: str | None = None) -> CalibrationJob:
    resolved = resolve_scenario(Path(scenario_path), Overrides())
    if resolved.speculative.enabled:
        # The fits replay without drafts: a fit against a drafting server would be off.
        raise ConfigError("speculative.method", "no [speculative] table for kvtwin calibrate (the fits replay "
                          "without drafts)", resolved.speculative.method, source=resolved.where)
    planned = resolved.plan()
    planned.require_fits()
    resolved.require_host_memory(planned)
    table = _trace(trace) if trace is not None else None
    if steps is not None:
        samples = read_steps(steps)
        measured = read_measured_on(steps)
        return CalibrationJob(resolved, "steps", (str(steps),), steps=samples,
                              warning=device_warning(measured, resolved.gpu),
                              measured_on=measured.name if measured is not None else None)
    if metrics_before is not None or metrics_after is not None:
        if metrics_before is None or metrics_after is None:
            raise ConfigError("--metrics-before/--metrics-after", "both scrapes, before and after the load")
        if table is None:
            raise ConfigError("--trace", "the load the scrapes measured, as a trace (a scrape has no requests)")
        metrics = scrape_delta(read_scrape(metrics_before), read_scrape(metrics_after), model_name=model_name)
        return CalibrationJob(resolved, "scrape", (str(metrics_before), str(metrics_after)), metrics=metrics,
                              trace=table)
    bench = tuple(result for path in bench_serve for result in read_bench_serve_all(path))
    measured_requests(bench, table)  # checks the files against each other and the trace now
    return CalibrationJob(resolved, "bench serve", tuple(str(p) for p in bench_serve), bench=bench, trace=table)


def _trace(spec: str) -> pa.Table:
    return load_trace(resolve_trace(spec))  # a TraceError names the file and line


def write(result: CalibrationResult, out: Path) -> Path:
    job = result.job
    device = {"gpu": job.measured_on} if job.measured_on is not None else {}
    sources = [{"path": path, **device, "notes": f"{job.kind} measurements"} for path in job.sources]
    return write_calibration(out, result.fit.efficiency, label=result.label, errors=result.errors(),
                             sources=sources, comment_lines=result.lines(), warning=job.warning)
