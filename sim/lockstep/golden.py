"""Golden cases: the on-disk format of a lockstep case and of its results, and comparison.

A case directory holds ``config.json`` (engine and KV cache settings), ``requests.jsonl``
(the workload, with each request's scripted output tokens) and, when produced by vLLM
itself, ``expected_requests.jsonl`` / ``expected_steps.jsonl``. A disaggregated
prefill/decode case (``tests/golden/pd``, scripts/oracle/gen_pd_golden.py) is one JSON file
instead: ``config`` (one config for both engines, each with its own pool), ``requests`` and
vLLM's ``expected_ticks``; a file, not a directory, is read as one. Bad input raises a
``ConfigError`` naming the file, line and field.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtwin.sim.core.config import HEAD_METHODS, SPEC_METHODS, CacheConfig, SchedulerConfig
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.spec import (KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, spec_from_dict, with_prefill_lookahead,
                                  with_speculative_blocks)

_CONFIG_FIELDS = {
    "kv_cache_groups", "block_size", "num_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "long_prefill_token_threshold", "enable_chunked_prefill", "scheduling_policy", "watermark",
    "scheduler_reserve_full_isl", "enable_prefix_caching", "prefix_caching_hash_algo", "async_scheduling",
    "description", "vllm_version", "adaptive_long_prefill_threshold", "kv_offload", "speculative",
    "prefix_cache_retention_interval", "pipeline_parallel_size", "prefill_schedule_interval", "data_parallel_size",
}
# The ``speculative`` table of a speculative-decoding case (scripts/oracle/gen_spec_golden.py).
# "eagle", "eagle3", "mtp" (single-module): a draft head with its own KV, k lookahead slots
# per step and, with prefix caching on, block hashes that cover the next token.
# The ``kv_offload`` table of an offload case (the native CPU offloading connector).
_OFFLOAD_FIELDS = {"cpu_bytes_to_use": int, "eviction_policy": str, "kv_bytes_per_chunk": int,
                   "num_cpu_chunks": int, "load_steps": int, "store_steps": int}


@dataclass(frozen=True)
class CaseRequest:
    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    priority: int
    # Speculative cases: drafts accepted at each verify step, in order (0 once used up).
    num_accepted_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class CaseOffload:
    """A case's CPU tier: its size in chunks (vLLM's ``cpu_bytes_to_use`` over its bytes per
    chunk), the eviction policy, and after how many steps the worker stand-in reports a
    load or a store finished."""

    num_cpu_chunks: int
    eviction_policy: str
    load_steps: int
    store_steps: int


@dataclass(frozen=True)
class GoldenCase:
    name: str
    kv_cache_config: KVCacheConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    requests: tuple[CaseRequest, ...]
    description: str = ""
    offload: CaseOffload | None = None


@dataclass(frozen=True)
class PDCase:
    """A P/D case: one prefill and one decode engine, the same settings but their pools,
    the decode side pulling each prompt's blocks in reads that land ``read_steps`` batches
    after they are issued; ``requests`` in arrival order (file order among equals)."""

    name: str
    prefill_kv_cache_config: KVCacheConfig
    decode_kv_cache_config: KVCacheConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    read_steps: int
    requests: tuple[CaseRequest, ...]
    # vLLM's record of each tick (None: the case has none to compare with).
    expected_ticks: tuple[dict, ...] | None
    description: str = ""
    # The file it was read from, named by the errors a run raises.
    source: str = ""


# A P/D case file's tables, and its ``config``'s fields (those without a default required).
_PD_FIELDS = {"name", "config", "requests", "expected_ticks"}
_PD_CONFIG_FIELDS = {"block_size", "kv_cache_groups", "prefill_num_blocks", "decode_num_blocks", "max_model_len",
                     "max_num_seqs", "max_num_batched_tokens", "read_steps", "async_scheduling", "description",
                     "vllm_version"}
_PD_REQUEST_FIELDS = ("request_id", "arrival_tick", "prompt_token_ids", "output_token_ids")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("config.json", "a file in the case directory", source=str(path.parent)) from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"line {err.lineno}", f"valid JSON ({err.msg})", source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("(top level)", "a JSON object", type(data).__name__, source=str(path))
    return data


def _typed(data: dict, key: str, kind: type, default=None, *, source: str):
    if key not in data:
        if default is None:
            raise ConfigError(key, f"a {kind.__name__} (required)", source=source)
        return default
    value = data[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(key, f"a {kind.__name__}", value, source=source)
    return value


def _refuse_unknown(data: Mapping, known: Collection[str], expected: str, source: str, where: str = "") -> None:
    """One error naming the first key of ``data`` (sorted) that is not in ``known``."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(where + unknown[0], expected, source=source)


