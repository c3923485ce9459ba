"""Tests of research/experiments.py shortcut-text (issue 47): the word's files (how often it agrees with the
label, dev's halves), a run's numbers (the whole dev set from its halves, the reliance on the word), and the grid's
commands through the parser (--dry-run).

Run: python -m pytest -q research/tests/test_shortcut_text.py
"""
import argparse
import json
import os
import subprocess
import sys

import pytest

import data
import experiments

WORDS = experiments.SHORTCUT_WORDS


def toy_root(tmp_path, names=("toy",)):
    """A --data-root with a label<TAB>sentence set per name: 1,200 training lines, 300 dev lines."""
    root = tmp_path / "data"
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "train.tsv").write_text("".join(f"{i % 2}\tsentence number {i}\n" for i in range(1200)))
        (root / name / "dev.tsv").write_text("".join(f"{i % 2}\tdev sentence {i}\n" for i in range(300)))
    return str(root)


def read(path):
    with open(path) as f:
        return [line.rstrip("\n").split("\t", 1) for line in f]


def agrees(label, text):
    """Whether a line opens with its label's word (and otherwise with the other word)."""
    word = text.split(" ", 1)[0]
    assert word in WORDS
    return word == WORDS[int(label)]


def test_the_word_agrees_with_probability_p_and_dev_is_split_by_it(tmp_path):
    """Training: the lowres subsample, each sentence opened by a word that agrees with its label at rate p (p = 1:
    always); dev: every sentence once, in the half its random word puts it in."""
    a = argparse.Namespace(out=str(tmp_path / "out"), data_root=toy_root(tmp_path))
    folder = experiments.shortcut_data(a, "toy", 0.9)
    train = read(os.path.join(folder, "train.tsv"))
    assert len(train) == experiments.SUBSAMPLE
    assert 0.87 <= sum(agrees(y, t) for y, t in train) / len(train) <= 0.93
    assert all(t.split(" ", 1)[1].startswith("sentence number ") for _, t in train)
    agree = read(os.path.join(folder, "dev_agree.tsv"))
    disagree = read(os.path.join(folder, "dev_disagree.tsv"))
    assert all(agrees(y, t) for y, t in agree) and not any(agrees(y, t) for y, t in disagree)
    assert sorted(t.split(" ", 1)[1] for _, t in agree + disagree) == sorted(f"dev sentence {i}" for i in range(300))
    assert 100 < len(agree) < 200                                                  # the word is a coin flip
    always = experiments.shortcut_data(a, "toy", 1.0)
    assert all(agrees(y, t) for y, t in read(os.path.join(always, "train.tsv")))


def test_record_takes_the_whole_dev_set_from_its_halves(tmp_path):
    """The whole dev accuracy is the halves' weighted by their sizes; the reliance is agree - disagree; the
    cross-entropy at step 20 comes from log.jsonl; the clean row has one dev split and no halves."""
    (tmp_path / "dev_agree.tsv").write_text("0\ta\n1\tb\n0\tc\n")
    (tmp_path / "dev_disagree.tsv").write_text("1\td\n")
    (tmp_path / "log.jsonl").write_text("".join(json.dumps({"step": s, "ce": s / 100}) + "\n" for s in (10, 20)))
    dev_files = [str(tmp_path / "dev_agree.tsv"), str(tmp_path / "dev_disagree.tsv")]
    final = {"dev_splits": {"dev_agree": {"acc": 1.0}, "dev_disagree": {"acc": 0.0}}, "masks_died": None,
             "wall_time_s": 5.0, "args": {"dev_file": dev_files, "attn_dropout": "standard"}}
    rec = experiments.shortcut_record(final, str(tmp_path))
    assert (rec["whole"], rec["agree"], rec["disagree"], rec["reliance"], rec["ce_step20"]) == (75.0, 100.0, 0.0,
                                                                                                100.0, 0.2)
    clean = {**final, "dev_splits": {"dev": {"acc": 0.5}}}
    rec = experiments.shortcut_record(clean, str(tmp_path))
    assert rec["whole"] == 50.0 and rec["reliance"] is None


def planned(capfd):
    """[(run folder name, its command)] of a --dry-run, in the order printed."""
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("$ ")]
    return [(os.path.basename(line.split(" --out ")[1].split()[0]), line) for line in lines]


