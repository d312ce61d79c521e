"""The fits that turn measurements into a calibration: of steps (``step_model``,
``steps``), of kernels (``kernels``) and of a server's latencies (``serving``), with the
readers of a user's measurements ``kvtwin calibrate`` builds on: ``bench_serve`` reads the
result file ``vllm bench serve --save-result [--save-detailed]`` writes (run settings,
latency summaries and, when detailed, one row per request), and ``prometheus`` parses the
server's ``/metrics`` scrapes and takes the difference of two of them (token counters and
the per-step, TTFT, ITL and request-phase histograms over the benchmark's window). Both
readers use the standard library only and report every malformed input as one
``ConfigError`` naming the file, the field and what was expected.

The fits run the replay, so this subpackage is a layer above ``replay``; the rest of
``kvtwin.sim.calibration`` is below it (docs/architecture.md#folders-and-layers).
"""
