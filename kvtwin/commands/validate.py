"""`kvtwin validate`: run the scenario's engine on a device and check the predictions.

Parses flags, resolves the scenario, checks everything it can before the first kernel
runs (the output directory, the plan, the device, the pool's size), then runs the checks
of ``kvtwin.executor.validate`` and prints one verdict line each. Writes
``validation.parquet`` (one row per checked item), ``steps.parquet`` (the executor's
measured steps beside the cost model's predictions), ``calibration.toml`` (check 4's fit,
which ``kvtwin replay`` accepts as ``[cost_model] calibration``) and ``plan.json``.
Exit status: 0 when every check passed (or was informational / skipped), 1 when one
failed, 2 for bad input.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from kvtwin.console import interrupt_note, user_errors
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.core.errors import ConfigError

# Validation runs the workload four times on the device (prefix caching on and off, and the
# two halves for calibration): a hundred requests is minutes on a GPU; the CPU's torch
# reference takes about half a minute per long (Mooncake-sized) request.
DEFAULT_REQUESTS = {"cuda": 100, "cpu": 8}


def validate(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="SCENARIO.toml",
                                                   help="Scenario file (default: scenarios/default.toml)."),
    device: str = typer.Option("cpu", "--device", help="cuda (real sizes) or cpu (a scaled-down model)."),
    requests: Optional[int] = typer.Option(None, "--requests", "-n",
                                           help="Validate on the first N requests of the trace (default: 100 on "
                                                "cuda, 8 on cpu; each check runs the workload again)."),
    checks: Optional[str] = typer.Option(None, "--checks",
                                         help="Comma-separated subset of: prefix_hits_are_real, "
                                              "predicted_hits_are_executed, memory, step_latency."),
    clock: str = typer.Option("measured", "--clock", help="measured (step time = device time) or wall."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    out: Path = typer.Option(Path("runs/validate"), "--out", "-o", help="Directory to write."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
) -> None:
    """Run the engine on a device and check prefix hits, memory and step times against the simulator."""
    with user_errors(), interrupt_note(lambda: f"interrupted; nothing written to {out}"):
        from kvtwin.reports.run_dir import check_out_dir, run_metadata, write_dir
        from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario

        check_out_dir(out)
        chosen = _checks(checks)
        if requests is None:
            requests = DEFAULT_REQUESTS.get(device, DEFAULT_REQUESTS["cpu"])
        elif requests <= 0:
            raise ConfigError("--requests", "a positive number of requests", requests)
        path = scenario_path or DEFAULT_SCENARIO
        overrides = Overrides(limit=requests)
        resolved = resolve_scenario(path, overrides)
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
        workload = resolved.require_workload()
        planned = resolved.plan()
        planned.require_fits()
        _require_torch()
        from kvtwin.executor.device_replay import ExecutorOptions, check_pool_fits, require_device
        from kvtwin.executor.validate import ValidateOptions
        from kvtwin.executor.validate import validate as run_validation

        options = ExecutorOptions(device=device, clock=clock, seed=seed)
        require_device(device)
        check_pool_fits(planned, options)
        trace = workload.load()
        started = time.perf_counter()

        def progress(stage: str) -> None:
            if not quiet:
                print(f"kvtwin: validate: {stage} ({time.perf_counter() - started:,.0f} s)", file=sys.stderr,
                      flush=True)

        result = run_validation(resolved, trace, ValidateOptions(executor=options, checks=chosen), progress=progress)
        texts = {"calibration.toml": result.calibration_toml} if result.calibration_toml else {}
        tables = {"validation": result.table()}
        if result.executor_steps is not None:
            tables["steps"] = result.executor_steps
        paths = write_dir(out, tables=tables, json_files={"plan": planned.to_json()}, text_files=texts,
                          run_metadata=run_metadata(path, {**overrides.given(), "device": device, "clock": clock}))
    for verdict in result.verdicts:
        print(verdict.line)
    print(f"{trace.num_rows:,} requests of {planned.model.name} on {device}; wrote "
          f"{', '.join(p.name for p in paths)} to {out} in {time.perf_counter() - started:,.1f} s")
    if result.failed:
        raise typer.Exit(code=1)


def _checks(value: str | None) -> tuple[str, ...]:
    from kvtwin.executor.validate import CHECKS

    if value is None:
        return CHECKS
    chosen = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in chosen if name not in CHECKS]
    if unknown or not chosen:
        raise ConfigError("--checks", f"a comma-separated subset of {', '.join(CHECKS)}", value)
    return chosen


def _require_torch() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ConfigError("--device", "torch installed for the executor (pip install 'kvtwin[kernels]')",
                          "no torch")
