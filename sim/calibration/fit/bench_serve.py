"""Read the result file of ``vllm bench serve --save-result [--save-detailed]``.

The format is the one ``vllm/benchmarks/serve.py`` of vLLM 0.33 writes: one JSON object
with the run's settings (``backend``, ``model_id``, ``num_prompts``, ``request_rate`` —
the string ``"inf"`` when unlimited —, ``burstiness``, ``max_concurrency`` — ``null`` when
unlimited), the totals (``duration`` in seconds, ``completed``, ``failed``,
``total_input_tokens``, ``total_output_tokens``) and latency summaries in milliseconds
named ``{mean,median,std,p<N>}_{ttft,tpot,itl,e2el}_ms`` (``p99_ttft_ms``; a fractional
percentile keeps its point, ``p99.9_ttft_ms``). ``--save-detailed`` keeps the per-request
lists, all in request order and in seconds where they are times: ``input_lens``,
``output_lens`` (0 for a failed request), ``ttfts``, ``itls`` (one list per request),
``start_times`` (the client's ``time.perf_counter()``, so only differences mean
anything), ``generated_texts`` and ``errors`` ("" for a success). ``latencies`` (seconds,
from sending the request to its last streamed chunk) is written with or without
``--save-detailed`` by 0.33; older versions do not write it.

``--append-result`` appends one JSON object per run to the same file: ``read_bench_serve_all``
reads all of them, ``read_bench_serve`` insists on exactly one.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtwin.sim.core.errors import ConfigError

# Summary keys kept (converted to seconds): the four latency families vLLM reports, with
# any of the statistics it may write for them.
_SUMMARY_KEY = re.compile(r"^(mean|median|std|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
# The per-request lists that only --save-detailed keeps; any one of them means all four
# must be there (a half-detailed file is a damaged file, not a summary-only one).
_DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls")


@dataclass(frozen=True)
class BenchServeRequest:
    """One request of the benchmark, as the client saw it.

    ``ttft_s`` and ``itls_s`` are what vLLM wrote: 0.0 and () for a request that failed
    before its first token. ``success`` is ``output_tokens > 0`` and, when the file has
    ``errors``, an empty error string (vLLM records a failure as output length 0, and an
    HTTP failure with no reason phrase leaves the error empty). ``e2e_s`` is ``None`` for
    a failed request; otherwise the file's ``latencies`` entry or, in files without that
    list, ``ttft_s + sum(itls_s)`` — the same quantity, since vLLM's client measures the
    latency to the last streamed chunk and its ITLs are the gaps between chunks.
    """

    input_tokens: int
    output_tokens: int
    ttft_s: float
    itls_s: tuple[float, ...]
    e2e_s: float | None
    success: bool
    # time.perf_counter() at send: an offset on the client's clock, not a wall time.
    start_s: float | None = None


@dataclass(frozen=True)
class BenchServeResult:
    """One ``vllm bench serve`` run: its settings, summaries and (when detailed) requests.

    ``summary_s`` maps vLLM's summary keys, renamed from ``_ms`` to ``_s`` and converted
    to seconds, to their values: ``{"mean_ttft_s": 0.0123, "p99_itl_s": ..., ...}`` — only
    those the file has (vLLM writes e2el only when ``--percentile-metrics`` names it).
    ``e2e_derived`` says the requests' ``e2e_s`` came from ``ttft + sum(itls)`` because
    the file has no ``latencies`` list.
    """

    source: str
    model_id: str
    backend: str
    num_prompts: int
    request_rate: float  # requests per second; math.inf when vLLM sent them all at once
    burstiness: float
    max_concurrency: int | None
    duration_s: float
    completed: int
    failed: int | None  # None in files older than the "failed" key
    total_input_tokens: int
    total_output_tokens: int
    summary_s: dict[str, float] = field(default_factory=dict)
    requests: tuple[BenchServeRequest, ...] = ()
    e2e_derived: bool = False


def read_bench_serve(path: str | Path) -> BenchServeResult:
    """The single run in ``path``; a ``ConfigError`` for anything else."""
    results = read_bench_serve_all(path)
    if len(results) != 1:
        raise ConfigError("file", "one benchmark result (use read_bench_serve_all for a file written with "
                          "--append-result)", f"{len(results)} results", source=str(path))
    return results[0]


def read_bench_serve_all(path: str | Path) -> tuple[BenchServeResult, ...]:
    """Every run in ``path``, in file order (several when written with ``--append-result``)."""
    source = str(path)
    text = _read_text(Path(path), source)
    objects = _json_objects(text, source)
    if not objects:
        raise ConfigError("file", "a JSON object written by `vllm bench serve --save-result`", "an empty file",
                          source=source)
    return tuple(_result(obj, source, prefix="" if len(objects) == 1 else f"result {i}: ")
                 for i, obj in enumerate(objects))


def _read_text(path: Path, source: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file", "an existing `vllm bench serve --save-result` JSON file", "no such file",
                          source=source) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("file", "a readable UTF-8 JSON file", str(err), source=source) from None


def _json_objects(text: str, source: str) -> list[object]:
    # --append-result writes the objects back to back, one per line; raw_decode walks them
    # without assuming the line layout.
    decoder = json.JSONDecoder()
    objects, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return objects
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise ConfigError(f"JSON (line {err.lineno}, column {err.colno})", "valid JSON", err.msg,
                              source=source) from None
        objects.append(obj)


def _result(obj: object, source: str, prefix: str) -> BenchServeResult:
    if not isinstance(obj, dict):
        raise ConfigError(prefix + "top level", "a JSON object", type(obj).__name__, source=source)
    get = _Fields(obj, source, prefix)
    requests, derived = _requests(get)
    return BenchServeResult(
        source=source,
        model_id=get.string("model_id"),
        backend=get.string("backend"),
        num_prompts=get.integer("num_prompts"),
        request_rate=get.rate("request_rate"),
        burstiness=get.rate("burstiness"),
        max_concurrency=get.optional_integer("max_concurrency", minimum=1),
        duration_s=get.seconds("duration"),
        completed=get.integer("completed"),
        failed=get.optional_integer("failed", minimum=0, may_be_absent=True),
        total_input_tokens=get.integer("total_input_tokens"),
        total_output_tokens=get.integer("total_output_tokens"),
        summary_s=_summary(get),
        requests=requests,
        e2e_derived=derived,
    )


def _summary(get: "_Fields") -> dict[str, float]:
    summary = {}
    for key in get.obj:
        match = _SUMMARY_KEY.match(key)
        if match:
            summary[f"{match[1]}_{match[2]}_s"] = get.seconds(key) / 1000.0
    return summary


def _requests(get: "_Fields") -> tuple[tuple[BenchServeRequest, ...], bool]:
    if not any(key in get.obj for key in _DETAILED_KEYS):
        return (), False
    input_lens = get.items("input_lens", get.integer)
    n = len(input_lens)
    output_lens = get.items("output_lens", get.integer, length=n)
    ttfts = get.items("ttfts", get.seconds, length=n)
    itls = get.items("itls", lambda key, value: tuple(get.items(key, get.seconds, value=value)), length=n)
    errors = get.items("errors", get.string, length=n, optional=True, allow_empty=True)
    latencies = get.items("latencies", get.seconds, length=n, optional=True)
    starts = get.items("start_times", get.number, length=n, optional=True)
    requests = []
    for i in range(n):
        success = output_lens[i] > 0 and (errors is None or errors[i] == "")
        e2e_s = None
        if success:
            e2e_s = latencies[i] if latencies is not None else ttfts[i] + math.fsum(itls[i])
        requests.append(BenchServeRequest(
            input_tokens=input_lens[i], output_tokens=output_lens[i], ttft_s=ttfts[i], itls_s=itls[i],
            e2e_s=e2e_s, success=success, start_s=None if starts is None else starts[i]))
    return tuple(requests), latencies is None


_MISSING = object()


class _Fields:
    """Typed access to one result object; every refusal names the file and the key path."""

    def __init__(self, obj: dict, source: str, prefix: str):
        self.obj, self.source, self.prefix = obj, source, prefix

    def error(self, key: str, expected: str, got: object) -> ConfigError:
        return ConfigError(self.prefix + key, expected, got, source=self.source)

    def value(self, key: str, value: object = _MISSING) -> object:
        if value is not _MISSING:
            return value
        if key not in self.obj:
            raise self.error(key, "a key that `vllm bench serve --save-result` writes (the key is missing)", None)
        return self.obj[key]

    def string(self, key: str, value: object = _MISSING, allow_empty: bool = False) -> str:
        value = self.value(key, value)
        if not isinstance(value, str) or not (value or allow_empty):
            raise self.error(key, "a non-empty string" if not allow_empty else "a string", value)
        return value

    def number(self, key: str, value: object = _MISSING) -> float:
        value = self.value(key, value)
        # bool is an int to Python but never a measurement; NaN is never a valid time.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(key, "a finite number", value)
        return float(value)

    def seconds(self, key: str, value: object = _MISSING) -> float:
        number = self.number(key, value)
        if number < 0:
            raise self.error(key, "a time ≥ 0", number)
        return number

    def integer(self, key: str, value: object = _MISSING, minimum: int = 0) -> int:
        value = self.value(key, value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, f"an integer ≥ {minimum}", value)
        return value

    def optional_integer(self, key: str, minimum: int, may_be_absent: bool = False) -> int | None:
        if may_be_absent and key not in self.obj:
            return None
        value = self.value(key)
        return None if value is None else self.integer(key, value, minimum=minimum)

    def rate(self, key: str) -> float:
        # vLLM writes an unlimited request rate as the string "inf"; a burstiness or a rate
        # written by other tools may be JSON's Infinity, which json reads as float inf.
        value = self.value(key)
        if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
            return math.inf
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.error(key, 'a number > 0 or "inf"', value)
        return float(value)

    def items(self, key: str, convert, *, value: object = _MISSING, length: int | None = None,
              optional: bool = False, **kwargs) -> list | None:
        if optional and key not in self.obj:
            return None
        value = self.value(key, value)
        if not isinstance(value, list):
            raise self.error(key, "a list", type(value).__name__)
        if length is not None and len(value) != length:
            raise self.error(key, f"one entry per request, as many as input_lens ({length})",
                             f"{len(value)} entries")
        return [convert(f"{key}[{i}]", item, **kwargs) for i, item in enumerate(value)]
