"""`kvtwin kernels`: which paged-kernel backends work on this machine, and why not.

Prints one line per backend (torch reference, Triton, vllm_flash_attn) and the one that
``KVTWIN_ATTN_BACKEND`` (default auto) selects. Works without torch installed: the
``kernels`` package imports torch only when a backend is actually probed.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer


def kernels(
    device: Optional[str] = typer.Option(None, "--device",
                                         help="Device type to probe: cuda or cpu (default: cuda if present)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of lines."),
) -> None:
    """Which kernel backends are usable here, and why not."""
    from kvtwin.kernels import backends

    try:
        requested = backends.requested_backend()
    except backends.BackendUnavailable as err:
        print(f"kvtwin: error: {err}", file=sys.stderr)
        raise typer.Exit(code=2) from None
    if device not in (None, "cpu", "cuda"):
        print(f"kvtwin: error: --device: expected cpu or cuda, got {device!r}", file=sys.stderr)
        raise typer.Exit(code=2)
    report = backends.availability(device)
    try:
        chosen = backends.resolve(requested, device or _default_device())
        selected, note = chosen.name, chosen.note
    except backends.BackendUnavailable as err:
        selected, note = None, str(err)
    if as_json:
        print(json.dumps({
            "backends": [{"name": a.name, "usable": a.usable, "detail": a.detail} for a in report],
            "requested": requested, "selected": selected, "note": note,
        }))
        return
    for a in report:
        print(f"{a.name + ':':<17} {'usable' if a.usable else 'not usable':<11} {a.detail}")
    print(f"{backends.ENV_VAR}={requested} -> {selected or 'none'}" + (f" ({note})" if note else ""))


def _default_device() -> str:
    from kvtwin.kernels import backends

    return "cpu" if backends.torch_problem() else backends.default_device_type()
