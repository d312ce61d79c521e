"""The capacity report's table helpers (``reports.sweep_frame``, ``html_tables.frame_table``)
keep the conventions of the pandas code they replaced, on which the pages' bytes depend:
the table's HTML layout and escaping, groups in sorted order of their text with a missing
key in none, a missing value counted as no value, an integer column with a gap read as
floats."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from kvtwin.reports.html_tables import frame_table
from kvtwin.reports.sweep_frame import (column_values, lines_by_combo, sort_order, sweep_table, texts,
                                        varying)


def test_frame_table_is_laid_out_and_escaped_as_before():
    html = frame_table(["point", "a <b> & c"], [[1, None], ["  two  spaces\there ", math.nan]])
    assert html == (
        '<div class="wide"><table class="dataframe">\n'
        '  <thead>\n'
        '    <tr style="text-align: right;">\n'
        '      <th>point</th>\n'
        '      <th>a &lt;b&gt; &amp; c</th>\n'
        '    </tr>\n'
        '  </thead>\n'
        '  <tbody>\n'
        '    <tr>\n'
        '      <td>1</td>\n'
        '      <td>two&nbsp;&nbsp;spaces\\there</td>\n'
        '    </tr>\n'
        '    <tr>\n'
        '      <td>-</td>\n'
        '      <td>-</td>\n'
        '    </tr>\n'
        '  </tbody>\n'
        '</table></div>')
    assert frame_table(["x"], [[]]).endswith("<tbody>\n  </tbody>\n</table></div>")


def test_lines_are_grouped_by_the_text_of_the_other_keys():
    table = sweep_table(pa.table({
        "workload.rate_scale": [2.0, 1.0, 2.0, 1.0, 1.0, 3.0],
        "engine.max_num_seqs": pa.array([10, 2, 2, 10, None, 2]),
        "request_throughput": [4.0, 1.0, 3.0, 2.0, 9.0, math.nan]}))
    # The gap makes the column floats, as pandas read it: "10.0" sorts before "2.0".
    assert texts(table, "engine.max_num_seqs") == ["10.0", "2.0", "2.0", "10.0", None, "2.0"]
    lines = lines_by_combo(table, "workload.rate_scale", "request_throughput", ["engine.max_num_seqs"])
    assert [label for label, _, _ in lines] == ["max_num_seqs=10", "max_num_seqs=2"]
    # The point without a value of the key is in no line, the NaN throughput in none either.
    assert [(xs.tolist(), ys.tolist()) for _, xs, ys in lines] == [([1.0, 2.0], [2.0, 4.0]), ([1.0, 2.0], [1.0, 3.0])]
    assert lines_by_combo(table, "workload.rate_scale", "request_throughput", [])[0][1].tolist() == [
        1.0, 1.0, 1.0, 2.0, 2.0]


def test_a_missing_value_is_no_value_of_a_key():
    table = sweep_table(pa.table({"engine.router": ["a", None, "a"], "engine.replicas": [1, 1, 2],
                                  "disaggregation.shape": ["2P1D", None, "1P2D"]}))
    assert varying(table, ["engine.router", "engine.replicas", "disaggregation.shape"]) == [
        "engine.replicas", "disaggregation.shape"]
    assert column_values(table, "engine.router")[0] == "a" and math.isnan(column_values(table, "engine.router")[1])


def test_sort_order_puts_nan_last_in_table_order():
    assert sort_order(np.array([3.0, math.nan, 1.0, math.nan, 2.0])).tolist() == [2, 4, 0, 1, 3]
    assert sort_order(np.array([5, 1, 3])).tolist() == [1, 2, 0]
