"""Which kernel backend runs here: availability, the ``KVTWIN_ATTN_BACKEND`` override and
the one cached choice.

Backends, best first on a GPU:

- ``vllm_flash_attn``: vLLM's flash attention for attention (``kernels.flash``), checked
  once against Triton (or the reference) on a tiny case; K/V writes and the state update
  come from Triton (the reference if Triton is unusable);
- ``triton``: all three operations; needs a CUDA device, or ``TRITON_INTERPRET=1`` set
  before the kernel modules are imported to run on CPU tensors (slowly; tests do this);
- ``torch``: the reference (``kernels.reference``), anywhere.

``KVTWIN_ATTN_BACKEND=auto|vllm_flash_attn|triton|torch`` (default auto). Auto takes the
first usable one for the device, falling back with the reason kept in ``Backend.note``;
a forced backend that cannot run is an error (``BackendUnavailable``), never a silent
substitute. Nothing here imports torch or Triton at module import time, so the ``kvtwin
kernels`` command can report a machine without them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

ENV_VAR = "KVTWIN_ATTN_BACKEND"
NAMES = ("vllm_flash_attn", "triton", "torch")
CHOICES = ("auto", *NAMES)


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why."""


@dataclass(frozen=True)
class Backend:
    """The three operations of one backend (signatures of ``kernels.reference``)."""

    name: str
    write_kv: Callable
    paged_attention: Callable
    state_update: Callable
    note: str = ""


@dataclass(frozen=True)
class Availability:
    name: str
    usable: bool
    detail: str


def requested_backend() -> str:
    """The value of ``KVTWIN_ATTN_BACKEND`` (``auto`` when unset), validated."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise BackendUnavailable(f"{ENV_VAR}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def default_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------
# Why a backend can or cannot run (None = it can)
# --------------------------------------------------------------------------------------


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def torch_problem() -> str | None:
    if not installed("torch"):
        return "not installed (pip install 'kvtwin[kernels]')"
    return None


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_problem(device_type: str) -> str | None:
    if torch_problem():
        return "needs torch, which is not installed"
    if not installed("triton"):
        return "not installed (pip install 'kvtwin[kernels]')"
    if device_type == "cpu" and not interpreter_on():
        return "no CUDA device; on CPU Triton runs only under TRITON_INTERPRET=1 (set before import)"
    if device_type not in ("cpu", "cuda"):
        return f"device type {device_type!r} is not supported"
    try:
        importlib.import_module("kvtwin.kernels.triton_attention")
        importlib.import_module("kvtwin.kernels.triton_write_kv")
        importlib.import_module("kvtwin.kernels.triton_state_update")
    except Exception as err:
        return f"kernel modules fail to import: {type(err).__name__}: {err}"
    return None


def flash_problem(device_type: str) -> str | None:
    """Import vllm_flash_attn and check it once against Triton (or the reference)."""
    if torch_problem():
        return "needs torch, which is not installed"
    if device_type != "cuda":
        found = [name for name in ("vllm", "vllm_flash_attn") if installed(name)]
        return "needs a CUDA device" + (f" ({', '.join(found)} installed)" if found else
                                        " (and neither vllm nor vllm_flash_attn is installed)")
    from kvtwin.kernels import flash

    try:
        attention = flash.load()
    except flash.FlashUnavailable as err:
        return f"not importable: {err}"
    baseline = _triton_backend() if triton_problem(device_type) is None else _torch_backend()
    reason = flash.check(attention, baseline.paged_attention, device_type)
    if reason:
        return f"{attention.module_name} {reason} (compared with {baseline.name})"
    return None


# --------------------------------------------------------------------------------------
# Building backends
# --------------------------------------------------------------------------------------


def _torch_backend(note: str = "") -> Backend:
    from kvtwin.kernels import reference

    return Backend("torch", reference.write_kv, reference.paged_attention, reference.state_update, note)


def _triton_backend(note: str = "") -> Backend:
    from kvtwin.kernels import triton_attention, triton_state_update, triton_write_kv

    return Backend("triton", triton_write_kv.write_kv, triton_attention.paged_attention,
                   triton_state_update.state_update, note)


def _flash_backend(device_type: str, note: str = "") -> Backend:
    from kvtwin.kernels import flash

    others = _triton_backend() if triton_problem(device_type) is None else _torch_backend()
    note = note or f"write_kv and state_update from {others.name}"
    return Backend("vllm_flash_attn", others.write_kv, flash.load(), others.state_update, note)


def _problem(name: str, device_type: str) -> str | None:
    if name == "torch":
        return torch_problem()
    if name == "triton":
        return triton_problem(device_type)
    return flash_problem(device_type)


@functools.lru_cache(maxsize=None)
def resolve(requested: str, device_type: str) -> Backend:
    """The backend for ``requested`` (a name or ``auto``) on ``device_type``; cached, so
    the flash check runs once per process. ``resolve.cache_clear()`` forgets the choice."""
    if requested != "auto":
        reason = _problem(requested, device_type)
        if reason:
            raise BackendUnavailable(f"{ENV_VAR}={requested}: {reason}")
        return _build(requested, device_type, note=f"forced by {ENV_VAR}")
    skipped = []
    # On CPU only the reference is a sensible default, even under the interpreter.
    for name in (NAMES if device_type == "cuda" else ("torch",)):
        reason = _problem(name, device_type)
        if reason is None:
            note = "; ".join(skipped)
            return _build(name, device_type, note=f"auto; skipped {note}" if note else "auto")
        skipped.append(f"{name}: {reason}")
    raise BackendUnavailable("no usable kernel backend: " + "; ".join(skipped))


def _build(name: str, device_type: str, note: str) -> Backend:
    if name == "torch":
        return _torch_backend(note)
    if name == "triton":
        return _triton_backend(note)
    return _flash_backend(device_type, note)


def select_backend(device_type: str | None = None) -> Backend:
    """The backend to use for tensors on ``device_type`` (default: cuda if present),
    honouring ``KVTWIN_ATTN_BACKEND``."""
    return resolve(requested_backend(), device_type or default_device_type())


def availability(device_type: str | None = None) -> list[Availability]:
    """Every backend, usable or not and why, for ``device_type`` (default: cuda if
    present). Runs the flash check, so on a GPU it launches tiny kernels."""
    if torch_problem():
        device_type = device_type or "cpu"
    else:
        device_type = device_type or default_device_type()
    report = []
    for name in reversed(NAMES):
        reason = _problem(name, device_type)
        report.append(Availability(name, reason is None, reason or _usable_detail(name, device_type)))
    return report


def _usable_detail(name: str, device_type: str) -> str:
    if name == "torch":
        import torch

        return f"torch {torch.__version__}, reference ({device_type})"
    if name == "triton":
        import triton

        mode = "interpreter" if device_type == "cpu" else "compiled"
        return f"triton {triton.__version__} ({mode})"
    from kvtwin.kernels import flash

    return f"{flash.load().module_name}, checked against a tiny case"
