"""Smoke tests of research/bench.py: its helpers, --base's side-by-side loading, one scaling child process
and two tiny command-line runs.

Never asserts on times (timings are noisy); only that the bench runs and reports what it says.
Run: python -m pytest -q research/tests/test_bench.py      (well under 30 s)
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import bench
from model import Config, Model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root


def tiny_model(**kw):
    cfg = Config(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                 max_positions=70, **kw)
    return Model(cfg).train()


def test_time_alternately_interleaves_calls():
    calls = []
    t = bench.time_alternately({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                               rounds=3, warmup=1)
    assert calls == ["a", "b"] * 4                     # warm-up round, then 3 timed rounds, alternating
    assert [len(t["a"]), len(t["b"])] == [3, 3] and all(x >= 0 for x in t["a"] + t["b"])


def test_train_step_gives_gradients():
    model = tiny_model(attention="sparse", block_size=8, num_global=2, num_random=1)
    batch = bench.random_batch(2, 32, 50, "cpu")
    loss = bench.train_step(model, batch, bench.ours_hidden_loss)
    assert torch.isfinite(loss)
    assert model.layers[0].attn.qkv.weight.grad is not None


def test_verdict_lines():
    assert bench.verdict(0.82, 1.0, 0.85) == "ratio 0.82 (need <= 1, target 0.85): PASS"
    assert bench.verdict(0.9, 1.0, 0.85).endswith("PASS (target missed)")
    assert bench.verdict(1.2, 1.0).endswith("FAIL")
    f = bench.figure("x", [2.0, 2.0], [1.0, 1.0], need=1.5)
    assert f["ratio"] == 2.0 and f["status"] == "FAIL"


def test_sparse_flops_grow_linearly():
    cfg = Config(hidden_size=256, num_layers=2, num_heads=4, attention="sparse", block_size=64,
                 num_global=128, num_random=3)
    f = [bench.train_flops(cfg, 1000, 1, n) for n in (2048, 8192)]
    assert abs(f[1] / f[0] - 4.0) < 1e-9
    dense = Config(hidden_size=256, num_layers=2, num_heads=4)
    assert bench.train_flops(dense, 1000, 1, 8192) > f[1]


def test_child_process_reports_time_and_memory():
    """A scaling point in a fresh process, built from a --base checkout's modules (here: this one's)."""
    args = SimpleNamespace(device="cpu", threads=1, clock="cpu")
    r = bench.peak_memory_child("sparse", 256, args, steps=1, lib=SimpleNamespace(root=ROOT))
    assert "error" not in r, r.get("error")
    assert len(r["times"]) == 1 and r["peak_bytes"] >= 0 and r["flops"] > 0


def test_load_checkout_imports_a_second_copy_side_by_side(monkeypatch):
    """--base DIR: DIR's model / attendout / sar are fresh module objects; `import model` still gives ours, and
    section 5's AttendOut step of the base's model (bench.sar_losses(lib)["AttendOut"]) runs its masked pass
    through the base's sar.stacked_views and attendout.keep_reward, never through ours."""
    import attendout
    import model
    import sar
    lib = bench.load_checkout(ROOT)
    assert lib.model is not model and sys.modules["model"] is model and lib.tag == " (base)"
    assert lib.model.__file__ == model.__file__ and lib.model.Model is not model.Model
    assert lib.sar is not sar and lib.attendout is not attendout
    cfg = bench.make_config(lib, vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                            max_positions=70, attn_dropout="attendout", num_labels=2,
                            no_such_field=1)   # a base drops it
    net = lib.model.Model(cfg).train()
    calls = []

    def counted(module, name):
        original = getattr(module, name)

        def wrapped(*a, **k):
            calls.append(name)
            return original(*a, **k)
        monkeypatch.setattr(module, name, wrapped)

    def not_ours(*a, **k):
        raise AssertionError("the base's model ran through our module")
    counted(lib.sar, "stacked_views")
    counted(lib.attendout, "keep_reward")
    monkeypatch.setattr(sar, "stacked_views", not_ours)
    monkeypatch.setattr(attendout, "keep_reward", not_ours)
    batch = bench.random_batch(2, 16, 50, "cpu", num_labels=2)
    loss = bench.train_step(net, batch, bench.sar_losses(lib)["AttendOut"], lib=lib)
    assert torch.isfinite(loss)
    assert calls == ["stacked_views", "keep_reward"]
    # the masked pass ran in every layer: each G-Net measured a masking rate and got a gradient
    mods = lib.attendout.attendout_modules(net)
    assert len(mods) == 2 and all(0 <= r <= 1 for r in lib.attendout.mask_rates(net).tolist())    # nan: did not run
    assert all(m.gnet.weight.grad is not None and m.gnet.weight.grad.abs().sum() > 0 for m in mods)


