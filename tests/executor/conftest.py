"""The executor tests need torch (the ``kernels`` extra); without it they are not collected.

They run the scaled model through the torch reference: tiny matrices, for which torch's
intra-op threads only cost (on a loaded 2-core machine a run gets ten times slower), so
the tests of this package run single-threaded.
"""

import importlib.util

import pytest

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
