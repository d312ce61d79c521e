"""The one table of features and their combinations (sim/scenario/features.py,
docs/architecture.md#features-and-their-combinations): every refused set is refused when a
scenario with it is resolved, as one error naming the setting; every feature alone, and
every pair the table does not refuse, resolves; and no other module refuses a pair."""

from __future__ import annotations

import ast
import copy
import itertools
from pathlib import Path

import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.features import FEATURES, REFUSED, feature_settings
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from tests.cli_run import one_error_line, run

ROOT = Path(__file__).parents[2]
PD_SCENARIO = ROOT / "scenarios" / "mooncake-llama8b-h100-pd.toml"
BASE = {"model": {"preset": "llama-3.1-8b"}, "hardware": {"gpu": "h100"}}
# The smallest scenario tables (or flags) that turn each feature on, written here, not
# taken from the table under test.
ON = {
    "offload": ({"offload": {"cpu_bytes": 2**30}}, Overrides()),
    "disaggregation": ({"disaggregation": {"prefill_replicas": 1, "decode_replicas": 1}}, Overrides()),
    "speculative": ({"speculative": {"method": "ngram", "num_speculative_tokens": 2, "acceptance": 0.5}},
                    Overrides()),
    "replicas": ({}, Overrides(deployment={"replicas": 2})),
    "mamba_without_prefix_caching": ({"model": {"preset": "nemotron-h-8b"},
                                      "engine": {"enable_prefix_caching": False}}, Overrides()),
    "async_scheduling": ({"engine": {"async_scheduling": True}}, Overrides()),
    "pipeline_parallel": ({"engine": {"pipeline_parallel_size": 2}}, Overrides()),
    "data_parallel": ({"engine": {"data_parallel_size": 2}}, Overrides()),
    "expert_parallel": ({"model": {"preset": "gpt-oss-20b"}, "engine": {"enable_expert_parallel": True}},
                        Overrides()),
    "dp_lockstep": ({"model": {"preset": "gpt-oss-20b"}, "engine": {"data_parallel_size": 2}}, Overrides()),
    "prefill_cadence": ({"engine": {"prefill_schedule_interval": 2}}, Overrides()),
}
# Pairs whose tables name different models: not a refusal, just no one scenario.
OTHER_MODELS = {frozenset({"expert_parallel", "mamba_without_prefix_caching"}),
                frozenset({"dp_lockstep", "mamba_without_prefix_caching"})}
# A lockstep group is data parallelism too: the pairs refused with DP are refused with it.
IMPLIED = {frozenset({"dp_lockstep", "replicas"}), frozenset({"dp_lockstep", "disaggregation"})}
# What each refusal's error names when every feature comes from the scenario file (the
# replicas only refuse as a flag) and a word of its reason.
REFUSAL_NAMES = {
    frozenset({"disaggregation", "offload"}): ("disaggregation", "offload tier"),
    frozenset({"disaggregation", "speculative"}): ("disaggregation", "drafting"),
    frozenset({"offload", "speculative"}): ("offload.cpu_bytes", "drafts"),
    frozenset({"replicas", "disaggregation"}): ("--replicas", "prefill_replicas"),
    frozenset({"offload", "mamba_without_prefix_caching"}): ("offload.cpu_bytes", "prefix caching off"),
    frozenset({"pipeline_parallel", "speculative"}): ("speculative.method", "drafting"),
    frozenset({"pipeline_parallel", "offload"}): ("offload.cpu_bytes", "KV connector"),
    frozenset({"pipeline_parallel", "disaggregation"}): ("engine.pipeline_parallel_size", "KV connector"),
    frozenset({"data_parallel", "replicas"}): ("--replicas", "several DP engines"),
    frozenset({"data_parallel", "disaggregation"}): ("engine.data_parallel_size", "prefill_data_parallel_size"),
    frozenset({"dp_lockstep", "pipeline_parallel"}): ("engine.pipeline_parallel_size", "lockstep"),
    frozenset({"dp_lockstep", "speculative"}): ("speculative.method", "lockstep"),
    frozenset({"prefill_cadence", "offload"}): ("offload.cpu_bytes", "prefill cadence"),
    frozenset({"prefill_cadence", "disaggregation"}): ("engine.prefill_schedule_interval", "KV connector"),
    frozenset({"prefill_cadence", "speculative"}): ("speculative.method", "prefill cadence"),
    frozenset({"prefill_cadence", "pipeline_parallel"}): ("engine.prefill_schedule_interval", "pipeline stages"),
}
def _merge(*tables: dict) -> dict:
    out: dict = {}
    for table in tables:
        for section, value in table.items():
            if isinstance(value, dict):
                out[section] = {**out.get(section, {}), **copy.deepcopy(value)}
            else:
                out[section] = value
    return out


def _with(names, tmp_path):
    data = _merge(BASE, *(ON[name][0] for name in names))
    deployment: dict = {}
    for name in names:
        deployment.update(ON[name][1].deployment)
    return tmp_path / "s.toml", data, Overrides(deployment=deployment)


