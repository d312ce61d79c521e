"""The scenarios kvtwin ships (package data): the default replay, hybrid-model examples and
synthetic workload specs. ``scenarios/README.md`` documents the format.
"""

from __future__ import annotations

from pathlib import Path

SCENARIOS_DIR = Path(__file__).resolve().parent
DEFAULT_SCENARIO = SCENARIOS_DIR / "default.toml"
