"""Tests of train.py: a tiny end-to-end run that learns, masked-LM, the flags, the input checks.

Tiny models (1 layer, d = 32) on tiny generated data in tmp_path; most runs call train.main in-process
(one thread, restored afterwards), one input check runs as a real subprocess.
Run: python -m pytest tests/test_train.py -q
"""
import json
import os
import random
import re
import shlex
import subprocess
import sys
import types

import pytest
import torch

import data
import train
from helpers import train_args
from model import load_pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a tiny dense model with standard dropout and no SAR (the defaults are the demo's: HST, AttendOut, SAR), on the
# CPU also on a GPU machine (--device auto would pick CUDA: bf16, other kernels, no "CPU thread(s)" line)
TINY = ["--init", "scratch", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--attention", "dense",
        "--attn-dropout", "standard", "--sar", "0", "--device", "cpu"]




def run_main(argv, capfd):
    """train.main in-process -> (exit code, stdout, stderr lines that are not blank)."""
    try:
        train.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]


def write_zebra_tsv(folder, n_train=400, n_dev=100, seed=0, dev_labels=None):
    """A learnable toy task: label 1 iff the word 'zebra' appears (40% of the lines)."""
    rng = random.Random(seed)
    words = "apple river stone cloud green table music paper light water horse dream".split()
    os.makedirs(folder, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        with open(os.path.join(folder, name), "w") as f:
            f.write("text\tlabel\n")
            for i in range(n):
                toks = [rng.choice(words) for _ in range(rng.randint(4, 10))]
                y = int(rng.random() < 0.4)
                if y:
                    toks[rng.randrange(len(toks))] = "zebra"
                label = dev_labels[i % len(dev_labels)] if name == "dev.tsv" and dev_labels else y
                f.write(" ".join(toks) + f"\t{label}\n")
    return folder


def tsv_args(folder, out):
    return ["--task", "tsv", "--data", folder, "--text-col", "text", "--label-col", "label", "--vocab-size", "36",
            "--out", str(out), *TINY]


def listops_args(folder, out, steps=1):
    return ["--task", "listops", "--data", folder, "--out", str(out), "--max-steps", str(steps),
            "--batch-size", "8", *TINY]


def read_log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


# -----------------------------------------------------------------------------
# evaluation

@pytest.mark.parametrize("attention", ["dense", "sparse", "hst"])
def test_evaluation_in_length_order_scores_as_one_example_at_a_time(attention):
    """The classifier's evaluation (train.evaluate) batches the dev set longest first (data.longest_first); its scores must equal those of a
    pass with batch size 1, where no example has padding beside it. A regression head: its Pearson and
    Spearman correlations move with any change of a score or any score paired with the wrong label."""
    from types import SimpleNamespace
    from model import Config, Model
    torch.manual_seed(0)
    model = Model(Config(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48,
                         max_positions=80, pad_id=1, num_labels=1, attention=attention, block_size=4,
                         hidden_dropout_p=0.0, attn_dropout_p=0.0))
    with torch.no_grad():   # wider than BERT's 0.02 init, so the scores spread and the correlations are not noise
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    rng = random.Random(0)
    dev = [data.Example([0] + [rng.randrange(3, 40) for _ in range(rng.randint(2, 30))] + [2], None, rng.random())
           for _ in range(40)]
    task = data.TaskData([], {"dev": dev}, 1, True, "pearson", [])
    tok = SimpleNamespace(pad_id=1)                  # all the evaluation reads of a tokenizer
    for shift in ([0, 1] if attention != "dense" else [0]):
        one = train.evaluate(model, task, train_args("--task", "stsb", "--batch-size", "1"), torch.device("cpu"), tok, shift)
        batched = train.evaluate(model, task, train_args("--task", "stsb", "--batch-size", "16"), torch.device("cpu"), tok, shift)
        for k in ("pearson", "spearman"):
            assert batched["dev"][k] == pytest.approx(one["dev"][k], abs=1e-6), (shift, k)


def test_console_shows_each_metric_in_its_unit():
    """Fractions in percent (accuracy, F1), SQuAD's percent as it is, the others as numbers; a shifted
    evaluation's mean and worst after a bar."""
    shifted = {"by": {"1": {"acc": 0.8}}, "mean": {"acc": 0.829}, "worst": {"acc": 0.821}}
    assert data.show_metrics("sst2", {"acc": 0.834, "shift": shifted}) == "acc 83.4% | shifted mean acc 82.9% worst acc 82.1%"
    assert data.show_metrics("mrpc", {"f1": 0.9, "acc": 0.85}) == "f1 90.0%, acc 85.0%"
    assert data.show_metrics("cola", {"mcc": 0.512, "acc": 0.8}) == "mcc 0.5120, acc 80.0%"
    assert data.show_metrics("squad", {"em": 71.25, "f1": 80.5, "questions": 8}) == "em 71.2%, f1 80.5%, questions 8"
    assert data.show_metrics("mlm", {"loss": 2.34567, "ppl": 10.4}) == "loss 2.3457, ppl 10.4000"


def test_shifted_evaluation_scores_every_shift():
    """--eval-shift all scores every shift s = 1 .. b-1 (dense: s = 1 alone); sar.add_shifted's mean and worst are
    over those evaluations (worst: the lowest of a score, the highest of a loss); counts are not averaged."""
    import sar
    assert sar.eval_shifts("all", True, 4) == [1, 2, 3] and sar.eval_shifts("all", False, 4) == [1]
    assert sar.eval_shifts(2, True, 4) == [2] and sar.eval_shifts(0, True, 4) == []
    by = {s: {"dev": {"acc": 0.9 - 0.1 * s ** 2, "loss": 1.0 + s, "questions": 8}} for s in (1, 2, 3)}
    metrics = {"dev": {"acc": 0.5}}
    sar.add_shifted(metrics, by)
    shift = metrics["dev"]["shift"]
    assert list(shift["by"]) == ["1", "2", "3"]
    assert shift["mean"] == {"acc": pytest.approx(1.3 / 3), "loss": pytest.approx(3.0)}
    assert shift["worst"]["acc"] == pytest.approx(0.0) and shift["worst"]["loss"] == 2.0
    sar.add_shifted(metrics, by, lower_is_better=True)
    assert metrics["dev"]["shift"]["worst"]["loss"] == 4.0


def check_eval_shift_all(argv, out, capfd, shifts, metric, worst=min):
    """train.py with --eval-shift all against the same run without it (evaluating after every step): each
    evaluation in log.jsonl and final.json holds every shift s in `shifts`, with their mean and worst, and
    its numbers on the original topology, like the training losses after it, are the plain run's (the
    perturbed evaluations change nothing else). worst: max where lower is better (masked LM's loss). Returns the
    --eval-shift all run's final.json."""
    finals, evals, losses = {}, {}, {}
    for name, extra in (("plain", []), ("all", ["--eval-shift", "all"])):
        code, stdout, err = run_main([*argv, "--out", str(out / name), "--eval-every", "1", "--log-every", "1",
                                      "--lr", "1e-2", *extra], capfd)
        assert code == 0 and err == [], err
        finals[name] = json.loads((out / name / "final.json").read_text())
        evals[name] = [r["dev"] for r in read_log(out / name) if "dev" in r]
        losses[name] = [r["loss"] for r in read_log(out / name) if "loss" in r]
    assert "| shifted mean " in stdout
    assert losses["all"] == losses["plain"] and len(losses["all"]) >= 2
    assert len(evals["all"]) == len(evals["plain"]) >= 2 and finals["all"]["dev_splits"] == evals["all"][-1]
    for dev, plain in zip(evals["all"], evals["plain"]):
        for split, m in dev.items():
            shifted = m.pop("shift")
            assert m == plain[split]                                       # the original topology: unchanged
            assert list(shifted["by"]) == [str(s) for s in shifts]
            by = [v[metric] for v in shifted["by"].values()]
            assert shifted["mean"][metric] == pytest.approx(sum(by) / len(by))
            assert shifted["worst"][metric] == worst(by)
    return finals["all"]


def test_eval_shift_all_on_tsv_listops_and_mlm(listops_dir, tmp_path, capfd):
    folder = write_zebra_tsv(str(tmp_path / "zebra"), n_train=40, n_dev=20)
    tsv = tsv_args(folder, tmp_path / "x") + ["--max-steps", "2", "--batch-size", "8", "--attention", "hst",
                                              "--block-size", "4"]
    check_eval_shift_all(tsv, tmp_path / "tsv", capfd, range(1, 4), "acc")
    listops = listops_args(listops_dir, tmp_path / "x", steps=2) + ["--attention", "sparse", "--block-size", "8",
                                                                   "--num-random", "1"]
    check_eval_shift_all(listops, tmp_path / "listops", capfd, range(1, 8), "acc")
    (tmp_path / "text").mkdir()
    for name in ("train.txt", "dev.txt"):
        (tmp_path / "text" / name).write_text("the cat sat on the mat by the door\na dog ran to the red house\n" * 10)
    mlm = ["--task", "mlm", "--data", str(tmp_path / "text"), "--vocab-size", "24", *TINY, "--max-steps", "2",
           "--batch-size", "8", "--attention", "hst", "--block-size", "4"]
    final = check_eval_shift_all(mlm, tmp_path / "mlm", capfd, range(1, 4), "loss", worst=max)
    dev = final["dev_splits"]["dev"]
    assert set(dev["shift"]["worst"]) == {"loss", "ppl"}
    assert all(m["loss"] != dev["loss"] for m in dev["shift"]["by"].values())    # a continuous score: the shift moved it


# -----------------------------------------------------------------------------
# end to end

def test_tsv_run_learns_and_writes_its_files(tmp_path, capfd):
    folder = write_zebra_tsv(str(tmp_path / "zebra"))
    out = tmp_path / "run"
    code, stdout, err = run_main(tsv_args(folder, out) + [
        "--max-steps", "120", "--batch-size", "16", "--lr", "3e-3", "--warmup", "10", "--eval-every", "40",
        "--save-every", "40", "--log-every", "10", "--attn-dropout", "none", "--hidden-dropout-p", "0"], capfd)
    assert code == 0, err
    assert err == []
    # the console: one opening line, evaluations as "dev acc 83.4%", the summary in the same units
    lines = stdout.splitlines()
    assert re.fullmatch(r"task tsv: 400 train / 100 dev examples \| model 0\.\d\dM parameters \(1 layers, hidden 32, "
                        r"from scratch\) \| dense attention, no attention dropout \| 120 steps on cpu, 1 CPU thread\(s\) "
                        r"\(--threads\)", lines[0]), lines[0]
    log = read_log(out)
    shown = [line for line in lines if re.fullmatch(r"step \d+: dev acc \d+\.\d%", line)]
    assert shown == [f"step {r['step']}: dev acc {100 * r['dev']['dev']['acc']:.1f}%" for r in log if "dev" in r]
    assert re.fullmatch(r"done in \d+s, 120 steps: dev acc \d+\.\d% at the last step, best \d+\.\d% at step \d+ "
                        r"\(majority-class baseline: acc \d+\.\d%\); results in .*final\.json", lines[-1]), lines[-1]
    losses = [r["loss"] for r in log if "loss" in r]
    evals = [r for r in log if "dev" in r]
    assert [r["step"] for r in log if "loss" in r] == list(range(10, 121, 10))
    assert [r["step"] for r in evals] == [40, 80, 120]
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3          # the loss falls
    final = json.loads((out / "final.json").read_text())
    for key in ("task", "metric", "acc", "dev_split", "dev_splits", "steps", "wall_time_s", "config"):
        assert key in final
    assert final["task"] == "tsv" and final["metric"] == "acc" and final["steps"] == 120
    assert final["dev_splits"] == evals[-1]["dev"] and final["dev_split"] == "dev"
    assert final["acc"] == final["dev_splits"]["dev"]["acc"]                # flat: the first split at the top
    assert final["acc"] > final["majority_baseline"] + 0.2    # beats always-the-majority
    # every setting as it was in force: the G-Nets' rate (the demo's), the flags left to Config recorded
    # with Config's values
    assert final["config"]["gnet_lr"] == 1e-5 and final["args"]["lr"] == 3e-3          # DEMO's
    assert all(final["args"][k] == final["config"][k] for k in train.CONFIG_FLAGS)
    assert final["args"]["window"] == 1 and final["args"]["hidden_dropout_p"] == 0.0      # not given: Config's
    for name in ("ckpt_best.pt", "ckpt_last.pt"):
        model = load_pretrained(str(out / name))
        ckpt = torch.load(out / name, weights_only=True)
        assert all(torch.equal(v, ckpt["model"][k]) for k, v in model.state_dict().items())
        assert model.cfg.num_labels == 2


def test_several_dev_files_are_dev_splits_of_their_own(listops_dir, tmp_path, capfd):
    """--dev-file A B with --task tsv scores each file as a dev split named by its stem, the first
    one at final.json's top ("dev_split", its metrics flat); several dev files with another task
    are one `error:` line naming --dev-file, before anything is read."""
    folder = write_zebra_tsv(str(tmp_path / "zebra"), n_train=40, n_dev=10)
    os.rename(os.path.join(folder, "dev.tsv"), os.path.join(folder, "dev_a.tsv"))
    with open(os.path.join(folder, "dev_a.tsv")) as f:
        head = f.readlines()[:6]                         # the header and 5 rows
    with open(os.path.join(folder, "dev_b.tsv"), "w") as f:
        f.writelines(head)
    dev_files = [os.path.join(folder, name) for name in ("dev_a.tsv", "dev_b.tsv")]
    out = tmp_path / "two"
    argv = tsv_args(folder, out) + ["--dev-file", *dev_files, "--max-steps", "2"]
    code, _, err = run_main(argv + ["--batch-size", "8"], capfd)
    assert code == 0 and err == [], err
    final = json.loads((out / "final.json").read_text())
    assert list(final["dev_splits"]) == ["dev_a", "dev_b"] and final["dev_split"] == "dev_a"
    assert final["acc"] == final["dev_splits"]["dev_a"]["acc"]
    argv = listops_args(listops_dir, tmp_path / "l") + ["--dev-file", *dev_files]
    code, _, err = run_main(argv, capfd)
    assert code == 2 and not (tmp_path / "l").exists()
    only_line(err, "error: --dev-file: 2 files", "only --task tsv scores several dev files")


def test_mlm_runs_and_its_loss_falls(tmp_path, capfd):
    rng = random.Random(0)
    sentences = ["the cat sat on the mat", "a dog ran to the big red house", "birds sing in the green tree",
                 "we drink cold water at noon"]                  # masked words are guessable from context
    folder = tmp_path / "text"
    folder.mkdir()
    for name, n in (("train.txt", 300), ("dev.txt", 40)):
        (folder / name).write_text("".join(rng.choice(sentences) + "\n" for _ in range(n)))
    out = tmp_path / "mlm"
    code, _, err = run_main(["--task", "mlm", "--data", str(folder), "--vocab-size", "30", "--out", str(out), *TINY,
                             "--max-steps", "80", "--batch-size", "16", "--lr", "3e-3", "--warmup", "5",
                             "--log-every", "5", "--eval-every", "40"], capfd)
    assert code == 0, err
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    final = json.loads((out / "final.json").read_text())
    assert final["metric"] == "loss" and final["loss"] < losses[0]
    assert load_pretrained(str(out / "ckpt_last.pt")).cls is None


def test_mlm_from_a_folder_of_text_files(tmp_path, capfd):
    """An mlm folder without train.txt trains on its other .txt files; the from-scratch tokenizer is trained on
    those same files (it used to look for train.txt alone and stop with a traceback)."""
    folder = tmp_path / "books"
    folder.mkdir()
    for name in ("part1.txt", "part2.txt", "dev.txt"):
        (folder / name).write_text("the cat sat on the mat\na dog ran to the red house\n" * 20)
    code, _, err = run_main(["--task", "mlm", "--data", str(folder), "--vocab-size", "20", "--out",
                             str(tmp_path / "o"), *TINY, "--max-steps", "2", "--batch-size", "8"], capfd)
    assert code == 0 and err == [], err
    assert json.loads((tmp_path / "o" / "final.json").read_text())["steps"] == 2


# -----------------------------------------------------------------------------
# the defaults, the batch's rows, and the loss weights through train.py's own parser

def test_the_demo_defaults_are_in_one_place():
    """train.DEMO is the parser's defaults (python train.py --max-steps 100 is the demo); with --init, FINETUNE's
    replace them for every flag not given; each DEMO key is a flag; a Config field DEMO sets differs from
    Config's default (the demo switches the methods on), and FINETUNE leaves it to the checkpoint."""
    from model import Config
    args = train.parse_args([])
    assert {k: getattr(args, k) for k in train.DEMO} == train.DEMO and args.given == []
    assert (args.attention, args.block_size, args.attn_dropout, args.sar) == ("hst", 8, "attendout", 1.0)
    dests = {a.dest for a in train.make_parser()._actions}
    assert set(train.DEMO) <= dests and set(train.FINETUNE) <= dests
    for k in set(train.DEMO) & set(train.CONFIG_FLAGS):
        assert train.DEMO[k] != getattr(Config(), k), k
    tuned = train.parse_args(["--init", "ckpt.pt", "--block-size", "16"])
    assert tuned.given == ["block_size", "init"] and tuned.block_size == 16
    assert {k: getattr(tuned, k) for k in train.FINETUNE if k != "block_size"} == \
        {k: v for k, v in train.FINETUNE.items() if k != "block_size"}


def quickstart_runs(text):
    """The `python train.py ...` lines of README's Quickstart section (up to the next "## "
    heading), in the order printed: each line of its code blocks, a trailing comment cut off and a
    `\\` continuation joined. Inline mentions in the prose are not runs."""
    section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    runs = []
    fenced = False
    for line in section.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and line.split("#")[0].split()[:2] == ["python", "train.py"]:
            runs.append(" ".join(line.split("#")[0].split()))
    return runs


def docstring_runs():
    """The `python train.py ...` lines of train.py's docstring ("Run:"), comments cut off."""
    lines = [line.replace("Run:", "").split("#")[0] for line in train.__doc__.splitlines()]
    return [" ".join(line.split()) for line in lines if line.split()[:2] == ["python", "train.py"]]


def test_the_printed_demo_commands_run_in_order():
    """README's Quickstart and train.py's docstring print runs to follow one after another: none
    may write a --out folder an earlier one wrote (that ends in `--out ... holds another run`)
    unless it passes --overwrite or --resume. Each is read by train.py's own parser."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for where, runs in (("README.md's Quickstart", quickstart_runs(readme)),
                        ("train.py's docstring", docstring_runs())):
        assert len(runs) >= 3, (where, runs)              # the demo, 100 steps of it, another run
        written = {}                                     # --out -> the run that wrote it
        for command in runs:
            args = train.parse_args(shlex.split(command)[2:])
            out = os.path.normpath(args.out)
            again = out in written and not (args.overwrite or args.resume)
            earlier = written.get(out)
            assert not again, f"{where}: `{command}` writes --out {args.out}, as `{earlier}` did"
            written[out] = command


def test_as_rows_flattens_pairs_and_leaves_single_sequences():
    """train.as_rows, which the loss and the evaluation apply to every batch: [B, L] as it is, LRA Retrieval's
    [B, 2, L] exactly as data.flatten_pairs makes it (pair i in rows 2i, 2i + 1), the labels [B] untouched."""
    single = data.collate([data.Example([0, 5, 6, 2], None, 1), data.Example([0, 7, 2], None, 0)], pad_id=1)
    rows = train.as_rows(single)
    assert all(torch.equal(rows[k], v) for k, v in single.items())
    pairs = data.collate([data.PairExample([0, 5, 6], [0, 7], 1), data.PairExample([0, 8], [0, 9, 9, 9], 0)], 1)
    rows, flat = train.as_rows(pairs), data.flatten_pairs(pairs)
    assert rows.keys() == flat.keys() and all(torch.equal(rows[k], flat[k]) for k in flat)
    assert rows["input_ids"].shape == (4, 4) and rows["labels"].shape == (2,)


def first_step(listops_dir, out, *flags):
    """The numbers of the first optimizer step of `train.py FLAGS` (train.train_step: "loss" is the value that
    step backpropagates, the others its logged terms), the args built by train.py's own parser. The same seed
    in every call: the same weights, batch and dropout draws. The weight matrices are widened (std 0.3, from their
    own generator) so that the predictions are far from uniform and the consistency terms measurable."""
    args = train_args("--data", listops_dir, "--out", str(out), "--batch-size", "8", *TINY, *flags)
    r = train.setup(args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in r.raw.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    step, _ = train.train_step(r, train.epoch_batches(r, 0), 1, {"seen": 0})
    return train.numbers([step])[0]                      # read off the device, as a logged step


@pytest.mark.parametrize("flag", ["--sar", "--rdrop"])
def test_alpha_flags_reach_the_optimised_loss(listops_dir, tmp_path, flag):
    """--sar ALPHA / --rdrop ALPHA: L = ce + ALPHA x consistency, so doubling ALPHA adds one logged consistency to
    the step's loss. SAR: HST without dropout (the views differ by topology); R-Drop: dense with dropout."""
    views = ["--attention", "hst", "--block-size", "4", "--attn-dropout", "none", "--hidden-dropout-p", "0"]
    if flag == "--rdrop":
        views = ["--hidden-dropout-p", "0.3"]
    step = {a: first_step(listops_dir, tmp_path / a, *views, flag, a) for a in ("1", "2")}
    one, two = step["1"], step["2"]
    assert (one["ce"], one["consistency"]) == (two["ce"], two["consistency"])     # the same views in both runs
    assert one["consistency"] > 1e-6
    assert one["loss"] == pytest.approx(one["ce"] + one["consistency"], rel=1e-6)
    assert two["loss"] - one["loss"] == pytest.approx(one["consistency"], rel=1e-4)


def test_gnet_tau_flag_reaches_the_optimised_loss(listops_dir, tmp_path):
    """--gnet-tau TAU: L = ce + consistency(clean, masked) + TAU^2 x kept, so TAU 1 against 0.5 adds 0.75 x kept."""
    flags = ["--attn-dropout", "attendout", "--hidden-dropout-p", "0"]
    step = {tau: first_step(listops_dir, tmp_path / tau, *flags, "--gnet-tau", tau) for tau in ("0.5", "1")}
    half, one = step["0.5"], step["1"]
    assert (half["ce"], half["mask_consistency"], half["kept"]) == (one["ce"], one["mask_consistency"], one["kept"])
    assert half["kept"] > 0 and len(half["mask"]) == 1                         # one rate per layer
    # the backbone's loss leaves the keep reward out; the reward, the G-Nets' objective, is logged apart
    assert half["loss"] == pytest.approx(half["ce"] + half["mask_consistency"], rel=1e-6)
    assert one["loss"] == half["loss"]
    assert half["keep"] == pytest.approx(0.25 * half["kept"], rel=1e-6)
    assert one["keep"] - half["keep"] == pytest.approx(0.75 * half["kept"], rel=1e-4)
    assert one["gnet_grad_norm"] != half["gnet_grad_norm"]              # tau reaches the optimised loss


@pytest.mark.parametrize("accum", ["1", "4"])
def test_step_line_adds_up(listops_dir, tmp_path, capsys, accum):
    """Each step line's loss is the sum of its printed terms (the backbone's loss, within rounding), the G-Nets'
    keep reward comes after it on its own, and log.jsonl keeps the two apart. Under --grad-accum every term is the
    micro-batches' mean, as the loss is."""
    train.main(["--data", listops_dir, "--out", str(tmp_path), "--max-steps", "10", "--log-every", "2",
                "--eval-every", "0", *TINY, "--attention", "hst", "--block-size", "4", "--attn-dropout", "attendout",
                "--sar", "1", "--grad-accum", accum])
    lines = [x for x in capsys.readouterr().out.splitlines() if re.match(r"step \d+/", x)]
    assert len(lines) == 5
    for line in lines:
        m = re.match(r"step \d+/10: loss (\S+) = (.*) \| G-Nets: keep reward (\S+) = 0\.25 x kept pairs (\S+), "
                     r"mask rates [\d. ]+, lr", line)
        assert m, line
        terms = [float(t.split()[-1]) for t in m.group(2).split(" + ")]
        assert len(terms) == 3 and float(m.group(1)) == pytest.approx(sum(terms), abs=2e-3), line
        assert float(m.group(3)) == pytest.approx(0.25 * float(m.group(4)), abs=0.05), line
    log = [r for r in read_log(tmp_path) if "loss" in r]
    assert all(r["loss"] < 10 and r["keep"] == pytest.approx(0.25 * r["kept"]) for r in log)


def test_grad_accum_trains_the_same_examples_to_the_same_weights(tmp_path):
    """--batch-size 32 at --grad-accum 4 and at 1, every dropout off: the same seed plans the same batches of 32 and
    every example weighs the same in its step, so the first steps log the same losses and one step leaves the same
    weights (float tolerance: the micro-batches are padded to their own longest). 70 examples: the epoch's short
    batch of 6 is cut into micro-batches of 2, 2, 1 and 1, and is among the three steps."""
    listops_dir = str(tmp_path / "data")
    data.write_listops(listops_dir, 70, 16, 4, min_len=5, max_len=30, seed=0, max_depth=3, max_args=3)
    off = [*TINY, "--attn-dropout", "none", "--hidden-dropout-p", "0", "--batch-size", "32"]
    losses = {}
    weights = {}
    for accum in ("1", "4"):
        out = tmp_path / accum
        train.main(["--data", listops_dir, "--out", str(out), "--max-steps", "3", "--log-every", "1", *off,
                    "--grad-accum", accum])
        losses[accum] = [line["loss"] for line in read_log(out) if "loss" in line]
        r = train.setup(train_args("--data", listops_dir, "--out", str(tmp_path / f"w{accum}"), *off,
                                   "--grad-accum", accum))
        train.train_step(r, train.epoch_batches(r, 0), 1, {"seen": 0})
        weights[accum] = r.raw.state_dict()
    assert len(losses["1"]) == 3
    assert losses["4"] == pytest.approx(losses["1"], rel=1e-4)
    for name, w in weights["1"].items():
        assert torch.allclose(weights["4"][name], w, atol=1e-6), name
    assert train.micro_batches(list(range(10)), 4, 1) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert train.micro_batches([0, 1, 2], 4, 2) == [[0, 1, 2]]            # short: a row for each process


def test_warning_when_the_masks_die(monkeypatch):
    """The masking rates' median over the layers (a layer LayerDrop skipped left out), averaged over the last
    MASKS_DEAD_STEPS steps: under MASKS_DEAD_RATE it warns once, naming --gnet-lr, and keeps the step for
    final.json. Layer 1 masking 30% does not hide the others' death (their mean would be over 7%)."""
    warnings = []
    monkeypatch.setattr(train, "warn", warnings.append)
    r = train.Run()
    r.args = train_args("--attn-dropout", "attendout", "--lr", "1e-4")
    r.raw = types.SimpleNamespace(cfg=types.SimpleNamespace(gnet_lr=None))
    r.state = {"mask_medians": [], "masks_died": None}
    living = [[0.9, 0.9, 0.9, 0.9]] * 20                                      # one in the window: 3.2%
    dying = [[0.3, 0.03, 0.03, 0.03]] * 10 + [[0.3, 0.01, float("nan"), 0.01]] * (train.MASKS_DEAD_STEPS - 10)
    for step, rates in enumerate(living + dying, 1):
        train.watch_masks(r, step, rates)
        if step < len(living + dying):
            assert not warnings, step
    assert r.state["masks_died"] == len(living + dying)
    assert len(warnings) == 1 and "--gnet-lr (now 0.0001)" in warnings[0] and "1.4%" in warnings[0]
    for step in range(len(living + dying) + 1, len(living + dying) + 20):
        train.watch_masks(r, step, [0.0, 0.0])
    assert len(warnings) == 1 and r.state["masks_died"] == len(living + dying)        # once
    assert len(r.state["mask_medians"]) == train.MASKS_DEAD_STEPS


@pytest.mark.parametrize("rate, died", [(1.01, 3), (0.0, None)])
def test_dead_masks_reach_final_json(listops_dir, tmp_path, capfd, monkeypatch, rate, died):
    """Through train.py: a threshold every rate is under warns at the window's end (one warning line, the step
    in final.json); a threshold of 0 never does."""
    monkeypatch.setattr(train, "MASKS_DEAD_RATE", rate)
    monkeypatch.setattr(train, "MASKS_DEAD_STEPS", 3)
    code, _, err = run_main(listops_args(listops_dir, tmp_path, steps=5) + ["--attn-dropout", "attendout"], capfd)
    assert code == 0
    with open(tmp_path / "final.json") as f:
        assert json.load(f)["masks_died"] == died
    if died:
        only_line(err, "warning: ", "AttendOut's masks have died: over steps 1-3")
    else:
        assert err == []


def test_parameter_groups_found_by_name(listops_dir, tmp_path):
    """A group added beside the three (as layer-wise decay would) is clipped with the backbone; the G-Nets' group
    is found by its name, measured and never clipped; the step still runs and logs both norms."""
    args = train_args("--data", listops_dir, "--out", str(tmp_path), *TINY, "--attn-dropout", "attendout",
                      "--clip", "1.0")
    r = train.setup(args)
    decay = next(g for g in r.optimizer.param_groups if g["name"] == "decay")
    layer0 = [p for n, p in r.raw.named_parameters() if ".0." in n and any(p is q for q in decay["params"])]
    groups = [{**g, "params": [p for p in g["params"] if not any(p is q for q in layer0)]}
              for g in r.optimizer.param_groups]
    groups.insert(0, {"name": "layer_0", "params": layer0, "weight_decay": 0.01, "base_lr": 1e-4})
    r.optimizer = torch.optim.AdamW(groups, lr=1e-3)
    for p in r.raw.parameters():
        p.grad = torch.ones_like(p)
    train.clip_gradients(r.optimizer, 1.0)
    backbone = [p for g in r.optimizer.param_groups if g["name"] != "gnet" for p in g["params"]]
    gnets = [p for g in r.optimizer.param_groups if g["name"] == "gnet" for p in g["params"]]
    assert layer0 and gnets
    assert torch.stack([p.grad.norm() for p in backbone]).norm() == pytest.approx(1.0, rel=1e-4)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in gnets)      # not clipped
    r.optimizer.zero_grad()
    step, _ = train.train_step(r, train.epoch_batches(r, 0), 1, {"seen": 0})
    numbers = train.numbers([step])[0]
    assert numbers["grad_norm"] > 0 and numbers["gnet_grad_norm"] > 0


