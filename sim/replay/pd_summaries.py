"""A disaggregated prefill/decode replay's summary figures: the P/D columns of the summary
(``pd_summary_columns``), each replica's requests as its side saw them
(``pd_replica_requests``), and each side's load imbalance (``pd_side_imbalance``).

The run itself is the replay's one path (``run.py``'s ``run_with_executor`` with a
``Disaggregation``: P/D connector tiers, a ``PDFront`` in front of the one ``Cluster``);
the outputs get the P/D columns (``reports/SCHEMA.md``) from here and ``output_columns.py``.
"""

from __future__ import annotations

import math

import numpy as np

from kvtwin.sim.replay.summaries import ReplicaRequests
from kvtwin.sim.scenario.disaggregation import Disaggregation


def pd_summary_columns(requests) -> dict[str, float]:
    """The summary's P/D figures over finished requests (``reports/SCHEMA.md``): mean read
    seconds and bytes, and the share of TTFT the read took (mean of per-request shares,
    and the total read time over the total TTFT)."""
    status = requests.column("status").to_numpy(zero_copy_only=False)
    done = status == "finished"
    transfer = requests.column("transfer_s").to_numpy()[done]
    ttft = requests.column("ttft_s").to_numpy()[done]
    num_bytes = requests.column("transfer_bytes").to_numpy()[done]
    ok = ~np.isnan(transfer) & (ttft > 0)
    if not ok.any():
        nan = math.nan
        return {"pd_transfer_mean_ms": nan, "pd_transfer_bytes_mean": nan, "pd_transfer_share_of_ttft": nan,
                "pd_transfer_share_of_ttft_total": nan}
    return {
        "pd_transfer_mean_ms": float(transfer[ok].mean() * 1000),
        "pd_transfer_bytes_mean": float(num_bytes[ok].mean()),
        "pd_transfer_share_of_ttft": float((transfer[ok] / ttft[ok]).mean()),
        "pd_transfer_share_of_ttft_total": float(transfer[ok].sum() / ttft[ok].sum()),
    }


# The prefix-cache request columns and the decode side's own counterparts.
DECODE_SIDE_PREFIX_COLUMNS = {"prefix_hit_tokens": "decode_prefix_hit_tokens",
                              "prefix_cache_queries": "decode_prefix_cache_queries",
                              "prefix_cache_hits": "decode_prefix_cache_hits"}


def _side_counts(requests, column: str, first: int, count: int):
    """Requests routed to each replica of one side (``column`` names the replica)."""
    picked = requests.column(column).to_numpy()
    picked = picked[picked >= 0] - first
    return np.bincount(picked, minlength=count)[:count] if picked.size else np.zeros(count, np.int64)


def pd_replica_requests(requests, disaggregation: Disaggregation) -> list:
    """Each replica's requests as it saw them (``summaries.ReplicaRequests``): a prefill
    replica the requests it prefilled, with their prefix-cache columns as they are (the
    prefill side's); a decode replica the requests it decoded, with the decode side's own
    lookups in their place (``DECODE_SIDE_PREFIX_COLUMNS``). Load ratios are over the mean
    of the replica's own side."""
    decode_view = requests
    for name, source in DECODE_SIDE_PREFIX_COLUMNS.items():
        decode_view = decode_view.set_column(decode_view.schema.get_field_index(name), name,
                                             requests.column(source))
    out = []
    num_prefill = disaggregation.prefill_engines
    for column, first, count, table in (("prefill_replica", 0, num_prefill, requests),
                                        ("decode_replica", num_prefill, disaggregation.decode_engines, decode_view)):
        counts = _side_counts(requests, column, first, count)
        mean = counts.mean()
        replica_of_request = requests.column(column).to_numpy()
        for index in range(count):
            out.append(ReplicaRequests(np.flatnonzero(replica_of_request == first + index), table,
                                       float(counts[index] / mean) if mean > 0 else math.nan))
    return out


def pd_side_imbalance(requests, disaggregation: Disaggregation) -> tuple[float, float]:
    """Each side's load imbalance: requests per prefill replica over their mean, and per
    decode replica over theirs (``summaries.load_imbalance``); NaN for a side nothing reached."""
    sides = []
    for column, first, count in (("prefill_replica", 0, disaggregation.prefill_engines),
                                 ("decode_replica", disaggregation.prefill_engines, disaggregation.decode_engines)):
        counts = _side_counts(requests, column, first, count)
        mean = counts.mean()
        sides.append(float(counts.max() / mean) if mean > 0 else math.nan)
    return sides[0], sides[1]


def pd_load_imbalance(requests, disaggregation: Disaggregation) -> float:
    """The worse of the prefill side's and the decode side's load imbalance (``pd_side_imbalance``)."""
    known = [side for side in pd_side_imbalance(requests, disaggregation) if not math.isnan(side)]
    return max(known) if known else math.nan
