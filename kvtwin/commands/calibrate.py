"""`kvtwin calibrate`: fit the replay clock to your own server, and write a calibration file.

One kind of measurement per run:

* ``--bench-serve FILE`` (repeatable): `vllm bench serve --save-result --save-detailed`
  result files; ``--trace`` gives the dataset they ran (as a kvtwin trace, in order) so
  prefix caching can hit. The replay is fitted to the requests' TTFT and TPOT.
* ``--metrics-before F --metrics-after F --trace T``: two scrapes of the server's
  ``/metrics`` around a load, and the load as a trace. The replay is fitted to the TTFT
  and ITL histograms between them.
* ``--steps FILE``: `kvtwin validate`'s steps.parquet; the factors are refitted from the
  measured steps. Steps timed on a CPU, or on a device that is not the scenario's GPU, get
  one ``kvtwin: warning:`` line and a ``warning`` in the file (``steps_device``).

The scenario gives the model, GPU and engine (its calibration, bundled or named, is the
starting point). Writes ``--out`` (a TOML a scenario names as ``[cost_model] calibration``)
with the held-out error under ``[error]``, and prints that error per kind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from kvtwin.console import user_errors
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.scenario.bundled import find_scenario
from kvtwin.sim.core.errors import ConfigError


def calibrate(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="SCENARIO.toml",
                                                   help="The server's model, GPU and engine: a scenario file or a "
                                                        "bundled scenario's name (default: default)."),
    bench_serve: Optional[List[Path]] = typer.Option(None, "--bench-serve",
                                                     help="A `vllm bench serve --save-result --save-detailed` "
                                                          "JSON file (repeat for several runs; the last is held "
                                                          "out)."),
    metrics_before: Optional[Path] = typer.Option(None, "--metrics-before",
                                                  help="A /metrics scrape taken before the load."),
    metrics_after: Optional[Path] = typer.Option(None, "--metrics-after",
                                                 help="A /metrics scrape taken after the load."),
    model_name: Optional[str] = typer.Option(None, "--model-name",
                                             help="The scrape's model_name label, when it serves several."),
    steps: Optional[Path] = typer.Option(None, "--steps", help="`kvtwin validate`'s steps.parquet."),
    trace: Optional[str] = typer.Option(None, "--trace",
                                        help="The load the measurements ran, as a trace (a file or "
                                             "bundled:NAME): required with a scrape, optional with bench files."),
    out: Path = typer.Option(Path("calibration.toml"), "--out", "-o", help="Calibration file to write."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
) -> None:
    """Fit the cost model to your server's measurements and write a calibration file."""
    with user_errors():
        from kvtwin.reports.paths import check_out_file
        from kvtwin.sim.calibration.fit import job as calibration_job

        kinds = [name for name, given in (("--bench-serve", bool(bench_serve)),
                                          ("--metrics-before/--metrics-after",
                                           metrics_before is not None or metrics_after is not None),
                                          ("--steps", steps is not None)) if given]
        if len(kinds) != 1:
            raise ConfigError("measurements", "exactly one of --bench-serve, --metrics-before with "
                              "--metrics-after, or --steps", ", ".join(kinds) or "none")
        check_out_file(out, "--out")
        # Everything read and checked before the first replay.
        job = calibration_job.prepare(find_scenario(scenario_path) or DEFAULT_SCENARIO, bench_serve=bench_serve or (),
                                      metrics_before=metrics_before, metrics_after=metrics_after,
                                      model_name=model_name, steps=steps, trace=trace)
        if job.warning is not None:
            typer.echo(f"kvtwin: warning: --steps: {job.warning}", err=True)
        started = time.perf_counter()

        def on_replay(count: int, loss: float) -> None:
            if not quiet:
                typer.echo(f"kvtwin: calibrate: replay {count}, fit error {loss:.4g}, "
                           f"{time.perf_counter() - started:,.0f} s wall", err=True)

        result = job.run(on_replay)
        path = calibration_job.write(result, out)
    for line in result.lines():
        print(line)
    print(f"wrote {path}; use it with [cost_model] calibration = \"{path}\"")