def load_config(path: Path, *, hash_algo: str | None = None) -> tuple[KVCacheConfig, SchedulerConfig, CacheConfig, str]:
    source = str(path)
    data = _read_json(path)
    _refuse_unknown(data, _CONFIG_FIELDS, f"one of the known fields ({', '.join(sorted(_CONFIG_FIELDS))})", source)
    try:
        block_size = _typed(data, "block_size", int, source=source)
        groups_raw = _typed(data, "kv_cache_groups", list, source=source)
        num_spec_tokens = _speculative_tokens(data, source)
        lookaheads = _head_lookaheads(data, num_spec_tokens)
        prefill_lookahead = lookaheads.get("num_prefill_lookahead_tokens", 0)
        groups = tuple(
            KVCacheGroupSpec((f"group{i}",), _drafting_spec(g, i, block_size, num_spec_tokens, prefill_lookahead))
            for i, g in enumerate(groups_raw))
        retention = _retention(data)
        kv_cache_config = KVCacheConfig(num_blocks=_typed(data, "num_blocks", int, source=source), groups=groups,
                                        hash_block_size=block_size,
                                        prefix_cache_retention_interval=retention if retention != "absent" else None)
        scheduler_config = SchedulerConfig(
            max_model_len=_typed(data, "max_model_len", int, source=source),
            max_num_seqs=_typed(data, "max_num_seqs", int, 128, source=source),
            max_num_batched_tokens=_typed(data, "max_num_batched_tokens", int, 2048, source=source),
            enable_chunked_prefill=_typed(data, "enable_chunked_prefill", bool, True, source=source),
            long_prefill_token_threshold=_typed(data, "long_prefill_token_threshold", int, 0, source=source),
            adaptive_long_prefill_threshold=_typed(data, "adaptive_long_prefill_threshold", bool, False,
                                                   source=source),
            scheduling_policy=_typed(data, "scheduling_policy", str, "fcfs", source=source),
            watermark=_typed(data, "watermark", float, 0.0, source=source),
            scheduler_reserve_full_isl=_typed(data, "scheduler_reserve_full_isl", bool, True, source=source),
            async_scheduling=_typed(data, "async_scheduling", bool, False, source=source),
            pipeline_parallel_size=_typed(data, "pipeline_parallel_size", int, 1, source=source),
            prefill_schedule_interval=_typed(data, "prefill_schedule_interval", int, 1, source=source),
            data_parallel_size=_typed(data, "data_parallel_size", int, 1, source=source),
            num_speculative_tokens=num_spec_tokens,
            **lookaheads,
        )
        cache_config = CacheConfig(
            enable_prefix_caching=_typed(data, "enable_prefix_caching", bool, True, source=source),
            prefix_caching_hash_algo=hash_algo or _typed(data, "prefix_caching_hash_algo", str, "sha256",
                                                         source=source),
            **({} if retention == "absent" else {"prefix_cache_retention_interval": retention}),
        )
    except ConfigError as err:
        raise err if err.source else err.with_source(source) from None
    return kv_cache_config, scheduler_config, cache_config, data.get("description", "")


def _retention(data: dict) -> int | None | str:
    """The case's ``prefix_cache_retention_interval``, set on vLLM's ``CacheConfig`` and
    copied into its ``KVCacheConfig``; ``"absent"`` for a case made before the key existed:
    a dense GPU cache beside vLLM's ``CacheConfig`` default (0), which only an offload
    connector reads (docs/semantics.md#prefix-cache-retention)."""
    if "prefix_cache_retention_interval" not in data:
        return "absent"
    value = data["prefix_cache_retention_interval"]
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError("prefix_cache_retention_interval", "null, 0 or a positive multiple of the block size",
                          value)
    return value


