"""Tests of research/experiments.py: its statistics by hand, the subsample, the ListOps shortcut, the shift probe
against train.py's own shifted scores, and each grid end to end on a tiny model (real train.py runs, 2-3 s each).

Run: python -m pytest -q research/tests/test_experiments.py
"""
import json
import math
import os
import random

import pytest
import torch

import data
import experiments
import model
import train


def test_paired_ci_by_hand():
    # baseline 80, 82, 81; method 83, 84, 82  ->  d = 3, 2, 1: mean 2, sd 1, se 1/sqrt(3), t_{0.975,2} = 4.303
    m, h = experiments.paired_ci([80.0, 82.0, 81.0], [83.0, 84.0, 82.0])
    assert m == pytest.approx(2.0) and h == pytest.approx(4.303 / math.sqrt(3))
    assert experiments.fmt_diff([0.80, 0.82, 0.81], [0.83, 0.84, 0.82]) == "+2.0 [-0.5, +4.5]"
    # pairing matters: a constant shift has sd 0, however spread the seeds are
    assert experiments.paired_ci([70.0, 90.0, 80.0], [71.0, 91.0, 81.0]) == (pytest.approx(1.0), pytest.approx(0.0))
    xs = [0.8, 0.9]
    assert experiments.fmt_diff(xs, xs) == "(baseline)"
    assert experiments.fmt_diff([0.80], [0.83]) == "+3.0 (one seed: no interval)"
    with pytest.raises(ValueError):
        experiments.paired_ci([1.0], [2.0])                          # one seed: no interval
    with pytest.raises(ValueError):
        experiments.paired_ci([1.0, 2.0], [2.0])                     # unpaired lengths
    # t_{0.975, df} from any table; beyond 30 the normal quantile
    assert [experiments.t975(df) for df in (1, 4, 9, 30, 100)] == [12.706, 2.776, 2.262, 2.042, 1.960]


def test_subsample_is_fixed(tmp_path):
    src = tmp_path / "train.tsv"
    lines = [f"{i % 2}\tsentence number {i}\n" for i in range(50)]
    src.write_text("".join(lines) + "\n")                            # a trailing blank line is not an example
    out = str(tmp_path / "sub" / "train-10.tsv")
    experiments.write_subsample(str(src), 10, 0, out)
    expect = list(lines)
    random.Random(0).shuffle(expect)
    assert open(out).read() == "".join(expect[:10])
    experiments.write_subsample(str(src), 10, 1, out)                # another seed, another subsample
    assert open(out).read() != "".join(expect[:10])
    experiments.write_subsample(str(src), 100, 0, out)               # n larger than the file: all of it
    assert sorted(open(out).readlines()) == sorted(lines)


def test_operator_shortcut_and_window_change_by_hand():
    """ListOps' one-token shortcut: the outermost operator is the first operator token (right after [CLS]); the
    rule maps it to its commonest label; the share counts predictions that are a function of it."""
    tok = data.ListOpsTokenizer()
    ids = tok.encode_plus("( ( [MAX 4 ( [MIN 2 7 ] ) ] )")[0]
    mx, mn = tok.vocab["[MAX"], tok.vocab["[MIN"]
    assert experiments.outermost_operator(ids) == mx
    ex = [data.Example([2, op], None, y) for op, y in ((mx, 9), (mx, 9), (mx, 3), (mn, 0))]
    assert experiments.operator_rule(ex) == {mx: 9, mn: 0}
    assert experiments.operator_share([9, 9, 3, 0, 1, 1], [mx, mx, mx, mn, mn, mn]) == 4 / 6
    assert experiments.operator_share([9, 9, 0, 0], [mx, mx, mn, mn]) == 1.0
    # b = 4, s = 2: offsets 0, 1 keep their block (window moves 2), 2, 3 move on (window moves 2): 2 of 12 keys
    assert experiments.window_change(2, 4) == pytest.approx(2 / 12)
    assert experiments.probe_shifts(32) == [1, 8, 16, 24]


