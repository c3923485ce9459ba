"""--compile: a compiled training run on the CPU logs the same loss and gradient norm as the eager one (train.py's own flag,
tiny dense model, one step, no dropout so that both draw nothing random that could differ). The first
compile takes tens of seconds; this is the suite's one compiled case.
Run: python -m pytest tests/test_compile.py -q
"""
import shutil

import pytest

from tests.test_train import read_log, run_main, tsv_args, write_zebra_tsv


def compiler_missing():
    """Inductor's CPU backend needs a C++ compiler."""
    return shutil.which("g++") is None and shutil.which("c++") is None and shutil.which("clang++") is None


@pytest.mark.skipif(compiler_missing(), reason="torch.compile on the CPU needs a C++ compiler (g++/clang++): none found")
def test_compiled_step_logs_the_eager_loss(tmp_path, capfd):
    folder = write_zebra_tsv(str(tmp_path / "data"), n_train=40, n_dev=8)
    flags = ["--attention", "dense",
             "--attn-dropout", "none", "--hidden-dropout-p", "0", "--max-steps", "1", "--batch-size", "8",
             "--log-every", "1", "--lr", "1e-3"]
    losses = {}
    for mode in ("eager", "compiled"):
        out = tmp_path / mode
        code, _, err = run_main(tsv_args(folder, out) + flags + (["--compile"] if mode == "compiled" else []), capfd)
        assert code == 0, err
        losses[mode] = [(rec["loss"], rec["grad_norm"]) for rec in read_log(out) if "loss" in rec]
    assert len(losses["eager"]) == 1
    # the loss at initialisation is ~log(2) whatever the model computes; the gradient norm is not
    assert losses["compiled"][0] == pytest.approx(losses["eager"][0], rel=1e-4, abs=1e-6)
