"""research/experiments.py: the grids and probes behind docs/results.md, one command each.

What it is: a thin driver, not part of the course. Every cell of a table is an ordinary
`python train.py ...` run (its exact command is printed; its final.json keeps every flag in force);
this file loops over rows and seeds, skips the runs that finished with the same flags (an
interrupted grid continues where it stopped), and writes each table (Markdown) and its raw numbers
(JSON) to --tables. Seeds are paired: a row's difference to the baseline row comes with a 95%
t-interval.

The experiments (the ERNIE-Sparse rows: hst, the baseline, then dense, sparse, hst+sar, hst+rdrop):
  listops               from scratch on short generated ListOps (10-60 tokens), under every shift
  listops-long          the same at LRA's lengths (500-1,000 tokens); --candidates: the learning
                        curves of the model sizes that chose the grid's model (LONG_CANDIDATES)
  listops-long-probe    what a shift does to the listops-long models' answers (changes, KL)
  pretrained-sparse     the same rows fine-tuned from --init on SST-2 and MR, under every shift
  pretrained-attendout  fine-tuning --init with standard (baseline), none, attendout, scheduled,
                        layerdrop or attn_layerdrop attention dropout; 1,000 training examples
                        (lowres) or all (full)
  gnet-lr               the G-Nets' learning rate at the author's setting (MiniLM at --lr 2e-5)
  sar-ce                the demo with SAR's cross-entropy on both views against the original alone
  lab                   the generated tasks where one mechanism decides (data.LAB); --variants ROW
                        runs one row, --base OTHER_LAB pairs it by seed with another lab (base.md)
  shortcut-text         a word that gives the label away in real text (SST-2, MR): how much each
                        method relies on it (--parts probe, main, sparse, oracle, p1)

How a grid works (each grid is one function of EXPERIMENTS, called twice by main):
  plan  main calls the grid with a.plan = []: the grid loops over its rows and seeds and calls
        run_train(flags, out, a) for each run. run_train adds --extra's flags (each flag once:
        --extra's value replaces the grid's), skips a run whose OUT/final.json recorded the same
        flags, and puts the others' commands in a.plan; a finished run of other flags is one error
        line before anything runs. The grid returns before its table (`if a.plan is not None:
        return`). --dry-run prints a.plan.
  run   run_all runs a.plan, --jobs runs at a time, each its own train.py process (OUT/NAME.log).
  read  main calls the grid again with a.plan = None: run_train now returns each run's final.json,
        with "changed" (the flags --extra changed in that run, read off its recorded flags), and
        the grid writes its table (write_table: --tables/NAME.md and NAME.json; the lab:
        OUT/lab.json, lab.md and base.md).
A new grid is a function (its rows, seeds, run_train calls and table, in that order; `lab` is the
model) and its entry in EXPERIMENTS.

How to run it (from the repository root; --dry-run prints a grid's commands and runs nothing):
    python research/experiments.py listops --threads 2
    python research/experiments.py listops-long --variants hst sparse hst+sar --dry-run
    python research/experiments.py listops-long --candidates --variants 2x64 2x128
    python research/experiments.py listops-long-probe --variants hst sparse hst+sar
    python research/experiments.py pretrained-sparse --init ckpt/minilm.pt --data-root DATA
    python research/experiments.py pretrained-attendout --init ckpt/minilm.pt --data-root DATA \
        --seeds 0 1 2 3 4
    python research/experiments.py gnet-lr --init ckpt/minilm.pt --data-root DATA --seeds 0 1 2
    python research/experiments.py lab --out out/lab --jobs 2
    python research/experiments.py lab --variants reach-sparse-g0 --extra="--window 2" \
        --out out/mine --base docs/results/results_lab.json
    python research/experiments.py shortcut-text --init ckpt/minilm.pt --data-root DATA --jobs 2
ckpt/minilm.pt comes from `python model.py convert HF_DIR ckpt/minilm.pt`; DATA holds sst2/ and
mr/, each with train.tsv and dev.tsv as label<TAB>sentence. More train.py flags for every run go in
ONE string, always written with "=" (--extra="--window 2 --lr 1e-3"), so that the grid's own flags
(--out, --base, --dry-run) may come anywhere on the line, before or after it.
"""
import argparse
import collections
import functools
import hashlib
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time

import torch

# the repository root: the six files
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import sar  # noqa: E402
import train  # noqa: E402
from data import ArgumentParser, fail, one_line_errors  # noqa: E402
from model import Config, build_model, read_checkpoint  # noqa: E402

# -----------------------------------------------------------------------------
# A run's flags. A command is a list of words; flag_dict cuts it into an ordered {flag: [values]}: a
# word that opens with "--" opens a flag (by its full name: train.py's parser also takes an
# unambiguous prefix), the words after it are its values (no value of train.py's opens with "--"). A
# flag given twice keeps its first place and its last value, the one argparse uses.

RUNNER_FLAGS = ("out", "threads", "overwrite")     # the runner's: they never tell two runs apart
# research/oracle_mask.py's own, beside train.py's
ORACLE_FLAGS = ("--oracle-layers",)


def flag_dict(words):
    """{flag: [values]} of a command's words, in order, each flag once (its last value)."""
    names = [*train.make_parser()._option_string_actions, *ORACLE_FLAGS]
    flags, name = {}, None
    for word in words:
        if not word.startswith("--"):
            flags[name].append(word)
            continue
        word, eq, value = word.partition("=")                    # --window=2
        prefixed = [n for n in names if n.startswith(word)]
        name = word if word in names or len(prefixed) != 1 else prefixed[0]
        flags[name] = [value] if eq else []
    return flags


def flag_words(flags):
    return [word for name, values in flags.items() for word in (name, *values)]


def merge_flags(words, more):
    """`words` with each flag of `more` in place of its value there (or after them, where `words`
    lacks it): every flag once, with the value that runs."""
    flags = flag_dict(words)
    flags.update(flag_dict(more))
    return flag_words(flags)


@functools.lru_cache(maxsize=None)
def model_config(init):
    """The model.Config a run starts from: Config's defaults from scratch, the checkpoint's with
    --init."""
    return Config() if init == "scratch" else read_checkpoint(init)[0]


def differences(words, recorded):
    """[(flag, recorded value, planned value)]: the flags in which a finished run (final.json's
    "args", every flag in force) differs from the flags `words` would run with (train.parse_args). A
    Config flag that `words` leave out takes the model's value (model_config; gnet_lr None: --lr's,
    train.gnet_peak_lr). Not compared: the runner's flags, --max-len and --max-positions left to the
    task and the model, and research/oracle_mask.py's --oracle-layers (train.py does not record it;
    the row's folder names it)."""
    flags = {n: v for n, v in flag_dict(words).items() if n not in ORACLE_FLAGS}
    planned = vars(train.parse_args(flag_words(flags)))
    found = []
    for name, was in recorded.items():
        if name in RUNNER_FLAGS or name not in planned:
            continue
        want = planned[name]
        if want is None and name in ("max_len", "max_positions"):
            continue
        if want is None and name in train.CONFIG_FLAGS:
            want = getattr(model_config(planned["init"]), name)
            want = planned["lr"] if name == "gnet_lr" and want is None else want
        # as final.json holds it: tuples are lists
        if json.loads(json.dumps(want)) != was:
            found.append((train.flag(name), was, want))
    return found


def shown(value):
    """A flag's value as a command line writes it."""
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def changed_words(found):
    """differences' flags with the values the run recorded: "--attn-dropout dropkey --window 2"."""
    return " ".join(f"{name} {shown(was)}" for name, was, _ in found) or None


# -----------------------------------------------------------------------------
# Runs, tables and paired statistics

def run_train(flags, out, a, script="train.py"):
    """One `python SCRIPT FLAGS` run into `out`, --extra's flags in place of the grid's
    (merge_flags). While the grid is planned (a.plan a list): nothing, the run's command joining
    a.plan unless `out` holds a finished run of the same flags; a finished run of other flags joins
    a.stale (main's error). While the grid is read: the run's final.json, with "changed", the flags
    in which the run differs from `flags` (None: none)."""
    final = os.path.join(out, "final.json")
    words = merge_flags(flags, a.extra)
    if a.plan is not None:
        if os.path.exists(final):
            with open(final) as f:
                found = differences(words, json.load(f).get("args", {}))
            if found:
                a.stale.append((out, found))
        elif out not in [folder for _, folder in a.plan]:   # two parts of a grid may share a run
            cmd = [sys.executable, os.path.join(ROOT, script), *words, "--out", out, "--overwrite",
                   "--threads", str(a.threads)]
            a.plan.append((cmd, out))
        return None
    with open(final) as f:
        record = json.load(f)
    record["changed"] = changed_words(differences(flags, record.get("args", {})))
    return record


def stale_error(stale):
    """The one error line for finished runs of other flags than planned (run_train's a.stale)."""
    out, found = stale[0]
    flags = "; ".join(f"{name} {shown(was)}, planned {shown(want)}" for name, was, want in found)
    more = f" (and {len(stale) - 1} other run folder(s) like it)" if len(stale) > 1 else ""
    return f"{out} holds a finished run of other flags ({flags}){more}: give another --out"


def ran_as(name, finals):
    """A table's row name, with the flags --extra changed in its runs: "hst (ran with --window
    2)"."""
    changes = sorted({f["changed"] for f in finals if f.get("changed")})
    return f"{name} (ran with {'; '.join(changes)})" if changes else name


def schedule_source(cmd):
    """The run folder whose droprates.jsonl a command replays (--schedule FILE), or None."""
    if "--schedule" not in cmd:
        return None
    return os.path.dirname(cmd[cmd.index("--schedule") + 1])


def run_all(plan, a):
    """Run the planned (command, folder) pairs, a.jobs at a time, each its own train.py process at
    --threads threads, its console in OUT/NAME.log; a scheduled run starts after the run it replays.
    One line per run started and finished. A failed run stops the others and names its log; Ctrl-C
    stops them all. Either way the finished runs stay finished (the next call skips them) and the
    stopped ones start over. SIGTERM (`kill`) does the same as Ctrl-C."""
    waiting = list(plan)
    running = {}                                         # Popen -> (folder, log file, start time)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    failed = None
    # `kill` stops the children too (finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        while (waiting or running) and failed is None:
            pending = {out for _, out in waiting} | {out for out, _, _ in running.values()}
            for cmd, out in list(waiting):
                if len(running) >= a.jobs:
                    break
                if schedule_source(cmd) in pending:      # its source has not finished yet
                    continue
                waiting.remove((cmd, out))
                print("$ " + shlex.join(cmd), flush=True)
                log = open(os.path.join(a.out, os.path.basename(out) + ".log"), "w")
                child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                running[child] = (out, log, time.time())
            time.sleep(0.2)
            for child in [c for c in running if c.poll() is not None]:
                out, log, t = running.pop(child)
                log.close()
                if child.returncode != 0:
                    failed = f"run failed (exit {child.returncode}); see {log.name}"
                    break
                left = len(waiting) + len(running)
                print(f"  done {os.path.basename(out)} in {time.time() - t:.0f}s ({left} to go)",
                      flush=True)
    finally:
        for child, (out, log, _) in running.items():    # Ctrl-C, or another run failed
            child.terminate()
            child.wait()
            log.close()
    if failed:
        stopped = f"; stopped {len(running)} other run(s)" if running else ""
        fail(failed + stopped + " (the next call resumes the grid)")


def fmt(xs, scale=100.0):
    """'83.1 +- 0.4': mean +- std over seeds, in percent."""
    xs = [x * scale for x in xs]
    return f"{statistics.mean(xs):.1f} +- {statistics.stdev(xs) if len(xs) > 1 else 0.0:.1f}"


# two-sided 95% quantiles of Student's t, t_{0.975, df}, df = 1 .. 30 (any statistics table)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def t975(df):
    """t_{0.975, df}: the table for df <= 30, the normal quantile 1.960 beyond (within 2% there)."""
    if df < 1:
        raise ValueError(f"a confidence interval needs at least 2 paired seeds (df = {df})")
    return T975[df - 1] if df <= len(T975) else 1.960


def paired_ci(xs, ys):
    """Paired difference ys - xs over seeds: (mean d, half-width of its 95% CI)."""
    if len(xs) != len(ys):
        raise ValueError(f"paired_ci: {len(xs)} baseline seeds against {len(ys)}")
    d = [y - x for x, y in zip(xs, ys)]                  # d_s = y_s - x_s, one per seed
    n = len(d)
    # mean +- t sd(d) / sqrt(n)
    return statistics.mean(d), t975(n - 1) * statistics.stdev(d) / math.sqrt(n)


def fmt_diff(xs, ys, scale=100.0):
    """'+1.2 [-0.3, +2.7]': the paired difference and its 95% CI in points; '(baseline)' for the
    baseline itself; with one seed the difference alone."""
    if xs is ys:
        return "(baseline)"
    # a grid run with one --seeds value: no interval
    if len(xs) == len(ys) == 1:
        return f"{(ys[0] - xs[0]) * scale:+.1f} (one seed: no interval)"
    m, h = paired_ci([x * scale for x in xs], [y * scale for y in ys])
    return f"{m:+.1f} [{m - h:+.1f}, {m + h:+.1f}]"