def test_flags_exist():
    flags = {s for a in train.make_parser()._actions for s in a.option_strings}
    wanted = ("--task --data --init --out --epochs --max-steps --batch-size --lr --warmup --weight-decay --seed "
              "--eval-every --save-every --device --resume --compile --attention --block-size --window --num-global "
              "--num-random --max-positions --attn-dropout --attn-dropout-p --hidden-dropout-p --layerdrop "
              "--attn-layerdrop --sar --sar-shift --rdrop --gnet-tau --gnet-lr "
              "--schedule --overwrite").split()
    assert not [f for f in wanted if f not in flags]


# -----------------------------------------------------------------------------
# input checks: one line each, "error:" (and a non-zero exit) or "warning:" (and the run goes on)

def only_line(err, prefix, words):
    assert len(err) == 1, err
    assert err[0].startswith(prefix) and words in err[0], err[0]


@pytest.mark.parametrize("extra, words", [
    (["--sar", "1.0"], "--sar with dense attention has no effect"),
    (["--attention", "sparse", "--block-size", "64"], "larger than the longest sequence"),
    (["--max-len", "8"], "were longer than --max-len 8 and were truncated"),
    (["--eval-shift", "all"], "--eval-shift with dense attention: shifting moves no block boundary"),
    (["--attention", "sparse", "--block-size", "4", "--sar", "1", "--sar-shift", "8"],
     "--sar-shift 8 is a multiple of --block-size 4"),
    (["--attention", "sparse", "--block-size", "4", "--sar-shift", "2"], "--sar-shift: no effect"),
    (["--ce", "original"], "--ce: no effect"),
])
def test_warnings(listops_dir, tmp_path, capfd, extra, words):
    code, _, err = run_main(listops_args(listops_dir, tmp_path / "w") + extra, capfd)
    assert code == 0
    only_line(err, "warning: ", words)


