"""The ``[speculative]`` table: speculative decoding in a replay (vLLM's ``speculative_config``).

docs/semantics.md#speculative-decoding. ``method`` is the drafter (``ngram``: prompt lookup,
no model; ``eagle``, ``eagle3``, ``mtp``: a draft head that writes its own KV, so the
scheduler reserves ``num_lookahead_tokens = k`` slots and, with prefix caching on, each
block's hash covers the token after it; ``mtp`` is a single-module head, one MTP layer
run k times, as DeepSeek-V3's), ``num_speculative_tokens`` the k
drafts verified per decode, ``acceptance`` how often they are accepted (one rate, or one
per draft position; default: the method's published table, ``spec_defaults.py``), ``seed``
the acceptance draws' seed, ``draft_layers`` the draft head's depth (default 1 for a head,
0 for n-gram): its GPU time in the cost model, and in the plan its KV layers and weights
(``sim/planner/draft_head.py``). No table (or ``method`` unset): no drafting, and the
run is exactly the one without this feature.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtwin.sim.core.config import HEAD_METHODS, SPEC_METHODS, is_int
from kvtwin.sim.core.errors import require
from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.scenario.acceptance import AcceptanceConfig
from kvtwin.sim.scenario.spec_defaults import default_acceptance


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int = 0
    acceptance: float | tuple[float, ...] | None = None
    seed: int = 0
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.acceptance, list):
            object.__setattr__(self, "acceptance", tuple(self.acceptance))
        if self.method is None:
            require(self.num_speculative_tokens == 0, "method",
                    f"one of {', '.join(SPEC_METHODS)} when num_speculative_tokens is set", None)
            return
        require(self.method in SPEC_METHODS, "method", f"one of {', '.join(SPEC_METHODS)}", self.method)
        k = self.num_speculative_tokens
        require(is_int(k) and k >= 1, "num_speculative_tokens", "a positive integer (the drafts per decode)", k)
        if self.draft_layers is not None:
            require(is_int(self.draft_layers) and self.draft_layers >= 0, "draft_layers",
                    "a non-negative integer (layers of the draft head)", self.draft_layers)
        if self.method == "mtp" and self.num_draft_layers > 1:
            # An MTP head's layers are its modules, which vLLM runs in turn: k must not end
            # part-way through a round (docs/semantics.md#configuration).
            modules = self.num_draft_layers
            require(k <= modules or k % modules == 0, "num_speculative_tokens",
                    f"at most draft_layers ({modules}, the MTP modules) or a multiple of it (vLLM refuses k that "
                    "is neither)", k)
        if self.acceptance is None:
            require(default_acceptance(self.method, k) is not None, "acceptance",
                    f"a rate in [0, 1] or a table of {k} rates ('{self.method}' has no published default: its "
                    "acceptance depends on the workload)", None)
        self.acceptance_config()  # checks the rates and the seed

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the drafts (vLLM: k for a draft head, 0 for n-gram)."""
        return self.num_speculative_tokens if self.method in HEAD_METHODS else 0

    @property
    def num_prefill_lookahead_tokens(self) -> int:
        """Prefill tokens past a chunk the drafter reads (vLLM: 1 for a draft head, 0 for
        n-gram; k only for multi-module MTP, which a replay does not model). The planner
        sizes sliding-window retention from it (docs/semantics.md#sliding-window)."""
        return 1 if self.method in HEAD_METHODS else 0

    def num_hash_lookahead_tokens(self, enable_prefix_caching: bool) -> int:
        """Tokens after each block its hash covers (vLLM 0.33: 1 for a single-module draft
        head with prefix caching on, docs/semantics.md#draft-heads-and-prefix-caching; else 0)."""
        return 1 if self.method in HEAD_METHODS and enable_prefix_caching else 0

    @property
    def num_draft_layers(self) -> int:
        if self.draft_layers is not None:
            return self.draft_layers
        return 1 if self.method in HEAD_METHODS else 0

    @property
    def draft_head(self) -> DraftHead | None:
        """The head the plan gives KV layers and weights and the clock runs k passes of
        (None: n-gram, off, or no layers)."""
        if self.method not in HEAD_METHODS or not self.num_draft_layers:
            return None
        return DraftHead(str(self.method), self.num_draft_layers, self.num_speculative_tokens)

    def acceptance_config(self) -> AcceptanceConfig:
        rates = self.acceptance
        if rates is None:
            rates = default_acceptance(str(self.method), self.num_speculative_tokens)
        assert rates is not None
        return AcceptanceConfig(self.num_speculative_tokens, rates, self.seed)


SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "acceptance", "seed", "draft_layers")
