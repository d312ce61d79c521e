"""Page sizes: the attention block size of hybrid attention+state models, and page-size
unification across layers.

docs/semantics.md#grouping-and-page-size. One block id is one page in every layer
of a group and every group aliases the same pool, so all layers must end up with the same
page bytes:

* ``hybrid_attention_block_size`` — a recurrent state's page does not depend on the block
  size, so vLLM raises the *attention* block size (in steps of the kernel's alignment)
  until one attention page holds a state, then pads the state page up to that attention
  page (vLLM ``_align_hybrid_block_size``; older releases padded differently).
* ``unify_page_sizes`` — what remains unequal is fixed per layer against the largest page:
  a smaller page that divides it scales its block size by the ratio (no waste); a state
  page is padded; a non-dividing, non-MLA attention page is padded (read through a strided
  view); MLA cannot be padded (sparse MLA indexes whole token rows), so the caller falls
  back to full allocation (``sim/planner/grouping.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvtwin.sim.core.spec import AttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec, cdiv


@dataclass(frozen=True)
class HybridBlockSize:
    """The attention block size chosen for a model with recurrent-state layers."""

    block_size: int
    alignment_tokens: int
    mamba_page_bytes: int
    attention_page_bytes: int

    @property
    def mamba_page_padded_bytes(self) -> int | None:
        """The padded state page, or None when the state already fills a page exactly."""
        return self.attention_page_bytes if self.attention_page_bytes != self.mamba_page_bytes else None

    @property
    def mamba_padding_bytes(self) -> int:
        return self.attention_page_bytes - self.mamba_page_bytes


def hybrid_attention_block_size(*, block_size: int, attention_bytes_per_token: int, mamba_page_bytes: int,
                                kernel_alignment_tokens: int,
                                checkpoint_alignment_tokens: int | None = None) -> HybridBlockSize:
    """Smallest aligned attention block size whose page holds one recurrent state.

    ``block_size`` is the user's (or default) block size: it acts as a floor *and* as the
    alignment step when it is larger than the kernel's own minimum, as in vLLM. A state
    checkpoint alignment (gated-DeltaNet prefill kernels on some GPUs) makes the step
    the least common multiple of both.
    """
    alignment = max(kernel_alignment_tokens, block_size)
    if checkpoint_alignment_tokens:
        alignment = math.lcm(alignment, checkpoint_alignment_tokens)
    chosen = block_size
    if mamba_page_bytes > 0:
        needed = alignment * cdiv(mamba_page_bytes, alignment * attention_bytes_per_token)
        chosen = max(block_size, needed)
    return HybridBlockSize(block_size=chosen, alignment_tokens=alignment, mamba_page_bytes=mamba_page_bytes,
                           attention_page_bytes=chosen * attention_bytes_per_token)


class PageSizeNotUnifiable(Exception):
    """A layer's page neither divides the largest page nor can be padded (MLA)."""

    def __init__(self, layer_name: str, page_bytes: int, max_page_bytes: int):
        self.layer_name = layer_name
        super().__init__(f"layer {layer_name}: page of {page_bytes} bytes neither divides the largest page "
                         f"({max_page_bytes} bytes) nor can be padded (MLA)")


def unify_page_sizes(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Specs with one common page size (the largest), or raise ``PageSizeNotUnifiable``."""
    pages = {spec.page_size_bytes for spec in specs.values()}
    if len(pages) <= 1:
        return dict(specs)
    max_page = max(pages)
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if page == max_page:
            new = spec
        elif isinstance(spec, MambaSpec):
            new = dataclasses.replace(spec, page_size_padded=max_page)
        elif max_page % page == 0:
            new = dataclasses.replace(spec, block_size=spec.block_size * (max_page // page))
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            new = dataclasses.replace(spec, page_size_padded=max_page)
        else:
            raise PageSizeNotUnifiable(name, page, max_page)
        assert new.page_size_bytes == max_page
        unified[name] = new
    return unified
