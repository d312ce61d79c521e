"""A draft head's share of the GPU: its attention layers in the KV cache and its weights
(docs/semantics.md#draft-heads-in-the-memory-plan).

vLLM 0.33 loads an EAGLE, EAGLE-3 or MTP drafter before it profiles memory, so its weights
come out of what the KV cache gets; and its attention layers are registered next to the
target's, so the planner groups them with the target's layers: each draft layer is one
more layer in a group, whose bytes per block grow with it (for DeepSeek-V3's MTP layer,
one 576-element latent at 2 bytes: 1,152 more bytes per token,
``tests/planner/test_draft_head.py``). A draft layer has the target's attention shape
(MLA on an MLA model, full attention otherwise; EAGLE heads copy the target's head counts).

The weights are an estimate, like every other term of the memory budget: a draft layer
costs the target's average layer (its parameters without the embedding and LM head, over
its layers), plus the head's input projection (EAGLE and MTP: ``2 h x h`` over the
concatenated token embedding and hidden state; EAGLE-3: ``3 h x h`` over three fused
hidden states), stored as the target stores its weights. The embedding and LM head are the
target's (vLLM shares them when the drafter has none of its own or an identical copy); an
EAGLE-3 head's own reduced-vocabulary LM head is not counted.

One type describes the head to both of its readers: the planner (its layers in the KV cache
and its weights in the memory budget) and the cost model (``num_passes`` runs of its layers
per step, ``sim/replay/cost_model.py``). ``SpeculativeConfig.draft_head`` builds it from a
scenario's ``[speculative]`` table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtwin.sim.core.errors import require
from kvtwin.sim.core.spec import FullAttentionSpec, MLAAttentionSpec
from kvtwin.sim.planner.models import ModelPreset

# The head's input projection, in units of hidden_size x hidden_size parameters.
INPUT_PROJECTION_SQUARES = {"eagle": 2, "eagle3": 3, "mtp": 2}


@dataclass(frozen=True)
class DraftHead:
    """A draft head: its method, its ``num_layers`` layers of the target's shape, and the
    ``num_passes`` (k, the drafts per decode) it runs them per step."""

    method: str
    num_layers: int
    num_passes: int

    def __post_init__(self) -> None:
        require(self.method in INPUT_PROJECTION_SQUARES, "speculative.method",
                f"one of {', '.join(INPUT_PROJECTION_SQUARES)} (a drafter with its own layers)", self.method)
        require(isinstance(self.num_layers, int) and not isinstance(self.num_layers, bool) and self.num_layers >= 1,
                "speculative.draft_layers", "a positive integer (layers of the draft head)", self.num_layers)
        require(isinstance(self.num_passes, int) and not isinstance(self.num_passes, bool) and self.num_passes >= 1,
                "speculative.num_speculative_tokens", "a positive integer (the head's passes per step)",
                self.num_passes)

    def layer_kind(self, model: ModelPreset) -> str:
        """The spec kind of each draft layer: the target's attention, MLA or full."""
        return MLAAttentionSpec.kind if model.uses_mla else FullAttentionSpec.kind

    def params(self, model: ModelPreset) -> float:
        matrices = 1 if model.tie_word_embeddings else 2
        body = max(float(model.params_total) - matrices * model.lm_head_params, 0.0)
        projection = INPUT_PROJECTION_SQUARES[self.method] * model.hidden_size ** 2
        return self.num_layers * body / model.num_layers + projection

    def weights_bytes_per_gpu(self, model: ModelPreset, *, tp: int) -> int:
        """Bytes on one GPU of the TP group, in the target's weight format (its bytes per
        parameter, so an fp8 target has an fp8 head)."""
        bytes_per_param = model.weights_bytes / float(model.params_total)
        return math.ceil(self.params(model) * bytes_per_param / tp)