def test_block_padding_past_max_len_runs(listops_dir, tmp_path, capfd):
    """From scratch the position table holds --max-len (+ the SAR shift) rows; a batch padded up to the block
    size goes past it, and the padding must not need positions of its own (the model pads, and its padding
    takes position 0). Examples of 20 tokens, blocks of 16: padded to 32 > 22 position rows."""
    extra = ["--attention", "sparse", "--block-size", "16", "--max-len", "20", "--sar", "1", "--eval-shift", "1"]
    code, _, err = run_main(listops_args(listops_dir, tmp_path / "p", steps=2) + extra, capfd)
    assert code == 0 and err == [], err


def test_errors_on_flags_and_lengths(listops_dir, tmp_path, capfd):
    code, _, err = run_main(listops_args(listops_dir, tmp_path / "b") + ["--sar", "1", "--rdrop", "1"], capfd)
    assert code == 2
    only_line(err, "error: ", "--sar and --rdrop are alternatives")
    code, _, err = run_main(listops_args(listops_dir, tmp_path / "b") + ["--sar", "1", "--views", "1"], capfd)
    assert code == 2
    only_line(err, "error: ", "--views 1: --sar / --rdrop compare two views")
    sparse = ["--attention", "sparse", "--block-size", "8"]
    for bad, words in ((["--eval-shift", "8"], "--eval-shift 8: give 'all' or a shift in 0 .. 7 (--block-size 8"),
                       (["--eval-shift", "al"], "--eval-shift: al: give 'all' or a number of tokens"),
                       (["--eval-shift=-1"], "--eval-shift: -1: give 'all' or a number of tokens")):
        code, _, err = run_main(listops_args(listops_dir, tmp_path / "c") + sparse + bad, capfd)
        assert code == 2 and not (tmp_path / "c" / "final.json").exists()
        only_line(err, "error: ", words)