def test_load_checkout_refuses_a_folder_without_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.load_checkout(str(tmp_path))
    assert capsys.readouterr().err.startswith("error: --base")


def test_scaling_kinds_choose_the_kernel_path():
    """"sparse": no attention dropout (FlexAttention on CUDA); "sparse-dropout": standard 0.1 (the gather path)."""
    spec = dict(batch=1, device="cpu")
    cfg, _, _ = bench.long_step({**spec, "kind": "sparse"}, 128)
    assert (cfg.attention, cfg.attn_dropout) == ("sparse", "none")
    cfg, _, step = bench.long_step({**spec, "kind": "sparse-dropout"}, 128)
    assert (cfg.attention, cfg.attn_dropout, cfg.attn_dropout_p) == ("sparse", "standard", 0.1)
    assert torch.isfinite(step())


def test_cli_quick_section_writes_json(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "research/bench.py", "--quick", "--only", "sar", "--rounds", "1",
                        "--warmup", "0", "--threads", "1", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SAR / plain step: ratio" in r.stdout and "| plain CE |" in r.stdout
    res = json.loads(out.read_text())
    assert [f["name"] for f in res["results"]["sar"]["figures"]] == ["SAR / plain step", "R-Drop / plain step"]


def test_cli_base_runs_both_checkouts_side_by_side(tmp_path):
    """`--only attendout --base DIR --clock cpu`: section 5's three steps (plain, R-Drop, AttendOut) of both
    checkouts timed alternately, AttendOut against R-Drop, and the after / before figures."""
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "research/bench.py", "--quick", "--only", "attendout", "--rounds", "1",
                        "--warmup", "0", "--threads", "1", "--clock", "cpu", "--base", ROOT, "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| attendout (base) |" in r.stdout and "attendout / attendout (base): ratio" in r.stdout
    assert "| R-Drop (base) |" in r.stdout and "AttendOut / R-Drop train step: ratio" in r.stdout
    res = json.loads(out.read_text())
    assert res["meta"]["base"] == ROOT and res["meta"]["clock"] == "cpu"
    sec = res["results"]["attendout"]
    assert sorted(sec["train_times"]) == sorted(k + tag for k in ("standard", "R-Drop", "attendout")
                                                for tag in ("", " (base)"))
    assert [f["name"] for f in sec["figures"]] == [
        "AttendOut / R-Drop train step", "AttendOut / standard train step", "AttendOut / standard inference",
        "attendout / attendout (base)", "standard / standard (base)", "R-Drop / R-Drop (base)"]


def test_peak_tensor_bytes_counts_live_tensors():
    """bench.peak_tensor_bytes: the most tensor bytes alive at once while fn runs (a freed tensor no longer
    counts), the figure bench.py compares block-sparse and dense memory by."""
    def fn():
        a = torch.empty(1_000_000)          # 4 MB, freed before the next two
        del a
        b = torch.empty(2_000_000)          # 8 MB
        c = torch.empty(500_000)            # + 2 MB alive with b: the peak, 10 MB
        return b, c
    peak = bench.peak_tensor_bytes(fn)
    assert 10_000_000 <= peak < 10_001_000, peak