def chosen(a, rows, baseline=True):
    """The names of `rows` that --variants picks, in the table's order (all without --variants). One
    error line for a name that is no row, or (baseline=True) a choice without the first row, the
    paired differences' base."""
    unknown = [v for v in a.variants or [] if v not in rows]
    if unknown:
        fail(f"--variants {' '.join(unknown)}: not a row of {a.experiment}; choose among "
             f"{' '.join(rows)}")
    first = next(iter(rows))
    if a.variants and baseline and first not in a.variants:
        fail(f"--variants: the baseline row {first} must be among them (the paired differences "
             f"are taken against it)")
    return [name for name in rows if not a.variants or name in a.variants]


def command_line(a):
    """The grid's command as typed, for the tables' "Command:" line: each word shell-quoted, --extra
    in its documented form (--extra='--window 2')."""
    quoted = lambda w: ("--extra=" + shlex.quote(w[len("--extra="):]) if w.startswith("--extra=")
                        else shlex.quote(w))
    return " ".join(quoted(w) for w in a.argv)


def write_table(a, name, lines, note, raw=None):
    """NAME.md (the table's lines and the note under it) and NAME.json (its raw numbers) in
    --tables."""
    command = f"Command: `python research/experiments.py {command_line(a)}`."
    text = "\n".join(lines) + "\n\n" + f"{command} {note}\n"
    print("\n" + text)
    os.makedirs(a.tables, exist_ok=True)
    with open(os.path.join(a.tables, name + ".md"), "w") as f:
        f.write(text)
    if raw is not None:
        with open(os.path.join(a.tables, name + ".json"), "w") as f:
            json.dump(raw, f, indent=1)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_name(name):
    return name.replace("+", "_")                        # "hst+sar" -> run folder "..-hst_sar-s0"


# -----------------------------------------------------------------------------
# ERNIE-Sparse (methods.md §2): the rows, and how a run's final weights fare under every topology
# shift

SPARSE_ROWS = {             # the baseline first: HST without SAR
    "hst": ["--attention", "hst"],
    "dense": ["--attention", "dense"],
    "sparse": ["--attention", "sparse"],
    "hst+sar": ["--attention", "hst", "--sar", "1.0", "--sar-shift", "1"],
    "hst+rdrop": ["--attention", "hst", "--rdrop", "1.0"],
    # SAR's parts: hst+sar takes the cross-entropy on the original view only (train.py's default);
    # hst+sar_ce_all on both views (R-Drop's form); hst+views2 the shifted view without consistency
    "hst+sar_ce_all": ["--attention", "hst", "--sar", "1.0", "--sar-shift", "1", "--ce", "all"],
    "hst+views2": ["--attention", "hst", "--views", "2", "--sar", "0", "--sar-shift", "1", "--ce",
                   "all"],
}


def shifted_scores(fs, dirs):
    """Per seed, from each run's final.json (train.py --eval-shift all): the dev accuracy on the
    original topology ("acc"), its mean and worst over the shifts s = 1 .. b-1, the accuracy at each
    ("acc_by_shift": [original, s = 1, 2, ...]) and the drop under shifting, acc - the shifts' mean
    (methods.md §2.3)."""
    cols = collections.defaultdict(list)
    for f, d in zip(fs, dirs):
        dev = dev_metrics(f)
        if "shift" not in dev:
            fail(f"{d}/final.json has no shifted scores (a run without --eval-shift all): remove "
                 f"it to rerun")
        cols["acc"].append(dev["acc"])
        cols["acc_shift_mean"].append(dev["shift"]["mean"]["acc"])
        cols["acc_shift_worst"].append(dev["shift"]["worst"]["acc"])
        cols["acc_by_shift"].append([dev["acc"]] + [m["acc"] for m in dev["shift"]["by"].values()])
        cols["shift_drop"].append(dev["acc"] - dev["shift"]["mean"]["acc"])
        cols["wall_time_s"].append(f["wall_time_s"])
        cols["changed"].append(f.get("changed"))         # run_train's: the flags --extra changed
    return dict(cols)


SPARSE_HEADER = ("dev acc (%) | per seed (%) | shifted, mean over s (%) | shifted, worst s (%) | "
                 "drop under shift (points) | paired diff to hst (points, 95% CI) | same, worst s "
                 "| same, drop | time per run (s)")


def sparse_cells(raw, name):
    """SPARSE_HEADER's cells of row `name` of one table (raw: {row: shifted_scores}), paired to
    raw["hst"]."""
    cols, diff = raw[name], lambda col: fmt_diff(raw["hst"][col], raw[name][col])
    # shows a run left at the majority class
    per_seed = " / ".join(f"{100 * x:.1f}" for x in cols["acc"])
    return (f"{fmt(cols['acc'])} | {per_seed} | {fmt(cols['acc_shift_mean'])} | "
            f"{fmt(cols['acc_shift_worst'])} | {fmt(cols['shift_drop'])} | {diff('acc')} | "
            f"{diff('acc_shift_worst')} | {diff('shift_drop')} | "
            f"{statistics.mean(cols['wall_time_s']):.0f}")


# -----------------------------------------------------------------------------
# ERNIE-Sparse from scratch on generated ListOps: short (a sanity check), and at LRA's lengths
# (topology matters)

# b = 8, window 1, one global token ([CLS]), no random blocks; a 2 x 64 model, 5 epochs of 5,000
# sequences
SHORT_DATA = dict(n_train=5000, n_val=500, n_test=100, min_len=10, max_len=60, max_depth=3,
                  max_args=4, seed=1)
SHORT_FLAGS = ["--task", "listops", "--init", "scratch", "--layers", "2", "--hidden", "64",
               "--heads", "4",
               "--ffn", "128", "--block-size", "8", "--window", "1", "--num-global", "1",
               "--num-random", "0",
               "--epochs", "5", "--batch-size", "32", "--lr", "1e-3", "--eval-every", "0",
               "--attn-dropout", "standard", "--sar", "0", "--eval-shift", "all"]
