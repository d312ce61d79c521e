"""Read a vLLM server's Prometheus scrapes and take the difference of two of them.

``parse_exposition`` reads the Prometheus text exposition format (``# HELP`` / ``# TYPE``
comments, samples ``name{label="value",...} value [timestamp]``, escaped label values,
``+Inf`` / ``-Inf`` / ``NaN``; an OpenMetrics ``# EOF`` or exemplar is tolerated).
``scrape_delta`` turns a scrape taken before a benchmark and one taken after it into the
server's side of that window: token and request counters and the histograms vLLM 0.33
defines in ``vllm/v1/metrics/loggers.py`` (bucket bounds in ``vllm/v1/metrics/buckets.py``),
as prometheus_client renders them — a counter ``vllm:prompt_tokens`` as
``vllm:prompt_tokens_total`` plus ``vllm:prompt_tokens_created``, a histogram as
``<name>_bucket{le="..."}``, ``<name>_sum``, ``<name>_count`` and ``<name>_created``;
every series is labelled ``engine`` and ``model_name``.

Histogram quantiles follow PromQL's ``histogram_quantile``: linear interpolation inside
the bucket holding the rank, the lowest bucket starting at 0, and the top (``+Inf``)
bucket answered with the highest finite bound.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtwin.sim.core.errors import ConfigError

Labels = tuple[tuple[str, str], ...]  # sorted by label name

# vLLM metric names (vllm/v1/metrics/loggers.py, 0.33), as exposed.
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PROMPT_TOKENS_CACHED = "vllm:prompt_tokens_cached_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"  # one series per finished_reason
ITERATION_TOKENS = "vllm:iteration_tokens_total"  # a histogram despite the suffix
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
# Before vLLM split it off, the per-token interval histogram had this name.
ITL_LEGACY = "vllm:time_per_output_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
DECODE = "vllm:request_decode_time_seconds"
QUEUE = "vllm:request_queue_time_seconds"

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_NAME_RE = re.compile(_NAME)
_LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Go's float syntax as exposition writers emit it; Python's float() alone would also take
# "1_000" and "infinity".
_NUMBER_RE = re.compile(r"[+-]?(?:Inf|inf|NaN|nan|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped", "unknown", "info", "stateset", "gaugehistogram"}
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True)
class Sample:
    """One sample line: ``name{labels} value [timestamp]``; ``line`` is 1-based."""

    name: str
    labels: Labels
    value: float
    timestamp: float | None
    line: int

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


@dataclass(frozen=True)
class Scrape:
    """A parsed scrape and the file it came from (for error messages)."""

    source: str
    samples: Mapping[str, tuple[Sample, ...]]


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram: ``cumulative_counts[i]`` observations were ≤ ``upper_bounds[i]``.

    The bounds ascend and end with ``math.inf`` (Prometheus's ``le="+Inf"``), whose count
    is ``count``; ``sum`` is the sum of the observations.
    """

    upper_bounds: tuple[float, ...]
    cumulative_counts: tuple[float, ...]
    sum: float
    count: float

    def __post_init__(self) -> None:
        if len(self.upper_bounds) != len(self.cumulative_counts) or not self.upper_bounds:
            raise ConfigError("Histogram", "as many cumulative counts as upper bounds, at least one",
                              (len(self.upper_bounds), len(self.cumulative_counts)))
        if self.upper_bounds[-1] != math.inf or list(self.upper_bounds) != sorted(set(self.upper_bounds)):
            raise ConfigError("Histogram.upper_bounds", "strictly ascending bounds ending with inf",
                              self.upper_bounds)

    def mean(self) -> float:
        """sum / count; NaN for an empty histogram (as PromQL's division would give)."""
        return self.sum / self.count if self.count > 0 else math.nan

    def quantile(self, q: float) -> float:
        """The q-quantile (0 ≤ q ≤ 1) as PromQL's ``histogram_quantile`` estimates it; NaN
        when the histogram is empty or has no finite bucket."""
        if not 0.0 <= q <= 1.0:
            raise ConfigError("q", "a quantile between 0 and 1", q)
        if self.count <= 0 or len(self.upper_bounds) < 2:
            return math.nan
        rank = q * self.count
        # The first bucket holding the rank; a bucket must hold at least one observation
        # (q=0 would otherwise land in a leading empty bucket and divide 0 by 0).
        b = next(i for i, c in enumerate(self.cumulative_counts) if c >= rank and c > 0)
        if b == len(self.upper_bounds) - 1:
            return self.upper_bounds[-2]  # no upper edge to interpolate to
        upper = self.upper_bounds[b]
        if b == 0 and upper <= 0:
            return upper
        lower, below = (self.upper_bounds[b - 1], self.cumulative_counts[b - 1]) if b > 0 else (0.0, 0.0)
        return lower + (upper - lower) * (rank - below) / (self.cumulative_counts[b] - below)


