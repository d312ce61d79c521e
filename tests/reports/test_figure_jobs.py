"""The report's figures drawn on two processes (``reports.figure_jobs``) and its columns read
from Arrow buffers (``reports.binning.numbers``): the same results as the plain way, and a
failing helper process costs nothing but time."""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.reports.binning import column_array, numbers, usage_matrix
from kvtwin.reports.figure_jobs import draw_all

needs_fork = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the helper process is Linux-only")


def _draws(count: int) -> list:
    return [lambda i=i: f"figure {i} of {count}".encode() * (1 + 20_000 * i) for i in range(count)]


@needs_fork
@pytest.mark.parametrize("count", [1, 2, 5])
def test_forked_drawing_returns_what_drawing_here_returns(count):
    draws = _draws(count)  # the last ones large: more than a pipe's buffer holds
    assert draw_all(draws, fork=True) == draw_all(draws, fork=False) == [d() for d in draws]


@needs_fork
def test_what_the_helper_fails_to_draw_is_drawn_here():
    parent = os.getpid()
    calls_here = []

    def fails_in_the_helper():
        if os.getpid() != parent:
            raise RuntimeError("the helper process fails")
        calls_here.append(1)
        return b"drawn here"

    draws = [fails_in_the_helper, *_draws(3)[1:]]
    assert draw_all(draws, fork=True) == [b"drawn here", *(d() for d in draws[1:])]
    assert calls_here == [1]


@needs_fork
def test_a_failure_here_still_reaps_the_helper(monkeypatch):
    helpers = []
    fork = os.fork

    def remembered_fork():
        pid = fork()
        if pid:
            helpers.append(pid)
        return pid

    def fails():
        raise ValueError("no figure")

    monkeypatch.setattr(os, "fork", remembered_fork)
    with pytest.raises(ValueError, match="no figure"):
        draw_all([_draws(1)[0], fails], fork=True)
    assert len(helpers) == 1
    with pytest.raises(ChildProcessError):  # waited for already: no helper left behind
        os.waitpid(helpers[0], os.WNOHANG)


def test_numbers_read_nulls_slices_and_chunks_as_to_numpy_does():
    column = pa.chunked_array([pa.array([7, None, 9, 10], pa.int32()).slice(1), pa.array([], pa.int32()),
                               pa.array([-3], pa.int32())])
    assert numbers(column, null=-1).tolist() == [-1, 9, 10, -3]
    floats = pa.table({"x": pa.chunked_array([[1.5, None], [2.5]]), "n": pa.chunked_array([[1, None], [3]])})
    np.testing.assert_array_equal(column_array(floats, "x"), [1.5, np.nan, 2.5])
    np.testing.assert_array_equal(column_array(floats, "n"), [1.0, np.nan, 3.0])
    assert column_array(floats, "n", np.int64).tolist() == [1, 0, 3]
    assert numbers(pa.array([2**40, 5], pa.uint64())).tolist() == [2**40, 5]
    assert numbers(pa.chunked_array([], pa.float64())).tolist() == []


def test_usage_lists_read_through_their_offsets():
    lists = pa.array([[0.9, 0.8], [0.1, 0.2], None, [0.5]]).slice(1)
    usage, width = usage_matrix(pa.table({"kv_cache_usage_by_group": lists}))
    assert width == 2
    np.testing.assert_array_equal(usage, [[0.1, 0.2], [0.0, 0.0], [0.5, 0.0]])
    even = pa.array([[0.9, 0.8], [0.1, 0.2], [0.3, 0.4]]).slice(1)
    usage, width = usage_matrix(pa.table({"kv_cache_usage_by_group": even}))
    np.testing.assert_array_equal(usage, [[0.1, 0.2], [0.3, 0.4]])


@needs_fork
def test_a_refused_fork_draws_everything_here(monkeypatch):
    def refused():
        raise BlockingIOError("Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", refused)
    draws = _draws(3)
    open_fds = len(os.listdir("/proc/self/fd"))
    assert draw_all(draws, fork=True) == [d() for d in draws]
    assert len(os.listdir("/proc/self/fd")) == open_fds  # the pipe is closed again