# LRA's recipe (depth 10, up to 10 arguments) at 500-1,000 tokens, not LRA's 500-2,000 (that would
# double every run on 2 CPU cores); 20,000 training sequences (LRA: 96,000)
LONG_DATA = dict(n_train=20000, n_val=500, n_test=100, min_len=500, max_len=1000, seed=1)
# b = 32 cuts a sequence into 16-32 blocks; a token sees its own and both neighbouring blocks (96
# tokens), one random block, [CLS] and (HST) its block's representative: tokens further apart than
# the window meet only through those (methods.md §2.1, §2.2)
LONG_TOPOLOGY = ["--block-size", "32", "--window", "1", "--num-global", "1", "--num-random", "1"]
# the grid's model: the smallest of LONG_CANDIDATES that learned (2 x 64 stayed at the majority
# class for 1,000 steps, 2 x 128 reached 34% by step 300; docs/results.md); LRA: 6 layers, d 512
LONG_MODEL = ["--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "256"]
# no attention dropout (LRA: 0.1), hidden dropout 0.1; one evaluation, of the final weights, after
# 500 steps of batch 32 (0.8 epoch; LRA: 5,000 steps): the candidates' curves are flat after step
# 300
LONG_COMMON = ["--task", "listops", "--init", "scratch", "--max-len", "1000", "--batch-size", "32",
               "--lr", "1e-3",
               "--attn-dropout", "none", "--sar", "0", "--eval-every", "1000000"]
LONG_FLAGS = [*LONG_COMMON, "--max-steps", "500", *LONG_MODEL, *LONG_TOPOLOGY, "--eval-shift",
              "all"]
# model sizes whose learning curves (hst, one seed, 1,000 steps) chose LONG_MODEL
LONG_CANDIDATES = {
    "2x64": ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128"],
    "2x128": ["--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "256"],
    "4x64": ["--layers", "4", "--hidden", "64", "--heads", "4", "--ffn", "128"],
}
# --candidates: a dev score every 100 steps
LONG_CURVE = ["--max-steps", "1000", "--eval-every", "100"]
# data, flags
LISTOPS = {"listops": (SHORT_DATA, SHORT_FLAGS), "listops-long": (LONG_DATA, LONG_FLAGS)}


def listops_data(a, name):
    """OUT/NAME-data: the grid's ListOps (data.write_listops), generated once; a folder already
    there is used."""
    folder = os.path.join(a.out, f"{name}-data")
    if not os.path.exists(os.path.join(folder, "basic_val.tsv")):
        print(f"generating {folder}: data.write_listops({LISTOPS[name][0]})", flush=True)
        if not a.dry_run:
            data.write_listops(folder, **LISTOPS[name][0])
    return folder


def listops_grid(a):
    """The ERNIE-Sparse rows on generated ListOps, seed-major (every row's seed 0 first), each run's
    final weights scored on the original topology and under every shift; paired differences to
    hst."""
    folder = listops_data(a, a.experiment)
    if a.candidates:
        return listops_candidates(a, folder)
    finals, dirs = collections.defaultdict(list), collections.defaultdict(list)
    for s in a.seeds:
        for name in chosen(a, SPARSE_ROWS):
            out = os.path.join(a.out, f"{a.experiment}-{run_name(name)}-s{s}")
            flags = [*LISTOPS[a.experiment][1], *SPARSE_ROWS[name], "--data", folder, "--seed",
                     str(s)]
            finals[name].append(run_train(flags, out, a))
            dirs[name].append(out)
    if a.plan is not None:                               # main's planning pass: nothing ran yet
        return
    raw = {name: shifted_scores(fs, dirs[name]) for name, fs in finals.items()}
    f0 = finals["hst"][0]
    table = [f"| attention | {SPARSE_HEADER} |", "|---" * 10 + "|",
             *[f"| {ran_as(name, finals[name])} | {sparse_cells(raw, name)} |" for name in raw]]
    note = (f"Generated ListOps (data.write_listops({LISTOPS[a.experiment][0]})); majority-class "
            f"baseline {100 * f0['majority_baseline']:.1f}%. Seeds {a.seeds}; mean +- std over "
            "seeds of the final weights' dev accuracy; paired difference to hst with a 95% "
            f"t-interval over seeds. Shifted: every s = 1 .. {f0['config']['block_size'] - 1} "
            "(train.py --eval-shift all; dense: s = 1 alone, a shift moves no block boundary). "
            f"Flags: {' '.join(merge_flags(LISTOPS[a.experiment][1], a.extra))}")
    write_table(a, "results_" + a.experiment.replace("-", "_"), table, note, raw)


def listops_candidates(a, folder):
    """listops-long --candidates: the learning curve (dev accuracy every 100 steps, original
    topology) of each LONG_CANDIDATES size, hst, the first --seeds value; the smallest that learns
    is the grid's LONG_MODEL."""
    s, curves, walls = a.seeds[0], {}, {}
    # --variants 2x64 2x128: only these sizes
    for name in chosen(a, LONG_CANDIDATES, baseline=False):
        out = os.path.join(a.out, f"listops-long-candidate-{name}-s{s}")
        flags = [*LONG_COMMON, *LONG_CURVE, *LONG_CANDIDATES[name], *LONG_TOPOLOGY, "--attention",
                 "hst",
                 "--data", folder, "--seed", str(s)]
        f = run_train(flags, out, a)
        if f is not None:
            log = read_jsonl(os.path.join(out, "log.jsonl"))
            curves[name] = {r["step"]: r["dev"]["dev"]["acc"] for r in log if "dev" in r}
            walls[name] = f["wall_time_s"]
    if a.plan is not None:                               # main's planning pass: nothing ran yet
        return
    steps = sorted({step for c in curves.values() for step in c})
    cell = lambda c, step: f"{100 * c[step]:.1f}" if step in c else "-"
    table = [f"| step | {' | '.join(curves)} |", "|---" * (len(curves) + 1) + "|",
             *[f"| {step} | {' | '.join(cell(c, step) for c in curves.values())} |"
               for step in steps],
             f"| time per run (s) | {' | '.join(f'{w:.0f}' for w in walls.values())} |"]
    note = (f"Dev accuracy (%) on the original topology; hst attention, seed {s}; majority-class "
            f"baseline {100 * f['majority_baseline']:.1f}%. Candidates: "
            f"{({n: LONG_CANDIDATES[n] for n in curves})}. Flags: "
            f"{' '.join(merge_flags(LONG_COMMON + LONG_CURVE + LONG_TOPOLOGY, a.extra))}")
    write_table(a, "results_listops_long_candidates", table, note, {"curves": curves,
                                                                    "wall_time_s": walls})


# -----------------------------------------------------------------------------
# The shift probe: what a shift does to the trained listops-long models' answers (methods.md §2.3)

def probe_shifts(b):
    """The shifts the probe scores: 1 and a quarter, half and three quarters of the block (b = 32:
    1, 8, 16, 24)."""
    return sorted({1, max(1, b // 4), max(1, b // 2), max(1, 3 * b // 4)})


def window_change(s, b):
    """The mean share of a token's window keys (its block and both neighbours, 3b tokens) a shift by
    s replaces. A token at offset o keeps its block when o + s < b (b - s offsets; the window moves
    by s tokens), else it moves to the next (s offsets; the window moves by b - s): ((b - s) s + s
    (b - s)) / b / (3b)."""
    # = 2 s (b - s) / (3 b^2): at most 1/6, at s = b/2
    return 2 * s * (b - s) / (3 * b * b)


def listops_long_probe(a):
    """Per listops-long run (its ckpt_last.pt), the dev predictions on the original topology against
    those under each shift of probe_shifts: the share of sequences whose predicted class changes,
    and the symmetric KL of the two outputs (sar.consistency, what SAR trains down). Accuracy moves
    only when a prediction flips between right and wrong; these two say whether the shift changes
    the model's output at all."""
    torch.set_num_threads(a.threads)
    folder, tok = os.path.join(a.out, "listops-long-data"), data.fixed_tokenizer("listops")
    if not os.path.isdir(folder):
        fail(f"{folder}: no such folder (run `python research/experiments.py listops-long --out "
             f"{a.out}` first)")
    task = data.load_task("listops", folder, tok, max_len=1000)
    batches = data_batches(task.dev["dev"], 32, tok.pad_id)
    # batch order
    dev_ops = [outermost_operator(row) for bt in batches for row in bt["input_ids"].tolist()]
    # the shortcut: each operator's commonest training label
    rule = operator_rule(task.train)
    rule_acc = statistics.mean(float(rule.get(outermost_operator(e.ids)) == e.label)
                               for e in task.dev["dev"])
    rows, raw = [], {}
    # dense: no block boundary to move
    for name in [n for n in chosen(a, SPARSE_ROWS) if n != "dense"]:
        raw[name] = []
        for s in a.seeds:
            path = os.path.join(a.out, f"listops-long-{run_name(name)}-s{s}", "ckpt_last.pt")
            if not os.path.exists(path):
                fail(f"{path}: no such checkpoint (run `python research/experiments.py "
                     f"listops-long` first)")
            cfg, state, _, _ = read_checkpoint(path)
            shifts = probe_shifts(cfg.block_size)
            kept = os.path.join(os.path.dirname(path), "shift_probe.json")   # a run is probed once
            if os.path.exists(kept) and os.path.getmtime(kept) > os.path.getmtime(path):
                effects = json.load(open(kept))
            else:
                effects = shift_effects(build_model(cfg, state, path).eval(), batches, shifts)
                effects["0"]["by_operator"] = operator_share(effects["0"].pop("pred"), dev_ops)
                with open(kept, "w") as f:
                    json.dump(effects, f)
            raw[name].append(effects)
            cells = [f"{100 * effects[sh]['flip']:.1f} / {effects[sh]['kl']:.1e}"
                     for sh in map(str, shifts)]
            rows.append(f"| {name} | {s} | {100 * effects['0']['acc']:.1f} | "
                        f"{100 * effects['0']['by_operator']:.1f} "
                        # one line a run: a run left at the majority class shows
                        f"| {' | '.join(cells)} |")
    b = cfg.block_size
    table = [f"| attention | seed | dev acc (%) | answers fixed by the outermost operator (%) "
             f"| {' | '.join(f's = {sh}: changed (%) / KL' for sh in shifts)} |",
             "|---" * (len(shifts) + 4) + "|",
             f"| (window keys a shift replaces, %) | | | | "
             f"{' | '.join(f'{100 * window_change(sh, b):.1f}' for sh in shifts)} |", *rows]
    shortcut = ", ".join(f"{tok.SYMBOLS[op]} -> {y}" for op, y in sorted(rule.items()))
    note = (f"Each run's final weights (ckpt_last.pt), the {len(task.dev['dev'])} dev sequences. "
            "Answers fixed by the outermost operator: the share of sequences whose prediction is "
            "the model's commonest prediction for that sequence's first operator token (100% = "
            "the answer is a function of that one token); predicting each operator's commonest "
            f"training label scores {100 * rule_acc:.1f}% ({shortcut}). Shift cells: predictions "
            "the shift changes (%) / symmetric KL between the original and the shifted outputs "
            "(mean). The first row: the share of a token's window keys the shift replaces, 2 s (b "
            f"- s) / (3 b^2) with b = {b}.")
    write_table(a, "results_listops_long_shift_probe", table, note, raw)


def outermost_operator(ids):
    """The first operator token of a ListOps sequence (parentheses are not tokens: it sits right
    after [CLS])."""
    return next((i for i in ids if data.ListOpsTokenizer.SYMBOLS[i].startswith("[")), None)


def counts_by(keys, values):
    """{key: Counter of the values that come with it}."""
    counts = collections.defaultdict(collections.Counter)
    for k, v in zip(keys, values):
        counts[k][v] += 1
    return counts


def operator_rule(examples):
    """{outermost operator id: its commonest label} over `examples` (ListOps' one-token
    shortcut)."""
    counts = counts_by((outermost_operator(e.ids) for e in examples), (e.label for e in examples))
    return {op: c.most_common(1)[0][0] for op, c in counts.items()}


def operator_share(preds, ops):
    """The share of predictions equal to the commonest prediction among sequences of the same
    outermost operator: 1.0 when the prediction is a function of that one token."""
    return sum(c.most_common(1)[0][1] for c in counts_by(ops, preds).values()) / len(preds)


def data_batches(examples, batch_size, pad_id):
    """The examples in fixed, longest-first batches on the CPU, as train.py's evaluation makes
    them."""
    return list(data.make_batches(data.longest_first(examples), batch_size, pad_id=pad_id, seed=0,
                                  epoch=0,
                                  shuffle=False))


@torch.no_grad()
def shift_effects(model, batches, shifts):
    """{str(s): {"acc", "flip": share of changed argmax, "kl": mean symmetric KL}} of `model` (eval
    mode) under each shift s against the original topology ("0": the original's accuracy and
    predictions, batch order)."""
    correct = lambda z, bt: (z.argmax(-1) == bt["labels"]).sum().item()
    n = sum(bt["labels"].numel() for bt in batches)
    # [B, C] each
    base = [model(bt["input_ids"], bt["attention_mask"], bt["token_type_ids"]) for bt in batches]
    out = {"0": {"acc": sum(correct(z0, bt) for z0, bt in zip(base, batches)) / n,
                 "pred": torch.cat([z0.argmax(-1) for z0 in base]).tolist()}}
    for s in shifts:
        acc = flips = kls = 0.0
        # the content keeps its positions; the blocks move by s
        for bt, z0 in zip(batches, base):
            ids, mask, pos, types = sar.shift(bt["input_ids"], bt["attention_mask"], s,
                                              model.cfg.pad_id,
                                              model.position_ids(bt["input_ids"]),
                                              bt["token_type_ids"])
            # [B, C]
            z = model(ids, mask, types, pos)
            acc += correct(z, bt)
            flips += (z.argmax(-1) != z0.argmax(-1)).sum().item()
            # 1/2 (KL(p0 || p_s) + KL(p_s || p0)), §2.3
            kls += sar.consistency(z0, z).item() * z.size(0)
        out[str(s)] = {"acc": acc / n, "flip": flips / n, "kl": kls / n}
    return out


# -----------------------------------------------------------------------------
# The papers' regime: fine-tuning a pretrained checkpoint (--init) on SST-2 and MR

# Sized for 2 CPU cores: max length 64 covers 99.9% of SST-2 / MR sentences in MiniLM's WordPiece
# tokens; lr 1e-4 suits a 6-layer MiniLM; the final weights are scored (no dev-based checkpoint
# picking: SST-2's dev is its test)
PRE_COMMON = ["--task", "tsv", "--text-col", "1", "--label-col", "0", "--max-len", "64",
              "--batch-size", "32",
              "--lr", "1e-4", "--attn-dropout-p", "0.1",
              # one evaluation and one checkpoint, at the end
              "--eval-every", "1000000", "--save-every", "0"]
# lowres: the first 1,000 lines of the training file after a fixed shuffle
SUBSAMPLE, SUBSAMPLE_SEED = 1000, 0
# setting -> (training examples or None: all, epochs)
PRE_SETTINGS = {"lowres": (SUBSAMPLE, 3), "full": (None, 1)}
DEFAULT_DATASETS = ["sst2", "mr"]
# the G-Nets' own lr in the attendout rows: at --lr 1e-4 their masks collapse in ~5 steps
GNET_LR = "1e-5"
# the baseline first; "scheduled" replays the attendout run of its set, setting and seed
ATTENDOUT_ROWS = {
    "standard": ["--attn-dropout", "standard"],
    "none": ["--attn-dropout", "none"],
    "rdrop": ["--attn-dropout", "standard", "--rdrop", "1.0"],
    "attendout": ["--attn-dropout", "attendout", "--gnet-lr", GNET_LR],
    "attendout_gnet_lr_1e-4": ["--attn-dropout", "attendout", "--gnet-lr", "1e-4"],
    "scheduled": ["--attn-dropout", "scheduled", "--schedule", "{attendout_out}/droprates.jsonl"],
    "layerdrop": ["--attn-dropout", "standard", "--layerdrop", "0.1"],
    "attn_layerdrop": ["--attn-dropout", "standard", "--attn-layerdrop", "0.1"],
}
# the rows the attendout row is paired against (besides the baseline): the no-dropout control, the
# R-Drop control (a consistency term without a G-Net), the author's G-Net lr, and its own rates
# replayed as Bernoulli dropout (the per-head G-Net's row ran at 4b33384, docs/results.md)
CONTRASTS = ["none", "rdrop", "attendout_gnet_lr_1e-4", "scheduled"]
# b = 8 gives 3-4 blocks for a typical sentence; window 1, one global token ([CLS]), no random
# blocks
PRE_SPARSE_TOPOLOGY = ["--block-size", "8", "--window", "1", "--num-global", "1", "--num-random",
                       "0"]


def write_subsample(src, n, seed, path):
    """The lowres training file: the first n lines of `src` after random.Random(seed).shuffle. Same
    input, same file, on any machine (Python's Mersenne Twister shuffle is fixed across versions).
    Returns path."""
    with open(src) as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
    random.Random(seed).shuffle(lines)
    write_if_changed(path, "".join(lines[:n]))
    return path


def write_if_changed(path, text):
    """Write `text` to `path` unless it already holds it; atomic: a stopped grid never leaves half a
    file."""
    if not (os.path.exists(path) and open(path).read() == text):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def setting_flags(a, ds, setting):
    """(--data and --train-file flags, epochs) of one data set in one setting."""
    folder = os.path.join(a.data_root, ds)
    if not os.path.isfile(os.path.join(folder, "train.tsv")):
        fail(f"--data-root {a.data_root}: no {ds}/train.tsv (label<TAB>sentence, with dev.tsv)")
    n, epochs = PRE_SETTINGS[setting]
    flags = ["--data", folder]
    # named by the source file's content too: another --data-root never reuses it
    if n is not None:
        with open(os.path.join(folder, "train.tsv"), "rb") as f:
            tag = hashlib.md5(f.read()).hexdigest()[:8]
        sub = os.path.join(a.out, "subsample", f"{ds}-train-{n}-seed{SUBSAMPLE_SEED}-{tag}.tsv")
        flags += ["--train-file", write_subsample(os.path.join(folder, "train.tsv"), n,
                                                  SUBSAMPLE_SEED, sub)]
    return flags, epochs


def pretrained_runs(a, rows, common):
    """Run (or, --dry-run, print) the grid: {(ds, setting, row): [final.json per seed]} and the run
    folders. Seed-major, so a grid stopped early has whole rows at fewer seeds. The checkpoints
    (270 MB a run) go unless --keep-ckpt: the tables need only final.json and droprates.jsonl."""
    finals, dirs = collections.defaultdict(list), collections.defaultdict(list)
    for setting in a.settings:
        for ds in a.datasets:
            flags, epochs = setting_flags(a, ds, setting)
            for s in a.seeds:
                for name in chosen(a, rows):
                    out = os.path.join(a.out, f"{ds}-{setting}-{run_name(name)}-s{s}")
                    ao_out = os.path.join(a.out, f"{ds}-{setting}-attendout-s{s}")
                    extra = [x.format(attendout_out=ao_out) for x in rows[name]]
                    f = run_train([*PRE_COMMON, *common, "--init", a.init, *flags, "--epochs",
                                   str(epochs), *extra,
                                   "--seed", str(s)], out, a)
                    finals[(ds, setting, name)].append(f)
                    dirs[(ds, setting, name)].append(out)
                    if f is not None and not a.keep_ckpt:
                        drop_checkpoints(out)
    return finals, dirs


def drop_checkpoints(folder):
    for name in ("ckpt_last.pt", "ckpt_best.pt"):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))


def settings_suffix(a):
    """'' for the default settings and data sets (lowres; sst2 and mr), else e.g. '_full' or '_mr':
    each choice writes its own table and figure, so a partial run does not overwrite the whole
    one."""
    parts = ([] if a.settings == ["lowres"] else a.settings)
    parts += [] if a.datasets == DEFAULT_DATASETS else a.datasets
    return "".join("_" + p for p in parts)


def pretrained_note(a, extra=""):
    settings = "; ".join(f"{s}: {PRE_SETTINGS[s][0] or 'all'} training examples, "
                         f"{PRE_SETTINGS[s][1]} epoch(s)"
                         for s in a.settings)
    return (f"Fine-tuned from {a.init}; {settings} (lowres: the first {SUBSAMPLE} lines after "
            f"random.Random({SUBSAMPLE_SEED}).shuffle, write_subsample). Seeds {a.seeds}; mean +- "
            "std over seeds of the final weights' dev accuracy; paired difference to the baseline "
            f"row with a 95% t-interval over seeds. {extra}Flags: "
            f"{' '.join(merge_flags(PRE_COMMON, a.extra))}")


def pretrained_sparse(a):
    """The ERNIE-Sparse rows fine-tuned, each scored on its final weights under every shift s = 1 ..
    7."""
    finals, dirs = pretrained_runs(a, SPARSE_ROWS, [*PRE_SPARSE_TOPOLOGY, "--eval-shift", "all"])
    if a.plan is not None:                               # main's planning pass: nothing ran yet
        return
    raw, rows = collections.defaultdict(dict), []
    for (ds, setting, name), fs in finals.items():
        raw[f"{ds}-{setting}"][name] = shifted_scores(fs, dirs[(ds, setting, name)])
        cells = sparse_cells(raw[f"{ds}-{setting}"], name)
        rows.append(f"| {ds} | {setting} | {ran_as(name, fs)} | {cells} |")
    table = [f"| data | setting | attention | {SPARSE_HEADER} |", "|---" * 12 + "|", *rows]
    note = pretrained_note(a, "Shifted: s = 1 .. 7 (train.py --eval-shift all; dense: s = 1 "
                              "alone). Topology: "
                              + " ".join(PRE_SPARSE_TOPOLOGY) + ". ")
    write_table(a, "results_pretrained_sparse" + settings_suffix(a), table, note, raw)


def dev_metrics(final):
    """The first dev split's metrics in a final.json: flat ("dev_splits" beside them, as train.py
    writes it) or nested (dev -> dev, older runs)."""
    return final["dev_splits"][final["dev_split"]] if "dev_splits" in final else final["dev"]["dev"]


def dev_acc(final):
    """The dev accuracy in a final.json: flat ("acc" at the top, as train.py writes it) or nested
    (dev -> dev -> acc, older runs)."""
    return final["acc"] if "acc" in final else final["dev"]["dev"]["acc"]


def pretrained_attendout(a):
    """Each attention-dropout row's dev accuracy and paired difference to standard dropout;
    attendout - scheduled (what AttendOut's choice of pairs adds beyond its per-layer rates, which
    scheduled replays); the figure of the attendout runs' per-layer drop rates."""
    finals, _ = pretrained_runs(a, ATTENDOUT_ROWS, [])
    if a.plan is not None:                               # main's planning pass: nothing ran yet
        return
    raw, rows = collections.defaultdict(dict), []
    for (ds, setting, name), fs in finals.items():
        acc = raw[f"{ds}-{setting}"][name] = [dev_acc(f) for f in fs]
        diff = fmt_diff(raw[f"{ds}-{setting}"]["standard"], acc)
        rows.append(f"| {ds} | {setting} | {ran_as(name, fs)} | {fmt(acc)} | {diff} "
                    f"| {statistics.mean(f['wall_time_s'] for f in fs):.0f} |")
    header = ("| data | setting | attention dropout | dev acc (%) "
              "| paired diff to standard, 95% CI (points) | time per run (s) |")
    table = [header, "|---|---|---|---|---|---|", *rows]
    contrasts = [f"| {key} | attendout - {other} | {fmt_diff(r[other], r['attendout'])} |"
                 for key, r in raw.items() for other in CONTRASTS
                 if other in r and "attendout" in r]
    if contrasts:                                        # the two rows paired by seed
        table += ["", "| data-setting | contrast (row - row) | paired diff, 95% CI (points) |",
                  "|---|---|---|",
                  *contrasts]
    write_table(a, "results_pretrained_attendout" + settings_suffix(a), table, pretrained_note(a),
                raw)
    if "attendout" in chosen(a, ATTENDOUT_ROWS):
        plot_droprates(a)


def plot_droprates(a):
    """droprates_pretrained[_SUFFIX].png: the attendout runs' per-layer drop rate over training
    (mean over seeds), a panel per (data set, setting); the final rates also go to
    droprates_pretrained[_SUFFIX]_final.json."""
    name = "droprates_pretrained" + settings_suffix(a)
    panels = [(ds, st) for st in a.settings for ds in a.datasets]
    final = {}
    try:
        import matplotlib
        matplotlib.use("Agg")                            # headless
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    except ImportError:
        plt, axes = None, [[None] * len(panels)]
    for ax, (ds, st) in zip(axes[0], panels):
        logs = [read_jsonl(os.path.join(a.out, f"{ds}-{st}-attendout-s{s}",
                                        "droprates.jsonl")) for s in a.seeds]
        n, layers = min(map(len, logs)), len(logs[0][0]["drop_rate"])
        mean = lambda i, l: statistics.mean(log[i]["drop_rate"][l] for log in logs)     # over seeds
        final[f"{ds}-{st}"] = [round(mean(n - 1, l), 3) for l in range(layers)]
        if ax is not None:
            frac = [logs[0][i]["step_frac"] for i in range(n)]
            for l in range(layers):
                ax.plot(frac, [mean(i, l) for i in range(n)], label=f"layer {l + 1}")
            ax.set(title=f"AttendOut masking rate per layer ({ds}, {st})", xlabel="fraction of "
                                                                                  "training",
                   ylabel="share of real pairs masked")
            ax.legend(fontsize=7)
    with open(os.path.join(a.tables, f"{name}_final.json"), "w") as f:
        json.dump(final, f)
    if plt is not None:
        fig.tight_layout()
        fig.savefig(os.path.join(a.tables, f"{name}.png"), dpi=120)
    print(f"final per-layer drop rates: {final}" + ("" if plt else " (matplotlib is not "
                                                                   "installed: no figure)"))


# -----------------------------------------------------------------------------
# The lab: generated tasks where one mechanism decides the answer (data.LAB; docs/results.md, "The
# lab"). The grid reads top to bottom: its rows (LAB_ROWS), seeds (LAB_SEEDS), flags (lab_flags),
# the grid (lab), each run's record (lab_record), the tables (lab_table, against_base) and the
# tasks' numbers (bound, floors).

# One small model for every lab run: 2 x 64 from scratch, blocks of 8 (the tasks are built for b =
# 8), window 1, no random blocks, hidden dropout 0.1 (Config's), lr 2e-3, batch 32, one evaluation
# at the end. The layers and the window fix block-sparse attention's reach (reach_tokens), which the
# bound follows.
LAB_MODEL = dict(layers=2, window=1, block=8)
LAB_COMMON = ["--init", "scratch", "--layers", str(LAB_MODEL["layers"]), "--hidden", "64",
              "--heads", "4",
              "--ffn", "128", "--block-size", str(LAB_MODEL["block"]), "--window",
              str(LAB_MODEL["window"]),
              "--num-random", "0", "--batch-size", "32", "--lr", "2e-3", "--eval-every", "1000000",
              "--save-every", "0"]
# The G-Nets' peak rate of lab-shortcut's tuned AttendOut row (--gnet-lr): 1e-4 against the
# backbone's 2e-3, chosen by a probe before the grid ran (docs/results.md, the lab's reading 5). A
# row that gives no --gnet-lr trains its G-Nets at train.py's default, DEMO_GNET_LR (train.DEMO's,
# which applies from scratch).
LAB_GNET_LR = 1e-4
DEMO_GNET_LR = train.DEMO["gnet_lr"]
# A row's settings where it names none: block-sparse without a global token, one view, no SAR, no
# attention dropout, 600 steps. views 2: SAR's shifted second view (--sar-shift 1) at consistency
# weight `sar`, the cross-entropy on both views (ce "all") or on the original alone (ce "original").
LAB_ROW = dict(attention="sparse", num_global=0, views=1, ce="all", sar=0.0, attn_dropout="none",
               gnet_lr=None, steps=600)


def lab_name(row):
    """A row's name, its run folder without the seed: the task without "lab-", the topology, and
    each setting that differs from LAB_ROW's."""
    name = f"{row['task'][4:]}-{row['attention']}-g{row['num_global']}"
    if row["views"] == 2:
        name += f"-views2-ce{row['ce']}-sar{row['sar']:g}"
    if row["attn_dropout"] != "none":
        name += f"-{row['attn_dropout']}"
    if row["gnet_lr"] is not None:
        name += f"-gnetlr{row['gnet_lr']:g}"
    return name


# lab-shortcut's AttendOut row at the lab's G-Net rate; the scheduled row replays its
# droprates.jsonl
SHORTCUT_ATTENDOUT = {**LAB_ROW, "task": "lab-shortcut", "attention": "dense",
                      "attn_dropout": "attendout", "gnet_lr": LAB_GNET_LR, "steps": 1000}
# The rows, in the order a seed runs them (a scheduled row after the row it replays). reach: the
# three topologies without a global token (the needle's only paths are the window and, under HST,
# the representatives), and sparse with [CLS] global; bottleneck: the usual global token, sparse
# against hst; boundary: block-sparse trained on one topology, scored under every shift, with one
# view and with SAR's two views split into their parts (the second view's CE, the consistency term);
# shortcut: dense attention under each attention-dropout method, AttendOut with the G-Nets at
# LAB_GNET_LR and at DEMO_GNET_LR (no --gnet-lr); sum: the graded rows, HST at 300 steps, where
# every seed lies well inside (55, 97), for a change that should move a number (pooling, the
# representatives, an attention-dropout method: none, standard and dropkey side by side).
LAB_ROWS = [{**LAB_ROW, **row} for row in [
    dict(task="lab-reach", attention="dense"),
    dict(task="lab-reach", attention="hst"),
    dict(task="lab-reach"),
    dict(task="lab-reach", num_global=1),
    dict(task="lab-bottleneck", attention="hst", num_global=1, steps=2000),
    dict(task="lab-bottleneck", num_global=1, steps=2000),
    dict(task="lab-boundary"),
    dict(task="lab-boundary", views=2, ce="all", sar=0.0),
    dict(task="lab-boundary", views=2, ce="all", sar=1.0),
    dict(task="lab-boundary", views=2, ce="original", sar=0.0),
    dict(task="lab-boundary", views=2, ce="original", sar=1.0),
    dict(task="lab-shortcut", attention="dense", steps=1000),
    dict(task="lab-shortcut", attention="dense", attn_dropout="standard", steps=1000),
    dict(task="lab-shortcut", attention="dense", attn_dropout="dropkey", steps=1000),
    SHORTCUT_ATTENDOUT,
    dict(task="lab-shortcut", attention="dense", attn_dropout="scheduled", steps=1000,
         schedule=lab_name(SHORTCUT_ATTENDOUT)),
    dict(task="lab-shortcut", attention="dense", attn_dropout="attendout", steps=1000),
    dict(task="lab-sum", attention="hst", steps=300),
    dict(task="lab-sum", attention="hst", attn_dropout="standard", steps=300),
    dict(task="lab-sum", attention="hst", attn_dropout="dropkey", steps=300),
]]
# Seeds per task when --seeds is not given: 3, and 5 for the shortcut (its targets count seeds).
LAB_SEEDS = {task: [0, 1, 2] for task in data.LAB}
LAB_SEEDS["lab-shortcut"] = [0, 1, 2, 3, 4]


def lab_flags(row, folder, out_dir, seed):
    """train.py's flags for one run of a row (--out and --threads are run_train's, --extra's flags
    too)."""
    flags = ["--task", row["task"], "--data", folder, *LAB_COMMON, "--max-steps", str(row["steps"]),
             "--attention", row["attention"], "--num-global", str(row["num_global"]),
             "--views", str(row["views"]), "--sar", str(row["sar"]), "--attn-dropout",
             row["attn_dropout"]]
    # one view: no second view for --ce to leave out
    if row["views"] == 2:
        flags += ["--ce", row["ce"]]
    if row["gnet_lr"] is not None:
        flags += ["--gnet-lr", str(row["gnet_lr"])]
    if row.get("schedule"):                              # the replayed run's rates, same seed
        flags += ["--schedule", os.path.join(out_dir, f"{row['schedule']}-s{seed}",
                                             "droprates.jsonl")]
    if row["task"] == "lab-boundary":
        flags += ["--eval-shift", "all"]
    return flags + ["--seed", str(seed)]


def lab(a):
    """The lab's grid (LAB_ROWS of --tasks; --quick: the reach rows at the first seed), seed-major
    and resumable, into --out: a run folder each, lab.json ({"runs": [...]}, accuracies in percent),
    lab.md (the tables) and, with --base, base.md."""
    rows = lab_rows(a)
    seeds = {task: a.seeds or LAB_SEEDS[task] for task in a.tasks}
    if a.quick:
        seeds = {task: seeds[task][:1] for task in seeds}
    runs = []
    for s in sorted(set(sum(seeds.values(), []))):
        for row in rows:
            if s not in seeds[row["task"]]:
                continue
            out = os.path.join(a.out, f"{lab_name(row)}-s{s}")
            final = run_train(lab_flags(row, lab_data(row["task"]), a.out, s), out, a)
            if final is not None:
                runs.append(lab_record(lab_name(row), s, final, out))
    if a.plan is not None:                               # the planning pass: nothing ran yet
        return
    with open(os.path.join(a.out, "lab.json"), "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    text = lab_table(runs) + "\n\n" + lab_note(a) + "\n"
    with open(os.path.join(a.out, "lab.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    if a.base:
        text = against_base(runs, read_lab_runs(a.base), a.base)
        with open(os.path.join(a.out, "base.md"), "w") as f:
            f.write(text)
        print("\n" + text)


def lab_rows(a):
    """The rows to run: those of --tasks, or with --variants the rows so named (lab_name: the run
    folder without its seed, as --dry-run and lab.md show it). A scheduled row brings the row whose
    rates it replays."""
    rows = {lab_name(row): row for row in LAB_ROWS if row["task"] in a.tasks}
    picked = chosen(a, rows, baseline=False)            # one error line for a name that is no row
    for name in list(picked):
        source = rows[name].get("schedule")
        if source and source not in picked:
            print(f"{name} replays the rates of {source}: running {source} too", flush=True)
            picked.insert(picked.index(name), source)
    return [rows[name] for name in picked]


def lab_note(a):
    """lab.md's last line: the command, its time, and what every run shares."""
    return (f"Command: `python research/experiments.py {command_line(a)}` "
            f"({time.time() - a.t0:.0f}s here at --jobs {a.jobs}, runs already done skipped). "
            f"Every run: `python train.py` with {' '.join(merge_flags(LAB_COMMON, a.extra))}, and "
            "its row's task, attention, --num-global, --views, --ce, --sar, --attn-dropout, "
            "--gnet-lr and --max-steps (steps column); lab-boundary adds --eval-shift all; data: "
            f"data.write_lab with data.LAB_SIZES {data.LAB_SIZES}.")


def lab_record(name, seed, final, folder):
    """One run's line of lab.json, accuracies in percent, from the run's own final.json (what ran,
    not the row it started from): its row's name (for pairing), "changed" (run_train's: the flags
    --extra changed), its settings as recorded (config and args), the dev accuracy, the scores under
    shifted topologies (mean, worst, by shift; drop = dev - mean), the receptive field's bound
    (block-sparse without global tokens or random blocks) and, for an AttendOut run on lab-shortcut,
    what the G-Nets masked (shortcut_masking)."""
    args, cfg = final["args"], final["config"]
    dev = dev_metrics(final)
    bound = None
    blind = cfg["attention"] == "sparse" and cfg["num_global"] == 0 and cfg["num_random"] == 0
    kind, _ = data.lab_kind(args["task"])
    if blind and kind.evidence is not None:          # a task where one token decides (not lab-sum)
        reach = reach_tokens(cfg["num_layers"], cfg["window"], cfg["block_size"])
        bound = 100 * reach_bound(args["task"], *read_lab_dev(args["data"]), reach)
    shifted = dev.get("shift")
    dropout = cfg["attn_dropout"]
    record = {"row": name, "changed": final.get("changed"), "task": args["task"],
              "attention": cfg["attention"], "num_global": cfg["num_global"], "sar": args["sar"],
              "views": args["views"], "ce": args["ce"],
              "attn_dropout": dropout,
              "gnet_lr": cfg["gnet_lr"] if dropout == "attendout" else None,
              "steps": args["max_steps"], "seed": seed, "dev_acc": 100 * dev["acc"],
              "shifted_mean": 100 * shifted["mean"]["acc"] if shifted else None,
              "shifted_worst": 100 * shifted["worst"]["acc"] if shifted else None,
              "shifted_by": ({s: 100 * m["acc"] for s, m in shifted["by"].items()}
                             if shifted else None),
              "drop": 100 * (dev["acc"] - shifted["mean"]["acc"]) if shifted else None,
              "bound": bound, "wall_time_s": final["wall_time_s"]}
    if args["task"] == "lab-shortcut" and dropout == "attendout":
        record["shortcut_masking"] = shortcut_masking(folder)
    return record


LAB_SHORTCUT_TOKEN = 1          # lab-shortcut's first letter, after [CLS] (data.lab_shortcut)


def shortcut_masking(folder):
    """What an AttendOut run's G-Nets masked: from droprates.jsonl's "masked_by_key" (the share of a
    step's masked pairs whose key is at each position, per layer), the share on the shortcut token
    (LAB_SHORTCUT_TOKEN) at each logged step. {"step_frac": [f, ...], "share": [[layer 1, layer 2,
    ..], ...]}; None if the log has no such field."""
    lines = [r for r in read_jsonl(os.path.join(folder, "droprates.jsonl")) if "masked_by_key" in r]
    if not lines:
        return None
    return {"step_frac": [r["step_frac"] for r in lines],
            "share": [[layer[LAB_SHORTCUT_TOKEN] if layer else 0.0 for layer in r["masked_by_key"]]
                      for r in lines]}


# The contrasts lab.md pairs: (task, what, baseline row, its field, row, its field), each the paired
# difference row - baseline over the seeds both ran. "drop" is a boundary run's dev accuracy minus
# its mean over the shifts.
BOUNDARY = "boundary-sparse-g0"
LAB_CONTRASTS = [
    ("reach", "hst - sparse (no global token)", "reach-sparse-g0", "dev_acc", "reach-hst-g0",
     "dev_acc"),
    ("reach", "sparse - its bound", "reach-sparse-g0", "bound", "reach-sparse-g0", "dev_acc"),
    ("bottleneck", "hst - sparse (one global token)", "bottleneck-sparse-g1", "dev_acc",
     "bottleneck-hst-g1", "dev_acc"),
    ("boundary", "drop: the second view's CE (alpha 0, CE on both - CE on the original)",
     f"{BOUNDARY}-views2-ceoriginal-sar0", "drop", f"{BOUNDARY}-views2-ceall-sar0", "drop"),
    ("boundary", "drop: the consistency term, CE on the original (alpha 1 - alpha 0)",
     f"{BOUNDARY}-views2-ceoriginal-sar0", "drop", f"{BOUNDARY}-views2-ceoriginal-sar1", "drop"),
    ("boundary", "drop: the consistency term, CE on both (alpha 1 - alpha 0)",
     f"{BOUNDARY}-views2-ceall-sar0", "drop", f"{BOUNDARY}-views2-ceall-sar1", "drop"),
    ("boundary", "drop: SAR as the lab ran it before (CE on both, alpha 1) - one view",
     BOUNDARY, "drop", f"{BOUNDARY}-views2-ceall-sar1", "drop"),
    ("shortcut", "attendout - none", "shortcut-dense-g0", "dev_acc", lab_name(SHORTCUT_ATTENDOUT),
     "dev_acc"),
    ("shortcut", "attendout - standard", "shortcut-dense-g0-standard", "dev_acc",
     lab_name(SHORTCUT_ATTENDOUT), "dev_acc"),
    ("shortcut", "attendout - scheduled (its own rates, random pairs)",
     "shortcut-dense-g0-scheduled", "dev_acc", lab_name(SHORTCUT_ATTENDOUT), "dev_acc"),
    ("shortcut", "dropkey - standard", "shortcut-dense-g0-standard", "dev_acc",
     "shortcut-dense-g0-dropkey", "dev_acc"),
    ("shortcut", f"attendout, G-Nets at train.py's default {DEMO_GNET_LR:g} (no --gnet-lr) - none",
     "shortcut-dense-g0", "dev_acc", "shortcut-dense-g0-attendout", "dev_acc"),
    ("shortcut", f"attendout, G-Nets at {LAB_GNET_LR:g} - at {DEMO_GNET_LR:g}",
     "shortcut-dense-g0-attendout", "dev_acc", lab_name(SHORTCUT_ATTENDOUT), "dev_acc"),
    ("sum", "standard - none (HST)", "sum-hst-g0", "dev_acc", "sum-hst-g0-standard", "dev_acc"),
    ("sum", "dropkey - none (HST)", "sum-hst-g0", "dev_acc", "sum-hst-g0-dropkey", "dev_acc"),
    ("sum", "dropkey - standard (HST)", "sum-hst-g0-standard", "dev_acc", "sum-hst-g0-dropkey",
     "dev_acc"),
]


def runs_by_row(runs):
    """{row name: {seed: run}} of lab.json's runs."""
    by_row = collections.defaultdict(dict)
    for r in runs:
        by_row[r["row"]][r["seed"]] = r
    return by_row


def paired_seeds(base, base_key, other, key):
    """The seeds at which two rows' runs ({seed: run}) both know their field, in base's order."""
    return [s for s in base
            if s in other and base[s][base_key] is not None and other[s][key] is not None]


def paired(base, base_key, other, key):
    """Two rows' runs ({seed: run}) paired by seed: base's `base_key` and other's `key` (percent ->
    fractions) at paired_seeds. Every paired difference of the lab reads its values here."""
    seeds = paired_seeds(base, base_key, other, key)
    return [base[s][base_key] / 100 for s in seeds], [other[s][key] / 100 for s in seeds]


def lab_pair(base, base_key, other, key):
    """A pair's cell: the paired difference (fmt_diff) and, where the two rows measure the same
    field, the words of cannot_tell when both sit at one limit (lab_limits) on every seed; None with
    no seed in common."""
    seeds = paired_seeds(base, base_key, other, key)
    if not seeds:
        return None
    xs, ys = [base[s][base_key] for s in seeds], [other[s][key] for s in seeds]
    cell = fmt_diff([x / 100 for x in xs], [y / 100 for y in ys])
    if base_key == key:
        limits = lab_limits(key, [base[s] for s in seeds], [other[s] for s in seeds])
        words = cannot_tell(xs, ys, limits)
        cell += f"; {words}" if words else ""
    return cell


def lab_limits(key, base_runs, runs):
    """[(value per seed, its name)]: where a lab row's field sits whatever the method does. Dev
    accuracy: 100 (the ceiling), the receptive field's bound (both rows' the same at a seed), the
    floors of the task (lab_floors); the drop under shift: 0 (nothing lost)."""
    n = len(runs)
    if key == "drop":
        return [([0.0] * n, "no drop under any shift")]
    bounds = [x.get("bound") if x.get("bound") == y.get("bound") else None
              for x, y in zip(base_runs, runs)]
    floors = [([value] * n, name) for value, name in lab_floors(runs[0]["task"])]
    return [([100.0] * n, "the ceiling"), (bounds, "its bound"), *floors]


def cannot_tell(xs, ys, limits):
    """The words for a pair that cannot tell its two rows apart, or "": both at one of `limits`
    ([(value per seed, its name)]) on every seed, equal at the tables' precision (0.1 point). xs, ys
    in percent, per seed. E.g. "cannot tell them apart: both at 63.8, its bound"."""
    same = lambda u, v: round(u, 1) == round(v, 1)
    for values, name in limits:
        if all(v is not None and same(x, v) and same(y, v) for x, y, v in zip(xs, ys, values)):
            return f"cannot tell them apart: both at {values[0]:.1f}, {name}"
    return ""


def lab_table(runs):
    """lab.md: a row per LAB_ROWS row that ran (per-seed accuracies, mean +- std, the scores under
    shifts with the drop's 95% interval, the bound, time per run); the contrasts (LAB_CONTRASTS)
    paired by seed with 95% t-intervals; the boundary rows' accuracy by shift; what lab-shortcut's
    G-Nets masked. A run that --extra changed says so beside its task ("ran with ...")."""
    by_row = runs_by_row(runs)
    col = lambda name, key: [r[key] / 100 for r in by_row[name].values() if r[key] is not None]
    show = lambda xs: fmt(xs) if xs else "-"
    header = ("| task | attention | global tokens | views | CE on | SAR alpha | attention dropout "
              "| G-Net lr | steps | dev acc per seed (%) | dev acc (%) | shifted, mean over s (%) "
              "| shifted, worst s (%) | drop: dev - shifted mean, 95% CI (points) "
              "| bound of the receptive field (%) | time per run (s) |")
    lines = [header, "|---" * 16 + "|"]
    for name, by_seed in by_row.items():
        r = next(iter(by_seed.values()))
        per_seed = " / ".join(f"{x * 100:.1f}" for x in col(name, "dev_acc"))
        drop = col(name, "drop")
        # one view: its CE
        ce = "-" if r["views"] == 1 else {"all": "both", "original": "original"}[r["ce"]]
        gnet_lr = "-" if r["gnet_lr"] is None else format(r["gnet_lr"], "g")
        lines.append(f"| {ran_as(r['task'], by_seed.values())} | {r['attention']} "
                     f"| {r['num_global']} | {r['views']} | {ce} | {r['sar']:g} "
                     f"| {r['attn_dropout']} | {gnet_lr} | {r['steps']} | {per_seed} "
                     f"| {show(col(name, 'dev_acc'))} | {show(col(name, 'shifted_mean'))} "
                     f"| {show(col(name, 'shifted_worst'))} "
                     f"| {fmt_diff([0.0] * len(drop), drop) if drop else '-'} "
                     f"| {show(col(name, 'bound'))} "
                     f"| {statistics.mean(x['wall_time_s'] for x in by_seed.values()):.0f} |")
    contrasts = []
    for task, what, base, base_key, name, key in LAB_CONTRASTS:
        cell = lab_pair(by_row.get(base, {}), base_key, by_row.get(name, {}), key)
        if cell:
            both = [*by_row[base].values(), *by_row[name].values()]
            contrasts.append(f"| {task} | {ran_as(what, both)} | {cell} |")
    if contrasts:
        lines += ["", "| task | contrast | paired difference, 95% CI (points) |", "|---|---|---|",
                  *contrasts]
    shifted = [name for name in by_row if next(iter(by_row[name].values()))["shifted_by"]]
    if shifted:
        shifts = list(next(iter(by_row[shifted[0]].values()))["shifted_by"])
        header = f"| row | dev acc under shift s = {' / '.join(shifts)} (%, mean over seeds) |"
        lines += ["", header, "|---|---|"]
        for name in shifted:
            by = [statistics.mean(r["shifted_by"][s] for r in by_row[name].values())
                  for s in shifts]
            lines.append(f"| {ran_as(name, by_row[name].values())} | "
                         f"{' / '.join(f'{x:.1f}' for x in by)} |")
    masked = [r for r in runs if r.get("shortcut_masking")]
    if masked:
        points = (0.1, 0.25, 0.5, 1.0)
        # every token real: a token's share of all pairs is 1/L
        length = data.LAB["lab-shortcut"]["length"]
        lines += ["", "| row | seed | dev acc (%) | layer | masked pairs on the shortcut token, "
                      f"over its share of all pairs (1/{length}), at 10% / 25% / 50% / 100% of "
                      "training | mean over training |",
                  "|---" * 6 + "|"]
        for r in masked:
            m = r["shortcut_masking"]
            at = [next(i for i, f in enumerate(m["step_frac"]) if f >= p - 1e-9) for p in points]
            for layer in range(len(m["share"][0])):
                ratios = [length * m["share"][i][layer] for i in at]
                mean = length * statistics.mean(share[layer] for share in m["share"])
                lines.append(f"| {ran_as(r['row'], [r])} | {r['seed']} | {r['dev_acc']:.1f} "
                             f"| {layer + 1} | {' / '.join(f'{x:.2f}' for x in ratios)} "
                             f"| {mean:.2f} |")
    return "\n".join(lines)


def read_lab_runs(path):
    """The runs of a lab's lab.json: `path` is the lab's --out folder or the file itself. A missing
    file, one that is not JSON, or JSON without lab.json's runs (a final.json, another table's raw
    numbers) is one error line."""
    file = os.path.join(path, "lab.json") if os.path.isdir(path) else path
    expects = "a lab's --out folder, or its lab.json such as docs/results/results_lab.json"
    if not os.path.isfile(file):
        fail(f"--base {path}: no lab.json there (give {expects})")
    # the runs: a list of records, each with what against_base reads
    try:
        with open(file) as f:
            lab = json.load(f)
    except ValueError:                                   # not JSON, or not text at all
        fail(f"--base {path}: not JSON (give {expects})")
    runs = lab.get("runs") if isinstance(lab, dict) else None
    fields = {"row", "seed", "dev_acc", "drop"}
    if not isinstance(runs, list) or not all(isinstance(r,
                                                        dict) and fields <= set(r) for r in runs):
        fail(f"--base {path}: not a lab.json (no \"runs\" of a lab's records; give {expects})")
    return runs


def against_base(runs, base_runs, base_name):
    """base.md: for every row this lab and --base both ran, this lab's dev accuracy (and, where
    scored under shifts, its drop) against the base's, paired by seed over the seeds both ran, with
    a 95% t-interval and cannot_tell's words where both sit at one limit. A row --extra changed says
    so ("ran with ...")."""
    mine, base = runs_by_row(runs), runs_by_row(base_runs)
    lines = [f"| row | measure | seeds both ran | --base {base_name} (%) | this lab (%) "
             "| paired difference, this - base, 95% CI (points) |", "|---" * 6 + "|"]
    for name in mine:
        for key in ("dev_acc", "drop"):
            xs, ys = paired(base.get(name, {}), key, mine[name], key)
            seeds = paired_seeds(base.get(name, {}), key, mine[name], key)
            if xs:
                cell = lab_pair(base[name], key, mine[name], key)
                lines.append(f"| {ran_as(name, mine[name].values())} | {key} | "
                             f"{' '.join(map(str, seeds))} | {fmt(xs)} | {fmt(ys)} | {cell} |")
    if len(lines) == 2:
        return f"No row of this lab is in --base {base_name} at a seed both ran: nothing to pair."
    return "\n".join(lines)


# The tasks' numbers: their data, the receptive field's bound, the floors

def lab_data(task):
    """data/TASK: the task's train.tsv and dev.tsv (data.write_lab), generated when missing or made
    from other numbers than data.LAB's (its spec.json)."""
    folder = os.path.join("data", task)
    spec = {"task": task, **data.LAB[task], **data.LAB_SIZES}
    try:
        with open(os.path.join(folder, "spec.json")) as f:
            same = json.load(f) == spec
    except OSError:
        same = False
    if not same:
        print(f"generating {folder}: data.write_lab({task!r})", flush=True)
        data.write_lab(task, folder)
    return folder


def read_lab_dev(folder):
    """(texts, labels) of a lab task's dev.tsv."""
    records, _ = data.read_generic(os.path.join(folder, "dev.tsv"), data.SOURCE_TARGET)
    return [r[1] for r in records], [int(r[3]) for r in records]


def reach_tokens(layers, window, block):
    """How far [CLS] (token 0) sees through block-sparse attention without global tokens or random
    blocks: a layer moves information w blocks, so after L layers [CLS] holds tokens 0 .. (w L + 1)
    b - 1 (blocks 0 .. w L; the 2 w L + 1 blocks around a token, cut at the sequence's start)."""
    return (window * layers + 1) * block


def reach_bound(task, texts, labels, reach):
    """The dev accuracy a receptive field of `reach` tokens allows: every example whose evidence
    (data.lab_evidence) lies within it right, the others at the best constant guess among them
    (their commonest label). A task where no single token decides (bottleneck, shortcut) has no such
    bound: an error that says so."""
    kind, spec = data.lab_kind(task)
    if kind.evidence is None:
        raise data.DataError(f"reach_bound: {task} has no receptive-field bound (no single token "
                             f"decides a {spec['kind']} text)")
    far = [y for t, y in zip(texts, labels) if data.lab_evidence(task, t) >= reach]
    best_guess = max(collections.Counter(far).values(), default=0)
    return (len(labels) - len(far) + best_guess) / len(labels)


@functools.lru_cache(maxsize=None)
def lab_floors(task):
    """[(dev accuracy in percent, its name)] that a row reaches without reading what decides the
    label, on the task's dev set (lab_data): its commonest label ("the majority class") and, on a
    shortcut task, reading token 1 alone, X as 0 and Y as 1 ("reading only the shortcut": on dev
    token 1 is drawn at random). A task no longer in data.LAB: none."""
    if task not in data.LAB:
        return []
    texts, labels = read_lab_dev(lab_data(task))
    floors = [(100 * max(collections.Counter(labels).values()) / len(labels), "the majority class")]
    if data.LAB[task]["kind"] == "shortcut":
        hits = [data.LAB_NEEDLES.index(t[0]) == y for t, y in zip(texts, labels)]
        floors.append((100 * statistics.mean(hits), "reading only the shortcut"))
    return floors


# -----------------------------------------------------------------------------
# The G-Nets' learning rate at the author's setting: MiniLM at --lr 2e-5, 6% warmup, the G-Nets at
# the backbone's rate (with --init, Config.gnet_lr None: --lr's) against their own 1e-5 and against
# standard dropout

GNET_LR_ROWS = {            # the baseline first
    "standard": ["--attn-dropout", "standard"],
    # the author's rule: --lr's rate
    "attendout": ["--attn-dropout", "attendout"],
    "attendout_gnet_lr_1e-5": ["--attn-dropout", "attendout", "--gnet-lr", "1e-5"],
}
GNET_LR_FLAGS = ["--lr", "2e-5", "--warmup", "0.06"]


def rates_over_training(folder, key, points=(0.1, 0.25, 0.5, 1.0)):
    """A run's droprates.jsonl: each layer's `key` ("drop_rate" or "full_rows") at the first line at
    or past each fraction of training, and the largest over the run."""
    log = read_jsonl(os.path.join(folder, "droprates.jsonl"))
    at = {p: next(rec[key] for rec in log if rec["step_frac"] >= p - 1e-9) for p in points}
    largest = [max(rec[key][l] for rec in log) for l in range(len(log[0][key]))]
    return at, largest


def mean_logged(folder, key):
    """The mean of `key` over a run's log.jsonl step lines."""
    return statistics.mean(rec[key] for rec in read_jsonl(os.path.join(folder,
                                                                       "log.jsonl")) if key in rec)


def gnet_lr(a):
    """Dev accuracy of the rows, paired to standard and to each other; the per-layer masking rates
    over training (mean over seeds); the share of real query rows whose every real key is masked
    (largest over the run); the masked pass's consistency term (how far the masks move the
    prediction)."""
    finals, dirs = pretrained_runs(a, GNET_LR_ROWS, GNET_LR_FLAGS)
    if a.plan is not None:                               # main's planning pass: nothing ran yet
        return
    raw, table = collections.defaultdict(dict), []
    table += ["| data | row | dev acc (%) | per seed | paired diff to standard, 95% CI (points) |",
              "|---|---|---|---|---|"]
    for (ds, setting, name), fs in finals.items():
        acc = raw[ds][name] = [dev_acc(f) for f in fs]
        table.append(f"| {ds} | {ran_as(name, fs)} | {fmt(acc)} | "
                     f"{' / '.join(f'{x * 100:.1f}' for x in acc)} "
                     f"| {fmt_diff(raw[ds]['standard'], acc)} |")
    table += ["", "| data | contrast | paired diff, 95% CI (points) |", "|---|---|---|"]
    for ds, r in raw.items():
        if "attendout" in r and "attendout_gnet_lr_1e-5" in r:
            table.append(f"| {ds} | attendout (author's rule) - attendout_gnet_lr_1e-5 "
                         f"| {fmt_diff(r['attendout_gnet_lr_1e-5'], r['attendout'])} |")
    table += ["", "| data | row | masking rate per layer at 10% / 25% / 50% / 100% of training "
                  "(mean over seeds) "
              "| fully masked rows, largest share over the run, per layer (max over seeds) "
              "| masked-pass consistency, mean over the logged steps (mean over seeds) "
              "| train.py's dead-mask warning: at step (per seed) |", "|---|---|---|---|---|---|"]
    rates = {}
    for (ds, setting, name), ds_dirs in dirs.items():
        if not name.startswith("attendout"):
            continue
        drop = [rates_over_training(d, "drop_rate") for d in ds_dirs]
        full = [rates_over_training(d, "full_rows")[1] for d in ds_dirs]
        mean = {p: [statistics.mean(x[0][p][l] for x in drop) for l in range(len(drop[0][1]))]
                for p in drop[0][0]}
        worst = [max(f[l] for f in full) for l in range(len(full[0]))]
        # what the masks do to the quantity they change: the KL between the clean and the masked
        # pass
        consistency = statistics.mean(mean_logged(d, "mask_consistency") for d in ds_dirs)
        died = [f.get("masks_died") for f in finals[(ds, setting, name)]]   # None: no warning
        rates[f"{ds}-{name}"] = {"drop_rate": {str(p): v for p, v in mean.items()},
                                 "full_rows_max": worst,
                                 "mask_consistency": consistency, "masks_died": died}
        shown = " / ".join(" ".join(f"{x:.2f}" for x in v) for v in mean.values())
        table.append(f"| {ds} | {name} | {shown} | {' '.join(f'{x:.3f}' for x in worst)} | "
                     f"{consistency:.5f} "
                     f"| {' / '.join('none' if x is None else str(x) for x in died)} |")
    note = pretrained_note(a, f"Rows add {' '.join(GNET_LR_FLAGS)} (the author's setting; "
                              f"--extra's flags win). ")
    write_table(a, "results_gnet_lr" + settings_suffix(a), table, note, {"acc": raw,
                                                                         "rates": rates})


# -----------------------------------------------------------------------------
# SAR's cross-entropy views on the demo: the full demo (`python train.py`: ListOps, HST +
# SAR + AttendOut) with the cross-entropy on both clean views (R-Drop's form) against the original
# view only (the digest's words)

SAR_CE_ROWS = {             # the baseline first
    "ce_all": ["--ce", "all"],
    "ce_original": ["--ce", "original"],
}


def sar_ce(a):
    """The demo at each seed with each form; the dev accuracy of the last step, paired by seed."""
    finals = collections.defaultdict(list)
    for s in a.seeds:
        for name in chosen(a, SAR_CE_ROWS):
            out = os.path.join(a.out, f"demo-{name}-s{s}")
            finals[name].append(run_train([*SAR_CE_ROWS[name], "--seed", str(s)], out, a))
    if a.plan is not None:                               # main's planning pass: nothing ran yet
        return
    accs = {name: [dev_acc(f) for f in fs] for name, fs in finals.items()}
    base = accs[next(iter(accs))]                        # fmt_diff marks the baseline by identity
    lines = ["| cross-entropy on | dev acc per seed (%) | dev acc (%) | paired difference, 95% CI "
             "(points) |",
             "|---|---|---|---|"]
    for name, xs in accs.items():
        per_seed = " / ".join(f"{100 * x:.1f}" for x in xs)
        lines.append(f"| {ran_as(name[3:], finals[name])} | {per_seed} | {fmt(xs)} | "
                     f"{fmt_diff(base, xs)} |")
    write_table(a, "results_sar_ce_demo", lines, f"Seeds {a.seeds}; every run the full demo "
                                                 f"(`python train.py "
                "--seed S` with the row's --ce); the last step's dev accuracy.", dict(finals))


# -----------------------------------------------------------------------------
# A shortcut in real text (docs/results.md, "A shortcut in real text"): SST-2 and MR at
# the lowres setting, one word put first in every training sentence that agrees with the label with
# probability p. On dev the word is chosen at random, and dev is scored in its two halves: the word
# agrees, the word disagrees. Reliance on the word: accuracy on the agreeing half minus the
# disagreeing half (0 for a model that ignores it).

# label 0's word, label 1's: no sentiment, one WordPiece token each
SHORTCUT_WORDS = ["river", "table"]
SHORTCUT_SEED = 0                       # which sentences get the other word, and dev's words
# Every run takes the pretrained grids' flags (PRE_COMMON: lr 1e-4, batch 32, max length 64, one
# evaluation at the end). At train.py's fine-tuning lr, 2e-5, 96 steps teach MiniLM little sentiment
# (56.8% on SST-2's dev without the word) and the word decides every dev answer (agreeing half 100%,
# disagreeing 0%, at p 0.9 and 0.8; standard dropout, seed 10): no method could differ. At 1e-4:
# 99.7% / 19.7% at p 0.9 (98.2% / 27.5% at p 0.8). The second AttendOut row's setting, fixed by the
# probe part (seeds 10 and 11, SST-2) before the grid ran
SHORTCUT_TUNED = ["--gnet-lr", "1e-5"]
# the baseline first; "scheduled" replays the attendout run of its data and seed
SHORTCUT_ROWS = {
    "standard": ["--attn-dropout", "standard"],
    "none": ["--attn-dropout", "none"],
    "attendout": ["--attn-dropout", "attendout"],
    "scheduled": ["--attn-dropout", "scheduled", "--schedule", "{attendout_out}/droprates.jsonl"],
    "rdrop": ["--attn-dropout", "standard", "--rdrop", "1.0"],
    "attendout_tuned": ["--attn-dropout", "attendout", *SHORTCUT_TUNED],
    # no word, in training or on dev: the ceiling
    "clean": ["--attn-dropout", "none"],
    "hst": ["--attn-dropout", "standard", "--attention", "hst", *PRE_SPARSE_TOPOLOGY],
    "hst+sar": ["--attn-dropout", "standard", "--attention", "hst", *PRE_SPARSE_TOPOLOGY, "--sar",
                "1.0"],
    # AttendOut with an oracle's mask in place of the G-Nets' (research/oracle_mask.py: the word's
    # column masked in layer 1, or in every layer, and nothing else)
    "oracle_layer1": ["--attn-dropout", "attendout", "--oracle-layers", "1"],
    "oracle_all": ["--attn-dropout", "attendout", "--oracle-layers", "1", "2", "3", "4", "5", "6"],
    # the probe's candidates for attendout_tuned: the pretrained grids' G-Net rate (GNET_LR), the
    # same with a smaller keep reward (tau^2 = 0.01: masking costs the G-Nets less), and a slower
    # rate still
    "attendout_gnet_lr_1e-5": ["--attn-dropout", "attendout", "--gnet-lr", GNET_LR],
    "attendout_gnet_lr_1e-5_tau_0.1": ["--attn-dropout", "attendout", "--gnet-lr", GNET_LR,
                                       "--gnet-tau", "0.1"],
    "attendout_gnet_lr_1e-6": ["--attn-dropout", "attendout", "--gnet-lr", "1e-6"],
}
# The parts, in the order they run: (p, data sets: "all" is --datasets, "first" its first, rows,
# seeds)
SHORTCUT_PARTS = {
    "probe": (0.9, "first", ["standard", "attendout_gnet_lr_1e-5", "attendout_gnet_lr_1e-5_tau_0.1",
                             "attendout_gnet_lr_1e-6"], [10, 11]),
    "main": (0.9, "all", ["standard", "none", "attendout", "scheduled", "rdrop", "attendout_tuned",
                          "clean"],
             [0, 1, 2, 3, 4]),
    "sparse": (0.9, "first", ["standard", "hst", "hst+sar"], [0, 1, 2, 3, 4]),
    "p1": (1.0, "first", ["standard", "none", "attendout", "attendout_tuned"], [0, 1, 2]),
    "oracle": (0.9, "first", ["standard", "attendout", "oracle_layer1", "oracle_all"], [0, 1, 2, 3,
                                                                                        4]),
}
SHORTCUT_DEFAULT_PARTS = ["main", "sparse", "oracle", "p1"]
# The contrasts that credit an effect to a part (row, the row it is paired with, what it isolates),
# each within one part and data set where both rows ran
SHORTCUT_CONTRASTS = [
    ("scheduled", "none", "masking at AttendOut's rates, random pairs, no consistency (scheduled "
                          "- none)"),
    ("attendout", "scheduled", "the G-Nets' choice of pairs and the consistency term (attendout - "
                               "scheduled)"),
    ("attendout", "rdrop", "masks against a dropout copy, both with a consistency term (attendout "
                           "- rdrop)"),
    ("rdrop", "standard", "a consistency term between two dropout copies (rdrop - standard)"),
    ("attendout_tuned", "attendout", "the G-Nets at 1e-5, not the backbone's 1e-4 "
                                     "(attendout_tuned - attendout)"),
    ("oracle_layer1", "attendout", "the word's column masked in layer 1, for the G-Nets' masks "
                                   "(oracle_layer1 - attendout)"),
    ("oracle_all", "attendout", "the word's column masked in every layer (oracle_all - attendout)"),
    ("oracle_all", "standard",
     "the oracle's masks against standard dropout (oracle_all - standard)"),
    ("hst+sar", "hst", "SAR's consistency term and shifted view on HST (hst+sar - hst)"),
    ("hst", "standard", "HST's topology, dense's dropout (hst - standard)"),
    ("clean", "standard", "the word's cost: no word, in training or on dev (clean - standard)"),
]


def shortcut_data(a, ds, p):
    """OUT/shortcut-data/DS-pP/: train.tsv (the lowres subsample, each sentence opened by its
    label's word, or with probability 1 - p the other's), dev_agree.tsv and dev_disagree.tsv (every
    dev sentence opened by a word drawn at random, filed by whether it agrees). Returns the
    folder."""
    flags, _ = setting_flags(a, ds, "lowres")
    folder = os.path.join(a.out, "shortcut-data", f"{ds}-p{p:g}")
    rng = random.Random(SHORTCUT_SEED)
    train = []
    for line in open(flags[flags.index("--train-file") + 1]):
        label, text = line.rstrip("\n").split("\t", 1)
        word = SHORTCUT_WORDS[int(label)] if rng.random() < p else SHORTCUT_WORDS[1 - int(label)]
        train.append(f"{label}\t{word} {text}\n")
    halves = {"agree": [], "disagree": []}
    for line in open(os.path.join(a.data_root, ds, "dev.tsv")):
        if not line.strip():
            continue
        label, text = line.rstrip("\n").split("\t", 1)
        word = rng.choice(SHORTCUT_WORDS)
        half = "agree" if word == SHORTCUT_WORDS[int(label)] else "disagree"
        halves[half].append(f"{label}\t{word} {text}\n")
    for name, lines in [("train", train), ("dev_agree", halves["agree"]), ("dev_disagree",
                                                                           halves["disagree"])]:
        write_if_changed(os.path.join(folder, name + ".tsv"), "".join(lines))
    return folder


def shortcut_flags(a, ds, folder, name):
    """train.py's data flags of a row: the clean row the plain lowres files, every other row the
    word's (folder, shortcut_data's)."""
    flags, epochs = setting_flags(a, ds, "lowres")
    if name == "clean":
        return flags + ["--epochs", str(epochs)]
    halves = [os.path.join(folder, f"dev_{h}.tsv") for h in ("agree", "disagree")]
    return ["--data", folder, "--train-file", os.path.join(folder, "train.tsv"), "--dev-file",
            *halves,
            "--epochs", str(epochs)]


def shortcut_record(final, folder):
    """One run's numbers, accuracies in percent: the whole dev set (the halves weighted by their
    sizes), each half, the reliance (agree - disagree), the cross-entropy at step 20 (how fast the
    word is taken), and for AttendOut what its G-Nets masked (masks_died; the word's masking ratio,
    shortcut_text_masking)."""
    splits = final["dev_splits"]
    step20 = next((r for r in read_jsonl(os.path.join(folder,
                                                      "log.jsonl")) if r.get("step") == 20), {})
    # one view, no masks: the loss is the CE
    rec = {"ce_step20": step20.get("ce", step20.get("loss")),
           "masks_died": final.get("masks_died"), "wall_time_s": final["wall_time_s"],
           "changed": final.get("changed")}
    if "dev" in splits:                                  # the clean row
        return {**rec, "whole": 100 * splits["dev"]["acc"], "agree": None, "disagree": None,
                "reliance": None}
    n = {h: sum(1 for _ in open(final["args"]["dev_file"][i])) for i, h in enumerate(("agree",
                                                                                      "disagree"))}
    acc = {h: splits[f"dev_{h}"]["acc"] for h in n}
    whole = sum(acc[h] * n[h] for h in n) / sum(n.values())
    rec.update(whole=100 * whole, agree=100 * acc["agree"], disagree=100 * acc["disagree"],
               reliance=100 * (acc["agree"] - acc["disagree"]))
    if final["args"]["attn_dropout"] == "attendout":
        rec["masking"] = shortcut_text_masking(folder, final["args"]["train_file"],
                                               final["args"]["init"])
    return rec


def shortcut_text_masking(folder, train_file, init):
    """Per layer, at 10% / 25% / 50% / 100% of training: the share of masked pairs whose key is the
    word (position 1, after [CLS]; droprates.jsonl's masked_by_key) over the word's share of all
    real pairs, sum L / sum L^2 over the training sentences of L tokens (each of a sentence's L
    queries has the word among its L^2 pairs). 1: masked as often as any key; above 1: the G-Nets
    single it out. Also each layer's masking rate."""
    share = word_share(train_file, init)
    lines = [r for r in read_jsonl(os.path.join(folder, "droprates.jsonl")) if "masked_by_key" in r]
    at = [next(r for r in lines if r["step_frac"] >= p - 1e-9) for p in (0.1, 0.25, 0.5, 1.0)]
    return {"word_ratio": [[layer[1] / share if layer else 0.0 for layer in r["masked_by_key"]]
                           for r in at],
            "drop_rate": [r["drop_rate"] for r in at]}


@functools.lru_cache(maxsize=None)
def word_share(train_file, init):
    """sum L / sum L^2 over a training file's sentences, L their tokens (at most --max-len 64) under
    init's tokenizer: the share of all real (query, key) pairs whose key is one given position of
    each sentence."""
    tok = data.tokenizer_from_path(init)
    # [CLS] word [SEP]: the word is position 1 alone
    for word in SHORTCUT_WORDS:
        if len(tok.encode(word)) != 3:
            fail(f"shortcut-text: {word!r} is not one token of {init}'s vocabulary (choose "
                 f"SHORTCUT_WORDS anew)")
    lengths = [min(64, len(tok.encode(line.split("\t",
                                                 1)[1].strip()))) for line in open(train_file)]
    return sum(lengths) / sum(n * n for n in lengths)


def shortcut_text(a):
    """The parts (--parts) of SHORTCUT_PARTS: each row's dev accuracy, halves and reliance, paired
    by seed with standard dropout; what the AttendOut rows' G-Nets masked; the word's loss at step
    20."""
    records = collections.defaultdict(dict)              # (part, ds, row) -> {seed: record}
    for part in a.parts:
        p, which, rows, seeds = SHORTCUT_PARTS[part]
        datasets = a.datasets if which == "all" else a.datasets[:1]
        for ds in datasets:
            folder = shortcut_data(a, ds, p)             # once per data set, not once per run
            for s in a.seeds or seeds:
                for name in [row for row in chosen(a, SHORTCUT_ROWS) if row in rows]:
                    out = os.path.join(a.out, f"{ds}-p{p:g}-{run_name(name)}-s{s}")
                    ao_out = os.path.join(a.out, f"{ds}-p{p:g}-attendout-s{s}")
                    extra = [x.format(attendout_out=ao_out) for x in SHORTCUT_ROWS[name]]
                    flags = [*PRE_COMMON, "--init", a.init, *shortcut_flags(a, ds, folder, name),
                             *extra,
                             "--seed", str(s)]
                    script = "research/oracle_mask.py" if name.startswith("oracle") else "train.py"
                    final = run_train(flags, out, a, script)
                    if final is not None:
                        records[(part, ds, name)][s] = shortcut_record(final, out)
                        drop_checkpoints(out)
    if a.plan is not None:                               # main's planning pass: nothing ran yet
        return
    note = (f"Fine-tuned from {a.init} at the pretrained grids' flags (lr 1e-4, 3 epochs, batch "
            f"32) on the lowres subsample ({SUBSAMPLE} examples); the word: {SHORTCUT_WORDS[0]!r} "
            f"for label 0, {SHORTCUT_WORDS[1]!r} for label 1, first in the sentence; dev: a "
            "random word, scored in its agreeing and disagreeing halves (shortcut_data, seed "
            f"{SHORTCUT_SEED}). Paired differences over seeds, 95% t-intervals. attendout_tuned: "
            f"{' '.join(SHORTCUT_TUNED)}. Flags: {' '.join(merge_flags(PRE_COMMON, a.extra))}")
    raw = {"|".join(key): by_seed for key, by_seed in records.items()}
    # a partial run: its own table
    parts = "" if a.parts == SHORTCUT_DEFAULT_PARTS else "_" + "_".join(a.parts)
    write_table(a, "results_shortcut_text" + parts, shortcut_table(records), note, raw)


def shortcut_table(records):
    """The tables of shortcut-text's records ({(part, data set, row): {seed: shortcut_record}}):
    each row against standard dropout; the contrasts (SHORTCUT_CONTRASTS); what the AttendOut rows'
    G-Nets masked. Every paired difference pairs runs by seed (paired)."""
    lines = ["| part | p | data | row | dev acc, whole (%) | agreeing half (%) "
             "| disagreeing half (%) | reliance: agree - disagree (points) | "
             "per seed | paired diff to standard, 95% CI: reliance | "
             "disagreeing half | whole | CE at step 20 | time per run (s) |", "|---" * 14 + "|"]
    # mean +- std over seeds, "-" for the clean row's halves
    def show(by_seed, key):
        xs = [r[key] / 100 for r in by_seed.values() if r[key] is not None]
        return fmt(xs) if xs else "-"

    for (part, ds, name), by_seed in records.items():
        base = records.get((part, ds, "standard"), {})
        known = next(iter(by_seed.values()))["reliance"] is not None
        diff = lambda key: fmt_diff(*paired(base, key, by_seed, key)) if known and base else "-"
        if name == "standard":
            diff = lambda key: "(baseline)"
        per_seed = " / ".join(f"{r['reliance']:.0f}" for r in by_seed.values()) if known else "-"
        ce = [r["ce_step20"] for r in by_seed.values() if r["ce_step20"] is not None]
        lines.append(f"| {part} | {SHORTCUT_PARTS[part][0]:g} | {ds} | "
                     f"{ran_as(name, by_seed.values())} | {show(by_seed, 'whole')} | "
                     f"{show(by_seed, 'agree')} | {show(by_seed, 'disagree')} | "
                     f"{show(by_seed, 'reliance')} | {per_seed} | {diff('reliance')} | "
                     f"{diff('disagree')} | {diff('whole')} | "
                     f"{statistics.mean(ce) if ce else float('nan'):.3f} | "
                     f"{statistics.mean(r['wall_time_s'] for r in by_seed.values()):.0f} |")
    contrasts = []
    # each part and data set once
    for part, ds in dict.fromkeys((part, ds) for part, ds, _ in records):
        for name, base, what in SHORTCUT_CONTRASTS:
            if (part, ds, name) not in records or (part, ds, base) not in records:
                continue
            mine, theirs = records[(part, ds, name)], records[(part, ds, base)]
            cells = [fmt_diff(*paired(theirs, key, mine,
                                      key)) if next(iter(mine.values()))[key] is not None
                     else "-" for key in ("reliance", "disagree", "whole")]
            contrasts.append(f"| {part} | {ds} | {what} | {' | '.join(cells)} |")
    if contrasts:
        lines += ["", "| part | data | contrast | reliance: paired diff, 95% CI (points) | "
                      "disagreeing half | whole |",
                  "|---" * 6 + "|", *contrasts]
    lines += ["", "| part | data | row | seed | reliance (points) | masks died at step | layer | "
                  "the word's share of masked pairs over its share of all pairs, at 10% / 25% / "
                  "50% / 100% of training | masking rate, same points |", "|---" * 9 + "|"]
    for (part, ds, name), by_seed in records.items():
        for s, r in by_seed.items():
            if "masking" not in r:
                continue
            m = r["masking"]
            for layer in range(len(m["word_ratio"][0])):
                ratio = " / ".join(f"{x[layer]:.2f}" for x in m["word_ratio"])
                rate = " / ".join(f"{x[layer]:.2f}" for x in m["drop_rate"])
                died = "none" if r["masks_died"] is None else r["masks_died"]
                lines.append(f"| {part} | {ds} | {name} | {s} | {r['reliance']:.1f} | {died} "
                             f"| {layer + 1} | {ratio} | {rate} |")
    return lines


# -----------------------------------------------------------------------------
# The command line

EXPERIMENTS = {"listops": listops_grid, "listops-long": listops_grid,
               "listops-long-probe": listops_long_probe,
               "pretrained-sparse": pretrained_sparse,
               "pretrained-attendout": pretrained_attendout, "lab": lab,
               "gnet-lr": gnet_lr, "sar-ce": sar_ce, "shortcut-text": shortcut_text}


def parse_args(argv):
    """The command line (a list, without the program's name), checked without touching a file: every
    flag's value, the flags that belong to one experiment, --extra split (shlex) into train.py's
    flags and parsed by train.py's parser. A printed command parses here without running anything;
    main adds the file checks."""
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=list(EXPERIMENTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="default: 0 1 2 (pretrained-attendout: 0-4; lab: each task's LAB_SEEDS, "
                         "lab-shortcut 0-4)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads of each run (train.py --threads)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at a time, each its own train.py process at --threads threads "
                         "(default 1: the tables' time per run assumes a run has its cores to "
                         "itself; cores / --threads uses them all)")
    ap.add_argument("--out", default=None,
                    help="where the runs go (default: out/EXPERIMENT); lab: also lab.json")
    ap.add_argument("--tables", default=os.path.join("out", "tables"),
                    help="where the tables and figures go")
    ap.add_argument("--data-root", default=os.path.join("data", "text"),
                    help="pretrained-*: a folder with sst2/ and mr/ (train.tsv, dev.tsv: "
                         "label<TAB>text)")
    ap.add_argument("--datasets", nargs="+", default=DEFAULT_DATASETS)
    ap.add_argument("--init", default=None,
                    help="pretrained-*: a converted checkpoint (python model.py convert)")
    ap.add_argument("--settings", nargs="+", default=["lowres"], choices=list(PRE_SETTINGS),
                    help="pretrained-*: lowres (1,000 training examples) and / or full")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="only these rows (the first row, the baseline, must be among them); "
                         "--candidates: sizes")
    ap.add_argument("--extra", default="", metavar='"FLAGS"',
                    help='more train.py flags for every run, ONE string written with "=": '
                         '--extra="--window 2 --lr 1e-3" (each replaces the grid\'s value of its '
                         'flag; the grid\'s own flags may come before or after it)')
    ap.add_argument("--dry-run", action="store_true",
                    help="print the commands of unfinished runs, run nothing")
    ap.add_argument("--candidates", action="store_true",
                    help="listops-long: the candidate sizes' learning curves")
    ap.add_argument("--base", default=None,
                    help="lab: another lab's --out (or its lab.json, e.g. "
                         "docs/results/results_lab.json): every "
                         "row both ran, paired by seed against it (OUT/base.md)")
    ap.add_argument("--parts", nargs="+", default=None, choices=list(SHORTCUT_PARTS),
                    help="shortcut-text: these parts (default: main sparse oracle p1; probe: the "
                         "candidates for attendout_tuned, on other seeds)")
    ap.add_argument("--quick", action="store_true",
                    help="lab: the reach rows at the first seed alone")
    ap.add_argument("--tasks", nargs="+", default=None,
                    help="lab: only these tasks' rows (default: all of data.LAB)")
    ap.add_argument("--keep-ckpt", action="store_true",
                    help="pretrained-*: keep each run's ckpt_*.pt (270 MB each)")
    # --extra takes one string: the old form (train.py's flags after a bare --extra, which took the
    # rest of the line) is one error line showing the new one
    at = argv.index("--extra") + 1 if "--extra" in argv else None
    if at is not None and (at == len(argv) or argv[at].startswith("-") and " " not in argv[at]):
        fail('--extra takes train.py\'s flags as one string, written with "=": '
             '--extra="--window 2"')
    a = ap.parse_args(argv)
    a.argv = list(argv)                                  # for the tables' "Command:" line
    # these have their own per part
    if a.seeds is None and a.experiment not in ("lab", "shortcut-text"):
        a.seeds = [0, 1, 2, 3, 4] if a.experiment == "pretrained-attendout" else [0, 1, 2]
    probe = a.experiment == "listops-long-probe"         # the probe reads listops-long's runs
    a.out = a.out or os.path.join("out", "listops-long" if probe else a.experiment)
    if a.candidates and a.experiment != "listops-long":
        fail("--candidates: only for listops-long")
    if a.quick and a.experiment != "lab":
        fail("--quick: only for lab")
    if a.tasks is not None and a.experiment != "lab":
        fail("--tasks: only for lab")
    if a.parts is not None and a.experiment != "shortcut-text":
        fail("--parts: only for shortcut-text")
    a.parts = a.parts or SHORTCUT_DEFAULT_PARTS
    if a.base is not None and a.experiment != "lab":
        fail("--base: only for lab")
    if a.experiment == "lab":
        unknown = [t for t in a.tasks or [] if t not in data.LAB]
        if unknown:
            fail(f"--tasks {' '.join(unknown)}: not a lab task (known: {', '.join(data.LAB)})")
        a.tasks = a.tasks or (["lab-reach"] if a.quick else list(data.LAB))
    needs_init = a.experiment.startswith("pretrained") or a.experiment in ("gnet-lr",
                                                                           "shortcut-text")
    if needs_init and a.init is None:
        fail(f"{a.experiment} needs --init PATH (a converted checkpoint: python model.py convert "
             f"HF_DIR OUT.pt)")
    if a.threads < 1:
        fail(f"--threads {a.threads}: must be >= 1")
    distinct = a.seeds and min(a.seeds) >= 0 and len(set(a.seeds)) == len(a.seeds)
    if a.seeds is not None and not distinct:
        fail(f"--seeds {' '.join(map(str, a.seeds))}: give distinct seeds >= 0")
    if a.jobs < 1:
        fail(f"--jobs {a.jobs}: must be >= 1")
    # --extra's flags, parsed by train.py's own parser (no defaults: what was given), before any
    # data is made or any run starts: a flag train.py does not know, a bad value, or a flag the grid
    # sets for each run is one error line naming --extra
    try:
        a.extra = shlex.split(a.extra)
    except ValueError as e:                              # an unclosed quote
        fail(f"--extra {a.extra}: {e}")
    train_ap = train.make_parser(defaults=False)
    train_ap.error = lambda message: fail(f"--extra: {message} (see python train.py --help)")
    given, unknown = train_ap.parse_known_args(a.extra)
    if unknown:
        fail(f"--extra: unrecognized train.py flag(s) {' '.join(unknown)} (see python train.py "
             f"--help)")
    own = [train.flag(name) for name in ("out", "threads", "seed") if name in vars(given)]
    if own:
        fail(f"--extra: {' '.join(own)}: set by the grid for each run (give experiments.py's "
             "--out, --threads or --seeds)")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    # the checks that read files: the checkpoint exists, --base is a lab's (before anything runs)
    if a.init is not None and not os.path.exists(a.init):
        fail(f"--init {a.init}: no such checkpoint (python model.py convert HF_DIR OUT.pt)")
    if a.base is not None:
        read_lab_runs(a.base)
    a.t0 = time.time()
    a.plan, a.stale = None, []
    with one_line_errors():
        os.makedirs(a.out, exist_ok=True)
        # The two passes of "How a grid works" (the docstring); the probe scores listops-long's runs
        # and starts none.
        if a.experiment != "listops-long-probe":
            a.plan = []
            EXPERIMENTS[a.experiment](a)
            if a.stale:
                fail(stale_error(a.stale))
            if a.dry_run:
                for cmd, _ in a.plan:
                    print("$ " + shlex.join(cmd), flush=True)
                return None
            run_all(a.plan, a)
            a.plan = None
        return EXPERIMENTS[a.experiment](a)


if __name__ == "__main__":
    main()
