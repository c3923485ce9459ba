"""Tests of research/experiments.py lab: the receptive field's bound against reachability propagated through
sparse.dense_mask, and the grid's commands (--dry-run, --quick).

Run: python -m pytest -q research/tests/test_lab_grid.py
"""
import argparse
import json
import os

import pytest
import torch

import data
import experiments
import model
import sparse
import train


def reached(n, layers, **pattern):
    """bool [n]: the tokens whose information reaches token 0 ([CLS]) through `layers` layers of the dense mask
    (query i attends key j), the residual stream keeping what a token held."""
    mask = sparse.dense_mask(n, **pattern)[0, 0]                              # [n, n]
    hold = torch.eye(n, dtype=torch.bool)                                       # hold[i, j]: i holds j's information
    for _ in range(layers):
        hold = hold | (mask.float() @ hold.float() > 0)
    return hold[0]


def test_bound_matches_reachability_through_the_mask():
    name = "lab-reach"
    spec = data.LAB[name]
    m = experiments.LAB_MODEL
    pattern = dict(block_size=m["block"], window=m["window"], num_global=0, num_random=0)
    seen = reached(spec["length"], m["layers"], **pattern)
    reach = experiments.reach_tokens(m["layers"], m["window"], m["block"])
    assert seen.tolist() == [t < reach for t in range(spec["length"])]         # blocks 0 .. w L
    rows = data.generate_lab(name, 2000, seed=5)
    texts, labels = [t for t, _ in rows], [y for _, y in rows]
    by_mask = [y for t, y in rows if not seen[data.lab_evidence(name, t)]]      # evidence out of reach
    best = max(by_mask.count(0), by_mask.count(1))
    expect = (len(rows) - len(by_mask) + best) / len(rows)
    assert experiments.reach_bound(name, texts, labels, reach) == expect
    # the formula the lab prints beside it: near .. far blocks, (w L + 1) of them in reach, the rest a coin
    q = (spec["far"] - m["window"] * m["layers"]) / (spec["far"] - spec["near"] + 1)
    assert abs(expect - ((1 - q) + q / 2)) < 0.03
    # a wider window or one more layer reaches further: the bound rises, as the mask says
    seen3 = reached(spec["length"], 3, **pattern)
    assert seen3.sum() == experiments.reach_tokens(3, m["window"], m["block"])
    # with [CLS] global, everything reaches it in one layer: no bound applies
    assert reached(spec["length"], 1, **{**pattern, "num_global": 1}).all()


def test_no_bound_without_a_deciding_token():
    """A task where no single token decides (bottleneck, shortcut) has no receptive-field bound: an error."""
    rows = data.generate_lab("lab-shortcut", 20, seed=0)
    texts, labels = [t for t, _ in rows], [y for _, y in rows]
    with pytest.raises(data.DataError, match="lab-shortcut has no receptive-field bound"):
        experiments.reach_bound("lab-shortcut", texts, labels, 24)


def commands(capfd):
    """The --out folder and the flags of every command a --dry-run printed."""
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("$ ")]
    return [(line.split(" --out ")[1].split()[0], line) for line in lines]


def test_dry_run_prints_the_grid(tmp_path, capfd):
    """Every row at its task's seeds (LAB_SEEDS: the shortcut at 0-4), seed-major; --quick: the reach rows at the
    first seed."""
    out = str(tmp_path / "lab")
    experiments.main(["lab", "--dry-run", "--out", out])
    runs = [folder for folder, _ in commands(capfd)]
    expect = [os.path.join(out, f"{experiments.lab_name(row)}-s{s}") for s in range(5)
              for row in experiments.LAB_ROWS if s in experiments.LAB_SEEDS[row["task"]]]
    assert runs == expect
    assert not os.path.exists(os.path.join(out, "lab.json"))                   # nothing ran
    experiments.main(["lab", "--dry-run", "--quick", "--seeds", "4", "--out", out])
    quick = [folder for folder, _ in commands(capfd)]
    assert quick == [os.path.join(out, f"reach-{v}-s4") for v in ("dense-g0", "hst-g0", "sparse-g0", "sparse-g1")]


