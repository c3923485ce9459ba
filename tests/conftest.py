"""Shared test setup."""
import pytest
import torch

import data


@pytest.fixture(autouse=True)
def one_thread():
    """Two shared cores: one intra-op thread per test is much faster than oversubscribed threads (and the same
    kernels). Subprocess runs get OMP_NUM_THREADS=1 in their environment."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory):
    """A small generated ListOps set (64 / 16 / 4 examples); test files that need another size define their own."""
    folder = str(tmp_path_factory.mktemp("listops"))
    data.write_listops(folder, 64, 16, 4, min_len=5, max_len=30, seed=0, max_depth=3, max_args=3)
    return folder
