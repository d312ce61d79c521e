"""One set of vLLM engine knobs, and how vLLM 0.33 resolves them for a model and a GPU.

docs/semantics.md#number-of-blocks (defaults) and #scheduler-defaults (scheduler knobs). The chain is:

    scenario [engine] / flags ─► EngineConfig ─resolve(model, gpu)─► ResolvedEngineConfig
                                                                      ├─ .scheduler: SchedulerConfig
                                                                      └─ .cache:     CacheConfig

``EngineConfig`` takes vLLM's option names; ``None`` means "vLLM's default", which may
depend on the model or the GPU (batching defaults by GPU memory, the hybrid manager per
model, Mamba "align" mode when prefix caching is on). Every value is checked when the
config is built, so a scenario typo or a wrong type is refused before any work starts.
The scheduler and cache knobs are checked by the same rules the core configs use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtwin.sim.core.config import (
    BYTE_FORMS,
    CACHE_KNOBS,
    SCHEDULER_KNOBS,
    CacheConfig,
    SchedulerConfig,
    byte_count,
    check_knobs,
    is_int,
    is_number,
)
from kvtwin.sim.core.errors import ConfigError, config_from_table, require
from kvtwin.sim.core.retention import parse_retention_setting
from kvtwin.sim.planner.hardware import GIB, GPUSpec
from kvtwin.sim.planner.models import DTYPE_BYTES, KV_HEAD_KINDS, ModelPreset
from kvtwin.sim.planner.parallel import MAX_EXPERT_REDUNDANCY, ParallelLayout

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2")
MAMBA_DTYPES = ("auto", "float32", "bfloat16", "bf16", "float16", "fp16")
MAMBA_CACHE_MODES = ("none", "align")
# vLLM 0.33's ``--all2all-backend`` choices (``vllm/config/parallel.py:45-60``, less
# ``passthrough``, which ``engine/arg_utils.py:1159`` keeps off the command line), the
# default first; docs/clock.md#moe-under-data-parallelism says what each one moves.
ALL2ALL_BACKENDS = ("allgather_reducescatter", "naive", "pplx", "deepep_high_throughput", "deepep_low_latency",
                    "deepep_v2", "mori_high_throughput", "mori_low_latency", "moonep", "nixl_ep",
                    "flashinfer_all2allv", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided")
# Names vLLM 0.33 runs as another backend: ``naive`` and ``pplx`` were removed and fall back
# (``config/parallel.py:537-543``); ``flashinfer_all2allv`` is the old name of the two-sided
# FlashInfer kernels (``distributed/device_communicators/cuda_communicator.py:252-264``).
ALL2ALL_BACKEND_ALIASES = {"naive": "allgather_reducescatter", "pplx": "allgather_reducescatter",
                           "flashinfer_all2allv": "flashinfer_nvlink_two_sided"}


def _positive(value: object, name: str, what: str = "a positive integer") -> None:
    require(is_int(value) and value > 0, name, what, value)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine settings (vLLM option names). None = vLLM's default."""

    tensor_parallel_size: int = 1
    # vLLM's data, expert and pipeline parallelism (docs/semantics.md#parallel-layouts):
    # planned per GPU and per DP rank; the replay runs pipeline stages, not DP or EP yet.
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    # How a DP group's MoE layers move tokens (vLLM's ``--all2all-backend``); it matters only
    # with DP > 1 on a MoE model (docs/clock.md#moe-under-data-parallelism).
    all2all_backend: str = ALL2ALL_BACKENDS[0]
    # vLLM's expert-parallel load balancer and its extra expert replicas
    # (``--enable-eplb``, ``EPLBConfig.num_redundant_experts``; docs/semantics.md#parallel-layouts).
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None
    hybrid_kv_cache: bool | None = None
    # vLLM's engine default (docs/semantics.md#asynchronous-scheduling), and the only one:
    # the core's SchedulerConfig has none of its own.
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    # Which sliding-window and Mamba blocks the prefix cache keeps: 0 (vLLM's engine
    # default: semantic checkpoints only), N (also every N tokens) or "dense" (every block);
    # docs/semantics.md#prefix-cache-retention.
    prefix_cache_retention_interval: int | str = 0
    mamba_cache_mode: str | None = None
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    # The scheduler's own knobs (vLLM 0.33 defaults).
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    adaptive_long_prefill_threshold: bool = False
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = True
    # Prefill on every Nth step of a DP MoE group's shared counter (docs/semantics.md#data-parallel-lockstep).
    prefill_schedule_interval: int = 1
    # vLLM's ``--enforce-eager``: no CUDA graphs, so a DP MoE group's ranks run unpadded
    # (docs/clock.md#moe-under-data-parallelism) and the estimate reserves no graph memory.
    enforce_eager: bool = False
    # Overrides of the memory estimate (bytes per GPU), e.g. from a real profiling run.
    activation_peak_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    non_torch_bytes: int | None = None
    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            _positive(getattr(self, name), name)
        for name in ("enable_expert_parallel", "enforce_eager"):
            require(isinstance(getattr(self, name), bool), name, "true or false", getattr(self, name))
        require(self.all2all_backend in ALL2ALL_BACKENDS, "all2all_backend",
                f"one of {', '.join(ALL2ALL_BACKENDS)}", self.all2all_backend)
        require(isinstance(self.enable_eplb, bool), "enable_eplb", "true or false", self.enable_eplb)
        require(is_int(self.num_redundant_experts) and 0 <= self.num_redundant_experts <= MAX_EXPERT_REDUNDANCY,
                "num_redundant_experts", f"an integer from 0 to {MAX_EXPERT_REDUNDANCY} (vLLM's cap)",
                self.num_redundant_experts)
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if value is not None:
                _positive(value, name)
        # Byte sizes in any of their forms (500GB, 1e9), one spelling after: an int.
        if self.kv_cache_memory_bytes is not None:
            object.__setattr__(self, "kv_cache_memory_bytes", byte_count(
                self.kv_cache_memory_bytes, "kv_cache_memory_bytes", f"a positive number of bytes ({BYTE_FORMS})",
                minimum=1))
        for name in ("activation_peak_bytes", "cuda_graph_bytes", "non_torch_bytes"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, byte_count(value, name,
                                                          f"a non-negative number of bytes ({BYTE_FORMS})"))
        util = self.gpu_memory_utilization
        require(is_number(util) and 0 < util <= 1, "gpu_memory_utilization", "a fraction in (0, 1]", util)
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}",
                self.kv_cache_dtype)
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            require(getattr(self, name) in MAMBA_DTYPES, name, f"one of {', '.join(MAMBA_DTYPES)}",
                    getattr(self, name))
        if self.mamba_cache_mode is not None:
            require(self.mamba_cache_mode in MAMBA_CACHE_MODES, "mamba_cache_mode",
                    f"one of {', '.join(MAMBA_CACHE_MODES)} ('all' is not modelled)", self.mamba_cache_mode)
        if self.hybrid_kv_cache is not None:
            require(isinstance(self.hybrid_kv_cache, bool), "hybrid_kv_cache", "true or false", self.hybrid_kv_cache)
        check_knobs({name: getattr(self, name) for name in SCHEDULER_KNOBS}, SCHEDULER_KNOBS)
        # One spelling whatever the source (a flag or a sweep gives digits as text).
        interval = parse_retention_setting(self.prefix_cache_retention_interval)
        object.__setattr__(self, "prefix_cache_retention_interval", "dense" if interval is None else interval)
        check_knobs(self._cache_settings(), CACHE_KNOBS)

    def _cache_settings(self) -> dict[str, object]:
        """The ``CacheConfig`` fields as the core takes them (``dense`` is None there)."""
        values = {name: getattr(self, name) for name in CACHE_KNOBS}
        values["prefix_cache_retention_interval"] = parse_retention_setting(self.prefix_cache_retention_interval)
        return values

    def resolve(self, model: ModelPreset, gpu: GPUSpec) -> ResolvedEngineConfig:
        """vLLM 0.33's defaults filled in, and the settings checked against the model."""
        tp = self.tensor_parallel_size
        max_model_len = self.max_model_len or model.max_position_embeddings
        # `vllm serve` defaults (engine/arg_utils.py): larger batches on >= 70 GiB GPUs, A100 excepted.
        large = gpu.memory_bytes >= 70 * GIB and "a100" not in f"{gpu.name} {gpu.description}".lower()
        max_num_batched_tokens = self.max_num_batched_tokens or (8192 if large else 2048)
        max_num_seqs = self.max_num_seqs or (1024 if large else 256)
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError("max_num_batched_tokens", f"at least max_num_seqs ({max_num_seqs})",
                              max_num_batched_tokens)
        has_state = "mamba" in model.layer_kinds
        mamba_cache_mode = self.mamba_cache_mode or ("align" if self.enable_prefix_caching and has_state else "none")
        # vLLM 0.33 would switch the mode to match prefix caching; a scenario that asks for the
        # other one is told so instead of being run as something it did not say.
        if mamba_cache_mode == "align" and not self.enable_prefix_caching:
            raise ConfigError("mamba_cache_mode", "'none' when prefix caching is off", "align")
        if mamba_cache_mode == "none" and self.enable_prefix_caching and has_state:
            raise ConfigError("mamba_cache_mode", "'align' when prefix caching is on (vLLM 0.33 switches to it; "
                              "set enable_prefix_caching = false for 'none')", "none")
        hybrid = model.default_hybrid_kv_cache if self.hybrid_kv_cache is None else self.hybrid_kv_cache
        _check_model_fits_settings(model, tp=tp, max_model_len=max_model_len)
        _check_model_fits_parallel(model, self)
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes > gpu.memory_bytes:
            raise ConfigError("kv_cache_memory_bytes", kv_cache_memory_limit(gpu), self.kv_cache_memory_bytes)
        scheduler = self._scheduler_config(max_model_len, max_num_seqs, max_num_batched_tokens,
                                           lockstep=self.data_parallel_size > 1 and model.num_experts > 0)
        cache = CacheConfig(**self._cache_settings())
        return ResolvedEngineConfig(
            tensor_parallel_size=tp, data_parallel_size=self.data_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel, pipeline_parallel_size=self.pipeline_parallel_size,
            all2all_backend=ALL2ALL_BACKEND_ALIASES.get(self.all2all_backend, self.all2all_backend),
            enable_eplb=self.enable_eplb, num_redundant_experts=self.num_redundant_experts,
            user_block_size=self.block_size or DEFAULT_BLOCK_SIZE,
            user_specified_block_size=self.block_size is not None, kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_dtype_bytes=DTYPE_BYTES[model.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype],
            gpu_memory_utilization=float(self.gpu_memory_utilization),
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, hybrid_kv_cache=hybrid,
            hybrid_kv_cache_is_default=hybrid == model.default_hybrid_kv_cache,
            mamba_cache_mode=mamba_cache_mode, **_mamba_dtypes(model, self),
            activation_peak_bytes=self.activation_peak_bytes,
            cuda_graph_bytes=0 if self.enforce_eager and self.cuda_graph_bytes is None else self.cuda_graph_bytes,
            non_torch_bytes=self.non_torch_bytes, enforce_eager=self.enforce_eager, scheduler=scheduler, cache=cache)

    def _scheduler_config(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, *,
                          lockstep: bool) -> SchedulerConfig:
        """The scheduler's config, with the engine's pipeline stages (its batch queue holds
        one batch per stage, one more with asynchronous scheduling:
        docs/semantics.md#pipeline-parallelism) and the DP size its scheduler sees: the
        group's for a MoE model's ranks in lockstep, whose engine core drives the prefill
        cadence, else 1 (docs/semantics.md#local-prefill-cadence)."""
        knobs = {name: getattr(self, name) for name in SCHEDULER_KNOBS}
        return SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, **knobs,
                               pipeline_parallel_size=self.pipeline_parallel_size,
                               data_parallel_size=self.data_parallel_size if lockstep else 1)


