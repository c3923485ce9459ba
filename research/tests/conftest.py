"""Shared setup of research/tests: the repository root on sys.path, one torch thread per test, and the
GPU check's CPU rehearsal started in the background when the session will run it."""
import os
import subprocess
import sys
import tempfile

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


# The GPU check's rehearsal on the CPU (research/tests/test_gpu_check.py) keeps one core busy for
# about 45 s, mostly waiting on processes of its own. When a session will run it, it starts in the
# background as soon as the tests are collected, on the core the suite (one thread) leaves free; its
# test waits for it and reads what it printed. A session that ends first stops it.
REHEARSAL = "test_the_cpu_rehearsal_ends_with_every_part_ok"


def pytest_collection_finish(session):
    if not any(item.name == REHEARSAL for item in session.items):
        return
    folder = tempfile.mkdtemp(prefix="gpu_check_")
    printed = open(os.path.join(folder, "printed.txt"), "w")
    report = os.path.join(folder, "gpu_check.md")
    process = subprocess.Popen(["bash", "research/gpu_check.sh", "--cpu", report], cwd=ROOT,
                               stdout=printed, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    printed.close()                                      # the child holds its own copy
    session.config.gpu_check = (process, printed.name, report)


def pytest_sessionfinish(session):
    started = getattr(session.config, "gpu_check", None)
    if started is not None and started[0].poll() is None:
        started[0].terminate()
        started[0].wait()
