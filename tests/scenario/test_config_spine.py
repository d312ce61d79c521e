"""The settings table is the one home of every user-facing setting: the scenario layer
stands without the replay, each flag is declared once, and the sweep keys, the commands'
options and the error words all come from it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.knobs import FLAGS, KNOBS, flag_for
from kvtwin.sim.scenario.resolve import Overrides
from kvtwin.sim.scenario.sweep_keys import sweep_key


def test_the_scenario_layer_loads_no_replay_module():
    code = ("import sys, pkgutil, importlib, kvtwin.sim.scenario as s\n"
            "for m in pkgutil.iter_modules(s.__path__): importlib.import_module('kvtwin.sim.scenario.' + m.name)\n"
            "print(sorted(n for n in sys.modules if n.startswith('kvtwin.sim.replay.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_flag_is_declared_once_for_a_known_setting():
    assert set(FLAGS) <= set(KNOBS)
    spellings = [flag for flags, _ in FLAGS.values() for flag in flags]
    assert len(spellings) == len(set(spellings))
    assert all(text for _, text in FLAGS.values())


@pytest.mark.parametrize("key, flag", [("engine.tensor_parallel_size", "--tp"),
                                       ("offload.disk_bandwidth_bytes_per_s", "--offload-disk-bandwidth"),
                                       ("workload.rate_scale", "--rate-scale"), ("run.time_limit_s", "--time-limit-s")])
def test_errors_name_the_tables_flag(key, flag):
    assert flag_for(*key.split(".")) == flag


def test_deployment_settings_are_swept_as_engine_keys():
    assert (sweep_key("engine.replicas").kind, sweep_key("engine.router").kind) == ("int", "str")


def test_a_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError) as err:
        Overrides.from_knobs({"workload.limit": 0}).check()
    assert err.value.field == "--limit"


@pytest.mark.parametrize("command", ["plan", "replay"])
def test_commands_take_their_setting_options_from_the_table(command):
    text = CliRunner().invoke(app, [command, "--help"], terminal_width=200).output
    for key in ("engine.tensor_parallel_size", "engine.max_model_len", "engine.enable_prefix_caching"):
        flags, help_text = FLAGS[key]
        assert flags[0] in text and help_text in text
