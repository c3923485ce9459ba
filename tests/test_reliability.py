"""Tests of train.py's reliability: exact resume after Ctrl-C and SIGKILL, the non-finite-loss stop,
torchrun / DDP on the CPU (gloo) against a single process.

Subprocesses run with OMP_NUM_THREADS=1, in-process runs with torch.set_num_threads(1) (the same kernels,
so the same bits). Run: python -m pytest tests/test_reliability.py -q
"""
import contextlib
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import data
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# On the CPU also on a GPU machine: exact resume is bit-identity, which CUDA's nondeterministic kernels (the gather
# kernel's index_select backward) and bf16 autocast do not give; torchrun here is gloo's, on the CPU.
TINY = ["--init", "scratch", "--hidden", "32", "--heads", "2", "--ffn", "64", "--attention", "dense",
        "--attn-dropout", "standard", "--sar", "0", "--device", "cpu"]




def run_main(argv):
    """train.main in-process -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def weights(path):
    return torch.load(path, weights_only=True)["model"]


def log_lines(out):
    """log.jsonl without the wall-clock field."""
    with open(os.path.join(out, "log.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "examples_per_s"} for line in f]


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("listops"))
    data.write_listops(folder, 300, 50, 10, min_len=5, max_len=30, seed=0, max_depth=3, max_args=3)
    return folder


# -----------------------------------------------------------------------------
# exact resume

STEPS = 60    # 19 batches of 16 per epoch: the run crosses epochs, the kills land mid-epoch


def resume_args(folder, out):
    """Everything that draws random numbers: hidden dropout, AttendOut's G-Net, random sparse blocks; and two
    micro-batches a step (the plan's position, batches used, is all a resume needs)."""
    return ["--task", "listops", "--data", folder, "--out", str(out), *TINY, "--layers", "2",
            "--attention", "sparse", "--block-size", "4", "--num-random", "1", "--attn-dropout", "attendout",
            "--max-steps", str(STEPS), "--batch-size", "16", "--grad-accum", "2", "--lr", "1e-3",
            "--eval-every", "10", "--log-every", "1", "--save-every", "3"]


def start(args):
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def signal_at_step(proc, out, step, sig):
    """Send sig once log.jsonl shows `step` (the process must still be running then)."""
    path = os.path.join(out, "log.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                steps = [json.loads(line)["step"] for line in f if line.endswith("\n")]
            if steps and steps[-1] >= step:
                assert proc.poll() is None, "the run ended before the signal"
                os.kill(proc.pid, sig)
                return proc.communicate(timeout=120)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise TimeoutError


def test_ctrl_c_then_sigkill_then_resume_is_bit_identical(listops_dir, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "run"
    code, _, err = run_main(resume_args(listops_dir, ref))                 # the uninterrupted run
    assert code == 0, err
    rng = random.Random()
    k1, k2 = rng.randint(3, 25), rng.randint(30, 52)
    print(f"Ctrl-C at step {k1}, SIGKILL at step {k2}")

    # Ctrl-C: the step finishes, ckpt_last.pt is saved, exit 130 (so `train.py ... && next` stops)
    p = start(resume_args(listops_dir, out))
    stdout, stderr = signal_at_step(p, str(out), k1, signal.SIGINT)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr and "stopped at step" in stdout
    stopped = torch.load(out / "ckpt_last.pt", weights_only=True)["train_state"]["step"]
    assert stopped >= k1 and log_lines(out)[-1]["step"] <= stopped

    # resume, then SIGKILL (most likely between two saves: --save-every 3)
    p = start(["--resume", "--out", str(out)])
    signal_at_step(p, str(out), k2, signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL
    saved = torch.load(out / "ckpt_last.pt", weights_only=True)["train_state"]["step"]
    assert stopped <= saved <= max(r["step"] for r in log_lines(out))

    # resume to the end
    p = start(["--resume", "--out", str(out)])
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr
    assert f"resuming at step {saved}" in stdout
    a, b = weights(ref / "ckpt_last.pt"), weights(out / "ckpt_last.pt")
    assert a.keys() == b.keys() and any("gnet" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, weights(out / "ckpt_best.pt")[k]) for k, v in weights(ref / "ckpt_best.pt").items())
    # what the resumed runs logged is what the uninterrupted run logged (no lost or repeated lines)
    assert log_lines(out) == log_lines(ref)
    assert (out / "droprates.jsonl").read_text() == (ref / "droprates.jsonl").read_text()
    final_ref, final = (json.loads((d / "final.json").read_text()) for d in (ref, out))
    assert final["dev_splits"] == final_ref["dev_splits"] and final["steps"] == STEPS
    assert not [f for f in os.listdir(out) if ".tmp" in f]


# -----------------------------------------------------------------------------
# non-finite losses

def test_nan_stops_and_keeps_the_last_good_checkpoint(listops_dir, tmp_path):
    out = tmp_path / "nan"
    # lr 1e30 without clipping: step 1 is finite (huge weights), step 2's loss is not
    code, _, err = run_main(["--task", "listops", "--data", listops_dir, "--out", str(out), *TINY, "--layers", "1",
                             "--max-steps", "10", "--batch-size", "16", "--lr", "1e30", "--clip", "0",
                             "--save-every", "1"])
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: non-finite loss at step 2"), err
    assert f"last good checkpoint: {out / 'ckpt_last.pt'} (step 1)" in lines[0]
    ckpt = torch.load(out / "ckpt_last.pt", weights_only=True)
    assert ckpt["train_state"]["step"] == 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


def write_stsb(folder, bad_rows):
    """A tiny STS-B (regression); the rows in bad_rows score 1e30, so their squared error overflows to inf."""
    rng = random.Random(0)
    words = "apple river stone cloud green table music paper light water horse dream".split()
    os.makedirs(folder, exist_ok=True)
    for name, n in (("train.tsv", 64), ("dev.tsv", 16)):
        rows = ["sentence1\tsentence2\tscore"]
        for i in range(n):
            s1, s2 = (" ".join(rng.choice(words) for _ in range(5)) for _ in range(2))
            score = "1e30" if name == "train.tsv" and i in bad_rows else f"{rng.uniform(0, 5):.2f}"
            rows.append(f"{s1}\t{s2}\t{score}")
        with open(os.path.join(folder, name), "w") as f:
            f.write("\n".join(rows) + "\n")


def test_a_regression_loss_that_overflows_stops_in_one_line(tmp_path):
    folder = str(tmp_path / "stsb")
    write_stsb(folder, bad_rows={5, 40})
    args = ["--task", "stsb", "--data", folder, "--vocab-size", "36", *TINY, "--layers", "1", "--max-steps", "16",
            "--batch-size", "8", "--lr", "1e-3", "--save-every", "1"]      # 2 epochs, no short-run warning
    code, _, err = run_main(args + ["--out", str(tmp_path / "stop")])
    assert code == 1 and err.startswith("error: non-finite loss at step") and len(err.strip().splitlines()) == 1


# -----------------------------------------------------------------------------
# torchrun

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A process that waits longer than the collective timeout aborts the job (NCCL's default: 10 minutes). So every
# process evaluates its share (train.evaluate) and none waits on another's whole evaluation: rehearsed with a 5 s
# timeout and each evaluation forward slowed to 3 s, where the 2 dev batches on rank 0 alone would keep rank 1
# waiting 6 s in the barrier (the job then aborts). Each process prints how many predictions its metrics saw.
SLOW_EVAL = """
import datetime, functools, sys, time
import torch.distributed as dist
import data, model, train
dist.init_process_group = functools.partial(dist.init_process_group, timeout=datetime.timedelta(seconds=5))
forward = model.Model.forward
def slow(self, *a, **kw):
    if not self.training:
        time.sleep(3)
    return forward(self, *a, **kw)
model.Model.forward = slow
metrics = data.compute_metrics
def counted(task, preds, labels):
    print(f"scored {len(preds)} predictions", flush=True)
    return metrics(task, preds, labels)
data.compute_metrics = counted
train.main(sys.argv[1:])
"""


def test_torchrun_two_processes_match_one(tmp_path):
    folder = str(tmp_path / "listops")
    data.write_listops(folder, 64, 16, 4, min_len=5, max_len=30, seed=0, max_depth=3, max_args=3)
    # no dropout, so both runs compute the same thing; --rdrop takes sar.py's path through the DDP wrapper; 16
    # dev examples: 2 batches, one per process
    args = ["--task", "listops", "--data", folder, *TINY, "--layers", "1", "--max-steps", "8", "--batch-size", "8",
            "--lr", "1e-3", "--attn-dropout", "none", "--hidden-dropout-p", "0", "--rdrop", "1.0", "--save-every", "4"]
    script = tmp_path / "slow_eval.py"                 # train.py under a 5 s timeout, evaluation slowed
    script.write_text(SLOW_EVAL)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *args,
                        "--out", str(tmp_path / "ddp")], cwd=ROOT, env={**ENV, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "x 2 processes" in p.stdout and "Traceback" not in p.stderr
    code, _, err = run_main(args + ["--out", str(tmp_path / "one")])
    assert code == 0, err
    ckpt = torch.load(tmp_path / "ddp" / "ckpt_last.pt", weights_only=True)
    assert len(ckpt["rng"]) == 2                                    # both processes' RNG states
    a, b = ckpt["model"], weights(tmp_path / "one" / "ckpt_last.pt")
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=0) for k in a)
    # the evaluation: each process scored every other batch; gathered, they score as one process
    scored = re.findall(r"scored (\d+) predictions", p.stdout)      # each process's, final.json's baseline
    assert len(scored) == 3 and set(scored) == {"16"}, scored
    finals = [json.load(open(tmp_path / run / "final.json")) for run in ("ddp", "one")]
    assert finals[0]["dev_splits"] == finals[1]["dev_splits"]