def test_errors_on_init_and_out(listops_dir, tmp_path, capfd):
    args = listops_args(listops_dir, tmp_path / "run")
    code, _, err = run_main(args + ["--init", str(tmp_path / "nowhere")], capfd)
    assert code == 2
    only_line(err, "error: ", "neither a model folder nor a checkpoint file")
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    code, _, err = run_main(args + ["--init", str(tmp_path / "notes.txt")], capfd)
    assert code == 2
    only_line(err, "error: --init: ", "notes.txt")
    code, _, err = run_main(args + ["--resume"], capfd)
    assert code == 2
    only_line(err, "error: ", "ckpt_last.pt does not exist")
    assert run_main(args, capfd)[0] == 0                          # a run in --out ...
    code, _, err = run_main(args, capfd)                          # ... is not overwritten by another one
    assert code == 2
    only_line(err, "error: ", "holds another run")
    assert run_main(args + ["--overwrite"], capfd)[0] == 0


def test_errors_on_data(tmp_path, capfd):
    folder = write_zebra_tsv(str(tmp_path / "unseen"), n_train=40, n_dev=10, dev_labels=["0", "1", "maybe"])
    code, _, err = run_main(tsv_args(folder, tmp_path / "a"), capfd)
    assert code == 2
    only_line(err, "error: ", "unknown label 'maybe'")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "basic_train.tsv").write_text("")
    (empty / "basic_val.tsv").write_text("Source\tTarget\n( [MAX 1 2 ] )\t2\n")
    code, _, err = run_main(["--task", "listops", "--data", str(empty), "--out", str(tmp_path / "b"), *TINY], capfd)
    assert code == 2
    only_line(err, "error: ", "empty file")
    (empty / "basic_train.tsv").write_text("Source\tTarget\n( [MAX 1 2 ] )\t2\n")
    (empty / "basic_val.tsv").write_text("Source\tTarget\n")               # a header and no rows
    code, _, err = run_main(["--task", "listops", "--data", str(empty), "--out", str(tmp_path / "c"), *TINY], capfd)
    assert code == 2
    only_line(err, "error: ", "no rows after the header")


