"""Speculative decoding in a replay: the ``[speculative]`` table, the acceptance draws, the
draft head's cost, the recorder's counts, and the bad-input errors (docs/semantics.md
#speculative-decoding)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.scenario.acceptance import AcceptanceConfig
from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.replay.run import plan_cost_model, run_replay
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from kvtwin.sim.scenario.spec_defaults import default_acceptance
from kvtwin.sim.scenario.sweep_keys import parse_sweeps
from tests.tables import assert_tables_equal
from kvtwin.traces import schema as col

SCENARIO = """\
description = "spec test: a short chat workload"
[model]
preset = "llama-3.1-8b"
[hardware]
gpu = "h100"
[engine]
max_model_len = 16896
max_num_seqs = 64
max_num_batched_tokens = 2048
enable_prefix_caching = false
async_scheduling = ASYNC
[workload]
kind = "chat"
seed = 3
num_requests = 40
block_tokens = 16
arrival = { process = "poisson", rate_per_s = 2.0 }
turns = { dist = "zipf", s = 1.2, max = 4 }
user_tokens = { dist = "lognormal", mean = 300, sigma = 0.5 }
output_tokens = { dist = "lognormal", mean = 120, sigma = 0.5 }
turn_gap_s = { dist = "exponential", mean = 5 }
max_prompt_tokens = 4000
"""


def _scenario(tmp_path, spec: str = "", *, async_scheduling: bool = True, engine: str = "", name: str = "s.toml"):
    text = SCENARIO.replace("ASYNC", "true" if async_scheduling else "false")
    if engine:
        text = text.replace("[workload]", engine + "\n[workload]")
    path = tmp_path / name
    path.write_text(text + ("\n[speculative]\n" + spec if spec else ""))
    return path


def _run(path, **speculative):
    resolved = resolve_scenario(path, Overrides(speculative=speculative))
    planned = resolved.plan()
    result = run_replay(planned, resolved.require_workload().load(), efficiency=resolved.efficiency,
                        slo=resolved.slo, speculative=resolved.speculative)
    return result, result.summary.to_pylist()[0]


def _replay_cli(*args):
    return CliRunner().invoke(app, ["replay", *map(str, args), "-q", "--no-report"])


def _one_error_line(res, *fragments):
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error:"), res.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_spec_replay_finishes_every_request_and_counts_its_drafts(tmp_path, async_scheduling):
    path = _scenario(tmp_path, 'method = "eagle3"\nnum_speculative_tokens = 3\nacceptance = 0.7\n',
                     async_scheduling=async_scheduling)
    result, summary = _run(path)
    requests = result.requests.to_pydict()
    assert summary["completed"] == result.requests.num_rows
    # A verify step yields its sampled token and its accepted drafts; past the stop they
    # are trimmed (at most k of them); a batch still in flight when it stopped yields nothing.
    for generated, accepted, drafts, steps in zip(requests["generated_tokens"], requests["accepted_draft_tokens"],
                                                  requests["draft_tokens"], requests["verify_steps"]):
        assert accepted <= drafts <= 3 * steps
        assert accepted + steps <= generated + 3
    expected = AcceptanceConfig(3, 0.7).mean_accepted()
    assert summary["mean_acceptance_length"] == pytest.approx(1 + expected, abs=0.1)
    assert summary["spec_acceptance_rate"] == pytest.approx(expected / 3, abs=0.05)
    # Verify rows are decodes: decode tokens include the drafts.
    steps = result.steps.to_pydict()
    assert sum(steps["decode_tokens"]) >= summary["spec_draft_tokens"]


def test_the_console_and_the_report_show_the_acceptance(tmp_path):
    """The acceptance rate, the mean acceptance length and the rate by draft position, as
    recomputed from the requests' and steps' rows, in the console and in report.html."""
    path = _scenario(tmp_path, 'method = "eagle3"\nnum_speculative_tokens = 3\nacceptance = [0.9, 0.5, 0.2]\n')
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["replay", str(path), "-q", "--out", str(out)])
    assert res.exit_code == 0, res.output
    requests = pq.read_table(out / "requests.parquet").to_pydict()
    steps = pq.read_table(out / "steps.parquet").to_pydict()
    drafts, accepted = sum(requests["draft_tokens"]), sum(requests["accepted_draft_tokens"])
    verify_steps = sum(requests["verify_steps"])
    by_step = np.array(steps["spec_accepted_by_position"])
    assert by_step.shape == (len(steps["step"]), 3)
    per_position = by_step.sum(axis=0)
    # A draft is accepted only after the ones before it: the counts fall with the position
    # and add up to the accepted drafts.
    assert per_position.sum() == accepted and (np.diff(per_position) <= 0).all()
    rates = per_position / verify_steps
    # Position i is accepted with the product of the rates up to it.
    assert rates == pytest.approx([0.9, 0.45, 0.09], abs=0.05)
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    assert summary["spec_acceptance_by_position"] == pytest.approx(list(rates))
    rate, length = accepted / drafts, 1 + accepted / verify_steps
    assert (summary["spec_acceptance_rate"], summary["mean_acceptance_length"]) == pytest.approx((rate, length))
    percents = " / ".join(f"{r * 100:.1f} %" for r in rates)
    line = (f"speculative decoding: acceptance rate {rate * 100:.1f} % ({accepted:,} of {drafts:,} drafts), mean "
            f"acceptance length {length:.2f} tokens per verify step; by draft position {percents}")
    assert line in res.output.splitlines()
    report = (out / "report.html").read_text()
    for fragment in (f"{rate * 100:.1f} % ({accepted:,} / {drafts:,})", f"<td>{length:.2f}</td>", percents):
        assert fragment in report, fragment


def test_a_spec_replay_is_deterministic(tmp_path):
    path = _scenario(tmp_path, 'method = "ngram"\nnum_speculative_tokens = 4\nacceptance = [0.8, 0.6, 0.5, 0.4]\n'
                               'seed = 7\n')
    runs = []
    for out in ("a", "b"):
        res = _replay_cli(path, "--out", tmp_path / out)
        assert res.exit_code == 0, res.output
        runs.append({name: pq.read_table(tmp_path / out / f"{name}.parquet") for name in ("requests", "steps")})
    for name in ("requests", "steps"):
        assert_tables_equal(runs[0][name], runs[1][name])
    other = _run(path, seed=8)[0]
    assert other.requests.column("accepted_draft_tokens") != runs[0]["requests"].column("accepted_draft_tokens")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_higher_acceptance_gives_lower_tpot(tmp_path, async_scheduling):
    path = _scenario(tmp_path, 'method = "eagle3"\nnum_speculative_tokens = 3\n', async_scheduling=async_scheduling)
    tpot = {rate: _run(path, acceptance=rate)[1]["mean_tpot_ms"] for rate in (0.1, 0.5, 0.9)}
    assert tpot[0.9] < tpot[0.5] < tpot[0.1]


def test_no_speculative_table_means_no_spec_columns(tmp_path):
    result, summary = _run(_scenario(tmp_path))
    assert "accepted_draft_tokens" not in result.requests.column_names
    assert "spec_acceptance_rate" not in summary


def test_a_draft_head_costs_time_and_ngram_does_not(tmp_path):
    path = _scenario(tmp_path, 'method = "ngram"\nnum_speculative_tokens = 3\nacceptance = 0.0\n')
    resolved = resolve_scenario(path)
    planned = resolved.plan()
    plain = plan_cost_model(planned, resolved.efficiency)
    head = plan_cost_model(planned, resolved.efficiency, DraftHead("eagle", 1, 3))
    verify = [(4, 1000)] * 32
    without = plain.split_step_cost([], verify, [1004] * 32)
    with_head = head.split_step_cost([], verify, [1004] * 32)
    assert without.draft_s == 0.0
    assert with_head.draft_s > 0.0
    assert with_head.total_s == pytest.approx(without.total_s + with_head.draft_s)
    # A head of one layer costs a small share of the 32-layer target's step.
    assert with_head.draft_s < 0.5 * without.total_s
    # More layers, more drafting requests, longer contexts: more time.
    assert plan_cost_model(planned, resolved.efficiency, DraftHead("eagle", 2, 3)).split_step_cost(
        [], verify, [1004] * 32).draft_s > with_head.draft_s
    assert head.split_step_cost([], verify, [8004] * 32).draft_s > with_head.draft_s
    # With acceptance 0 the drafter only costs: eagle3 (a head) is slower than ngram (none).
    ngram = _run(path)[1]["mean_tpot_ms"]
    eagle = _run(path, method="eagle3")[1]["mean_tpot_ms"]
    assert eagle > ngram


def test_default_tables_follow_their_sources():
    eagle3 = AcceptanceConfig(7, default_acceptance("eagle3", 7))
    assert 1 + eagle3.mean_accepted() == pytest.approx(2.77, abs=0.02)  # tau at K = 7, MT-bench
    mtp = default_acceptance("mtp", 7)
    assert 0.85 <= mtp[0] <= 0.90  # DeepSeek-V3: the second token accepted 85-90%
    assert 1 + AcceptanceConfig(7, mtp).mean_accepted() == pytest.approx(3.09, abs=0.02)
    assert default_acceptance("ngram", 3) is None
    assert len(default_acceptance("eagle", 5)) == 5


def test_speculative_fields_are_sweep_keys():
    axes = parse_sweeps(["speculative.num_speculative_tokens=1,3", "speculative.acceptance=0.5,0.8"])
    assert [a.values for a in axes] == [(1, 3), (0.5, 0.8)]


@pytest.mark.parametrize("spec, fragments", [
    ('method = "eagle3"\nnum_speculative_tokens = 3\nacceptance = 1.5\n', ("speculative.acceptance", "[0, 1]")),
    ('method = "eagle3"\nnum_speculative_tokens = 3\nacceptance = -0.1\n', ("speculative.acceptance",)),
    ('method = "eagle3"\nnum_speculative_tokens = 3\nacceptance = [0.5, 0.5]\n',
     ("speculative.acceptance", "3 rates")),
    ('method = "eagle3"\nnum_speculative_tokens = 3\nacceptance = [0.5, 1.2, 0.5]\n', ("speculative.acceptance",)),
    ('method = "ngram"\nnum_speculative_tokens = 3\n', ("speculative.acceptance", "no published default")),
    ('method = "medusa"\nnum_speculative_tokens = 3\n', ("speculative.method", "ngram")),
    ('method = "eagle3"\nnum_speculative_tokens = 0\n', ("speculative.num_speculative_tokens",)),
    ('num_speculative_tokens = 3\n', ("speculative.method",)),
    ('method = "ngram"\nnum_speculative_tokens = 3\nacceptance = 0.5\nbogus = 1\n', ("speculative.bogus",)),
    ('method = "ngram"\nnum_speculative_tokens = 2048\nacceptance = 0.5\n',
     ("speculative.num_speculative_tokens", "max_num_batched_tokens - 1 = 2047")),
    # An MTP head's layers are its modules: vLLM refuses k neither <= them nor a multiple of them.
    ('method = "mtp"\nnum_speculative_tokens = 3\ndraft_layers = 2\n',
     ("speculative.num_speculative_tokens", "at most draft_layers (2", "multiple")),
    ('method = "mtp"\nnum_speculative_tokens = 5\ndraft_layers = 3\n',
     ("speculative.num_speculative_tokens", "at most draft_layers (3")),
])
def test_bad_speculative_settings_are_one_error_line(tmp_path, spec, fragments):
    _one_error_line(_replay_cli(_scenario(tmp_path, spec), "--out", tmp_path / "out"), *fragments)


def _cached(path):
    path.write_text(path.read_text().replace("enable_prefix_caching = false", "enable_prefix_caching = true"))
    return path


def test_a_draft_head_with_prefix_caching_on_hashes_with_lookahead_and_still_hits(tmp_path):
    """docs/semantics.md#draft-heads-and-prefix-caching: EAGLE-3 with caching on replays (no
    refusal), its plan hashes each block with the token after it, and multi-turn chat still
    hits; never more than without drafting, since a lookahead hash matches only where the
    plain one does and also needs the token after the block to agree."""
    plain = _cached(_scenario(tmp_path, async_scheduling=False, name="plain.toml"))
    head = _cached(_scenario(tmp_path, 'method = "eagle3"\nnum_speculative_tokens = 3\n', async_scheduling=False,
                             name="head.toml"))
    ngram = _cached(_scenario(tmp_path, 'method = "ngram"\nnum_speculative_tokens = 3\nacceptance = 0.5\n',
                              async_scheduling=False, name="ngram.toml"))
    scheduler_of = lambda path: resolve_scenario(path, Overrides()).plan().engine.scheduler  # noqa: E731
    assert scheduler_of(head).num_hash_lookahead_tokens == 1 and not scheduler_of(head).use_eagle_block_drop
    assert scheduler_of(ngram).num_hash_lookahead_tokens == 0 and not scheduler_of(ngram).use_eagle_block_drop
    # Caching off: plain hashes, and vLLM keeps the head's trailing-block drop.
    head_off = _scenario(tmp_path, 'method = "eagle3"\nnum_speculative_tokens = 3\n', name="off.toml")
    assert scheduler_of(head_off).num_hash_lookahead_tokens == 0 and scheduler_of(head_off).use_eagle_block_drop
    hits = {}
    for name, path in (("plain", plain), ("head", head), ("ngram", ngram)):
        result, summary = _run(path)
        assert summary["completed"] == 40
        hits[name] = summary["prefix_cache_hits"]
    # n-gram drafts have no KV of their own: hashes, hence hits, as without drafting.
    assert hits["ngram"] == hits["plain"]
    assert 0 < hits["head"] <= hits["plain"]


def test_a_draft_head_misses_the_block_whose_next_token_differs(tmp_path):
    """Two prompts share their first two blocks (32 tokens) and differ right after them. With
    plain hashes the later one hits both blocks; with a draft head's lookahead hashes the
    second block's hash covers token 32, where they differ, so it hits one block."""
    shared = list(range(1000, 1032))
    table = col.build_table({col.REQUEST_ID: ["a", "b"], col.ARRIVAL_TIME_S: [0.0, 30.0],
                             col.PROMPT_TOKENS: [40, 40], col.OUTPUT_TOKENS: [4, 4],
                             col.PROMPT_TOKEN_IDS: [shared + [1] * 8, shared + [2] * 8]},
                            col.TraceMeta(source_format="test"))
    hit = {}
    for name, spec in (("plain", ""), ("head", 'method = "eagle"\nnum_speculative_tokens = 2\nacceptance = 0.5\n')):
        resolved = resolve_scenario(_cached(_scenario(tmp_path, spec, name=f"{name}.toml")), Overrides())
        result = run_replay(resolved.plan(), table, efficiency=resolved.efficiency, speculative=resolved.speculative)
        hit[name] = dict(zip(result.requests.column("request_id").to_pylist(),
                             result.requests.column("prefix_hit_tokens").to_pylist()))
    assert hit["plain"] == {"a": 0, "b": 32}
    assert hit["head"] == {"a": 0, "b": 16}


