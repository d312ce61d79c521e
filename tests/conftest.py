from pathlib import Path

import pytest

GOLDEN_CASES_DIR = Path(__file__).parent / "golden" / "cases"


@pytest.fixture
def golden_cases_dir() -> Path:
    return GOLDEN_CASES_DIR
