"""Kernel tests run on CPU: the Triton kernels under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before any kernel module is imported (``triton.jit``
reads it when the kernel is defined), so it is set here, when pytest loads this file
and before it imports the test modules of this directory.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_backend_choice():
    """Each test sees its own KVTWIN_ATTN_BACKEND: forget the cached choice around it."""
    from kvtwin.kernels import backends

    backends.resolve.cache_clear()
    yield
    backends.resolve.cache_clear()
