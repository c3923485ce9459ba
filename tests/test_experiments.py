"""Tests of experiments.py: its statistics and data helpers, and the pretrained grids end to end on a tiny model.

The paired 95% confidence interval against numbers computed by hand, the t table against known quantiles,
the low-resource subsample (deterministic, the first n lines after a seeded shuffle).
Run: python -m pytest tests/test_experiments.py -q
"""
import json
import math
import os
import random

import pytest

import data
import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_paired_ci_by_hand():
    # baseline 80, 82, 81; method 83, 84, 82  ->  d = 3, 2, 1: mean 2, sd 1, se 1/sqrt(3), t_{0.975,2} = 4.303
    m, h = experiments.paired_ci([80.0, 82.0, 81.0], [83.0, 84.0, 82.0])
    assert m == pytest.approx(2.0)
    assert h == pytest.approx(4.303 / math.sqrt(3))                 # 2.4843...
    assert experiments.fmt_diff([0.80, 0.82, 0.81], [0.83, 0.84, 0.82]) == "+2.0 [-0.5, +4.5]"
    # pairing matters: the same numbers unpaired would give a much wider interval; a constant shift has sd 0
    m, h = experiments.paired_ci([70.0, 90.0, 80.0, 60.0, 75.0], [71.0, 91.0, 81.0, 61.0, 76.0])
    assert (m, h) == (pytest.approx(1.0), pytest.approx(0.0))
    xs = [0.8, 0.9]
    assert experiments.fmt_diff(xs, xs) == "(baseline)"
    assert experiments.fmt_diff([0.80], [0.83]) == "+3.0 (one seed: no interval)"   # a one-seed table still writes
    with pytest.raises(ValueError):
        experiments.paired_ci([1.0], [2.0])                          # one seed: no interval
    with pytest.raises(ValueError):
        experiments.paired_ci([1.0, 2.0], [2.0])                     # unpaired lengths


def test_t_quantiles():
    # t_{0.975, df} from any table; beyond 30 the normal quantile
    assert experiments.t975(1) == 12.706
    assert experiments.t975(4) == 2.776
    assert experiments.t975(9) == 2.262
    assert experiments.t975(30) == 2.042
    assert experiments.t975(100) == 1.960
    assert all(a > b for a, b in zip(experiments.T975, experiments.T975[1:]))


def test_subsample_is_fixed(tmp_path):
    src = tmp_path / "train.tsv"
    lines = [f"{i % 2}\tsentence number {i}\n" for i in range(50)]
    src.write_text("".join(lines) + "\n")                            # a trailing blank line is not an example
    out = str(tmp_path / "sub" / "train-10.tsv")
    experiments.write_subsample(str(src), 10, 0, out)
    expect = list(lines)
    random.Random(0).shuffle(expect)
    assert open(out).read() == "".join(expect[:10])
    first = open(out).read()
    experiments.write_subsample(str(src), 10, 0, out)                # same input, same file
    assert open(out).read() == first
    experiments.write_subsample(str(src), 10, 1, out)                # another seed, another subsample
    assert open(out).read() != first
    experiments.write_subsample(str(src), 100, 0, out)               # n larger than the file: all of it
    assert sorted(open(out).readlines()) == sorted(lines)


# -----------------------------------------------------------------------------
# the pretrained grids end to end, on a tiny model and tiny data (real train.py runs, a few seconds each)