def test_every_feature_and_refusal_here_is_the_tables():
    assert {feature.name for feature in FEATURES} == set(ON)
    assert {frozenset(refusal.features) for refusal in REFUSED} == set(REFUSAL_NAMES)
    # One entry per feature and per refused set.
    assert len(FEATURES) == len(ON) and len(REFUSED) == len(REFUSAL_NAMES)


@pytest.mark.parametrize("names", sorted(REFUSAL_NAMES, key=sorted), ids=lambda n: "+".join(sorted(n)))
def test_each_refused_set_is_refused_when_resolved(names, tmp_path):
    path, data, overrides = _with(sorted(names), tmp_path)
    field, word = REFUSAL_NAMES[names]
    with pytest.raises(ConfigError) as err:
        resolve_scenario(path, overrides, data=data)
    assert err.value.field == field and word in err.value.expected, err.value
    # A scenario field is named with its file; a flag is named alone.
    assert err.value.source == (None if field.startswith("--") else str(path))


@pytest.mark.parametrize("name", sorted(ON))
def test_each_feature_alone_resolves(name, tmp_path):
    path, data, overrides = _with([name], tmp_path)
    resolved = resolve_scenario(path, overrides, data=data)
    assert name in feature_settings(resolved, overrides)
    resolved.plan()


@pytest.mark.parametrize("pair", [p for p in itertools.combinations(sorted(ON), 2)
                                  if frozenset(p) not in set(REFUSAL_NAMES) | OTHER_MODELS | IMPLIED], ids="+".join)
def test_every_pair_not_refused_resolves(pair, tmp_path):
    path, data, overrides = _with(pair, tmp_path)
    resolved = resolve_scenario(path, overrides, data=data)
    assert set(pair) <= set(feature_settings(resolved, overrides))


def test_scenario_replicas_beside_disaggregation_are_unused_not_refused(tmp_path):
    data = _merge(BASE, ON["disaggregation"][0], {"engine": {"replicas": 3}})
    resolved = resolve_scenario(tmp_path / "s.toml", data=data)
    assert resolved.num_replicas == 2 and resolved.describe()["replicas"] is None


@pytest.mark.parametrize("flags,field", [
    (("--offload-cpu-bytes", "1GB"), "--offload-cpu-bytes"),
    (("--speculative-method", "ngram", "--num-speculative-tokens", "2", "--spec-acceptance", "0.5"),
     "--speculative-method"),
    (("--router", "least_loaded"), "--router"),
])
def test_a_flag_that_adds_a_refused_feature_is_one_error_line_naming_it(flags, field, tmp_path):
    out = tmp_path / "run"
    line = one_error_line(run("replay", PD_SCENARIO, *flags, "--out", out), f"kvtwin: error: {field}: expected",
                          "[disaggregation]")
    assert str(PD_SCENARIO) not in line
    assert not out.exists()


def test_a_refused_pair_in_a_scenario_file_is_one_error_line_naming_the_file(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text(PD_SCENARIO.read_text() + "\n[offload]\ncpu_bytes = 1000000000\n")
    one_error_line(run("replay", scenario, "--out", tmp_path / "run"),
                   f"kvtwin: error: {scenario}: disaggregation: expected no [offload] table beside it")


def test_a_sweep_value_that_makes_a_refused_pair_is_a_flag_error_before_any_point(tmp_path):
    out = tmp_path / "cap"
    one_error_line(run("capacity", PD_SCENARIO, "--sweep", "offload.cpu_bytes=0,1e9", "--out", out),
                   "--sweep offload.cpu_bytes", "[offload]")
    assert not out.exists()


def _refusal_texts(tree: ast.AST) -> list[str]:
    """The string constants of every ``raise`` and ``require(...)`` call in ``tree``."""
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) or (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "require"):
            texts += [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return texts


def test_no_other_module_refuses_a_combination():
    table = ROOT / "sim" / "scenario" / "features.py"
    # The table's reasons, and the words the old refusals spread over five modules used.
    needles = [refusal.reason for refusal in REFUSED] + [
        "offload tier or a P/D connector", "with a KV offload tier", "P/D with speculative decoding",
        "table in the scenario (its"]
    found = []
    for path in sorted((ROOT / "sim").rglob("*.py")) + sorted((ROOT / "kvtwin").rglob("*.py")):
        if path == table:
            continue
        for text in _refusal_texts(ast.parse(path.read_text())):
            found += [(str(path.relative_to(ROOT)), needle) for needle in needles if needle in text]
    assert found == []
    # The search finds a refusal written the old way (so an empty result means something).
    old = ('raise ConfigError("disaggregation", '
           '"no [offload] table beside it (P/D with an offload tier is not modelled)")')
    assert any(REFUSED[0].reason in text for text in _refusal_texts(ast.parse(old)))
