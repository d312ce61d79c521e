"""kvtwin: a digital twin of an LLM server's KV cache."""

__version__ = "0.1.0"