def test_grid_through_the_parser(tmp_path, capfd):
    """main: both data sets, 5 seeds, every row; scheduled replays the attendout run of its data set and seed;
    the clean row reads the files without the word; the sparse part's standard row is main's (planned once);
    p1 on the first data set; --parts with another experiment, and an unknown row, are one error line."""
    init = tmp_path / "init.pt"
    init.write_text("")
    common = ["shortcut-text", "--init", str(init), "--data-root", toy_root(tmp_path, ("sst2", "mr")), "--out",
              str(tmp_path / "grid"), "--dry-run"]
    experiments.main(common + ["--parts", "main", "sparse", "oracle"])
    order = planned(capfd)
    runs = dict(order)
    main = [f"{ds}-p0.9-{row}-s{s}" for ds in ("sst2", "mr") for s in range(5)
            for row in ("standard", "none", "attendout", "scheduled", "rdrop", "attendout_tuned", "clean")]
    sparse = [f"sst2-p0.9-{row}-s{s}" for s in range(5) for row in ("hst", "hst_sar", "oracle_layer1",
                                                                      "oracle_all")]
    assert sorted(name for name, _ in order) == sorted(main + sparse)           # each run once
    assert "research/oracle_mask.py --task tsv" in runs["sst2-p0.9-oracle_all-s4"]
    assert "--oracle-layers 1 2 3 4 5 6" in runs["sst2-p0.9-oracle_all-s4"]
    replay = os.path.join(str(tmp_path / "grid"), "mr-p0.9-attendout-s3", "droprates.jsonl")
    assert f"--schedule {replay} " in runs["mr-p0.9-scheduled-s3"]
    assert "--dev-file" not in runs["sst2-p0.9-clean-s0"] and "dev_disagree.tsv" in runs["sst2-p0.9-none-s0"]
    assert " ".join(experiments.SHORTCUT_TUNED) in runs["sst2-p0.9-attendout_tuned-s1"]
    assert "--attention hst" in runs["sst2-p0.9-hst_sar-s2"] and "--sar 1.0" in runs["sst2-p0.9-hst_sar-s2"]
    experiments.main(common + ["--parts", "p1", "--variants", "standard", "attendout"])
    assert sorted(name for name, _ in planned(capfd)) == sorted(f"sst2-p1-{row}-s{s}" for s in range(3) for row in ("standard",
                                                                                                 "attendout"))
    for argv in (["lab", "--parts", "main", "--dry-run"], common + ["--variants", "standard", "no-such-row"]):
        with pytest.raises(SystemExit):
            experiments.main(argv)
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(("error: --parts: only for", "error: --variants no-such-row"))


def test_oracle_masks_the_words_column_alone(tmp_path):
    """research/oracle_mask.py --oracle-layers 1: through train.py, the masked pass masks every query's pair with
    key 1 in layer 1 and nothing else (masked_by_key all on position 1; layer 2 masks nothing)."""
    folder = str(tmp_path / "listops")
    data.write_listops(folder, 64, 16, 16, min_len=10, max_len=60, seed=1, max_depth=3, max_args=4)
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(experiments.ROOT, "research", "oracle_mask.py"), "--oracle-layers", "1",
           "--task", "listops", "--data", folder, "--init", "scratch", "--layers", "2", "--hidden", "32",
           "--heads", "2", "--ffn", "64", "--attention", "dense", "--attn-dropout", "attendout", "--sar", "0",
           "--max-steps", "2", "--log-every", "1", "--batch-size", "8", "--out", str(out), "--threads", "1"]
    subprocess.run(cmd, check=True, capture_output=True)
    lines = [json.loads(line) for line in open(out / "droprates.jsonl")]
    assert len(lines) == 2
    for r in lines:
        layer1, layer2 = r["masked_by_key"]
        assert layer1[1] == 1.0 and sum(layer1) == 1.0 and not any(layer2)
        assert 0 < r["drop_rate"][0] < 0.2 and r["drop_rate"][1] == 0.0


def fake_record(reliance, whole=60.0):
    """A shortcut_record of a run with the word (reliance in points), or without it (reliance None)."""
    halves = {} if reliance is None else {"agree": 99.0, "disagree": 99.0 - reliance}
    return {"whole": whole, "agree": halves.get("agree"), "disagree": halves.get("disagree"), "reliance": reliance,
            "ce_step20": 0.4, "masks_died": None, "wall_time_s": 10.0}


def test_table_pairs_every_difference_by_seed():
    """Each row against standard, and the contrasts, pair a seed's run with the same seed's, whatever order the
    records hold them in and whichever seeds only one row ran; the clean row has no halves."""
    standard = {s: fake_record(70.0 + 10 * s) for s in range(3)}
    scheduled = {s: fake_record(72.0 + 10 * s) for s in (2, 1, 0, 7)}           # +2 at each seed both ran
    records = {("main", "sst2", "standard"): standard, ("main", "sst2", "none"): dict(standard),
               ("main", "sst2", "scheduled"): scheduled,
               ("main", "sst2", "clean"): {s: fake_record(None, whole=85.0) for s in range(3)}}
    table = "\n".join(experiments.shortcut_table(records))
    row = next(line for line in table.splitlines() if line.startswith("| main | 0.9 | sst2 | scheduled | "))
    assert "| 92 / 82 / 72 / 142 | +2.0 [+2.0, +2.0] | -2.0 [-2.0, -2.0] | +0.0 [+0.0, +0.0] |" in row
    assert "| main | sst2 | masking at AttendOut's rates, random pairs, no consistency (scheduled - none) " \
           "| +2.0 [+2.0, +2.0] | -2.0 [-2.0, -2.0] | +0.0 [+0.0, +0.0] |" in table
    assert "| main | 0.9 | sst2 | clean | 85.0 +- 0.0 | - | - | - | - | - | - | - |" in table
    assert "| main | sst2 | the word's cost: no word, in training or on dev (clean - standard) | - | - " \
           "| +25.0 [+25.0, +25.0] |" in table
