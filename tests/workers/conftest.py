"""Worker tests run tiny models: one intra-op thread is fastest (no OpenMP spinning on a
shared 2-core machine)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