@dataclass(frozen=True, kw_only=True)
class ResolvedEngineConfig:
    """Every engine setting with vLLM's defaults filled in for one model on one GPU: what
    the planner sizes the pool with, and the configs the scheduler and KV cache run on."""

    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    pipeline_parallel_size: int
    all2all_backend: str  # the backend vLLM 0.33 runs (aliases resolved)
    enable_eplb: bool
    num_redundant_experts: int
    user_block_size: int
    user_specified_block_size: bool
    kv_cache_dtype: str
    kv_cache_dtype_bytes: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    hybrid_kv_cache: bool
    hybrid_kv_cache_is_default: bool
    mamba_cache_mode: str
    mamba_conv_dtype: str
    mamba_ssm_dtype: str
    activation_peak_bytes: int | None
    cuda_graph_bytes: int | None
    non_torch_bytes: int | None
    enforce_eager: bool
    scheduler: SchedulerConfig
    cache: CacheConfig
    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              data_parallel_size=self.data_parallel_size,
                              enable_expert_parallel=self.enable_expert_parallel, enable_eplb=self.enable_eplb,
                              num_redundant_experts=self.num_redundant_experts)

    # The scheduler's sizes are read everywhere in the planner; they live on ``scheduler``.
    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def async_scheduling(self) -> bool:
        return self.scheduler.async_scheduling

    @property
    def enable_prefix_caching(self) -> bool:
        return self.cache.enable_prefix_caching

    @property
    def max_in_flight_tokens(self) -> int:
        return self.scheduler.max_in_flight_tokens

    @property
    def decode_in_flight_tokens(self) -> int:
        """Tokens one request has in flight once its prefill is done (one per batch)."""
        return self.scheduler.max_concurrent_batches


