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


def client_request_columns(ttft_s: object, e2el_s: object, client_overhead_s: float) -> dict[str, pa.Array]:
    """The requests' client-side columns (``output_columns.CLIENT_SIDE``): each request's
    server TTFT and E2E plus ``client_overhead_s`` (0 gives columns equal to the server's)."""
    return {client: pa.array(np.asarray(server, dtype=float) + client_overhead_s, type=pa.float64())
            for client, server in (("ttft_client_s", ttft_s), ("e2el_client_s", e2el_s))}


def client_summary(requests: pa.Table, client_overhead_s: float) -> dict[str, float]:
    """The summary's client-side figures: the mean, median, p90 and p99 of the client-side
    TTFT and E2E over the finished requests, and the overhead itself (``client_overhead_ms``)."""
    done = requests.column("status").to_numpy(zero_copy_only=False) == "finished"
    row: dict[str, float] = {}
    for client in ("ttft_client_s", "e2el_client_s"):
        seconds = requests.column(client).to_numpy(zero_copy_only=False)
        finite = seconds[done & np.isfinite(seconds)]
        name = client.removesuffix("_s") + "_ms"
        for stat, value in (("mean", np.mean), ("median", np.median), ("p90", lambda a: np.percentile(a, 90)),
                            ("p99", lambda a: np.percentile(a, 99))):
            row[f"{stat}_{name}"] = float(value(finite) * 1000) if finite.size else math.nan
    row["client_overhead_ms"] = client_overhead_s * 1000
    return row
