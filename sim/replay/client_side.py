"""Latency as a client measures it: the server's figures plus the client-side overhead.

vLLM's own metrics (``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``)
start when the engine front end receives a request and stop when it emits a token. A
benchmark client (``vllm bench serve``, inference-perf) measures around the whole HTTP
exchange: it adds connection handling, tokenisation, detokenisation and streaming, a few
milliseconds per request. The replay's ``ttft_s`` and ``e2el_s`` are the server's; with a
``client_overhead_s`` in the calibration these columns add the client's view beside them.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

CLIENT_REQUEST_COLUMNS = ("ttft_client_s", "e2el_client_s")


def with_client_side(requests: pa.Table, summary: pa.Table, client_overhead_s: float) -> tuple[pa.Table, pa.Table]:
    """``requests`` and ``summary`` with the client-side columns (unchanged when the
    overhead is 0: the client and server figures are then the same)."""
    if not client_overhead_s:
        return requests, summary
    done = requests.column("status").to_numpy(zero_copy_only=False) == "finished"
    row = summary.to_pylist()[0]
    for server, client in (("ttft_s", "ttft_client_s"), ("e2el_s", "e2el_client_s")):
        seconds = requests.column(server).to_numpy(zero_copy_only=False).astype(float) + client_overhead_s
        requests = requests.append_column(client, pa.array(seconds, type=pa.float64()))
        finite = seconds[done & np.isfinite(seconds)]
        name = client.removesuffix("_s") + "_ms"
        for stat, value in (("mean", np.mean), ("median", np.median), ("p99", lambda a: np.percentile(a, 99))):
            row[f"{stat}_{name}"] = float(value(finite) * 1000) if finite.size else math.nan
    row["client_overhead_ms"] = client_overhead_s * 1000
    return requests, pa.Table.from_pylist([row], schema=None)