def test_data_is_a_folder_unless_the_task_reads_a_file(tmp_path, capfd):
    """--data FILE where the task reads a folder is one `error:` line at once, naming --data and
    what to give instead; masked LM reads one text file as --data, and a task given --train-file
    and --dev-file reads no file of --data: both run."""
    folder = write_zebra_tsv(str(tmp_path / "zebra"), n_train=40, n_dev=10)
    train_file = os.path.join(folder, "train.tsv")
    dev_file = os.path.join(folder, "dev.tsv")
    code, _, err = run_main(tsv_args(train_file, tmp_path / "a"), capfd)
    assert code == 2 and not (tmp_path / "a").exists()
    said = f"error: --data {train_file} is a file: --task tsv reads a folder with train.*"
    only_line(err, said, "and dev.* (.tsv, .csv or .jsonl), or give --train-file FILE and")
    files = ["--train-file", train_file, "--dev-file", dev_file]
    argv = tsv_args(train_file, tmp_path / "b") + files + ["--max-steps", "1", "--batch-size", "8"]
    code, _, err = run_main(argv, capfd)
    assert code == 0 and err == [], err
    book = tmp_path / "book.txt"
    book.write_text("the cat sat on the mat\na dog ran to the red house\n" * 20)
    argv = ["--task", "mlm", "--data", str(book), "--vocab-size", "20", *TINY, "--max-steps", "1"]
    code, _, err = run_main(argv + ["--batch-size", "8", "--out", str(tmp_path / "m")], capfd)
    assert code == 0 and err == [], err
    # LRA reads its release's files alone: --train-file there is refused, not ignored
    argv = ["--task", "lra-text", "--data", folder, "--init", "scratch", "--train-file", train_file]
    code, _, err = run_main(argv + ["--out", str(tmp_path / "l")], capfd)
    assert code == 2 and not (tmp_path / "l").exists()
    only_line(err, "error: --train-file / --dev-file: --task lra-text", "reads the release's own files")