def test_shift_probe_scores_the_shift_train_py_scores(tmp_path):
    """experiments.shift_effects on a random HST model (its answers depend on the topology): at every shift its
    accuracy is train.py's evaluation under --eval-shift s (train.objective's evaluate, shift_by=s), some
    predictions change, and no more accuracy moves than predictions change."""
    data.write_listops(str(tmp_path), 8, 48, 2, min_len=20, max_len=60, seed=0, max_depth=3, max_args=4)
    tok = data.fixed_tokenizer("listops")
    task = data.load_task("listops", str(tmp_path), tok, max_len=64)
    torch.manual_seed(0)
    net = model.Model(model.Config(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                                   intermediate_size=64, max_positions=80, pad_id=tok.pad_id, num_labels=10,
                                   attention="hst", block_size=8, window=1, num_global=1, num_random=1)).eval()
    with torch.no_grad():                           # std 0.02 -> 0.3: answers that depend on the input (and topology)
        for p in net.parameters():
            if p.dim() == 2:
                p.mul_(15)
    effects = experiments.shift_effects(net, experiments.data_batches(task.dev["dev"], 16, tok.pad_id), [1, 2, 4, 6])
    args, (_, evaluate) = train.parse_args(["--task", "listops", "--batch-size", "16"]), train.objective("listops")
    for s in (0, 1, 2, 4, 6):
        score = evaluate(net, task, args, torch.device("cpu"), tok, shift_by=s)["dev"]["acc"]
        assert effects[str(s)]["acc"] == pytest.approx(score)
    shifted = ("1", "2", "4", "6")
    assert any(effects[s]["flip"] > 0 and effects[s]["kl"] > 0 for s in shifted)
    assert all(effects[s]["flip"] >= abs(effects[s]["acc"] - effects["0"]["acc"]) - 1e-9 for s in shifted)


# -----------------------------------------------------------------------------
# The grids end to end, on tiny models and data (the grids call `python train.py`, one process a run)

def commands(capfd):
    """The runs' folders, in the order the grid printed their commands."""
    lines = capfd.readouterr().out.splitlines()
    return [line.split("--out ")[1].split()[0] for line in lines if line.startswith("$ ")]


def test_listops_long_grid_and_probe_end_to_end(tmp_path, capfd):
    """listops-long on tiny data (already in OUT/listops-long-data, so the grid uses it) and a tiny model
    (--extra wins over the grid's flags), one seed (the attendout grid's test pairs seeds): --dry-run prints the
    unfinished runs only; every shift in the table's columns; resumable. Then the probe on the same weights."""
    out, tables = tmp_path / "long", tmp_path / "tables"
    data.write_listops(str(out / "listops-long-data"), 48, 12, 2, min_len=20, max_len=60, seed=0, max_depth=3,
                       max_args=4)
    argv = ["listops-long", "--out", str(out), "--seeds", "0", "--tables", str(tables), "--variants", "hst",
            "dense", "--extra=--layers 1 --hidden 16 --heads 2 --ffn 32 --max-steps 3 --batch-size 8 --block-size 8 "
            "--lr 1e-2"]
    experiments.main(argv[:1] + ["--dry-run"] + argv[1:])
    dry = commands(capfd)
    assert dry == [str(out / f"listops-long-{v}-s0") for v in ("hst", "dense")]
    assert not os.path.exists(out / "listops-long-hst-s0")
    experiments.main(argv)
    assert commands(capfd) == dry
    raw = json.load(open(tables / "results_listops_long.json"))
    dev = json.load(open(out / "listops-long-hst-s0" / "final.json"))["dev_splits"]["dev"]
    assert raw["hst"]["acc_by_shift"][0] == [dev["acc"]] + [dev["shift"]["by"][str(i)]["acc"] for i in range(1, 8)]
    assert raw["hst"]["acc_shift_worst"][0] == min(dev["shift"]["by"][str(i)]["acc"] for i in range(1, 8))
    assert raw["hst"]["shift_drop"][0] == dev["acc"] - dev["shift"]["mean"]["acc"]
    assert len(raw["dense"]["acc_by_shift"][0]) == 2                      # dense: s = 1 alone
    table = open(tables / "results_listops_long.md").read()
    diff = experiments.fmt_diff(raw["hst"]["acc"], raw["dense"]["acc"])
    dense = next(line for line in table.splitlines() if line.startswith("| dense "))     # --extra's flags shown
    assert dense.startswith("| dense (ran with ") and "--max-steps 3" in dense and "--layers 1" in dense
    assert f") | {experiments.fmt(raw['dense']['acc'])} | {100 * raw['dense']['acc'][0]:.1f} | " in dense
    assert f"| {diff} | " in table and "(baseline)" in table
    assert "Command: `python research/experiments.py listops-long --out" in table
    experiments.main(argv)                                                   # resumable: nothing runs again
    assert commands(capfd) == [] and open(tables / "results_listops_long.md").read() == table
    # the probe: the same final weights and shifts as train.py's own scores; dense is left out (no boundary)
    probe_argv = ["listops-long-probe", "--out", str(out), "--seeds", "0", "--tables", str(tables),
                  "--variants", "hst", "dense"]
    experiments.main(probe_argv)
    probe = json.load(open(tables / "results_listops_long_shift_probe.json"))
    assert list(probe) == ["hst"]
    effects = probe["hst"][0]
    assert list(effects) == ["0", "1", "2", "4", "6"]                        # b = 8: 1, b/4, b/2, 3b/4
    assert 0 < effects["0"]["by_operator"] <= 1 and effects["0"]["acc"] == pytest.approx(dev["acc"])
    for sh in ("1", "2", "4", "6"):
        assert effects[sh]["acc"] == pytest.approx(dev["shift"]["by"][sh]["acc"])
    kept = out / "listops-long-hst-s0" / "shift_probe.json"                  # a run is probed once ...
    effects = json.load(open(kept))
    effects["0"]["by_operator"] = 0.125
    json.dump(effects, open(kept, "w"))
    experiments.main(probe_argv)
    assert json.load(open(tables / "results_listops_long_shift_probe.json"))["hst"][0]["0"]["by_operator"] == 0.125
    os.utime(kept, (0, 0))                                                   # ... unless its checkpoint is newer
    experiments.main(probe_argv)
    assert json.load(open(tables / "results_listops_long_shift_probe.json"))["hst"][0]["0"]["by_operator"] != 0.125


