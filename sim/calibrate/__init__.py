"""Turn a user's measurements of their own vLLM server into a kvtwin calibration.

This package holds the readers ``kvtwin calibrate`` builds on: ``bench_serve`` reads the
result file ``vllm bench serve --save-result [--save-detailed]`` writes (run settings,
latency summaries and, when detailed, one row per request), and ``prometheus`` parses the
server's ``/metrics`` scrapes and takes the difference of two of them (token counters and
the per-step, TTFT, ITL and request-phase histograms over the benchmark's window). Both
use the standard library only and report every malformed input as one ``ConfigError``
naming the file, the field and what was expected.
"""