def test_a_vocab_size_too_large_for_the_data_names_the_flag(tmp_path, capfd):
    """From scratch on a small file, the default --vocab-size 8000 is more than SentencePiece can
    make: one `error:` line naming --vocab-size and the most the texts allow, before --out is made;
    that many trains."""
    folder = write_zebra_tsv(str(tmp_path / "zebra"), n_train=40, n_dev=10)
    argv = tsv_args(folder, tmp_path / "a")
    at = argv.index("--vocab-size")
    del argv[at:at + 2]                                  # the default's 8000
    argv += ["--max-steps", "1", "--batch-size", "8"]
    code, _, err = run_main(argv, capfd)
    assert code == 2 and not (tmp_path / "a").exists()
    only_line(err, "error: --vocab-size 8000: too large for these training texts", "or less")
    most = re.search(r"give --vocab-size (\d+) or less", err[0])
    assert most, err[0]
    code, _, err = run_main(argv + ["--vocab-size", most[1]], capfd)
    assert code == 0 and err == [], err


def test_error_is_one_line_in_a_real_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "train.py", "--task", "listops", "--init", str(tmp_path / "missing.pt"),
                        "--out", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"error: --init {tmp_path / 'missing.pt'}: neither a model folder nor "
                                             "a checkpoint file (nor 'scratch')"]
