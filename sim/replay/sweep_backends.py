"""Where the points of a capacity sweep run: in this process (``jobs = 1``), on a local
process pool, or as Ray tasks. Every backend returns the same rows, sorted by point, so
``capacity.parquet`` is byte-identical whichever ran it."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.replay.capacity_points import PointTask, run_point

BACKENDS = ("process", "ray")


def check_backend(backend: str, jobs: int | None, ray_address: str | None) -> None:
    """The ``--backend``, ``--jobs`` and ``--ray-address`` flags, checked together."""
    if backend not in BACKENDS:
        raise ConfigError("--backend", " or ".join(BACKENDS), backend)
    if jobs is not None and jobs < 1:
        raise ConfigError("--jobs", "a positive number of points at once", jobs)
    if ray_address is not None and backend != "ray":
        raise ConfigError("--ray-address", "--backend ray with it", ray_address)


class _Collected:
    """The rows as they come back, each passed on to ``on_done`` (a progress display)."""

    def __init__(self, on_done: Callable[[dict], None] | None):
        self.rows: list[dict] = []
        self.on_done = on_done

    def __call__(self, row: dict) -> None:
        self.rows.append(row)
        if self.on_done is not None:
            self.on_done(row)


def default_jobs(num_points: int) -> int:
    return max(1, min(os.cpu_count() or 1, num_points))


def run_points(tasks: Sequence[PointTask], *, jobs: int = 1, backend: str = "process",
               ray_address: str | None = None, on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every task; rows sorted by point, the same whatever the backend and ``jobs``."""
    done = _Collected(on_done)
    if backend == "ray":
        _run_ray(tasks, ray_address, done)
    elif backend == "process":
        if jobs <= 1 or len(tasks) <= 1:
            for task in tasks:
                done(run_point(task))
        else:
            _run_pool(tasks, jobs, done)
    else:
        raise ConfigError("--backend", "process or ray", backend)
    return sorted(done.rows, key=lambda r: r["point"])


def _run_pool(tasks: Sequence[PointTask], jobs: int, done: Callable[[dict], None]) -> None:
    import concurrent.futures
    import multiprocessing

    context = _pool_context(multiprocessing)
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=context) as pool:
        futures = [pool.submit(run_point, task) for task in tasks]
        try:
            for future in concurrent.futures.as_completed(futures):
                done(future.result())
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _pool_context(multiprocessing):
    """Workers forked from a server that has imported kvtwin once (no fork of this process,
    whose progress-bar thread may hold a lock); plain spawn where there is no forkserver."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([run_point.__module__])
        return context
    return multiprocessing.get_context("spawn")


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend", "ray installed for a Ray cluster: pip install 'kvtwin[cluster]', "
                                       "or --backend process", "ray") from None
    return ray


def _run_ray(tasks: Sequence[PointTask], address: str | None, done: Callable[[dict], None]) -> None:
    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(run_point)
        pending = [remote.remote(task) for task in tasks]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                done(ray.get(ref))
    finally:
        if started_here:
            ray.shutdown()
