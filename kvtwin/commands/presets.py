"""`kvtwin models` and `kvtwin gpus`: the built-in presets, one line of facts each.

The names are what ``--model`` / ``--gpu`` and a scenario's ``preset`` / ``gpu`` accept;
the facts are the preset fields the planner and cost model read
(``sim/planner/data/models.toml``, ``gpus.toml``) and, for a GPU, whether kvtwin bundles a
calibration of its clock (``sim/replay/data/calibration``).
"""

from __future__ import annotations

import json
from collections import Counter

import typer

from kvtwin.sim.planner.hardware import GPU_PRESETS, gpu_names
from kvtwin.sim.planner.models import MODEL_PRESETS, model_names
from kvtwin.sim.calibration.file import bundled_gpus

# For --model / --gpu help; `kvtwin models` / `kvtwin gpus` add a line of facts to each name.
MODEL_CHOICES = ", ".join(model_names()) + " (kvtwin models)"
GPU_CHOICES = ", ".join(gpu_names()) + " (kvtwin gpus)"

# Layer-pattern letters (scenarios/README.md, [model] layer_pattern) in reading order.
_LAYER_WORDS = {"F": "full", "S": "sliding", "C": "chunked", "A": "MLA", "M": "state", "-": "no-cache"}


def _params(count: float) -> str:
    return f"{count / 1e9:,.1f}B" if count < 1e12 else f"{count / 1e12:,.2f}T"


def _tokens(count: int) -> str:
    return f"{count // 1024:,}k" if count % 1024 == 0 else f"{count:,}"


def _model_line(name: str) -> str:
    m = MODEL_PRESETS[name]
    active = m.params_active if m.params_active is not None else m.params_total
    params = _params(m.params_total) + (f" ({_params(active)} active)" if active < m.params_total else "")
    counts = Counter(m.layer_letters)
    words = dict(_LAYER_WORDS, M=f"{m.state.kind} state" if m.state is not None else "state")
    layers = ", ".join(f"{counts[letter]} {word}" for letter, word in words.items() if counts[letter])
    return (f"{name:<20} {params} params, {m.weight_format} weights; {m.num_layers} layers ({layers}); "
            f"context {_tokens(m.max_position_embeddings)}; {m.hf_id or m.architecture}")


def _clock(name: str, bundled: tuple[str, ...]) -> str:
    """Whether replays on this preset run on a bundled calibration or the default factors."""
    return "calibrated" if name in bundled else "uncalibrated"


def _gpu_line(name: str, bundled: tuple[str, ...]) -> str:
    g = GPU_PRESETS[name]
    fp8 = f", {g.fp8_flops / 1e12:,.0f} fp8" if g.fp8_flops else ", no fp8"
    return (f"{name:<10} {_clock(name, bundled):<12} {g.memory_datasheet or format(g.memory_gib, '.0f') + ' GiB'}, "
            f"{g.hbm_bandwidth_bytes_per_s / 1e12:,.2f} TB/s; {g.bf16_flops / 1e12:,.0f} bf16{fp8} dense TFLOP/s; "
            f"{g.interconnect_bytes_per_s / 1e9:,.0f} GB/s peer link, {g.pcie_h2d_bytes_per_s / 1e9:,.0f} GB/s "
            f"host link; {g.description}")


# What `--json` reports for each preset.
MODEL_FACTS = ("params_total", "params_active", "num_layers", "layer_pattern", "max_position_embeddings", "hf_id")
GPU_FACTS = ("description", "memory_bytes", "hbm_bandwidth_bytes_per_s", "bf16_flops", "fp8_flops",
             "interconnect_bytes_per_s", "pcie_h2d_bytes_per_s", "pcie_d2h_bytes_per_s", "nic_bytes_per_s")


def _facts(presets: dict, names: list[str], fields: tuple[str, ...], extra=lambda name: {}) -> str:
    return json.dumps({name: {**{f: getattr(presets[name], f) for f in fields}, **extra(name)} for name in names},
                      indent=1)


def models(as_json: bool = typer.Option(False, "--json", help="Print one JSON object: name -> facts.")) -> None:
    """The model presets --model and [model] preset accept, one line of facts each."""
    if as_json:
        print(_facts(MODEL_PRESETS, model_names(), MODEL_FACTS))
        return
    for name in model_names():
        print(_model_line(name))


def gpus(as_json: bool = typer.Option(False, "--json", help="Print one JSON object: name -> facts.")) -> None:
    """The GPU presets --gpu and [hardware] gpu accept, one line of facts each.

    Each line says calibrated (a bundled calibration sets the replay's clock) or
    uncalibrated (the default factors)."""
    bundled = bundled_gpus()
    if as_json:
        print(_facts(GPU_PRESETS, gpu_names(), GPU_FACTS, lambda name: {"calibrated": name in bundled}))
        return
    for name in gpu_names():
        print(_gpu_line(name, bundled))