@dataclass(frozen=True)
class ServerMetrics:
    """What one model's server did between two scrapes, summed over its engines.

    Counters are in their own units (tokens, requests), times in seconds. ``prompt_tokens``
    counts every prompt token scheduled, cached or not; ``iteration_tokens`` holds one
    observation per engine step: the prompt tokens it computed (cache hits excluded) plus
    the tokens it generated. ``itl_source`` names the metric ``itl_s`` came from. Phase
    histograms a server does not export are ``None``.
    """

    model_name: str
    prompt_tokens: float
    generation_tokens: float
    requests_finished: float
    prompt_tokens_cached: float | None
    iteration_tokens: Histogram
    ttft_s: Histogram
    itl_s: Histogram
    itl_source: str
    e2e_s: Histogram
    prefill_s: Histogram | None
    decode_s: Histogram | None
    queue_s: Histogram | None


def read_scrape(path: str | Path) -> Scrape:
    """Parse the scrape saved in ``path`` (e.g. ``curl -s http://server:8000/metrics > before.prom``)."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file", "an existing Prometheus scrape (the text of GET /metrics)", "no such file",
                          source=source) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("file", "a readable UTF-8 text file", str(err), source=source) from None
    return Scrape(source, parse_exposition(text, source=source))


def parse_exposition(text: str, *, source: str | None = None) -> dict[str, tuple[Sample, ...]]:
    """Every sample of an exposition, grouped by sample name (``..._bucket`` apart from
    ``..._sum``), in file order. A ``ConfigError`` names the line of the first bad one."""
    by_name: dict[str, list[Sample]] = {}
    seen: dict[tuple[str, Labels], int] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        if line.startswith("#"):
            _check_comment(line, number, source)
            continue
        sample = _parse_sample(line, number, source)
        key = (sample.name, sample.labels)
        if key in seen:
            raise ConfigError(f"line {number}", f"each series once (already on line {seen[key]})",
                              _series_text(sample.name, sample.labels), source=source)
        seen[key] = number
        by_name.setdefault(sample.name, []).append(sample)
    return {name: tuple(samples) for name, samples in by_name.items()}


def _check_comment(line: str, number: int, source: str | None) -> None:
    parts = line.split(None, 3)
    if len(parts) >= 2 and parts[1] == "TYPE":
        if len(parts) != 4 or not _NAME_RE.fullmatch(parts[2]) or parts[3].strip() not in _TYPES:
            raise ConfigError(f"line {number}", "# TYPE <metric name> <counter|gauge|histogram|summary|untyped>",
                              line, source=source)
    elif len(parts) >= 2 and parts[1] == "HELP" and (len(parts) < 3 or not _NAME_RE.fullmatch(parts[2])):
        raise ConfigError(f"line {number}", "# HELP <metric name> <text>", line, source=source)


def _parse_sample(line: str, number: int, source: str | None) -> Sample:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"line {number}", expected, line if len(line) <= 200 else line[:200] + "...",
                           source=source)

    match = _NAME_RE.match(line)
    if not match:
        raise bad("a sample `name{labels} value [timestamp]` starting with a metric name")
    name, pos = match[0], match.end()
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        pos = _parse_labels(line, pos + 1, labels, bad)
    rest = line[pos:]
    # An OpenMetrics exemplar (" # {...} value") is not part of the sample.
    rest = rest.split(" # ", 1)[0]
    if rest and not rest[0].isspace():
        raise bad("whitespace between the metric name (or label set) and the value")
    fields = rest.split()
    if not 1 <= len(fields) <= 2 or not all(_NUMBER_RE.fullmatch(f) for f in fields):
        raise bad("a value (a number, +Inf, -Inf or NaN) and at most a timestamp after the name")
    timestamp = float(fields[1]) if len(fields) == 2 else None
    return Sample(name, tuple(sorted(labels.items())), float(fields[0]), timestamp, number)


def _parse_labels(line: str, pos: int, labels: dict[str, str], bad) -> int:
    """Read ``name="value",...}`` from ``pos``; the position after the closing brace."""
    while True:
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return pos + 1
        match = _LABEL_NAME_RE.match(line, pos)
        if not match:
            raise bad('a label `name="value"` or `}`')
        key, pos = match[0], match.end()
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if line[pos:pos + 2] != '="':
            raise bad(f'`="` after label name {key}')
        pos += 2
        chars = []
        while True:
            if pos >= len(line):
                raise bad(f"a closing quote for label {key}")
            char = line[pos]
            if char == '"':
                pos += 1
                break
            if char == "\\":
                escaped = line[pos + 1:pos + 2]
                if escaped not in _ESCAPES:
                    raise bad(f'only \\\\, \\" and \\n escapes in label {key}')
                chars.append(_ESCAPES[escaped])
                pos += 2
            else:
                chars.append(char)
                pos += 1
        if key in labels:
            raise bad(f"label {key} once per sample")
        labels[key] = "".join(chars)
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if pos < len(line) and line[pos] == ",":
            pos += 1
        elif not (pos < len(line) and line[pos] == "}"):
            raise bad("`,` or `}` after a label value")


def _series_text(name: str, labels: Labels) -> str:
    """A series as prometheus_client writes it, to name it in messages."""
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return name + "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels) + "}" if labels else name


def scrape_delta(before: Scrape, after: Scrape, *, model_name: str | None = None) -> ServerMetrics:
    """What the server did between ``before`` and ``after``, for one model.

    ``model_name`` picks the model when the server reports several; a counter or bucket
    that went down, a series that disappeared, or a ``_created`` time that changed means
    the server restarted between the scrapes, which is refused (the difference would be
    meaningless).
    """
    model = _pick_model(after, model_name)
    delta = _Delta(before, after, model)
    if ITL + "_bucket" in after.samples:
        itl_source = ITL
    elif ITL_LEGACY + "_bucket" in after.samples:
        itl_source = ITL_LEGACY
    else:
        raise ConfigError(ITL + "_bucket", f"the inter-token latency histogram (or the older {ITL_LEGACY})",
                          None, source=after.source)
    return ServerMetrics(
        model_name=model,
        prompt_tokens=delta.counter(PROMPT_TOKENS),
        generation_tokens=delta.counter(GENERATION_TOKENS),
        requests_finished=delta.counter(REQUEST_SUCCESS),
        prompt_tokens_cached=delta.counter(PROMPT_TOKENS_CACHED, optional=True),
        iteration_tokens=delta.histogram(ITERATION_TOKENS),
        ttft_s=delta.histogram(TTFT),
        itl_s=delta.histogram(itl_source),
        itl_source=itl_source,
        e2e_s=delta.histogram(E2E),
        prefill_s=delta.histogram(PREFILL, optional=True),
        decode_s=delta.histogram(DECODE, optional=True),
        queue_s=delta.histogram(QUEUE, optional=True),
    )


def _pick_model(scrape: Scrape, model_name: str | None) -> str:
    names = sorted({s.label("model_name") for key in (PROMPT_TOKENS, GENERATION_TOKENS, ITERATION_TOKENS + "_count")
                    for s in scrape.samples.get(key, ()) if s.label("model_name") is not None})
    if not names:
        raise ConfigError(PROMPT_TOKENS, "vLLM's metrics with a model_name label (is this a vLLM /metrics scrape?)",
                          None, source=scrape.source)
    if model_name is not None:
        if model_name not in names:
            raise ConfigError("model_name", f"one of the models in the scrape: {', '.join(names)}", model_name,
                              source=scrape.source)
        return model_name
    if len(names) > 1:
        raise ConfigError("model_name", f"a model_name argument: the scrape has several ({', '.join(names)})",
                          None, source=scrape.source)
    return names[0]


class _Delta:
    """after - before, series by series, for the chosen model's series."""

    def __init__(self, before: Scrape, after: Scrape, model: str):
        self.before, self.after, self.model = before, after, model

    def _series(self, scrape: Scrape, name: str) -> dict[Labels, Sample]:
        return {s.labels: s for s in scrape.samples.get(name, ()) if s.label("model_name") == self.model}

    def _paired(self, name: str, optional: bool = False) -> list[tuple[Labels, float, float]] | None:
        """(labels, before value, after value) per series of ``after``; a series new since
        ``before`` counts from 0."""
        after = self._series(self.after, name)
        before = self._series(self.before, name)
        if not after:
            if optional:
                return None
            raise ConfigError(name, f"series for model_name={self.model!r} (vLLM exports this metric)", None,
                              source=self.after.source)
        gone = sorted(set(before) - set(after))
        if gone:
            raise ConfigError(_series_text(name, gone[0]), "in the second scrape too (the server restarted or "
                              "this is another server)", "missing", source=self.after.source)
        pairs = []
        for labels, sample in after.items():
            old = before[labels].value if labels in before else 0.0
            for value, scrape in ((old, self.before), (sample.value, self.after)):
                if not (math.isfinite(value) and value >= 0):
                    raise ConfigError(_series_text(name, labels), "a finite count ≥ 0", value, source=scrape.source)
            if sample.value < old:
                raise ConfigError(_series_text(name, labels), f"≥ {old!r}, its value in {self.before.source} (a "
                                  "counter went down: the server restarted between the scrapes)", sample.value,
                                  source=self.after.source)
            pairs.append((labels, old, sample.value))
        return pairs

    def _check_created(self, created_name: str) -> None:
        before = self._series(self.before, created_name)
        for labels, sample in self._series(self.after, created_name).items():
            if labels in before and before[labels].value != sample.value:
                raise ConfigError(_series_text(created_name, labels), f"{before[labels].value!r}, its value in "
                                  f"{self.before.source} (the metric was re-created: the server restarted between "
                                  "the scrapes)", sample.value, source=self.after.source)

    def counter(self, name: str, optional: bool = False) -> float | None:
        self._check_created(name.removesuffix("_total") + "_created")
        pairs = self._paired(name, optional)
        return None if pairs is None else math.fsum(new - old for _, old, new in pairs)

    def histogram(self, base: str, optional: bool = False) -> Histogram | None:
        self._check_created(base + "_created")
        buckets = self._paired(base + "_bucket", optional)
        if buckets is None:
            return None
        counts = {labels: new - old for labels, old, new in self._paired(base + "_count")}
        # A _sum only falls if the server restarted (vLLM observes no negative values), so
        # it is paired and checked like a counter.
        sums = {labels: new - old for labels, old, new in self._paired(base + "_sum")}
        per_series: dict[Labels, dict[float, tuple[Labels, float]]] = {}
        for labels, old, new in buckets:
            le_text = dict(labels).get("le")
            if le_text is None or not _NUMBER_RE.fullmatch(le_text) or math.isnan(float(le_text)):
                raise ConfigError(_series_text(base + "_bucket", labels), 'an le="<upper bound>" label', le_text,
                                  source=self.after.source)
            series = tuple((k, v) for k, v in labels if k != "le")
            per_series.setdefault(series, {})[float(le_text)] = (labels, new - old)
        bounds = None
        total = None
        for series, by_bound in sorted(per_series.items()):
            name = _series_text(base + "_bucket", series)
            series_bounds = tuple(sorted(by_bound))
            if series_bounds[-1] != math.inf:
                raise ConfigError(name, 'a bucket le="+Inf"', None, source=self.after.source)
            if bounds is not None and series_bounds != bounds:
                raise ConfigError(name, f"the same buckets as every other engine's: {bounds}", series_bounds,
                                  source=self.after.source)
            bounds = series_bounds
            cumulative = [by_bound[b][1] for b in bounds]
            for i in range(1, len(cumulative)):
                if cumulative[i] < cumulative[i - 1]:
                    raise ConfigError(_series_text(base + "_bucket", by_bound[bounds[i]][0]),
                                      f"at least the count of the bucket below, {cumulative[i - 1]!r} (buckets are "
                                      "cumulative; counted after minus before)", cumulative[i],
                                      source=self.after.source)
            if series not in counts or series not in sums:
                missing = base + ("_count" if series not in counts else "_sum")
                raise ConfigError(_series_text(missing, series), "a sample for every histogram series", None,
                                  source=self.after.source)
            if counts[series] != cumulative[-1]:
                raise ConfigError(_series_text(base + "_count", series), f'the le="+Inf" bucket\'s count '
                                  f"{cumulative[-1]!r} (after minus before)", counts[series],
                                  source=self.after.source)
            total = cumulative if total is None else [a + b for a, b in zip(total, cumulative)]
        return Histogram(upper_bounds=bounds, cumulative_counts=tuple(total),
                         sum=math.fsum(sums[s] for s in per_series), count=math.fsum(counts[s] for s in per_series))