def test_tasks_picks_rows_through_the_parser(tmp_path, capfd):
    """--tasks: those tasks' rows alone, each run's flags as its row says (views, CE, alpha, the replayed
    schedule of the same seed); an unknown task is one error line."""
    out = str(tmp_path / "lab")
    experiments.main(["lab", "--dry-run", "--tasks", "lab-boundary", "lab-shortcut", "--seeds", "1", "--out", out])
    runs = dict(commands(capfd))
    names = [os.path.basename(folder) for folder in runs]
    assert names == [f"{experiments.lab_name(row)}-s1" for row in experiments.LAB_ROWS
                     if row["task"] in ("lab-boundary", "lab-shortcut")]
    line = runs[os.path.join(out, "boundary-sparse-g0-views2-ceoriginal-sar1-s1")]
    assert " --views 2 --sar 1.0 " in line and " --ce original " in line and "--eval-shift all" in line
    one_view = runs[os.path.join(out, "boundary-sparse-g0-s1")]
    assert " --views 1 --sar 0.0 " in one_view and " --ce " not in one_view          # one view: no --ce
    replay = os.path.join(out, "shortcut-dense-g0-attendout-gnetlr0.0001-s1", "droprates.jsonl")
    scheduled = runs[os.path.join(out, "shortcut-dense-g0-scheduled-s1")]
    assert f"--attn-dropout scheduled --schedule {replay} --seed 1" in scheduled
    assert "--gnet-lr" not in runs[os.path.join(out, "shortcut-dense-g0-attendout-s1")]
    with pytest.raises(SystemExit):
        experiments.main(["lab", "--dry-run", "--tasks", "lab-boundary", "lab-xor", "--out", out])
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tasks lab-xor: not a lab task (known: lab-reach, ")


def recorded(flags):
    """final.json's "args" and "config" for a run of `flags`, as train.report writes them (no run): every flag
    in force, a Config flag not given at Config's value (gnet_lr: --lr's where none)."""
    args = vars(train.parse_args(flags))
    default = model.Config()
    config = {n: getattr(default, n) if args[n] is None else args[n] for n in train.CONFIG_FLAGS}
    config.update(gnet_lr=config["gnet_lr"] or args["lr"], num_layers=args["layers"])
    return {**{k: v for k, v in args.items() if k != "given"}, **{n: config[n] for n in train.CONFIG_FLAGS}}, \
        config


def fake_final(acc, shifted=None, flags=()):
    """A final.json as train.py writes it (flat): the dev accuracy, --eval-shift's scores, and the flags and
    config of a run of `flags` (recorded)."""
    dev = {"acc": acc}
    if shifted:
        by = {str(s): {"acc": x} for s, x in enumerate(shifted, 1)}
        dev["shift"] = {"by": by, "mean": {"acc": sum(shifted) / len(shifted)}, "worst": {"acc": min(shifted)}}
    args, config = recorded(list(flags))
    return {"acc": acc, "dev_splits": {"dev": dev}, "dev_split": "dev", "wall_time_s": 12.5, "config": config,
            "args": args}


def row_named(name):
    return next(r for r in experiments.LAB_ROWS if experiments.lab_name(r) == name)


def test_record_fields(tmp_path):
    """lab.json's line of a run, from its final.json: what ran (its recorded flags and config), the
    accuracies in percent, the drop under shift, the bound beside block-sparse without a global token (from
    the run's own window), and what the G-Nets masked on the shortcut token."""
    folder = str(tmp_path / "boundary")
    data.write_lab("lab-boundary", folder, n_train=10, n_dev=200)
    name = "boundary-sparse-g0-views2-ceoriginal-sar1"
    flags = experiments.lab_flags(row_named(name), folder, str(tmp_path), 2)
    record = experiments.lab_record(name, 2, fake_final(1.0, [0.5, 0.75] + [1.0] * 5, flags), str(tmp_path))
    assert {"row": name, "task": "lab-boundary", "attention": "sparse", "num_global": 0, "sar": 1.0,
            "views": 2, "ce": "original", "attn_dropout": "none", "gnet_lr": None, "steps": 600, "seed": 2,
            "dev_acc": 100.0, "shifted_worst": 50.0, "bound": 100.0}.items() <= record.items()
    assert abs(record["shifted_mean"] - 100 * 6.25 / 7) < 1e-9 and abs(record["drop"] - 100 * 0.75 / 7) < 1e-9
    assert record["shifted_by"]["2"] == 75.0
    # the shortcut's AttendOut run: the share of masked pairs on token 1, layer by layer, per logged step
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 10, "step_frac": 0.5, "masked_by_key": [[0.0, 0.5, 0.5], [0.2, 0.1, 0.7]]},
             {"step": 20, "step_frac": 1.0, "masked_by_key": [[0.1, 0.3, 0.6], []]}]      # [] nothing masked
    (run / "droprates.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    row = experiments.SHORTCUT_ATTENDOUT
    final = fake_final(0.9, flags=experiments.lab_flags(row, "data/lab-shortcut", str(tmp_path), 0))
    record = experiments.lab_record(experiments.lab_name(row), 0, final, str(run))
    assert {"task": "lab-shortcut", "attention": "dense", "views": 1, "attn_dropout": "attendout",
            "gnet_lr": experiments.LAB_GNET_LR, "dev_acc": 90.0, "shifted_mean": None, "bound": None}.items() \
        <= record.items()
    assert record["shortcut_masking"] == {"step_frac": [0.5, 1.0], "share": [[0.5, 0.1], [0.3, 0.0]]}


def test_record_says_what_ran_not_the_row(tmp_path):
    """A run of a row with --extra keeps the row's name and records what ran: the G-Nets of the row without
    --gnet-lr train at train.py's default (1e-5, not the backbone's 2e-3); a reach run at --window 2 has the
    bound of window 2; "changed" names the flags --extra changed, and lab.md shows it."""
    name = "shortcut-dense-g0-attendout"
    flags = experiments.lab_flags(row_named(name), "data/lab-shortcut", str(tmp_path), 0)
    (tmp_path / "droprates.jsonl").write_text("")
    record = experiments.lab_record(name, 0, fake_final(0.5, flags=flags), str(tmp_path))
    assert record["gnet_lr"] == 1e-5 == experiments.DEMO_GNET_LR and record["changed"] is None
    folder = str(tmp_path / "reach")
    data.write_lab("lab-reach", folder, n_train=10, n_dev=300)
    row = row_named("reach-sparse-g0")
    flags = experiments.lab_flags(row, folder, str(tmp_path), 0)
    final = fake_final(0.7, flags=experiments.merge_flags(flags, ["--window", "2", "--attn-dropout", "standard"]))
    final["changed"] = experiments.changed_words(experiments.differences(flags, final["args"]))
    record = experiments.lab_record("reach-sparse-g0", 0, final, folder)
    assert record["changed"] == "--window 2 --attn-dropout standard"
    assert record["row"] == "reach-sparse-g0" and record["attn_dropout"] == "standard"
    texts, labels = experiments.read_lab_dev(folder)
    assert record["bound"] == 100 * experiments.reach_bound("lab-reach", texts, labels, 5 * 8)   # (w L + 1) b
    table = experiments.lab_table([record])
    assert "| lab-reach (ran with --window 2 --attn-dropout standard) | sparse | 0 | 1 | - | 0 | standard | " \
        in table


def synthetic_runs(seeds):
    """A run per LAB_ROWS row and seed, as lab_record writes them: reach's sparse at 60-64%, the boundary's one
    view and CE-original alpha 0 dropping by 40, the shortcut's none at 50%, attendout at 90 + seed."""
    runs = []
    for s in seeds:
        for row in experiments.LAB_ROWS:
            name = experiments.lab_name(row)
            acc = 60.0 + 4 * s if name.startswith("reach-sparse-g0") else 100.0
            drop = None
            if row["task"] == "lab-boundary":
                drop = 40.0 if row["sar"] == 0 and (row["views"] == 1 or row["ce"] == "original") else 2.0 * s
            if row["task"] == "lab-shortcut":
                acc = {"none": 50.0, "standard": 51.0, "dropkey": 53.0,
                       "scheduled": 52.0 + s}[row["attn_dropout"]] \
                    if row["attn_dropout"] != "attendout" else 90.0 + s - 30 * (row["gnet_lr"] is None)
            masking = {"step_frac": [0.1, 0.5, 1.0], "share": [[0.5, 0.25], [0.25, 0.125], [0.0, 1 / 64]]}
            runs.append({"row": name, **{k: row[k] for k in ("task", "attention", "num_global", "sar", "views", "ce",
                                                              "attn_dropout", "gnet_lr", "steps")},
                         "seed": s, "dev_acc": acc, "shifted_mean": None if drop is None else acc - drop,
                         "shifted_worst": None if drop is None else acc - drop - 1,
                         "shifted_by": None if drop is None else {str(k): acc - drop for k in range(1, 8)},
                         "drop": drop, "bound": 62.0 if name.startswith("reach-sparse-g0") else None,
                         "wall_time_s": 30.0 + s,
                         **({"shortcut_masking": masking} if row["attn_dropout"] == "attendout" else {})})
    return runs


def test_table_of_a_grid():
    """lab.md from lab.json's runs: nulls where nothing was scored, the bound beside block-sparse without a global
    token, the drop's interval, the targets' contrasts paired by seed, the accuracy by shift, the masking table."""
    table = experiments.lab_table(synthetic_runs([0, 1]))
    assert "| lab-reach | dense | 0 | 1 | - | 0 | none | - | 600 | 100.0 / 100.0 | 100.0 +- 0.0 | - | - | - | - " \
           "| 30 |" in table
    assert "| lab-reach | sparse | 0 | 1 | - | 0 | none | - | 600 | 60.0 / 64.0 | 62.0 +- 2.8 | - | - | - " \
           "| 62.0 +- 0.0 | 30 |" in table
    assert "| lab-boundary | sparse | 0 | 2 | original | 0 | none | - | 600 | 100.0 / 100.0 | 100.0 +- 0.0 " \
           "| 60.0 +- 0.0 | 59.0 +- 0.0 | +40.0 [+40.0, +40.0] | - | 30 |" in table
    assert "| reach | hst - sparse (no global token) | +38.0 [" in table
    assert "| reach | sparse - its bound | +0.0 [" in table
    assert "| boundary | drop: the second view's CE (alpha 0, CE on both - CE on the original) | -39.0 [" in table
    assert "| boundary | drop: the consistency term, CE on the original (alpha 1 - alpha 0) | -39.0 [" in table
    assert "| boundary | drop: the consistency term, CE on both (alpha 1 - alpha 0) | +0.0 [+0.0, +0.0] |" in table
    assert "| shortcut | attendout - none | +40.5 [" in table
    assert "| shortcut | attendout - scheduled (its own rates, random pairs) | +38.0 [+38.0, +38.0] |" in table
    assert "| shortcut | attendout, G-Nets at 0.0001 - at 1e-05 | +30.0 [+30.0, +30.0] |" in table
    assert "| shortcut | dropkey - standard | +2.0 [+2.0, +2.0] |" in table
    assert "| boundary-sparse-g0 | 60.0 / 60.0 / 60.0 / 60.0 / 60.0 / 60.0 / 60.0 |" in table
    assert "| shortcut-dense-g0-attendout-gnetlr0.0001 | 1 | 91.0 | 2 | 16.00 / 8.00 / 8.00 / 1.00 | 8.33 |" in table
    # one seed: no intervals, and a subset of the tasks leaves the other tasks' contrasts out
    one = experiments.lab_table([r for r in synthetic_runs([0]) if r["task"] == "lab-shortcut"])
    assert "| shortcut | attendout - standard | +39.0 (one seed: no interval) |" in one
    assert "reach" not in one and "boundary" not in one


def test_contrasts_pair_runs_by_seed():
    """A contrast pairs each seed's run with the same seed's run of the other row, whatever order lab.json holds
    them in and whichever seeds only one row ran: standard at 51 + s, attendout at 52 + s (its seeds listed in
    reverse, seed 7 alone) is +1.0 at every seed."""
    runs = [r for r in synthetic_runs([0, 1, 2]) if r["row"] in ("shortcut-dense-g0-standard",
                                                                   "shortcut-dense-g0-attendout-gnetlr0.0001")]
    for r in runs:
        r["dev_acc"] = 51.0 + r["seed"] + (r["attn_dropout"] == "attendout")
    standard = [r for r in runs if r["attn_dropout"] == "standard"]
    attendout = [r for r in runs if r["attn_dropout"] == "attendout"][::-1]
    extra = {**attendout[0], "seed": 7, "dev_acc": 10.0}
    table = experiments.lab_table(standard + [extra] + attendout)
    assert "| shortcut | attendout - standard | +1.0 [+1.0, +1.0] |" in table


def test_variants_pick_rows_by_name(tmp_path, capfd):
    """--variants: the named rows alone (the run folder without its seed); a scheduled row brings the row it
    replays; an unknown name is one error line that lists the known ones."""
    out = str(tmp_path / "lab")
    experiments.main(["lab", "--tasks", "lab-reach", "--variants", "reach-hst-g0", "--seeds", "0", "--dry-run",
                      "--out", out])
    runs = commands(capfd)
    assert len(runs) == 1 and " --attention hst " in runs[0][1]
    experiments.main(["lab", "--variants", "shortcut-dense-g0-scheduled", "--seeds", "1", "--dry-run", "--out", out])
    names = [os.path.basename(folder) for folder, _ in commands(capfd)]
    assert names == ["shortcut-dense-g0-attendout-gnetlr0.0001-s1", "shortcut-dense-g0-scheduled-s1"]
    with pytest.raises(SystemExit):
        experiments.main(["lab", "--variants", "no-such-row", "--dry-run", "--out", out])
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --variants no-such-row: not a row of lab; choose among ")
    assert "reach-hst-g0" in err[0]


def test_base_pairs_rows_both_labs_ran(tmp_path, capfd):
    """--base: every row both labs ran, this - base over the seeds both ran; a base without lab.json is one
    error line, before anything runs."""
    base = synthetic_runs([0, 1, 2])
    mine = [{**r, "dev_acc": r["dev_acc"] + 2.0 + r["seed"]} for r in synthetic_runs([1, 2, 3])
            if r["row"] == "reach-hst-g0"]
    text = experiments.against_base(mine, base, "out/lab")
    assert "| reach-hst-g0 | dev_acc | 1 2 | 100.0 +- 0.0 | 103.5 +- 0.7 | +3.5 [-2.9, +9.9] |" in text
    assert "boundary" not in text
    with pytest.raises(SystemExit):
        experiments.main(["lab", "--variants", "reach-hst-g0", "--base", str(tmp_path / "none"), "--out",
                          str(tmp_path / "lab"), "--seeds", "0", "--dry-run"])
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --base {tmp_path / 'none'}: no lab.json there")


def test_jobs_give_the_runs_one_at_a_time_gives(tmp_path):
    """--jobs 3 runs the same runs as --jobs 1 (each its own seeded process): lab.json's numbers agree run for
    run; the scheduled row starts only after the run it replays (which it brings along), though a slot is free
    (else its --schedule file is missing)."""
    rows = ["shortcut-dense-g0-scheduled"]
    labs = {}
    for jobs in (1, 3):
        out = str(tmp_path / f"jobs{jobs}")
        experiments.main(["lab", "--variants", *rows, "--seeds", "0", "--jobs", str(jobs), "--out", out,
                          "--extra=--max-steps 3"])
        with open(os.path.join(out, "lab.json")) as f:
            labs[jobs] = [{k: v for k, v in r.items() if k != "wall_time_s"} for r in json.load(f)["runs"]]
    assert len(labs[1]) == 2 and labs[1] == labs[3]


def test_a_failed_run_stops_the_others_and_names_its_log(tmp_path, capfd):
    """run_all: a run that fails ends the grid with one error line naming its log, and the run beside it is
    stopped, not waited for."""
    a = argparse.Namespace(jobs=2, threads=1, out=str(tmp_path))
    sleep = [experiments.sys.executable, "-c", "import time; time.sleep(60)"]
    crash = [experiments.sys.executable, "-c", "import sys; sys.exit(3)"]
    t = experiments.time.time()
    with pytest.raises(SystemExit):
        experiments.run_all([(sleep, str(tmp_path / "slow")), (crash, str(tmp_path / "bad"))], a)
    assert experiments.time.time() - t < 30
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: run failed (exit 3); see {tmp_path / 'bad.log'}; stopped 1 other run(s) " \
                      "(the next call resumes the grid)"


def finish(out, name, seeds, acc, extra=()):
    """Fake finished runs of a lab row (final.json of recorded flags: the row's, with `extra` in place)."""
    for s in seeds:
        flags = experiments.lab_flags(row_named(name), "data/lab-reach", str(out), s)
        folder = out / f"{name}-s{s}"
        folder.mkdir(parents=True)
        final = fake_final(acc, flags=experiments.merge_flags(flags, list(extra)))
        (folder / "final.json").write_text(json.dumps(final))


def test_each_flag_once_with_the_value_that_runs(tmp_path, capfd):
    """--extra's flags replace the grid's: every planned command gives --window and --max-steps once, with
    --extra's values, also when --extra names a flag by a prefix or with "="; a flag the grid lacks comes last."""
    out = str(tmp_path / "lab")
    experiments.main(["lab", "--variants", "reach-sparse-g0", "--dry-run", "--out", out,
                      "--extra=--window 2 --max-st=300 --attn-dropout-p 0.2"])
    planned = [line.split() for _, line in commands(capfd)]
    assert len(planned) == 3
    for words in planned:
        flags = [w for w in words if w.startswith("--")]
        assert len(flags) == len(set(flags)), words
        assert words[words.index("--window") + 1] == "2" and words[words.index("--max-steps") + 1] == "300"
        assert words[words.index("--seed") + 1:words.index("--seed") + 4] == [words[words.index("--seed") + 1],
                                                                              "--attn-dropout-p", "0.2"]
    assert experiments.merge_flags(["--a", "1", "--dev-file", "x", "y", "--b"], ["--dev-file", "z"]) == \
        ["--a", "1", "--dev-file", "z", "--b"]


def test_a_finished_run_stands_only_for_its_own_flags(tmp_path, capfd):
    """A finished run is reused by its own command (the runner's flags aside, --extra giving the grid's own
    value too); run with other flags, the grid is one error line naming the folder and the flags, before
    anything runs. A Config flag the row leaves out counts at the model's value."""
    out = tmp_path / "lab"
    finish(out, "reach-sparse-g0", (0, 1, 2), 0.638)
    argv = ["lab", "--variants", "reach-sparse-g0", "--out", str(out), "--threads", "2"]
    for extra in ([], ["--extra=--window=1 --attn-dropout none"]):
        experiments.main(argv + extra + ["--dry-run"])
        assert commands(capfd) == []                                   # all three reused
    for extra, says in [("--attn-dropout standard", "--attn-dropout none, planned standard"),
                        ("--window 2 --lr 1e-3", "--lr 0.002, planned 0.001; --window 1, planned 2"),
                        ("--attn-dropout-p 0.3", "--attn-dropout-p 0.1, planned 0.3")]:
        for dry in ([], ["--dry-run"]):
            with pytest.raises(SystemExit) as e:
                experiments.main(argv + [f"--extra={extra}", *dry])
            err = capfd.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and err == [
                f"error: {out / 'reach-sparse-g0-s0'} holds a finished run of other flags ({says}) (and 2 other "
                "run folder(s) like it): give another --out"], err
    assert sorted(os.listdir(out)) == [f"reach-sparse-g0-s{s}" for s in (0, 1, 2)]     # nothing started
    # a run made with --attn-dropout-p 0.3 does not stand for the row, which leaves it at Config's 0.1
    finish(tmp_path / "other", "reach-sparse-g0", (0,), 0.638, ["--attn-dropout-p", "0.3"])
    with pytest.raises(SystemExit):
        experiments.main(["lab", "--variants", "reach-sparse-g0", "--seeds", "0", "--out", str(tmp_path / "other")])
    assert "(--attn-dropout-p 0.3, planned 0.1)" in capfd.readouterr().err


def test_a_variant_is_recorded_as_it_ran_and_paired_by_its_row(tmp_path, capfd):
    """The lab read from finished runs (no training): the row run again at 63.8% is paired with the documented
    lab and said to be unable to tell them apart (both at its bound); a --window 2 variant keeps the row's name,
    says what it changed in lab.json, lab.md and base.md, and is not at the bound of window 1."""
    base = "docs/results/results_lab.json"
    same, variant = tmp_path / "same", tmp_path / "variant"
    finish(same, "reach-sparse-g0", (0, 1, 2), 0.638)
    experiments.main(["lab", "--variants", "reach-sparse-g0", "--out", str(same), "--base", base])
    text = (same / "base.md").read_text()
    assert "| reach-sparse-g0 | dev_acc | 0 1 2 | 63.8 +- 0.0 | 63.8 +- 0.0 | +0.0 [+0.0, +0.0]; cannot tell " \
           "them apart: both at 63.8, its bound |" in text
    finish(variant, "reach-sparse-g0", (0, 1, 2), 0.787, ["--window", "2"])
    experiments.main(["lab", "--variants", "reach-sparse-g0", "--out", str(variant), "--base", base,
                      "--extra=--window 2"])
    runs = json.loads((variant / "lab.json").read_text())["runs"]
    assert [(r["row"], r["changed"]) for r in runs] == [("reach-sparse-g0", "--window 2")] * 3
    assert "| lab-reach (ran with --window 2) | sparse |" in (variant / "lab.md").read_text()
    text = (variant / "base.md").read_text()
    assert "| reach-sparse-g0 (ran with --window 2) | dev_acc | 0 1 2 | 63.8 +- 0.0 | 78.7 +- 0.0 | +14.9 " \
           "[+14.9, +14.9] |" in text and "cannot tell" not in text


def test_cannot_tell_names_the_limit_both_rows_sit_at():
    """Both rows at one limit on every seed: the ceiling, the bound, a floor (the shortcut task's floor is
    reading token 1 alone, 46.6% on the lab's dev set); one seed off the limit, or the rows apart: no words."""
    limits = experiments.lab_limits("dev_acc", [{"bound": 63.8}] * 3, [{"bound": 63.8, "task": "lab-shortcut"}] * 3)
    assert experiments.cannot_tell([100.0] * 3, [100.0] * 3, limits) == "cannot tell them apart: both at 100.0, " \
                                                                       "the ceiling"
    assert experiments.cannot_tell([63.8] * 3, [63.8] * 3, limits) == "cannot tell them apart: both at 63.8, its bound"
    floor = dict((name, value) for value, name in experiments.lab_floors("lab-shortcut"))
    assert round(floor["reading only the shortcut"], 1) == 46.6
    assert experiments.cannot_tell([46.6] * 3, [46.6] * 3, limits) == \
        "cannot tell them apart: both at 46.6, reading only the shortcut"
    assert experiments.cannot_tell([46.6, 46.6, 46.9], [46.6] * 3, limits) == ""        # one seed above the floor
    assert experiments.cannot_tell([46.6] * 3, [46.6, 46.6, 60.0], limits) == ""
    assert experiments.cannot_tell([80.0] * 3, [80.0] * 3, limits) == ""                # equal, at no limit
    other = experiments.lab_limits("dev_acc", [{"bound": 63.8}], [{"bound": 79.6, "task": "lab-reach"}])
    assert experiments.cannot_tell([63.8], [79.6], other) == ""                      # bounds differ
    drop = experiments.lab_limits("drop", [{}] * 2, [{}] * 2)
    assert experiments.cannot_tell([0.0, 0.0], [0.0, 0.0], drop) == "cannot tell them apart: both at 0.0, no drop " \
                                                                     "under any shift"
