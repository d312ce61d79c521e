"""Seeded synthetic workloads in the trace schema (spec: ``synth_spec.SynthSpec``, docs: SYNTH.md).

A prompt is a sequence of *segments*: an optional shared prefix (a system prompt or an agent's
context, picked by Zipf popularity), then user text and, in sessions, earlier outputs. Each
segment has an id fixed by its content, so the chained id of a block end is a function of the
segments before it and the offset into the current one; prompts that share segments share
block ids exactly as far as their content agrees. Nothing is materialised as tokens.

Every random quantity has its own child generator spawned from the spec's seed, so changing
one distribution leaves the others' draws unchanged, and the same spec gives the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvtwin.traces import schema as s
from kvtwin.traces.arrivals import arrival_times_s, interarrival_gaps_s
from kvtwin.traces.bundled import resolve
from kvtwin.traces.distributions import sampler, token_counts
from kvtwin.traces.errors import TraceError
from kvtwin.traces.hashing import ROOT, mix64
from kvtwin.traces.load import load_trace
from kvtwin.traces.synth_spec import REQUESTS, SynthSpec

_PREFIX_SALT = np.uint64(0x50FE_F1C5_0000_0001)
_UNIQUE_SALT = np.uint64(0x50FE_F1C5_0000_0002)
_STREAMS = ("arrival", "prefix", "prompt", "output", "turns", "gap", "prefix_tokens")
_SESSION_BATCH = 64
# Sessions without a single request after which a spec is taken to generate none.
_FRUITLESS_SESSIONS = 10_000


@dataclass
class _Prompt:
    """A growing prompt: segment ids, lengths, and the chained id after each segment."""

    ids: list[np.uint64] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    chain: list[np.uint64] = field(default_factory=lambda: [ROOT])

    def append(self, segment_id: np.uint64, length: int) -> None:
        self.ids.append(segment_id)
        self.lengths.append(length)
        self.chain.append(mix64(self.chain[-1], mix64(segment_id, np.uint64(length))))

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def block_ids(self, block_tokens: int) -> np.ndarray:
        """Chained id of each block (the last may be partial) of the prompt as it is now."""
        lengths = np.asarray(self.lengths, dtype=np.int64)
        ends = np.cumsum(lengths)
        total = int(ends[-1])
        block_ends = np.minimum(np.arange(1, -(-total // block_tokens) + 1) * block_tokens, total)
        segment = np.searchsorted(ends, block_ends, side="left")
        offset = block_ends - (ends[segment] - lengths[segment])
        ids = np.asarray(self.ids, dtype=np.uint64)
        chain = np.asarray(self.chain, dtype=np.uint64)
        return mix64(chain[segment], mix64(ids[segment], offset.astype(np.uint64)))


class _UniqueIds:
    """Ids for content that occurs once (user text, outputs)."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> np.uint64:
        self.next += 1
        return mix64(_UNIQUE_SALT, np.uint64(self.next))


def synthesize(spec: SynthSpec, base_dir: Path = Path("."), source_file: str = "", *,
               where: str | None = None) -> pa.Table:
    """Generate the workload of ``spec``; empirical traces resolve relative to ``base_dir``.
    A spec that generates no request is a TraceError named after ``where`` (the spec's path;
    default ``source_file``)."""
    rngs = dict(zip(_STREAMS, (np.random.default_rng(seq) for seq in np.random.SeedSequence(spec.seed).spawn(
        len(_STREAMS)))))

    def load_column(trace: str, column: str) -> np.ndarray:
        return load_trace(resolve(trace, base_dir)).column(column).to_numpy()

    prefixes = _Prefixes(spec, rngs, load_column)
    if spec.kind == REQUESTS:
        rows, notes = _requests(spec, rngs, prefixes, load_column)
    else:
        rows, notes = _sessions(spec, rngs, prefixes, load_column)
    meta = s.TraceMeta(source_format="synth", source_file=source_file, content_identity=s.IDENTITY_HASHES,
                       arrivals=f"{spec.arrival.process} at {spec.arrival.rate_per_s:g}/s "
                                f"({'requests' if spec.kind == REQUESTS else 'session starts'})",
                       notes=(f"kind {spec.kind}, seed {spec.seed}",) + notes)
    count = len(rows["time"])
    if count == 0:
        # Only the prompt limit can cut every request: the first arrival is at 0, and its first
        # turn is kept otherwise.
        if spec.max_prompt_tokens is None:
            raise TraceError(where or source_file or "<spec>", "num_requests", "a spec that generates a request")
        raise TraceError(where or source_file or "<spec>", "max_prompt_tokens",
                         "a limit that lets at least one request through (every session's first prompt was "
                         "longer)",
                         got=spec.max_prompt_tokens)
    lengths = np.array([len(ids) for ids in rows["hashes"]], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    flat = np.concatenate(rows["hashes"]) if count else np.zeros(0, np.uint64)
    return s.build_table({
        s.REQUEST_ID: rows["id"],
        s.ARRIVAL_TIME_S: np.asarray(rows["time"], dtype=np.float64),
        s.PROMPT_TOKENS: np.asarray(rows["prompt"], dtype=np.int32),
        s.OUTPUT_TOKENS: np.asarray(rows["output"], dtype=np.int32),
        s.SESSION_ID: rows["session"],
        s.TURN: pa.array(rows["turn"], s.TURN_TYPE),
        s.BLOCK_HASHES: pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, s.BLOCK_HASH_TYPE)),
        s.HASH_BLOCK_TOKENS: np.full(count, spec.block_tokens, dtype=np.int32),
    }, meta)


