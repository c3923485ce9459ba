"""research/gpu_check.sh rehearsed on the CPU (--cpu): every part runs and says ok in one line, so
the script a lent GPU runs once is itself tested here; and a part that fails says FAIL with its last
lines, and the script exits 1.
Run: python -m pytest -q research/tests/test_gpu_check.py
"""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = ["tests", "flex", "bf16-row", "demo", "compile", "resume", "predict", "bench"]


def test_the_cpu_rehearsal_ends_with_every_part_ok(request):
    """conftest.py started `bash research/gpu_check.sh --cpu REPORT` when the tests were collected."""
    process, printed, report = request.config.gpu_check
    process.wait(timeout=600)
    with open(printed) as f:
        output = f.read()
    lines = output.strip().splitlines()
    assert process.returncode == 0, output
    parts = [line for line in lines if line.startswith(("ok ", "FAIL "))]
    assert [line.split()[1].rstrip(":") for line in parts] == PARTS
    assert all(line.startswith("ok ") for line in parts)
    assert "compiles over 10 lengths" in parts[1] and "0 graph break(s)" in parts[4]
    assert "relative difference from the uninterrupted run 0.0e+00" in parts[5]
    assert lines[-1].startswith("every part ok in ")
    with open(report) as f:
        assert f.read().strip().splitlines() == lines                   # the report holds the same


def test_a_failing_part_says_fail_with_its_last_lines(tmp_path):
    """Every part that fails (here: a PATH whose python exits 3 with an error line) is one FAIL
    line with its exit status, then its own last lines; the script goes on, then exits 1."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\necho 'error: a part broke' >&2\nexit 3\n")
    (fake / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", "research/gpu_check.sh", "--cpu", str(tmp_path / "r.md")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1
    assert "FAIL tests (exit 3, " in p.stdout and "    error: a part broke" in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("some parts FAILED in ")
