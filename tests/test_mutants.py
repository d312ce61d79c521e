"""The mutant list of bench/mutation.py stays in step with the code: every mutant's text
is still in its file exactly once and names test files that exist, so a refactor that
moves a line says so here instead of silently shrinking the mutation check."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutation_module():
    spec = importlib.util.spec_from_file_location("bench_mutation", ROOT / "bench" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutant_applies_once_and_names_existing_tests():
    mutation = _mutation_module()
    mutants = mutation.load_mutants()
    assert mutants, "bench/mutants holds no mutant"
    for mutant in mutants:
        for test in mutant.tests:
            assert (ROOT / test.split("::")[0]).exists(), f"{mutant.name}: no test file {test}"


def test_a_find_that_is_not_unique_is_refused(tmp_path):
    mutation = _mutation_module()
    (tmp_path / "x.toml").write_text(
        '[[mutant]]\nname = "n"\npath = "README.md"\nfind = "kvtwin"\nreplace = "kvtwim"\ntests = []\n')
    with pytest.raises(SystemExit, match="occurs"):
        mutation.load_mutants(tmp_path)