@pytest.mark.parametrize("flags, fragments", [
    (["--num-speculative-tokens", "4096"], ("--num-speculative-tokens", "2047")),
    (["--spec-acceptance", "1.5"], ("--spec-acceptance", "[0, 1]")),
    (["--speculative-method", "medusa"], ("--speculative-method",)),
])
def test_bad_speculative_flags_name_the_flag(tmp_path, flags, fragments):
    path = _scenario(tmp_path, 'method = "ngram"\nnum_speculative_tokens = 3\nacceptance = 0.5\n')
    _one_error_line(_replay_cli(path, *flags, "--out", tmp_path / "out"), *fragments)


def test_flags_turn_drafting_on(tmp_path):
    path = _scenario(tmp_path)
    res = _replay_cli(path, "--speculative-method", "eagle3", "--num-speculative-tokens", "2", "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    summary = pq.read_table(tmp_path / "o" / "summary.parquet").to_pylist()[0]
    assert not math.isnan(summary["spec_acceptance_rate"])


def test_a_verify_step_is_priced_as_a_decode_of_several_queries(tmp_path):
    resolved = resolve_scenario(_scenario(tmp_path))
    cost = plan_cost_model(resolved.plan(), resolved.efficiency)
    decodes = cost.split_step_cost([4001] * 32, [])
    verify = cost.split_step_cost([], [], None, [(4, 4000)] * 32)
    as_chunks = cost.split_step_cost([], [(4, 4000)] * 32)
    # The same KV is read once; the short-chunk weighting of prefill attention does not apply.
    assert decodes.total_s < verify.total_s < as_chunks.total_s
    assert verify.total_s < 1.5 * decodes.total_s
    assert verify.kv_bytes == pytest.approx(as_chunks.kv_bytes)


def test_drafting_pays_off_only_with_acceptance(tmp_path):
    plain = _run(_scenario(tmp_path))[1]["mean_tpot_ms"]
    path = _scenario(tmp_path, 'method = "ngram"\nnum_speculative_tokens = 3\nacceptance = 0.0\n', name="n.toml")
    nothing_accepted = _run(path)[1]["mean_tpot_ms"]
    # Verifying drafts that are all rejected costs a little (4 queries instead of 1 per decode) ...
    assert plain < nothing_accepted < 1.3 * plain
    # ... and EAGLE-3's published acceptance (2.35 tokens per step at k = 3) more than pays for its head.
    eagle3 = _run(_scenario(tmp_path, 'method = "eagle3"\nnum_speculative_tokens = 3\n', name="e.toml"))[1]
    assert eagle3["mean_acceptance_length"] == pytest.approx(2.35, abs=0.1)
    eagle3 = eagle3["mean_tpot_ms"]
    assert eagle3 < 0.8 * plain


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_hybrid_mamba_model_replays_with_drafting(tmp_path, async_scheduling):
    """Jamba (Mamba + attention): each Mamba layer keeps k speculative state blocks per request,
    which the plan counts in a request's worst case, and the replay drafts and verifies."""
    def jamba(spec: str, name: str):
        text = SCENARIO.replace("llama-3.1-8b", "jamba-mini").replace("ASYNC", str(async_scheduling).lower())
        text = text.replace("[engine]", "[engine]\ntensor_parallel_size = 2").replace(
            "enable_prefix_caching = false", "enable_prefix_caching = true")
        path = tmp_path / name
        path.write_text(text + spec)
        return path

    plain_plan = resolve_scenario(jamba("", "plain.toml"), Overrides()).plan()
    path = jamba('[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 2\nacceptance = 0.6\nseed = 5\n',
                 "spec.toml")
    planned = resolve_scenario(path, Overrides()).plan()
    mamba = [g for g in planned.kv_cache_config.groups if g.spec.kind == "mamba"]
    assert mamba and all(g.spec.num_speculative_blocks == 2 for g in mamba)
    assert planned.engine.scheduler.num_speculative_tokens == 2
    assert planned.blocks_per_request == plain_plan.blocks_per_request + 2 * len(mamba)
    result, summary = _run(path)
    assert summary["completed"] == result.requests.num_rows == 40
    requests = result.requests.to_pydict()
    assert sum(requests["draft_tokens"]) > 0 and 0 < sum(requests["accepted_draft_tokens"])
    assert summary["mean_acceptance_length"] > 1


def test_what_the_core_does_not_model_is_refused_naming_the_table(tmp_path):
    offload = _scenario(tmp_path, 'method = "ngram"\nnum_speculative_tokens = 2\nacceptance = 0.5\n'
                                  '[offload]\ncpu_bytes = 1000000000\n', name="o.toml")
    _one_error_line(_replay_cli(offload, "--out", tmp_path / "out"), "offload.cpu_bytes", "[speculative]")


@pytest.mark.parametrize("spec,expected", [
    ('method = "eagle3"\nnum_speculative_tokens = 3\ndraft_layers = 2\n', DraftHead("eagle3", 2, 3)),
    ('method = "eagle"\nnum_speculative_tokens = 4\n', DraftHead("eagle", 1, 4)),
    # n-gram drafting has no model: no head in the plan, and none for the clock to run,
    # whatever draft_layers says.
    ('method = "ngram"\nnum_speculative_tokens = 3\nacceptance = 0.5\ndraft_layers = 2\n', None),
    ('method = "eagle3"\nnum_speculative_tokens = 3\ndraft_layers = 0\n', None)])
def test_the_plan_and_the_clock_take_one_draft_head(tmp_path, spec, expected):
    """[speculative] makes one DraftHead (sim/planner/draft_head.py): the plan gives its
    layers KV and its weights memory, and the clock runs k passes of the same layers."""
    from kvtwin.sim.replay.run import spec_executor

    resolved = resolve_scenario(_scenario(tmp_path, spec), Overrides())
    planned = resolved.plan()
    executor = spec_executor(planned, resolved.efficiency, resolved.speculative, 0)
    assert planned.draft_head == expected
    assert executor.cost_model.draft_head == expected


def test_a_draft_head_takes_its_layers_and_weights_out_of_the_pool(tmp_path):
    """docs/semantics.md#draft-heads-in-the-memory-plan: an EAGLE-3 head's layer joins the
    target's group and its weights are loaded before the KV cache is sized, so the pool
    has fewer blocks than with n-gram drafting; ``draft_layers = 0`` gives n-gram's pool."""
    def planned(spec: str, name: str):
        return resolve_scenario(_scenario(tmp_path, spec, name=name), Overrides()).plan()

    ngram = planned('method = "ngram"\nnum_speculative_tokens = 3\nacceptance = 0.5\n', "ngram.toml")
    head = planned('method = "eagle3"\nnum_speculative_tokens = 3\n', "head.toml")
    two = planned('method = "eagle3"\nnum_speculative_tokens = 3\ndraft_layers = 2\n', "two.toml")
    none = planned('method = "eagle3"\nnum_speculative_tokens = 3\ndraft_layers = 0\n', "none.toml")
    assert ngram.draft_head is None and none.draft_head is None
    assert none.num_blocks == ngram.num_blocks and none.memory == ngram.memory
    assert [len(p.groups[0].layer_names) for p in (ngram, head, two)] == [32, 33, 34]
    assert ngram.num_blocks > head.num_blocks > two.num_blocks
    assert ngram.memory.weights_bytes < head.memory.weights_bytes < two.memory.weights_bytes


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_replay_that_cannot_make_progress_stops_with_one_error(tmp_path, async_scheduling):
    """docs/semantics.md#no-progress: a scheduler that can never schedule its requests again
    (multi-module MTP, k = 3, under a long-prefill threshold of 2: no prefill chunk may end
    within 3 tokens of the prefill end, none may exceed 2 tokens; vLLM 0.33 livelocks too)
    stops the replay with a ConfigError naming the setting and a stuck request, instead of
    ending with requests silently unfinished."""
    import dataclasses

    from kvtwin.sim.core.errors import ConfigError

    spec = 'method = "mtp"\nnum_speculative_tokens = 3\nacceptance = 0.5\ndraft_layers = 3\n'
    resolved = resolve_scenario(_scenario(tmp_path, spec, async_scheduling=async_scheduling), Overrides())
    planned = resolved.plan()
    # A replay's MTP head is single-module; give the plan's scheduler the multi-module lookahead.
    scheduler = dataclasses.replace(planned.engine.scheduler, num_prefill_lookahead_tokens=3,
                                    long_prefill_token_threshold=2)
    planned = dataclasses.replace(planned, engine=dataclasses.replace(planned.engine, scheduler=scheduler))
    table = col.build_table({col.REQUEST_ID: ["a", "b"], col.ARRIVAL_TIME_S: [0.0, 0.0],
                             col.PROMPT_TOKENS: [10, 10], col.OUTPUT_TOKENS: [4, 4],
                             col.PROMPT_TOKEN_IDS: [list(range(100, 110)), list(range(200, 210))]},
                            col.TraceMeta(source_format="test"))
    with pytest.raises(ConfigError) as err:
        run_replay(planned, table, efficiency=resolved.efficiency, speculative=resolved.speculative)
    assert err.value.field == "long_prefill_token_threshold" and err.value.got == 2
    assert "never scheduled again" in str(err.value) and "livelocks" in str(err.value)
