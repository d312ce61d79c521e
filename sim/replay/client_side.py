"""Latency as a client measures it: the server's figures plus the client-side overhead.

vLLM's own metrics (``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``)
start when the engine front end receives a request and stop when it emits a token. A
benchmark client (``vllm bench serve``, inference-perf) measures around the whole HTTP
exchange: it adds connection handling, tokenisation, detokenisation and streaming, a few
milliseconds per request. The replay's ``ttft_s`` and ``e2el_s`` are the server's;
``ttft_client_s`` and ``e2el_client_s`` always stand beside them, the calibration's
``client_overhead_s`` later (equal to them when it is 0), so that every output says both
(docs/capacity.md#client-side-latency). The SLO is judged on the client's figures
(``summaries.summarize``).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

CLIENT_REQUEST_COLUMNS = ("ttft_client_s", "e2el_client_s")
DEFAULT_OVERHEAD_PATH = Path(__file__).resolve().parent / "data" / "measurements" / "client_overhead.toml"


@dataclass(frozen=True)
class DefaultClientOverhead:
    """The time outside the engine every bundled calibration carries, from public
    measurements (``data/measurements/client_overhead.toml``: the value, the span the
    sources support, and the sources)."""

    seconds: float
    low_seconds: float
    high_seconds: float
    sources: tuple[dict[str, str], ...]


def default_client_overhead(path: Path = DEFAULT_OVERHEAD_PATH) -> DefaultClientOverhead:
    table = tomllib.loads(path.read_text())
    return DefaultClientOverhead(float(table["seconds"]), float(table["low_seconds"]), float(table["high_seconds"]),
                                 tuple({k: str(v) for k, v in s.items()} for s in table.get("source", ())))


def with_client_side(requests: pa.Table, summary: pa.Table, client_overhead_s: float) -> tuple[pa.Table, pa.Table]:
    """``requests`` and ``summary`` with the client-side columns: each request's TTFT and
    E2E plus ``client_overhead_s``, their mean, median, p90 and p99 over the finished requests,
    and the overhead itself (``client_overhead_ms``; 0 gives columns equal to the server's)."""
    done = requests.column("status").to_numpy(zero_copy_only=False) == "finished"
    row = summary.to_pylist()[0]
    for server, client in (("ttft_s", "ttft_client_s"), ("e2el_s", "e2el_client_s")):
        seconds = requests.column(server).to_numpy(zero_copy_only=False).astype(float) + client_overhead_s
        column = pa.array(seconds, type=pa.float64())
        # Applied again (a result re-priced with another overhead), the columns are replaced;
        # else they go beside the server's, after ``e2el_s`` (reports/SCHEMA.md's order).
        if client in requests.column_names:
            requests = requests.set_column(requests.column_names.index(client), client, column)
        else:
            at = requests.column_names.index("e2el_s") + 1 + CLIENT_REQUEST_COLUMNS.index(client)
            requests = requests.add_column(at, client, column)
        finite = seconds[done & np.isfinite(seconds)]
        name = client.removesuffix("_s") + "_ms"
        for stat, value in (("mean", np.mean), ("median", np.median), ("p90", lambda a: np.percentile(a, 90)),
                            ("p99", lambda a: np.percentile(a, 99))):
            row[f"{stat}_{name}"] = float(value(finite) * 1000) if finite.size else math.nan
    row["client_overhead_ms"] = client_overhead_s * 1000
    return requests, pa.Table.from_pylist([row], schema=None)
