"""The traces bundled with kvtwin under ``traces/data/`` (see data/ATTRIBUTION.md)."""

from __future__ import annotations

import hashlib
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
PREFIX = "bundled:"

MOONCAKE_CONVERSATION = "mooncake_conversation_trace.jsonl"
AZURE_CODE_2023 = "AzureLLMInferenceTrace_code.csv"
AZURE_CONV_2023 = "AzureLLMInferenceTrace_conv.csv"
BURSTGPT1_FIRST400 = "burstgpt1_first400.csv"
BURSTGPT3_FIRST400 = "burstgpt3_first400.csv"
BUNDLED = (MOONCAKE_CONVERSATION, AZURE_CODE_2023, AZURE_CONV_2023, BURSTGPT1_FIRST400, BURSTGPT3_FIRST400)


def bundled_path(name: str) -> Path:
    """The path of bundled trace ``name`` (with or without the ``bundled:`` prefix)."""
    name = name.removeprefix(PREFIX)
    if name not in BUNDLED:
        raise FileNotFoundError(2, f"no bundled trace {name!r} (bundled: {', '.join(BUNDLED)})", name)
    return DATA_DIR / name


def resolve(path: str | Path, base_dir: Path | None = None) -> Path:
    """``bundled:NAME`` to the bundled file; a relative path against ``base_dir`` when given."""
    text = str(path)
    if text.startswith(PREFIX):
        return bundled_path(text)
    path = Path(text)
    return path if path.is_absolute() or base_dir is None else base_dir / path


def expected_sha256() -> dict[str, str]:
    """File name to sha256, from ``data/SHA256SUMS``."""
    sums = {}
    for line in (DATA_DIR / "SHA256SUMS").read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.strip().lstrip("*")] = digest
    return sums


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