def test_candidates_and_variants(tmp_path, capfd):
    """--candidates: a learning curve per chosen size, read from its log.jsonl; --variants picks rows in the
    table's order; a name that is no row, or a grid without its baseline row, is one error line, nothing run."""
    out, tables = tmp_path / "long", tmp_path / "tables"
    data.write_listops(str(out / "listops-long-data"), 32, 8, 2, min_len=20, max_len=60, seed=0, max_depth=3,
                       max_args=4)
    experiments.main(["listops-long", "--candidates", "--variants", "4x64", "2x64", "--out", str(out), "--dry-run"])
    assert commands(capfd) == [str(out / f"listops-long-candidate-{n}-s0") for n in ("2x64", "4x64")]
    experiments.main(["listops-long", "--candidates", "--variants", "2x64", "--out", str(out), "--tables", str(tables),
                      "--extra=--max-steps 4 --eval-every 2 --batch-size 8 --block-size 8"])
    log = experiments.read_jsonl(str(out / "listops-long-candidate-2x64-s0" / "log.jsonl"))
    table = open(tables / "results_listops_long_candidates.md").read().splitlines()
    assert table[0] == "| step | 2x64 |"
    for step, row in zip((2, 4), table[2:4]):
        acc = next(r["dev"]["dev"]["acc"] for r in log if r["step"] == step and "dev" in r)
        assert row == f"| {step} | {100 * acc:.1f} |"
    capfd.readouterr()
    for variants, says in ((["hst", "hst+sra"], "--variants hst+sra: not a row of listops-long"),
                           (["sparse", "hst+sar"], "--variants: the baseline row hst must be among them")):
        with pytest.raises(SystemExit) as e:
            experiments.main(["listops-long", "--variants", *variants, "--out", str(out), "--seeds", "0"])
        err = capfd.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert sorted(os.listdir(out)) == ["listops-long-candidate-2x64-s0", "listops-long-candidate-2x64-s0.log",
                                       "listops-long-data"]


def write_sentences(folder, n_train, n_dev, seed):
    """label<TAB>sentence, no header (the layout of SST-2 / MR here): label 1 iff 'zebra' is in it."""
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
def tiny_init(tmp_path_factory):
    """A data root with sst2/ (64 training sentences) and a tiny 'pretrained' checkpoint, trained from scratch on
    400 other sentences of the same task until it has learned it, so that the grids' short runs end at different
    accuracies for different seeds (its ckpt_last.pt carries the model and its tokenizer, as a converted one)."""
    root = tmp_path_factory.mktemp("grid")
    write_sentences(str(root / "pretrain"), 400, 8, seed=1)
    write_sentences(str(root / "data" / "sst2"), 64, 80, seed=0)
    train.main(["--task", "tsv", "--data", str(root / "pretrain"), "--text-col", "1", "--label-col", "0",
                "--init", "scratch", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--device", "cpu",
                "--vocab-size", "36", "--max-steps", "50", "--batch-size", "16", "--lr", "3e-3", "--warmup", "10",
                "--attention", "dense", "--attn-dropout", "none", "--sar", "0", "--hidden-dropout-p", "0",
                "--eval-every", "0", "--out", str(root / "init")])
    return root


def run_grid(root, argv, capfd, seeds=("0", "1")):
    experiments.main([*argv, "--init", str(root / "init" / "ckpt_last.pt"), "--data-root", str(root / "data"),
                      "--datasets", "sst2", "--seeds", *seeds, "--tables", str(root / "tables"),
                      "--extra=--lr 1e-2 --log-every 1"])   # 6 steps a run: seeds must matter
    return commands(capfd)


