"""kvtwin: a digital twin of an LLM server's KV cache."""

from kvtwin._native import select_build

__version__ = "0.1.0"

# Compiled or interpreted core, decided before anything under kvtwin.sim is imported.
CORE_BUILD = select_build()
