from pathlib import Path

import pytest
from hypothesis import settings

GOLDEN_CASES_DIR = Path(__file__).parent / "golden" / "cases"

# No per-example deadline: it is a timed assertion, and times belong in bench/. The suite
# runs on pytest-xdist workers (scripts/test.sh), where a loaded machine slows an example
# without anything being wrong.
settings.register_profile("kvtwin", deadline=None)
settings.load_profile("kvtwin")


@pytest.fixture
def golden_cases_dir() -> Path:
    return GOLDEN_CASES_DIR
