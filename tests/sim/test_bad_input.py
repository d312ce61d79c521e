"""Bad input: one clear message naming the file and field, never a traceback."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.core.config import SchedulerConfig
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.lockstep.golden import load_case
from kvtwin.sim.core.spec import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec, SlidingWindowSpec, spec_from_dict

CASE = Path(__file__).parent.parent / "golden" / "cases" / "swa128"


def _case_with(tmp_path, **changes):
    case = tmp_path / "case"
    shutil.copytree(CASE, case)
    config = json.loads((case / "config.json").read_text())
    config.update(changes)
    (case / "config.json").write_text(json.dumps(config))
    return case


@pytest.mark.parametrize("entry, field", [
    ({"kind": "linear_magic"}, "kind"),
    ({"kind": "sliding_window", "sliding_window": 0}, "sliding_window"),
    ({"kind": "sliding_window", "sliding_window": -5}, "sliding_window"),
    ({"kind": "chunked_local", "attention_chunk_size": 0}, "attention_chunk_size"),
    ({"kind": "full_attention", "windw": 3}, "windw"),
])
def test_invalid_group_is_rejected_naming_the_field(entry, field):
    with pytest.raises(ConfigError) as err:
        spec_from_dict(entry, block_size=16, where="kv_cache_groups[1]")
    assert f"kv_cache_groups[1].{field}" in str(err.value)


def test_block_size_must_be_a_multiple_of_the_hash_block():
    with pytest.raises(ConfigError, match=r"kv_cache_groups\[1\].block_size"):
        KVCacheConfig(num_blocks=10, hash_block_size=16, groups=(
            KVCacheGroupSpec(("a",), FullAttentionSpec(block_size=16)),
            KVCacheGroupSpec(("b",), SlidingWindowSpec(block_size=24, sliding_window=64))))


@pytest.mark.parametrize("num_blocks", [1, 0, -3])
def test_num_blocks_needs_the_null_block_and_one_more(num_blocks):
    with pytest.raises(ConfigError, match="num_blocks"):
        KVCacheConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("a",), FullAttentionSpec(block_size=16)),))


def test_non_positive_block_size_is_rejected():
    with pytest.raises(ConfigError, match="block_size"):
        FullAttentionSpec(block_size=0)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"watermark": 1.5}, "watermark"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 256}, "max_num_batched_tokens"),
])
def test_invalid_scheduler_settings(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(max_model_len=2048, async_scheduling=False, **kwargs)


def test_case_errors_name_the_file_and_field(tmp_path):
    case = _case_with(tmp_path, num_blocks=1)
    with pytest.raises(ConfigError) as err:
        load_case(case)
    assert str(err.value).startswith(f"{case / 'config.json'}: num_blocks: expected")


def test_unknown_config_field_is_an_error_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="max_num_seq"):
        load_case(_case_with(tmp_path, max_num_seq=4))


def test_malformed_request_line_names_file_line_and_field(tmp_path):
    case = _case_with(tmp_path)
    lines = (case / "requests.jsonl").read_text().splitlines()
    row = json.loads(lines[2])
    del row["output_token_ids"]
    lines[2] = json.dumps(row)
    (case / "requests.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        load_case(case)
    assert "requests.jsonl:3: output_token_ids" in str(err.value)


def test_cli_prints_one_line_and_exits_2(tmp_path):
    case = _case_with(tmp_path, kv_cache_groups=[{"kind": "sliding_window", "sliding_window": 0}])
    res = CliRunner().invoke(app, ["lockstep", str(case), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines == [f"kvtwin: error: {case / 'config.json'}: kv_cache_groups[0].sliding_window: "
                     f"expected a positive integer number of tokens, got 0"]
