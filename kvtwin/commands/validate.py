"""`kvtwin validate`: run the scenario's engine on a device and check the predictions.

Parses flags, resolves the scenario, checks everything it can before the first kernel
runs (the output directory, the plan, the device, the pool's size), then runs the checks
of ``kvtwin.executor.validate`` and prints one verdict line each, with a progress display
over the checks' stages. ``--size`` (``kvtwin.executor.sizes``): ``small``, the CPU's
default, a cut-down workload that still reuses, evicts and preempts, in under two minutes
on two cores; ``full``, the GPU's default, the scenario as it is. Writes
``validation.parquet`` (one row per checked item), ``steps.parquet`` (the executor's
measured steps beside the cost model's predictions), ``calibration.toml`` (check 4's fit,
which ``kvtwin replay`` accepts as ``[cost_model] calibration``) and ``plan.json``.
Exit status: 0 when every check passed (or was informational / skipped), 1 when one
failed, 2 for bad input.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import typer

from kvtwin.console import interrupt_note, require_extra, user_errors
from kvtwin.knob_options import number_option
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.scenario.bundled import find_scenario
from kvtwin.sim.core.errors import ConfigError


def validate(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="SCENARIO.toml",
                                                   help="Scenario file, or a bundled scenario's name (kvtwin "
                                                        "scenarios; default: default)."),
    device: str = typer.Option("cpu", "--device", help="cuda (real sizes) or cpu (a scaled-down model)."),
    size: Optional[str] = typer.Option(None, "--size",
                                       help="small (the default on cpu: 32 requests cut to 1,024 prompt and 32 "
                                            "output tokens, arriving together, on a pool that evicts and preempts; "
                                            "under two minutes on two cores) or full (the default on cuda: the "
                                            "scenario's requests, lengths, times and pool)."),
    requests: Optional[int] = number_option("--requests", "-n", kind="int", default=None,
                                            help="Validate on the first N requests of the trace (default: 32 at "
                                                 "--size small; at --size full 100 on cuda, 8 on cpu; each check "
                                                 "runs the workload again)."),
    checks: Optional[str] = typer.Option(None, "--checks",
                                         help="Comma-separated subset of: prefix_hits_are_real, "
                                              "predicted_hits_are_executed, memory, step_latency."),
    clock: str = typer.Option("measured", "--clock", help="measured (step time = device time) or wall."),
    seed: int = number_option("--seed", kind="int", default=0, help="Seed of the random weights."),
    out: Path = typer.Option(Path("runs/validate"), "--out", "-o", help="Directory to write."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
) -> None:
    """Run the engine on a device and check prefix hits, memory and step times against the simulator."""
    with user_errors(), interrupt_note(lambda: f"interrupted; nothing written to {out}"):
        from kvtwin.reports.run_dir import check_out_dir, run_metadata, write_dir
        from kvtwin.sim.calibration.band import uncalibrated_line

        check_out_dir(out)
        path = find_scenario(scenario_path) or DEFAULT_SCENARIO
        chosen = _checks(checks)
        resolved, overrides, sizing = _checked_scenario(path, device, size, requests)
        # The flags and the scenario are checked; before the trace is read, the executor's torch.
        require_extra("torch", "kernels", field="validate", needed_for="the device executor")
        resolved, trace = _sized_inputs(resolved, sizing)
        planned = resolved.plan()
        planned.require_fits()
        resolved.require_host_memory(planned)
        from kvtwin.executor.device_replay import ExecutorOptions, check_pool_fits, require_device
        from kvtwin.executor.validate import ValidateOptions
        from kvtwin.executor.validate import validate as run_validation

        if device == "cpu" and sizing.cpu_threads is not None:
            import torch

            torch.set_num_threads(sizing.cpu_threads)
        options = ValidateOptions(executor=ExecutorOptions(device=device, clock=clock, seed=seed), checks=chosen)
        require_device(device)
        check_pool_fits(planned, options.executor)
        started = time.perf_counter()
        with _stage_progress(options, quiet, started) as progress:
            result = run_validation(resolved, trace, options, progress=progress)
        texts = {"calibration.toml": result.calibration_toml} if result.calibration_toml else {}
        tables = {"validation": result.table()}
        if result.executor_steps is not None:
            tables["steps"] = result.executor_steps
        metadata = run_metadata(path, {**overrides.given(), "device": device, "clock": clock, "size": sizing.name})
        paths = write_dir(out, tables=tables, json_files={"plan": planned.to_json()}, text_files=texts,
                          run_metadata=metadata)
    for verdict in result.verdicts:
        print(verdict.line)
    if not resolved.calibration.calibrated:
        # The predictions checked above ran on this clock.
        print(uncalibrated_line(resolved.calibration.note))
    print(f"{trace.num_rows:,} requests of {planned.model.name} on {device} (--size {sizing.name}); wrote "
          f"{', '.join(p.name for p in paths)} to {out} in {time.perf_counter() - started:,.1f} s")
    if result.failed:
        raise typer.Exit(code=1)


def _checked_scenario(path: Path, device: str, size: str | None, requests: int | None):
    """The scenario with the run's requests (``executor.sizes``): (resolved, overrides, the
    size). Refuses what the device executor cannot run; reads no trace."""
    from kvtwin.executor.sizes import DEFAULT_SIZE, requests_of, run_size
    from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario

    if device not in DEFAULT_SIZE:  # checked here too: the size's default depends on it
        raise ConfigError("--device", f"one of {', '.join(DEFAULT_SIZE)}", device)
    chosen = run_size(size or DEFAULT_SIZE[device])
    overrides = Overrides(limit=requests_of(chosen, device, requests))
    resolved = resolve_scenario(path, overrides)
    _require_one_plain_engine(resolved)
    return resolved, overrides, chosen


def _sized_inputs(resolved, chosen):
    """The scenario and its trace at the run's size: (resolved, trace)."""
    from kvtwin.executor.sizes import sized_scenario, sized_trace

    trace = sized_trace(resolved.require_workload().load(), chosen)
    return sized_scenario(resolved, trace, chosen), trace