class _Prefixes:
    """The shared prefixes of a spec: fixed lengths drawn once, Zipf-popular choice per use."""

    def __init__(self, spec: SynthSpec, rngs: dict, load_column) -> None:
        self.spec = spec.shared_prefix
        self.rng = rngs["prefix"]
        if self.spec is None:
            return
        ranks = np.arange(1, self.spec.count + 1, dtype=np.float64)
        weights = ranks ** -self.spec.zipf_s
        self.probabilities = weights / weights.sum()
        self.tokens = token_counts(sampler(self.spec.tokens, load_column)(rngs["prefix_tokens"], self.spec.count))

    def pick(self, count: int) -> np.ndarray:
        if self.spec is None:
            return np.full(count, -1)
        return self.rng.choice(self.spec.count, size=count, p=self.probabilities)

    def start(self, choice: int) -> _Prompt:
        prompt = _Prompt()
        if choice >= 0:
            prompt.append(mix64(_PREFIX_SALT, np.uint64(choice)), int(self.tokens[choice]))
        return prompt


def _arrival_count_and_times(spec: SynthSpec, rng: np.random.Generator) -> np.ndarray:
    if spec.duration_s is None:
        return arrival_times_s(rng, spec.num_requests, spec.arrival.rate_per_s, spec.arrival.process,
                               spec.arrival.cv)
    times = [0.0]
    limit = spec.num_requests if spec.num_requests is not None else np.inf
    while times[-1] < spec.duration_s and len(times) < limit:
        gaps = interarrival_gaps_s(rng, 1024, spec.arrival.rate_per_s, spec.arrival.process, spec.arrival.cv)
        times.extend((times[-1] + np.cumsum(gaps)).tolist())
    times = np.asarray(times)
    times = times[times < spec.duration_s]
    return times[: int(min(limit, len(times)))]


def _requests(spec: SynthSpec, rngs: dict, prefixes: _Prefixes, load_column) -> tuple[dict, tuple[str, ...]]:
    times = _arrival_count_and_times(spec, rngs["arrival"])
    count = len(times)
    choices = prefixes.pick(count)
    own = token_counts(sampler(spec.prompt_tokens, load_column)(rngs["prompt"], count))
    outputs = token_counts(sampler(spec.output_tokens, load_column)(rngs["output"], count))
    unique = _UniqueIds()
    hashes, prompts = [], []
    for i in range(count):
        prompt = prefixes.start(int(choices[i]))
        prompt.append(unique(), int(own[i]))
        hashes.append(prompt.block_ids(spec.block_tokens))
        prompts.append(prompt.tokens)
    rows = {"id": [f"r{i}" for i in range(count)], "time": times, "prompt": prompts, "output": outputs,
            "session": [None] * count, "turn": [None] * count, "hashes": hashes}
    return rows, ()


def _sessions(spec: SynthSpec, rngs: dict, prefixes: _Prefixes, load_column) -> tuple[dict, tuple[str, ...]]:
    draw_turns = sampler(spec.turns, load_column)
    draw_user = sampler(spec.user_tokens, load_column)
    draw_output = sampler(spec.output_tokens, load_column)
    draw_gap = sampler(spec.turn_gap_s, load_column)
    unique = _UniqueIds()
    rows: dict[str, list] = {"id": [], "time": [], "prompt": [], "output": [], "session": [], "turn": [],
                             "hashes": []}
    cut_turns = 0
    session = 0
    start_s = 0.0
    while True:
        gaps = interarrival_gaps_s(rngs["arrival"], _SESSION_BATCH, spec.arrival.rate_per_s,
                                   spec.arrival.process, spec.arrival.cv)
        for gap in gaps:
            start_s = 0.0 if session == 0 else start_s + float(gap)
            if spec.duration_s is not None and start_s >= spec.duration_s:
                break
            turns = int(token_counts(draw_turns(rngs["turns"], 1))[0])
            prompt = prefixes.start(int(prefixes.pick(1)[0]))
            time_s = start_s
            for turn in range(1, turns + 1):
                user = int(token_counts(draw_user(rngs["prompt"], 1))[0])
                output = int(token_counts(draw_output(rngs["output"], 1))[0])
                gap_s = float(draw_gap(rngs["gap"], 1)[0])
                if spec.max_prompt_tokens is not None and prompt.tokens + user > spec.max_prompt_tokens:
                    cut_turns += turns - turn + 1
                    break
                prompt.append(unique(), user)
                rows["id"].append(f"s{session}t{turn}")
                rows["time"].append(time_s)
                rows["prompt"].append(prompt.tokens)
                rows["output"].append(output)
                rows["session"].append(f"s{session}")
                rows["turn"].append(turn)
                rows["hashes"].append(prompt.block_ids(spec.block_tokens))
                prompt.append(unique(), output)
                time_s += gap_s
            session += 1
        else:
            # A prompt limit below every first prompt would otherwise generate sessions forever.
            if not _enough(spec, rows["time"], start_s) and (rows["time"] or session < _FRUITLESS_SESSIONS):
                continue
        break
    keep = np.argsort(np.asarray(rows["time"]), kind="stable")
    times = np.asarray(rows["time"])[keep]
    if spec.duration_s is not None:
        keep = keep[times < spec.duration_s]
    if spec.num_requests is not None:
        keep = keep[: spec.num_requests]
    rows = {name: [values[i] for i in keep] for name, values in rows.items()}
    notes = (f"{cut_turns} turn(s) not generated: prompt would exceed max_prompt_tokens",) if cut_turns else ()
    return rows, notes


def _enough(spec: SynthSpec, times: list[float], last_start_s: float) -> bool:
    """Whether the first num_requests arrivals are final: sessions not yet generated start
    after ``last_start_s``, so only arrivals up to it are certain."""
    if spec.num_requests is None:
        return False
    return int(np.count_nonzero(np.asarray(times) <= last_start_s)) >= spec.num_requests
