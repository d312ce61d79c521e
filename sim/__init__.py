"""kvtwin's simulator, in six packages (docs/architecture.md#folders-and-layers):

* ``core`` — specs, block pool, managers, coordinators, the KV cache manager, the
  scheduler, the engine step and the offload tiers; the standard library only.
* ``planner`` — presets and vLLM's KV cache planner (on ``core``).
* ``lockstep`` — golden cases and the step clock (on ``core``).
* ``replay`` — the cost model and the SimPy clock (on ``core``, ``planner``, ``traces``).
* ``scenario`` — scenario files and their resolution with command-line overrides.
* ``calibration`` — the cost model's factors and the calibration files that carry them
  (on ``core``, ``planner``; read by ``scenario`` and ``replay``), and in ``fit`` the fits
  that make them, kernels, steps or a user's own server measurements (on ``replay``).

Nothing here imports torch, the executor, the kernels, reports or the CLI, so the lockstep
runner, the SimPy replay and the GPU executor all drive the very same code.
"""