def write_sentences(folder, n_train, n_dev, seed):
    """label<TAB>sentence, no header (the layout of the README's SST-2 / MR files): label 1 iff 'zebra'."""
    rng = random.Random(seed)
    words = "apple river stone cloud green table music paper light water horse dream".split()
    os.makedirs(folder, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        with open(os.path.join(folder, name), "w") as f:
            for _ in range(n):
                toks = [rng.choice(words) for _ in range(rng.randint(3, 12))]
                y = int(rng.random() < 0.5)
                if y:
                    toks[rng.randrange(len(toks))] = "zebra"
                f.write(f"{y}\t{' '.join(toks)}\n")


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    """A data root with sst2/ (64 training sentences) and a tiny 'pretrained' checkpoint: train.py from scratch
    on 400 other sentences of the same task until it has learned it, so that the grid's short runs end at
    different accuracies for different seeds (its ckpt_last.pt carries the model and its tokenizer, as a
    converted checkpoint does)."""
    root = tmp_path_factory.mktemp("grid")
    write_sentences(str(root / "pretrain"), 400, 8, seed=1)
    write_sentences(str(root / "data" / "sst2"), 64, 80, seed=0)
    import train
    train.main(["--task", "tsv", "--data", str(root / "pretrain"), "--text-col", "1", "--label-col", "0",
                "--init", "scratch", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64",
                "--vocab-size", "36", "--max-steps", "50", "--batch-size", "16", "--lr", "3e-3", "--warmup", "10",
                "--attn-dropout", "none", "--hidden-dropout-p", "0", "--out", str(root / "init")])
    return root


def run_grid(root, argv, capfd):
    experiments.main([*argv, "--init", str(root / "init" / "ckpt_last.pt"), "--data-root", str(root / "data"),
                      "--datasets", "sst2", "--seeds", "0", "1", "--docs", str(root / "docs"),
                      "--extra", "--lr", "1e-2", "--log-every", "1"])   # 6 steps a run: seeds must matter; log every step
    return capfd.readouterr().out


def test_attendout_grid_pairs_seeds_and_replays_the_same_seed(tiny_grid, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)                   # the grid calls `python train.py`
    out = tiny_grid / "runs-attendout"
    argv = ["pretrained-attendout", "--out", str(out), "--variants", "standard", "attendout", "scheduled"]
    printed = run_grid(tiny_grid, argv, capfd)
    # seed-major: every row's seed 0 before any seed 1
    runs = [line.split("--out ")[1].split()[0] for line in printed.splitlines() if line.startswith("$ ")]
    assert [os.path.basename(r) for r in runs] == [f"sst2-lowres-{v}-s{s}" for s in (0, 1)
                                                   for v in ("standard", "attendout", "scheduled")]
    finals = {os.path.basename(r): json.load(open(os.path.join(r, "final.json"))) for r in runs}
    for s in (0, 1):                          # scheduled replays the AttendOut run of its own seed
        args = finals[f"sst2-lowres-scheduled-s{s}"]["args"]
        assert args["schedule"] == str(out / f"sst2-lowres-attendout-s{s}" / "droprates.jsonl")
        assert args["seed"] == s and args["train_file"].startswith(str(out / "subsample"))
    raw = json.load(open(tiny_grid / "docs" / "results_pretrained_attendout_sst2.json"))["sst2-lowres"]
    assert len(set(raw["attendout"])) == 2        # the seeds differ, so a wrong pairing would show below
    for v in ("standard", "attendout", "scheduled"):       # each row lists its seeds' accuracies, in seed order
        assert raw[v] == [finals[f"sst2-lowres-{v}-s{s}"]["dev"]["dev"]["acc"] for s in (0, 1)]
    table = open(tiny_grid / "docs" / "results_pretrained_attendout_sst2.md").read()
    assert f"| sst2-lowres | attendout - scheduled | {experiments.fmt_diff(raw['scheduled'], raw['attendout'])} |" in table
    m, h = experiments.paired_ci([100 * x for x in raw["standard"]], [100 * x for x in raw["attendout"]])
    assert "| sst2 | lowres | standard |" in table and "(baseline)" in table
    assert f"| {m:+.1f} [{m - h:+.1f}, {m + h:+.1f}] |" in table
    assert not os.path.exists(out / "sst2-lowres-standard-s0" / "ckpt_last.pt")      # checkpoints dropped
    # resumable: a second call trains nothing and writes the same table
    assert "$ " not in run_grid(tiny_grid, argv, capfd)
    assert open(tiny_grid / "docs" / "results_pretrained_attendout_sst2.md").read() == table


def test_sparse_grid_scores_every_shift_of_the_final_weights(tiny_grid, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tiny_grid / "runs-sparse"
    printed = run_grid(tiny_grid, ["pretrained-sparse", "--out", str(out), "--variants", "hst", "dense"], capfd)
    assert all("--eval-shift all" in line for line in printed.splitlines() if line.startswith("$ "))
    raw = json.load(open(tiny_grid / "docs" / "results_pretrained_sparse_sst2.json"))["sst2-lowres"]
    for s in (0, 1):
        dev = json.load(open(out / f"sst2-lowres-hst-s{s}" / "final.json"))["dev"]["dev"]
        by = dev["shift"]["by"]
        assert list(by) == [str(i) for i in range(1, 8)]                    # b = 8: s = 1 .. 7
        assert raw["hst"]["acc_by_shift"][s] == [dev["acc"]] + [by[str(i)]["acc"] for i in range(1, 8)]
        assert raw["hst"]["acc_shift_worst"][s] == min(by[str(i)]["acc"] for i in range(1, 8))
    assert raw["dense"]["acc_shift_mean"] == raw["dense"]["acc"]           # dense: no topology to shift
    assert not os.path.exists(out / "sst2-lowres-hst-s0" / "ckpt_last.pt")


def test_listops_long_grid_end_to_end(tmp_path, capfd, monkeypatch):
    """listops-long on tiny generated data (already in OUT/listops-long-data, so the grid uses it) and a tiny
    model (--extra wins over the grid's flags): seed-major, every shift and draw in the table's columns,
    paired differences to hst, resumable; --dry-run prints the unfinished commands only."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "long"
    data.write_listops(str(out / "listops-long-data"), 48, 12, 2, min_len=20, max_len=60, seed=0, max_depth=3,
                       max_args=4)
    argv = ["listops-long", "--out", str(out), "--seeds", "0", "1", "--docs", str(tmp_path / "docs"), "--variants",
            "hst", "dense", "hst+sar", "--extra", "--layers", "1", "--hidden", "16", "--heads", "2", "--ffn", "32",
            "--max-steps", "3", "--batch-size", "8", "--block-size", "8", "--lr", "1e-2"]
    experiments.main(argv[:1] + ["--dry-run"] + argv[1:])
    dry = [line for line in capfd.readouterr().out.splitlines() if line.startswith("$ ")]
    assert len(dry) == 6 and not os.path.exists(out / "listops-long-hst-s0")
    experiments.main(argv)
    printed = [line for line in capfd.readouterr().out.splitlines() if line.startswith("$ ")]
    assert printed == dry
    assert [line.split("--out ")[1].split()[0] for line in printed] == [
        str(out / f"listops-long-{v}-s{s}") for s in (0, 1) for v in ("hst", "dense", "hst_sar")]
    raw = json.load(open(tmp_path / "docs" / "results_listops_long.json"))
    for s in (0, 1):
        dev = json.load(open(out / f"listops-long-hst-s{s}" / "final.json"))["dev"]["dev"]
        assert raw["hst"]["acc_by_shift"][s] == [dev["acc"]] + [dev["shift"]["by"][str(i)]["acc"] for i in range(1, 8)]
        assert list(dev["redraw"]["by"]) == ["1", "2", "3"]
        assert raw["hst"]["acc_redraw_worst"][s] == dev["redraw"]["worst"]["acc"]
        assert raw["hst"]["shift_drop"][s] == dev["acc"] - dev["shift"]["mean"]["acc"]
    assert "acc_redraw_mean" not in raw["dense"] and len(raw["dense"]["acc_by_shift"][0]) == 2   # dense: s = 1 alone
    table = open(tmp_path / "docs" / "results_listops_long.md").read()
    m, h = experiments.paired_ci([100 * x for x in raw["hst"]["acc"]], [100 * x for x in raw["hst+sar"]["acc"]])
    assert (f"| hst+sar | {experiments.fmt(raw['hst+sar']['acc'])} | "
            f"{100 * raw['hst+sar']['acc'][0]:.1f} / {100 * raw['hst+sar']['acc'][1]:.1f} |") in table
    assert f"| {m:+.1f} [{m - h:+.1f}, {m + h:+.1f}] |" in table
    assert "| dense |" in table and "| - | - |" in table
    experiments.main(argv)                                                   # resumable: nothing runs again
    assert "$ " not in capfd.readouterr().out
    assert open(tmp_path / "docs" / "results_listops_long.md").read() == table
    # the probe: the same final weights and shifts as train.py's own scores, dense left out (no boundary)
    experiments.main(["listops-long-probe", "--out", str(out), "--seeds", "0", "1", "--docs", str(tmp_path / "docs"),
                      "--variants", "hst", "dense", "hst+sar"])
    probe = json.load(open(tmp_path / "docs" / "results_listops_long_shift_probe.json"))
    assert list(probe) == ["hst", "hst+sar"]
    for name, folder in (("hst", "hst"), ("hst+sar", "hst_sar")):
        for s, effects in zip((0, 1), probe[name]):
            dev = json.load(open(out / f"listops-long-{folder}-s{s}" / "final.json"))["dev"]["dev"]
            assert list(effects) == ["0", "1", "2", "4", "6"]                # b = 8: 1, b/4, b/2, 3b/4
            assert 0 < effects["0"]["by_operator"] <= 1
            assert effects["0"]["acc"] == pytest.approx(dev["acc"])
            for sh in ("1", "2", "4", "6"):
                assert effects[sh]["acc"] == pytest.approx(dev["shift"]["by"][sh]["acc"])
                assert effects[sh]["flip"] >= abs(effects[sh]["acc"] - dev["acc"]) - 1e-9 and effects[sh]["kl"] >= 0
    # resumable: a run probed before is read back from its shift_probe.json, unless its checkpoint is newer
    kept = out / "listops-long-hst-s0" / "shift_probe.json"
    effects = json.load(open(kept))
    effects["0"]["by_operator"] = 0.125
    json.dump(effects, open(kept, "w"))
    probe_argv = ["listops-long-probe", "--out", str(out), "--seeds", "0", "--docs", str(tmp_path / "docs"),
                  "--variants", "hst"]
    experiments.main(probe_argv)
    assert json.load(open(tmp_path / "docs" / "results_listops_long_shift_probe.json"))["hst"][0]["0"]["by_operator"] == 0.125
    os.utime(out / "listops-long-hst-s0" / "ckpt_last.pt")                 # retrained: probed again
    os.utime(kept, (0, 0))
    experiments.main(probe_argv)
    assert json.load(open(tmp_path / "docs" / "results_listops_long_shift_probe.json"))["hst"][0]["0"]["by_operator"] != 0.125


def test_listops_long_candidates_write_learning_curves(tmp_path, capfd, monkeypatch):
    """--candidates: one hst run per candidate size (experiments.LONG_CANDIDATES), its dev accuracy at every
    evaluation in one table, a column per candidate, read from each run's log.jsonl."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "long"
    data.write_listops(str(out / "listops-long-data"), 32, 8, 2, min_len=20, max_len=60, seed=0, max_depth=3,
                       max_args=4)
    experiments.main(["listops-long", "--candidates", "--out", str(out), "--docs", str(tmp_path / "docs"),
                      "--extra", "--max-steps", "4", "--eval-every", "2", "--batch-size", "8", "--block-size", "8"])
    printed = [line for line in capfd.readouterr().out.splitlines() if line.startswith("$ ")]
    assert len(printed) == len(experiments.LONG_CANDIDATES)
    assert all("--attention hst" in line and "--eval-shift" not in line for line in printed)
    table = open(tmp_path / "docs" / "results_listops_long_candidates.md").read().splitlines()
    assert table[0] == "| step | " + " | ".join(experiments.LONG_CANDIDATES) + " |"
    for step, row in zip((2, 4), table[2:4]):
        accs = []
        for name in experiments.LONG_CANDIDATES:
            log = experiments.read_jsonl(str(out / f"listops-long-candidate-{name}-s0" / "log.jsonl"))
            accs.append(f"{100 * next(r['dev']['dev']['acc'] for r in log if r.get('step') == step and 'dev' in r):.1f}")
        assert row == f"| {step} | " + " | ".join(accs) + " |"


def test_attendout_ablation_rows_carry_their_own_mask_and_tail(tiny_grid, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tiny_grid / "runs-ablation"
    run_grid(tiny_grid, ["attendout-ablation", "--out", str(out), "--variants", "standard", "logit", "capped"], capfd)
    raw = json.load(open(tiny_grid / "docs" / "results_attendout_ablation_sst2.json"))["sst2-lowres"]
    table = open(tiny_grid / "docs" / "results_attendout_ablation_sst2.md").read()
    for row, bound in (("logit", 1.0), ("capped", 2.0)):       # each row ran its own form, whatever the default
        for s in (0, 1):
            args = json.load(open(out / f"sst2-lowres-{row}-s{s}" / "final.json"))["config"]
            assert args["gnet_mask"] == row
        logs = [[json.loads(line) for line in open(out / f"sst2-lowres-{row}-s{s}" / "droprates.jsonl")]
                for s in (0, 1)]
        assert raw[row]["max_row_sum"] == max(x for log in logs for r in log for x in r["max_row_sum"])
        assert 0.99 < raw[row]["max_row_sum"] <= bound + 1e-5
        final = [sum(log[-1]["drop_rate"][0] for log in logs) / 2]          # one layer: mean over seeds
        assert raw[row]["final_rates"] == pytest.approx(final)
        assert f"| sst2 | {row}" in table
    assert "max_pi" not in raw["standard"] and "| sst2 | standard | " in table
    # the contrasts between rows, paired by seed: capped - logit, the one whose two rows ran (row B - row A)
    d = [100 * (c - l) for l, c in zip(raw["logit"]["acc"], raw["capped"]["acc"])]
    mean, half = sum(d) / 2, 12.706 * abs(d[0] - d[1]) / 2 ** 0.5 / 2 ** 0.5    # sd of two = |d0 - d1| / sqrt 2
    assert f"| sst2-lowres | capped - logit | {mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}] |" in table
    contrasts = [line for line in table.splitlines() if line.startswith("| sst2-lowres | ")]
    assert len(contrasts) == 1                                  # a contrast needs both of its rows in the grid


def test_attendout_probe_writes_its_table(tiny_grid, capfd):
    experiments.main(["attendout-probe", "--init", str(tiny_grid / "init" / "ckpt_last.pt"), "--data-root",
                      str(tiny_grid / "data"), "--datasets", "sst2", "--docs", str(tiny_grid / "docs")])
    text = open(tiny_grid / "docs" / "probe_attendout_sst2.md").read()
    for name in ("standard", "attendout, logit", "attendout, capped", "attendout, inverted"):
        assert f"| {name} | " in text
    assert "| 1 | " in text                                                  # the one layer's attention rows


def test_attendout_trained_probe_sees_standard_dropout_in_a_uniform_g_net(tiny_grid, capfd):
    """A G-Net that never learned (--gnet-lr 0: pi = p0 on every pair) under the capped form is standard dropout
    at p0, so the probe must measure it as such: drop rate p0 on all keys and on each row's largest key alike,
    the noise of standard dropout (ratio 1), rows summing to 1 on average, at most 1 / (1 - p0) each."""
    import train
    run = tiny_grid / "uniform-gnet"
    train.main(["--task", "tsv", "--data", str(tiny_grid / "data" / "sst2"), "--text-col", "1", "--label-col", "0",
                "--init", str(tiny_grid / "init" / "ckpt_last.pt"), "--max-steps", "1", "--batch-size", "16",
                "--attn-dropout", "attendout", "--gnet-mask", "capped", "--gnet-lr", "0", "--out", str(run)])
    capfd.readouterr()
    sums = experiments.main(["attendout-trained-probe", "--init", str(run / "ckpt_last.pt"), "--data-root",
                             str(tiny_grid / "data"), "--datasets", "sst2", "--docs", str(tiny_grid / "docs"),
                             "--out", str(tiny_grid / "probe-out")])
    text = open(tiny_grid / "docs" / "probe_attendout_trained_sst2.md").read()
    row = next(line for line in text.splitlines() if line.startswith("| 1 | ")).split(" | ")
    rate, top, noise, noise_at_rate, mean_sum, max_sum = (float(x.strip(" |")) for x in row[1:])
    assert sum(sums["pairs"]) > 20_000                           # enough pairs for the tolerances below
    assert rate == pytest.approx(0.1, abs=0.01) and top == pytest.approx(0.1, abs=0.02)
    assert noise == pytest.approx(1.0, abs=0.06) and noise_at_rate == pytest.approx(1.0, abs=0.06)
    assert mean_sum == pytest.approx(1.0, abs=0.01) and max_sum <= 1 / 0.9 + 1e-3
    change = {line.split(" | ")[0][2:]: float(line.split(" | ")[1].strip(" |")) for line in text.splitlines()
              if line.startswith(("| AttendOut", "| plain", "| standard"))}
    assert set(change) == {"AttendOut (trained G-Net)", "plain dropout at the G-Net's layer rates", "standard dropout 0.1"}
    # plain dropout at the measured rate (~0.1) and at 0.1 draw nearly the same masks from the same seeds
    assert change["plain dropout at the G-Net's layer rates"] == pytest.approx(change["standard dropout 0.1"], rel=0.1)
    with pytest.raises(SystemExit):                              # a checkpoint without a G-Net: one error line
        experiments.main(["attendout-trained-probe", "--init", str(tiny_grid / "init" / "ckpt_last.pt"),
                          "--data-root", str(tiny_grid / "data"), "--datasets", "sst2", "--docs", str(tiny_grid / "docs"),
                          "--out", str(tiny_grid / "probe-out")])
    assert "needs the checkpoint of a dense AttendOut run" in capfd.readouterr().err


def test_variants_pick_rows_and_candidates_by_name(tmp_path, capfd, monkeypatch):
    """--variants: only the named rows (listops-long --candidates: only the named model sizes), in the table's
    order; a name that is no row, or a grid without its baseline row, is one error line before anything runs."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "long"
    data.write_listops(str(out / "listops-long-data"), 16, 8, 2, min_len=20, max_len=60, seed=0, max_depth=3,
                       max_args=4)
    experiments.main(["listops-long", "--candidates", "--variants", "2x128", "2x64", "--out", str(out), "--dry-run"])
    printed = [line for line in capfd.readouterr().out.splitlines() if line.startswith("$ ")]
    assert [line.split("--out ")[1].split()[0] for line in printed] == [
        str(out / f"listops-long-candidate-{name}-s0") for name in ("2x64", "2x128")]
    experiments.main(["listops-long", "--variants", "hst", "hst+sar", "--out", str(out), "--seeds", "0", "--dry-run"])
    printed = [line for line in capfd.readouterr().out.splitlines() if line.startswith("$ ")]
    assert [line.split("--out ")[1].split()[0] for line in printed] == [
        str(out / f"listops-long-{name}-s0") for name in ("hst", "hst_sar")]
    for variants, says in ((["hst", "hst+sra"], "--variants hst+sra: not a row of listops-long"),
                           (["sparse", "hst+sar"], "--variants: the baseline row hst must be among them")):
        with pytest.raises(SystemExit) as e:
            experiments.main(["listops-long", "--variants", *variants, "--out", str(out), "--seeds", "0"])
        assert e.value.code == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert sorted(os.listdir(out)) == ["listops-long-data"]                 # nothing ran


def test_shift_probe_scores_the_shift_train_py_scores(tmp_path):
    """experiments.shift_effects on a random HST model (its answers depend on the topology): at every shift its
    accuracy is the task evaluation's under --eval-shift s (tasks.classification_evaluate, shift_by=s), some
    predictions change, and no more accuracy moves than predictions change."""
    import torch
    import model
    import tasks
    from helpers import train_args
    data.write_listops(str(tmp_path), 8, 48, 2, min_len=20, max_len=60, seed=0, max_depth=3, max_args=4)
    tok = tasks.fixed_tokenizer("listops")
    task = tasks.load_task("listops", str(tmp_path), tok, max_len=64)
    torch.manual_seed(0)
    net = model.Model(model.Config(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                                   intermediate_size=64, max_positions=80, pad_id=tok.pad_id, num_labels=10,
                                   attention="hst", block_size=8, window=1, num_global=1, num_random=1)).eval()
    with torch.no_grad():                           # std 0.02 -> 0.3: answers that depend on the input (and topology)
        for p in net.parameters():
            if p.dim() == 2:
                p.mul_(15)
    effects = experiments.shift_effects(net, experiments.data_batches(task.dev["dev"], 16, tok.pad_id), [1, 2, 4, 6])
    args = train_args("--batch-size", "16")
    for s in (0, 1, 2, 4, 6):
        assert effects[str(s)]["acc"] == pytest.approx(
            tasks.classification_evaluate(net, task, args, torch.device("cpu"), tok, shift_by=s)["dev"]["acc"])
    assert any(effects[s]["flip"] > 0 and effects[s]["kl"] > 0 for s in ("1", "2", "4", "6"))
    assert all(effects[s]["flip"] >= abs(effects[s]["acc"] - effects["0"]["acc"]) - 1e-9 for s in ("1", "2", "4", "6"))


def test_operator_shortcut_by_hand():
    """ListOps' one-token shortcut: the outermost operator is the first operator token (right after [CLS]);
    the rule maps it to its most frequent label; the share counts predictions that are a function of it."""
    from vocab import ListOpsTokenizer
    tok = ListOpsTokenizer()
    ids = tok.encode_plus("( ( [MAX 4 ( [MIN 2 7 ] ) ] )")[0]
    assert experiments.outermost_operator(ids) == tok.vocab["[MAX"]
    mx, mn = tok.vocab["[MAX"], tok.vocab["[MIN"]
    ex = [data.Example([2, op], None, y) for op, y in ((mx, 9), (mx, 9), (mx, 3), (mn, 0))]
    assert experiments.operator_rule(ex) == {mx: 9, mn: 0}
    assert experiments.operator_share([9, 9, 3, 0, 1, 1], [mx, mx, mx, mn, mn, mn]) == 4 / 6
    assert experiments.operator_share([9, 9, 0, 0], [mx, mx, mn, mn]) == 1.0
