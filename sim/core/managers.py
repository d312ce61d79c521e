"""Which single-type manager each KV cache spec gets (docs/semantics.md#single-type-managers;
vLLM's ``spec_manager_map``): the one table a new attention kind adds its manager to.
The managers: ``single_type_manager.py`` (their base), ``attention_managers.py`` and
``mamba_manager.py``.
"""

from __future__ import annotations

from kvtwin.sim.core.attention_managers import ChunkedLocalAttentionManager, FullAttentionManager, SlidingWindowManager
from kvtwin.sim.core.mamba_manager import MambaManager
from kvtwin.sim.core.single_type_manager import SingleTypeKVCacheManager
from kvtwin.sim.core.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

# One manager class per spec class (vLLM's ``spec_manager_map``). MLA is full attention
# as far as blocks go; a subclass of a listed spec gets its nearest listed base's manager.
MANAGER_CLASSES: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    for cls in type(spec).__mro__:
        manager = MANAGER_CLASSES.get(cls)
        if manager is not None:
            return manager
    raise TypeError(f"no manager for {type(spec).__name__}")
