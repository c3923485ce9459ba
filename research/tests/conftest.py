"""Shared setup of research/tests: the repository root on sys.path, one torch thread per test."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the six files' folder
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "research"))          # `import experiments`, `import bench`


@pytest.fixture(autouse=True)
def one_thread():
    """Two shared cores: one intra-op thread per test (subprocess runs get --threads 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