def kv_cache_memory_limit(gpu: GPUSpec) -> str:
    """What ``kv_cache_memory_bytes`` may be on ``gpu``: vLLM allocates it on every GPU of
    the tensor-parallel group, so no GPU count raises the bound."""
    return (f"at most {gpu.name}'s memory, {gpu.memory_bytes:,} bytes ({gpu.memory_gib:,.1f} GiB): it is the KV "
            "cache of each GPU, whatever the tensor parallelism")


def _mamba_dtypes(model: ModelPreset, engine: EngineConfig) -> dict[str, str]:
    conv = model.dtype if engine.mamba_cache_dtype == "auto" else engine.mamba_cache_dtype
    ssm = engine.mamba_ssm_cache_dtype
    if ssm == "auto":
        ssm = model.mamba_ssm_cache_dtype if model.mamba_ssm_cache_dtype != "auto" else conv
    return {"mamba_conv_dtype": conv, "mamba_ssm_dtype": ssm}


def _check_model_fits_parallel(model: ModelPreset, engine: EngineConfig) -> None:
    """What vLLM cannot split: a stage needs at least one layer, and expert parallelism
    needs experts (docs/semantics.md#parallel-layouts)."""
    if engine.pipeline_parallel_size > model.num_layers:
        raise ConfigError("pipeline_parallel_size", f"at most {model.name}'s {model.num_layers} layers (one stage "
                          "holds at least one)", engine.pipeline_parallel_size)
    if engine.enable_expert_parallel and not model.num_experts:
        raise ConfigError("enable_expert_parallel", f"false for {model.name}: it has no experts to split", True)
    if engine.enable_eplb and not engine.enable_expert_parallel:
        raise ConfigError("enable_eplb", "false unless enable_expert_parallel is true (vLLM: 'enable_expert_parallel "
                          "must be True to use EPLB')", True)
    if engine.enable_eplb and engine.tensor_parallel_size * engine.data_parallel_size <= 1:
        raise ConfigError("enable_eplb", "false with one GPU per stage: EPLB balances experts over the DP x TP GPUs "
                          "of the EP group (tensor_parallel_size or data_parallel_size > 1)", True)
    ep_size = engine.tensor_parallel_size * engine.data_parallel_size
    if engine.enable_eplb and (model.num_experts + engine.num_redundant_experts) % ep_size:
        raise ConfigError("num_redundant_experts", f"a count that makes {model.name}'s {model.num_experts} experts "
                          f"plus it a multiple of the EP group's {ep_size} GPUs (vLLM's EPLB places the same number "
                          "of experts on every GPU)", engine.num_redundant_experts)
    if engine.num_redundant_experts and not engine.enable_eplb:
        raise ConfigError("num_redundant_experts", "0 unless enable_eplb is true (vLLM refuses redundant experts "
                          "without EPLB)", engine.num_redundant_experts)


