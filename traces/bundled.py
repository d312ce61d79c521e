"""The traces bundled with kvtwin under ``traces/data/`` (see data/ATTRIBUTION.md)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from kvtwin.traces.errors import TraceError

DATA_DIR = Path(__file__).parent / "data"
PREFIX = "bundled:"

MOONCAKE_CONVERSATION = "mooncake_conversation_trace.jsonl"
AZURE_CODE_2023 = "AzureLLMInferenceTrace_code.csv"
AZURE_CONV_2023 = "AzureLLMInferenceTrace_conv.csv"
BURSTGPT1_FIRST400 = "burstgpt1_first400.csv"
BURSTGPT3_FIRST400 = "burstgpt3_first400.csv"
BUNDLED = (MOONCAKE_CONVERSATION, AZURE_CODE_2023, AZURE_CONV_2023, BURSTGPT1_FIRST400, BURSTGPT3_FIRST400)

# One line each for `kvtwin trace list`; data/ATTRIBUTION.md has the sources and licences.
DESCRIPTIONS = {
    MOONCAKE_CONVERSATION: "Mooncake (Kimi) conversations, one hour: token counts and 512-token prefix block ids",
    AZURE_CODE_2023: "Azure LLM inference 2023, code service, one hour: token counts, no prefix identity",
    AZURE_CONV_2023: "Azure LLM inference 2023, conversation service, one hour: token counts, no prefix identity",
    BURSTGPT1_FIRST400: "BurstGPT_1 (ChatGPT / GPT-4 on Azure), first 400 rows: token counts, no prefix identity",
    BURSTGPT3_FIRST400: "BurstGPT_3, first 400 rows: token counts and conversation sessions, no prefix identity",
}


@dataclass(frozen=True)
class BundledTrace:
    name: str
    rows: int
    size_bytes: int
    description: str


def bundled_traces() -> list[BundledTrace]:
    """Every bundled trace with its row count (from data/ATTRIBUTION.md: no file is parsed)."""
    rows = {match[1]: int(match[2].replace(",", "")) for match in
            re.finditer(r"^\| `([^`]+)` \| ([\d,]+) \|", (DATA_DIR / "ATTRIBUTION.md").read_text(), re.M)}
    return [BundledTrace(name, rows.get(name, 0), (DATA_DIR / name).stat().st_size, DESCRIPTIONS[name])
            for name in BUNDLED]


def bundled_path(name: str) -> Path:
    """The path of bundled trace ``name`` (with or without the ``bundled:`` prefix)."""
    name = name.removeprefix(PREFIX)
    if name not in BUNDLED:
        raise TraceError(PREFIX + name, "bundled trace", f"one of {', '.join(PREFIX + n for n in BUNDLED)} "
                                                         "(kvtwin trace list)")
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