def _drafting_spec(entry: object, index: int, block_size: int, num_spec_tokens: int,
                   prefill_lookahead: int) -> KVCacheSpec:
    """Group ``index``'s spec as vLLM 0.33 builds it for the case's drafter: a Mamba group
    with k speculative state blocks, a sliding window retaining a multi-module MTP head's
    re-prefillable tail (docs/semantics.md#sliding-window). Both follow from the
    ``speculative`` table; a group that states the retained tail must agree with it."""
    where = f"kv_cache_groups[{index}]"
    spec = spec_from_dict(entry, block_size=block_size, where=where)
    planned = with_prefill_lookahead(with_speculative_blocks(spec, num_spec_tokens), prefill_lookahead)
    if isinstance(entry, dict) and "extra_retained_tokens" in entry and planned != spec:
        raise ConfigError(f"{where}.extra_retained_tokens", f"{max(0, prefill_lookahead - 1)} (what vLLM's planner "
                          "sets for the speculative table: num_prefill_lookahead_tokens - 1, at least 0)",
                          entry["extra_retained_tokens"])
    return planned


def _speculative_tokens(data: dict, source: str) -> int:
    """k of a case's ``speculative`` table ({"method": "ngram", "num_speculative_tokens": k}); 0 without one."""
    spec = data.get("speculative")
    if spec is None:
        return 0
    if not isinstance(spec, dict) or sorted(k for k in spec if k != "num_nextn_predict_layers") != [
            "method", "num_speculative_tokens"]:
        raise ConfigError("speculative", "a table with method and num_speculative_tokens (and, for mtp, "
                          "num_nextn_predict_layers)", spec, source=source)
    layers = spec.get("num_nextn_predict_layers", 1)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1 or (
            layers > 1 and spec["method"] != "mtp"):
        raise ConfigError("speculative.num_nextn_predict_layers", "a positive integer, above 1 only for mtp",
                          layers, source=source)
    if spec["method"] not in SPEC_METHODS:
        raise ConfigError("speculative.method", f"one of {', '.join(SPEC_METHODS)}", spec["method"], source=source)
    k = spec["num_speculative_tokens"]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError("speculative.num_speculative_tokens", "a positive integer", k, source=source)
    if k > layers and k % layers:
        # vLLM runs the MTP modules in turn, so k must not end part-way through a round
        # (docs/semantics.md#configuration).
        raise ConfigError("speculative.num_speculative_tokens", f"at most num_nextn_predict_layers ({layers}) or "
                          f"a multiple of it (vLLM refuses k that is neither)", k, source=source)
    return k


def _head_lookaheads(data: dict, k: int) -> dict[str, int]:
    """A draft head's lookaheads as vLLM 0.33 derives them (docs/semantics.md
    #draft-heads-and-prefix-caching): k slots; a prefill lookahead of 1, or k for
    multi-module MTP (more than one MTP layer and k > 1); hashes covering that many tokens
    with caching on."""
    if not _is_eagle(data):
        return {}
    spec = data["speculative"]
    multi = spec["method"] == "mtp" and min(spec.get("num_nextn_predict_layers", 1), k) > 1
    prefill = k if multi else 1
    caching = data.get("enable_prefix_caching", True)
    return dict(num_lookahead_tokens=k, num_prefill_lookahead_tokens=prefill,
                num_hash_lookahead_tokens=prefill if caching else 0)


def _is_eagle(data: dict) -> bool:
    """Whether the case drafts with a draft head (vLLM's ``use_eagle()``)."""
    spec = data.get("speculative")
    return spec is not None and spec.get("method") in HEAD_METHODS


def load_offload(path: Path) -> CaseOffload | None:
    data = _read_json(path).get("kv_offload")
    if data is None:
        return None
    source = f"{path} (kv_offload)"
    if not isinstance(data, dict):
        raise ConfigError("kv_offload", "a table", data, source=str(path))
    _refuse_unknown(data, _OFFLOAD_FIELDS, f"one of {', '.join(sorted(_OFFLOAD_FIELDS))}", source)
    values = {key: _typed(data, key, kind, source=source) for key, kind in _OFFLOAD_FIELDS.items()}
    num_chunks = values["cpu_bytes_to_use"] // values["kv_bytes_per_chunk"] if values["kv_bytes_per_chunk"] > 0 else 0
    if num_chunks != values["num_cpu_chunks"]:
        raise ConfigError("num_cpu_chunks", f"cpu_bytes_to_use // kv_bytes_per_chunk = {num_chunks}",
                          values["num_cpu_chunks"], source=source)
    for key in ("load_steps", "store_steps"):
        if values[key] < 0:
            raise ConfigError(key, "a non-negative integer", values[key], source=source)
    return CaseOffload(num_chunks, values["eviction_policy"], values["load_steps"], values["store_steps"])