def test_attendout_grid_pairs_seeds_and_replays_the_same_seed(tiny_init, capfd):
    out = tiny_init / "runs-attendout"
    argv = ["pretrained-attendout", "--out", str(out), "--variants", "standard", "attendout", "scheduled"]
    runs = run_grid(tiny_init, argv, capfd)
    assert [os.path.basename(r) for r in runs] == [f"sst2-lowres-{v}-s{s}" for s in (0, 1)       # seed-major
                                                   for v in ("standard", "attendout", "scheduled")]
    finals = {os.path.basename(r): json.load(open(os.path.join(r, "final.json"))) for r in runs}
    for s in (0, 1):                          # scheduled replays the AttendOut run of its own seed
        args = finals[f"sst2-lowres-scheduled-s{s}"]["args"]
        assert args["schedule"] == str(out / f"sst2-lowres-attendout-s{s}" / "droprates.jsonl")
        assert args["seed"] == s and args["train_file"].startswith(str(out / "subsample"))
    raw = json.load(open(tiny_init / "tables" / "results_pretrained_attendout_sst2.json"))["sst2-lowres"]
    assert len(set(raw["attendout"])) == 2        # the seeds differ, so a wrong pairing would show below
    for v in ("standard", "attendout", "scheduled"):       # each row lists its seeds' accuracies, in seed order
        assert raw[v] == [finals[f"sst2-lowres-{v}-s{s}"]["acc"] for s in (0, 1)]
    table = open(tiny_init / "tables" / "results_pretrained_attendout_sst2.md").read()
    contrast = experiments.fmt_diff(raw["scheduled"], raw["attendout"])
    assert f"| sst2-lowres | attendout - scheduled | {contrast} |" in table
    assert f"| sst2 | lowres | attendout (ran with --lr 0.01 --log-every 1) | {experiments.fmt(raw['attendout'])} | " \
           f"{experiments.fmt_diff(raw['standard'], raw['attendout'])} |" in table and "(baseline)" in table
    final = json.load(open(tiny_init / "tables" / "droprates_pretrained_sst2_final.json"))["sst2-lowres"]
    last = [json.loads(open(out / f"sst2-lowres-attendout-s{s}" / "droprates.jsonl").readlines()[-1])
            for s in (0, 1)]                  # each attendout run's masking rates at its last step
    assert all(rec["step_frac"] == 1.0 and len(rec["drop_rate"]) == 1 for rec in last)
    assert final == [round((last[0]["drop_rate"][0] + last[1]["drop_rate"][0]) / 2, 3)]   # one layer, mean of seeds
    assert 0 < final[0] < 1                   # the G-Net masks some of the real pairs, not none and not all
    assert not os.path.exists(out / "sst2-lowres-standard-s0" / "ckpt_last.pt")      # checkpoints dropped
    assert run_grid(tiny_init, argv, capfd) == []                            # resumable: nothing runs again
    assert open(tiny_init / "tables" / "results_pretrained_attendout_sst2.md").read() == table


def test_sparse_grid_scores_every_shift_of_the_final_weights(tiny_init, capfd):
    out = tiny_init / "runs-sparse"
    runs = run_grid(tiny_init, ["pretrained-sparse", "--out", str(out), "--variants", "hst"], capfd, ("0",))
    assert [os.path.basename(r) for r in runs] == ["sst2-lowres-hst-s0"]
    raw = json.load(open(tiny_init / "tables" / "results_pretrained_sparse_sst2.json"))["sst2-lowres"]
    final = json.load(open(out / "sst2-lowres-hst-s0" / "final.json"))
    dev = final["dev_splits"]["dev"]
    assert final["config"]["attention"] == "hst" and final["config"]["block_size"] == 8   # dense init, hst rows
    assert list(dev["shift"]["by"]) == [str(i) for i in range(1, 8)]         # b = 8: s = 1 .. 7
    assert raw["hst"]["acc_by_shift"][0] == [dev["acc"]] + [dev["shift"]["by"][str(i)]["acc"] for i in range(1, 8)]
    assert raw["hst"]["changed"] == ["--lr 0.01 --log-every 1"]                   # --extra's flags, as run
    assert "| sst2 | lowres | hst (ran with --lr 0.01 --log-every 1) | " in open(tiny_init / "tables" / "results_pretrained_sparse_sst2.md").read()
    assert not os.path.exists(out / "sst2-lowres-hst-s0" / "ckpt_last.pt")       # checkpoints dropped


def test_mean_logged_averages_the_step_lines_only(tmp_path):
    # gnet-lr's consistency column: the mean over log.jsonl's step lines; the dev lines lack the key
    lines = [{"step": 10, "mask_consistency": 0.002}, {"step": 20, "mask_consistency": 0.004},
             {"step": 20, "dev": {"dev": {"acc": 0.5}}}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert experiments.mean_logged(str(tmp_path), "mask_consistency") == pytest.approx(0.003)
