"""What a first GPU run meets in train.py (issue 55), rehearsed on the CPU: the head's logits in fp32 under
bf16 autocast (the consistency terms compare them), resume on a machine with fewer GPUs than the run had, and
the reads off the device that a training step makes (a GPU waits for each).
The torchrun evaluation under a short collective timeout is in test_reliability.py.
Run: python -m pytest tests/test_gpu_rehearsal.py -q
"""
import sys

import pytest
import torch

import sar
import train
from tests.test_precision import tiny_batch, tiny_model
from tests.test_train import run_main

TINY = ["--device", "cpu", "--init", "scratch", "--layers", "2", "--hidden", "32", "--heads", "2", "--ffn", "64",
        "--batch-size", "8", "--block-size", "4"]


def test_logits_are_fp32_under_bf16_autocast():
    """Under bf16 autocast (train.py's on CUDA; the CPU's here) every view's logits come out of an fp32 head: the
    consistency terms compare views whose logits differ by less than bf16's step. A bf16 head's logits would be
    bf16 values: each equal to its own bf16 rounding."""
    model = tiny_model("hst", "attendout", "cls")
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        views = sar.stacked_views(model, tiny_batch("cls"), second=1, masked=True)
    for z in views:
        assert z.dtype == torch.float32
        assert not torch.equal(z, z.bfloat16().float())         # more digits than bf16 holds


def test_resume_on_fewer_gpus_restores_what_it_can(listops_dir, tmp_path, capfd, monkeypatch):
    """A checkpoint from a machine with 2 GPUs (its CUDA RNG states faked) resumed on a machine with 1: the one
    GPU's state is restored, the other is not asked for (torch.cuda.set_rng_state_all would index a GPU that is not
    there: a traceback), and one warning line says so. Run with --device cpu; CUDA's generators are stand-ins."""
    argv = ["--task", "listops", "--data", listops_dir, "--out", str(tmp_path), *TINY, "--max-steps", "2",
            "--attn-dropout", "standard", "--sar", "0"]
    code, _, err = run_main(argv, capfd)
    assert code == 0 and err == []
    path = tmp_path / "ckpt_last.pt"
    ckpt = torch.load(path, weights_only=True)
    saved = [torch.full((16,), i, dtype=torch.uint8) for i in (7, 9)]      # GPU 0's state, GPU 1's
    ckpt["rng"][0]["cuda"] = saved
    torch.save(ckpt, path)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [saved[0]])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((state, device)))
    code, _, err = run_main(argv + ["--resume"], capfd)
    assert code == 0, err
    assert [int(state[0]) for state, _ in restored] == [7] and restored[0][1] in (0, "cuda", "cuda:0")
    assert len(err) == 1 and err[0].startswith("warning: --resume: "), err
    assert "random state of 2 GPUs, this machine has 1 (restored: 1)" in err[0]


# Reads off the device: a GPU waits for each. On the CPU they are counted by wrapping the Tensor methods that
# read a value: item, float(), int(), bool(), tolist, numpy, cpu. AdamW's own step counters are left out: they
# are host tensors (on CUDA train.py runs the fused AdamW, which reads none).
READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu")


def count_reads(monkeypatch, counted):
    """Wrap READS: counted["on"] turns counting on; counted["where"] collects (method, file, line)."""
    for name in READS:
        real = getattr(torch.Tensor, name)

        def read(self, *a, _real=real, _name=name, **kw):
            caller = sys._getframe(1).f_code.co_filename
            if counted["on"] and "torch/optim" not in caller.replace("\\", "/"):
                counted["where"].append((_name, caller.rsplit("/", 1)[-1], sys._getframe(1).f_lineno))
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, read)


@pytest.mark.parametrize("flags", [
    ["--attention", "hst", "--attn-dropout", "attendout", "--sar", "1"],     # the demo's methods (train.DEMO)
    ["--attention", "dense", "--attn-dropout", "standard", "--sar", "0"]])
def test_a_step_that_does_not_log_reads_the_device_at_most_twice(listops_dir, tmp_path, capfd, monkeypatch,
                                                                 flags):
    """One whole turn of train.py's loop at a step that neither logs, evaluates nor saves (step 2 of 3, from
    its train_step to the next one's): at most 2 reads, the finiteness check's and the model's own (dense: its
    fast-path test of the padding; SAR: its check of the shifted view's positions)."""
    counted = {"on": False, "where": []}
    count_reads(monkeypatch, counted)
    real_step = train.train_step

    def train_step(r, batches, step, meter):
        counted["on"] = step == 2                        # on from step 2's start to step 3's
        return real_step(r, batches, step, meter)
    monkeypatch.setattr(train, "train_step", train_step)
    argv = ["--task", "listops", "--data", listops_dir, "--out", str(tmp_path), *TINY, "--max-steps", "3",
            "--log-every", "3", "--save-every", "0", "--eval-every", "0", *flags]
    code, _, err = run_main(argv, capfd)
    assert code == 0, err
    assert 1 <= len(counted["where"]) <= 2, counted["where"]
    assert ("tolist", "train.py") in [where[:2] for where in counted["where"]]    # the finiteness check