def _check_model_fits_settings(model: ModelPreset, *, tp: int, max_model_len: int) -> None:
    kinds = set(model.layer_kinds)
    if model.num_attention_heads % tp:
        raise ConfigError("tensor_parallel_size",
                          f"a divisor of {model.name}'s {model.num_attention_heads} attention heads", tp)
    if kinds & KV_HEAD_KINDS:
        kv = model.num_kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ConfigError("tensor_parallel_size",
                              f"a divisor or a multiple of {model.name}'s {kv} KV heads", tp)
    if model.state is not None:
        model.state.state_shapes(hidden_size=model.hidden_size, tp=tp)  # raises on a bad split
    if "sliding_window" in kinds and model.sliding_window > max_model_len:
        raise ConfigError("max_model_len", f"at least {model.name}'s sliding window ({model.sliding_window} tokens)",
                          max_model_len)
    if "chunked_local" in kinds and model.attention_chunk_size > max_model_len:
        raise ConfigError("max_model_len",
                          f"at least {model.name}'s attention chunk ({model.attention_chunk_size} tokens)",
                          max_model_len)


ENGINE_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig))


def engine_config_from_mapping(entry: object, *, where: str = "engine") -> EngineConfig:
    """The ``[engine]`` table of a scenario as an ``EngineConfig``; errors name the table's
    key. Unknown keys are refused: a typo must not silently fall back to a default."""
    return config_from_table(EngineConfig, entry, where=where, table_is="a table of engine settings",
                             known=ENGINE_KEYS, expected=f"an engine setting ({', '.join(sorted(ENGINE_KEYS))})")
