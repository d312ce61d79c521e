"""Calibration: the cost model's factors, the files that carry them, and the fits that make
them (docs/architecture.md#folders-and-layers).

Two layers, so that a scenario can read a calibration without loading the replay, and the
fits can run the replay:

* this package, read by ``scenario`` and ``replay`` (it builds on ``core`` and
  ``planner`` only):

  - ``efficiency`` — the cost model's knobs (``Efficiency``) and the measured all-reduce
    curves, as a scenario's ``[cost_model]`` table and a calibration file set them;
  - ``file`` — the calibration file format: reading one, the bundled per-GPU files
    (``sim/replay/data/calibration``);
  - ``gpu`` — which bundled calibration a GPU gets and, when it gets none, why;
  - ``band`` — the band a calibration's held-out error puts around a replay's answers,
    and the pessimistic clock of a capacity search;

* ``fit`` — the fits, on the replay (its cost model and ``run_replay``): ``step_model``
  (the cost model's factors from measured steps, and writing a calibration file),
  ``kernels`` (GEMM, attention and all-reduce fits behind the bundled files), and
  ``kvtwin calibrate``'s library: the readers of ``vllm bench serve`` results
  (``bench_serve``) and ``/metrics`` scrapes (``prometheus``), the serving fit
  (``serving``), the step fit on ``kvtwin validate``'s steps (``steps``, with the device
  that measured them in ``steps_device``), and one calibration job end to end (``job``).

The maintainer scripts that refit the bundled files from the public measurements stay
scripts (``scripts/calibration/``), importing ``fit``.
"""
