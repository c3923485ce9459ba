"""Shared test setup."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Two shared cores: one intra-op thread per test is much faster than oversubscribed threads (and the same
    kernels). Subprocess runs get OMP_NUM_THREADS=1 in their environment."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