def _token_list(value, field: str, source: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ConfigError(field, "a list of integer token ids", type(value).__name__, source=source)
    return tuple(value)


def load_requests(path: Path) -> tuple[CaseRequest, ...]:
    requests = []
    seen: set[str] = set()
    last_arrival = 0
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError("requests.jsonl", "a file in the case directory", source=str(path.parent)) from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        source = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError("(line)", f"one JSON object per line ({err.msg})", source=source) from None
        request = _case_request(row, seen, source, arrival_key="arrival_step", min_arrival=last_arrival,
                                arrival_rule=f"an integer >= the previous line's ({last_arrival})")
        last_arrival = request.arrival_step
        requests.append(request)
    return tuple(requests)


def _case_request(row: object, seen: set[str], source: str, *, arrival_key: str, min_arrival: int,
                  arrival_rule: str, field_prefix: str = "") -> CaseRequest:
    """One request of a case (``seen``: the ids before it, which it joins); its arrival
    (``arrival_key``) at least ``min_arrival`` (``arrival_rule`` says so in the error).
    Fields are named after ``field_prefix``."""
    if not isinstance(row, dict):
        raise ConfigError(field_prefix.rstrip(".") or "(line)", "a JSON object", type(row).__name__, source=source)
    for key in ("request_id", arrival_key, "prompt_token_ids", "output_token_ids"):
        if key not in row:
            raise ConfigError(field_prefix + key, "present (required field)", source=source)
    request_id = row["request_id"]
    if not isinstance(request_id, str) or request_id in seen:
        raise ConfigError(field_prefix + "request_id", "a string unique within the file", request_id, source=source)
    seen.add(request_id)
    arrival = row[arrival_key]
    if not isinstance(arrival, int) or isinstance(arrival, bool) or arrival < min_arrival:
        raise ConfigError(field_prefix + arrival_key, arrival_rule, arrival, source=source)
    prompt = _token_list(row["prompt_token_ids"], field_prefix + "prompt_token_ids", source)
    outputs = _token_list(row["output_token_ids"], field_prefix + "output_token_ids", source)
    if not prompt:
        raise ConfigError(field_prefix + "prompt_token_ids", "at least one token", 0, source=source)
    if not outputs:
        raise ConfigError(field_prefix + "output_token_ids", "at least one token (max_tokens = its length)", 0,
                          source=source)
    priority = row.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ConfigError(field_prefix + "priority", "an integer", priority, source=source)
    accepted = _token_list(row.get("num_accepted_tokens", []), field_prefix + "num_accepted_tokens", source)
    if any(a < 0 for a in accepted):
        raise ConfigError(field_prefix + "num_accepted_tokens", "non-negative integers", list(accepted),
                          source=source)
    return CaseRequest(request_id, arrival, prompt, outputs, priority, accepted)


def load_pd_case(path: Path, *, hash_algo: str | None = None) -> PDCase:
    """A P/D case file (module docstring); the engines' specs are read as an ordinary
    case's ``kv_cache_groups``."""
    source = str(path)
    data = _read_json(path)
    _refuse_unknown(data, _PD_FIELDS, f"one of the P/D case's tables ({', '.join(sorted(_PD_FIELDS))})", source)
    config = _typed(data, "config", dict, source=source)
    _refuse_unknown(config, _PD_CONFIG_FIELDS, f"one of the known fields ({', '.join(sorted(_PD_CONFIG_FIELDS))})",
                    source, where="config.")
    try:
        block_size = _typed(config, "block_size", int, source=source)
        groups = tuple(KVCacheGroupSpec((f"group{i}",), spec_from_dict(g, block_size=block_size,
                                                                       where=f"kv_cache_groups[{i}]"))
                       for i, g in enumerate(_typed(config, "kv_cache_groups", list, source=source)))
        pools = [KVCacheConfig(num_blocks=_typed(config, key, int, source=source), groups=groups,
                               hash_block_size=block_size) for key in ("prefill_num_blocks", "decode_num_blocks")]
        scheduler_config = SchedulerConfig(
            max_model_len=_typed(config, "max_model_len", int, source=source),
            max_num_seqs=_typed(config, "max_num_seqs", int, source=source),
            max_num_batched_tokens=_typed(config, "max_num_batched_tokens", int, source=source),
            async_scheduling=_typed(config, "async_scheduling", bool, False, source=source))
        read_steps = _typed(config, "read_steps", int, source=source)
        if read_steps < 1:
            raise ConfigError("read_steps", "a positive integer (a read lands one batch after it is issued at the "
                              "earliest)", read_steps)
        description = _typed(config, "description", str, "", source=source)
    except ConfigError as err:
        raise ConfigError(f"config.{err.field}", err.expected, err.got, source=source) from None
    cache_config = CacheConfig(enable_prefix_caching=True,
                               **({"prefix_caching_hash_algo": hash_algo} if hash_algo else {}))
    requests = _pd_requests(_typed(data, "requests", list, source=source), source)
    if not requests:
        raise ConfigError("requests", "at least one request", 0, source=source)
    expected = data.get("expected_ticks")
    if expected is not None and not (isinstance(expected, list) and all(isinstance(t, dict) for t in expected)):
        raise ConfigError("expected_ticks", "a list of tick records", type(expected).__name__, source=source)
    return PDCase(path.stem, pools[0], pools[1], scheduler_config, cache_config, read_steps, requests,
                  None if expected is None else tuple(expected), description, source)


def _pd_requests(rows: list, source: str) -> tuple[CaseRequest, ...]:
    seen: set[str] = set()
    requests = []
    for index, row in enumerate(rows):
        where = f"requests[{index}]."
        if isinstance(row, dict):
            _refuse_unknown(row, _PD_REQUEST_FIELDS, f"one of {', '.join(_PD_REQUEST_FIELDS)}", source, where=where)
        requests.append(_case_request(row, seen, source, arrival_key="arrival_tick", min_arrival=0,
                                      arrival_rule="a non-negative integer", field_prefix=where))
    # The oracle admits them by arrival tick, in file order among equals.
    return tuple(sorted(requests, key=lambda r: r.arrival_step))


def load_case(case_dir: str | Path, *, hash_algo: str | None = None) -> GoldenCase | PDCase:
    """The case at ``case_dir``: a case directory, or a P/D case file."""
    case_dir = Path(case_dir)
    if case_dir.is_file():
        return load_pd_case(case_dir, hash_algo=hash_algo)
    if not case_dir.is_dir():
        raise ConfigError("CASE_DIR", "a directory holding config.json and requests.jsonl, or a P/D case file",
                          str(case_dir))
    kv_cache_config, scheduler_config, cache_config, description = load_config(case_dir / "config.json",
                                                                                hash_algo=hash_algo)
    requests = load_requests(case_dir / "requests.jsonl")
    for r in requests:
        if len(r.prompt_token_ids) + len(r.output_token_ids) > scheduler_config.max_model_len:
            raise ConfigError("prompt_token_ids", f"prompt + output within max_model_len "
                              f"{scheduler_config.max_model_len}", len(r.prompt_token_ids) + len(r.output_token_ids),
                              source=f"{case_dir / 'requests.jsonl'} ({r.request_id})")
    return GoldenCase(case_dir.name, kv_cache_config, scheduler_config, cache_config, requests, description,
                      load_offload(case_dir / "config.json"))


# -- results -------------------------------------------------------------------------------

def dumps_line(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write atomically: a temp name first, renamed when complete."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(dumps_line(r) + "\n" for r in rows))
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_SET_FIELDS = ("preempted", "finished")  # request ids whose order in a step carries no meaning


class _Absent:
    """A field one side lacks: unequal to everything, None included."""

    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


def expected_results(case_path: str | Path, case: GoldenCase | PDCase) -> tuple[list[dict], list[dict]] | None:
    """vLLM's results for ``case`` (read from ``case_path``): its requests and steps, or for
    a P/D case no requests and its ticks; None if the case has none."""
    if isinstance(case, PDCase):
        return None if case.expected_ticks is None else ([], list(case.expected_ticks))
    requests, steps = Path(case_path) / "expected_requests.jsonl", Path(case_path) / "expected_steps.jsonl"
    if not (requests.exists() and steps.exists()):
        return None
    return read_jsonl(requests), read_jsonl(steps)


def compare_results(expected_requests: list[dict], expected_steps: list[dict], actual_requests: list[dict],
                    actual_steps: list[dict], limit: int = 10) -> list[str]:
    """Field-by-field differences; empty if equal. Every field either side has is compared,
    so a field the runner forgets to write, or writes when vLLM has none, is a difference:
    admissions one by one (hit, external tokens, load step), and per step the offload record
    one field at a time (loads, stores, evictions, flushes, completions, resident chunks,
    requests waiting for their KV, the batches of an asynchronous step). A P/D case's ticks
    (``tick`` in place of ``step``) compare each engine's record one field at a time."""
    diffs: list[str] = []
    exp_req = {r["request_id"]: r for r in expected_requests}
    act_req = {r["request_id"]: r for r in actual_requests}
    for rid in exp_req.keys() | act_req.keys():
        if rid not in act_req or rid not in exp_req:
            diffs.append(f"request {rid}: present in only one of expected/actual")
    for rid, exp in exp_req.items():
        act = act_req.get(rid)
        if act is not None:
            diffs.extend(_request_diffs(rid, exp, act))
    if len(expected_steps) != len(actual_steps):
        unit = _unit(expected_steps or actual_steps)
        diffs.append(f"{unit}s: expected {len(expected_steps)}, got {len(actual_steps)}")
    for exp, act in zip(expected_steps, actual_steps):
        diffs.extend(_step_diffs(exp, act))
    diffs.sort(key=_diff_order)
    return diffs[:limit] if limit else diffs


def _request_diffs(rid: str, exp: dict, act: dict) -> list[str]:
    diffs = _field_diffs(f"request {rid}: ", exp, act, skip={"request_id", "admissions"})
    exp_adm, act_adm = exp.get("admissions", ABSENT), act.get("admissions", ABSENT)
    if not isinstance(exp_adm, list) or not isinstance(act_adm, list) or len(exp_adm) != len(act_adm):
        if exp_adm != act_adm:
            diffs.append(f"request {rid}: admissions expected {exp_adm!r}, got {act_adm!r}")
        return diffs
    for index, (e, a) in enumerate(zip(exp_adm, act_adm)):
        diffs.extend(_field_diffs(f"request {rid}: admissions[{index}].", e, a))
    return diffs


# A step's records compared one field at a time: the offload tier's, and each engine's of a P/D tick.
_NESTED_RECORDS = frozenset({"offload", "prefill", "decode"})


def _unit(steps: list[dict]) -> str:
    """What a run's records count: ``tick`` (P/D cases) or ``step``."""
    return "tick" if steps and "tick" in steps[0] and "step" not in steps[0] else "step"


def _step_diffs(exp: dict, act: dict) -> list[str]:
    unit = _unit([exp])
    where = f"{unit} {exp[unit]}: "
    diffs = _field_diffs(where, exp, act, skip=_NESTED_RECORDS)
    for name in sorted(_NESTED_RECORDS & (exp.keys() | act.keys())):
        exp_rec, act_rec = exp.get(name, ABSENT), act.get(name, ABSENT)
        if isinstance(exp_rec, dict) and isinstance(act_rec, dict):
            diffs.extend(_field_diffs(f"{where}{name}.", exp_rec, act_rec))
        elif exp_rec != act_rec:
            diffs.append(f"{where}{name} expected {exp_rec!r}, got {act_rec!r}")
    return diffs


def _field_diffs(where: str, exp: dict, act: dict, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """One message per field of either side (bar ``skip``) whose values differ."""
    diffs = []
    for key in sorted((exp.keys() | act.keys()) - skip):
        e, a = exp.get(key, ABSENT), act.get(key, ABSENT)
        if key in _SET_FIELDS and isinstance(e, list) and isinstance(a, list):
            e, a = sorted(e), sorted(a)
        if e != a:
            diffs.append(f"{where}{key} expected {e!r}, got {a!r}")
    return diffs


def _diff_order(message: str) -> tuple[int, int, str]:
    # Earliest step first: the first differing step is the most useful clue.
    unit, _, rest = message.partition(" ")
    number = rest.split(":")[0]
    if unit in ("step", "tick") and number.isdigit():
        return (0, int(number), message)
    return (1, 0, message)