def _require_one_plain_engine(resolved) -> None:
    if resolved.offload.enabled:
        # The device executor has no offload worker: refuse rather than validate another run.
        raise ConfigError("offload.cpu_bytes", "0 for kvtwin validate (the device executor does not offload "
                          "KV; validate the scenario without its [offload] table)", resolved.offload.cpu_bytes,
                          source=resolved.where)
    if resolved.disaggregation is not None:
        # One engine on one device: there is no second engine to read the KV from.
        raise ConfigError("disaggregation", "no [disaggregation] table for kvtwin validate (the device "
                          "executor runs one aggregated engine; validate the scenario without it)",
                          source=resolved.where)
    if resolved.speculative.enabled:
        # The device executor proposes no drafts: refuse rather than validate another run.
        raise ConfigError("speculative.method", "no [speculative] table for kvtwin validate (the device "
                          "executor does not draft)", resolved.speculative.method, source=resolved.where)


@contextlib.contextmanager
def _stage_progress(options, quiet: bool, started: float) -> Iterator[Callable[[str], None]]:
    """``validate``'s progress callback: a bar over its stages with the current one and the
    elapsed time on a terminal, a ``kvtwin: validate: STAGE (i/n), N s wall`` line as each
    stage starts in a log, nothing when quiet (``kvtwin.console.progress_display``)."""
    from kvtwin.console import progress_display
    from kvtwin.executor.validate import stages

    names = stages(options)
    state = {"done": 0, "stage": ""}

    def line() -> str:
        return f"{state['stage']} ({state['done'] + 1}/{len(names)})" if state["stage"] else "done"

    with progress_display("validate", len(names), quiet=quiet, started=started, done=lambda: state["done"],
                          line=line, info=lambda: state["stage"]) as update:
        def progress(stage: str) -> None:
            if state["stage"]:
                state["done"] += 1
            state["stage"] = stage
            update(final=True)  # one line per stage in a log; the bar moves on a terminal

        yield progress
        state["done"], state["stage"] = len(names), ""
        update(final=True)


def _checks(value: str | None) -> tuple[str, ...]:
    from kvtwin.executor.verdicts import CHECKS  # not validate's module: that one imports torch

    if value is None:
        return CHECKS
    chosen = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in chosen if name not in CHECKS]
    if unknown or not chosen:
        raise ConfigError("--checks", f"a comma-separated subset of {', '.join(CHECKS)}", value)
    return chosen
