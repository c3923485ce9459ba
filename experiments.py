"""experiments.py: the README's experiments, one command each: grids of `train.py` runs, 3 seeds, mean +- std.

What it is: a thin driver. Every cell of a table is an ordinary `python train.py ...` run (the exact command is
printed and stored in the run's final.json); this file only loops over variants and seeds, skips runs that
already finished (so an interrupted grid continues), and summarises the final.json files as a Markdown table.

The experiments:
  listops    a long-sequence sanity check from scratch: ERNIE-Sparse on generated ListOps, dense vs sparse vs
             HST vs HST+SAR vs HST+R-Drop, dev accuracy on the original topology and with the topology shifted
             by one token at evaluation (--eval-shift).

And the two papers' comparisons in their regime, fine-tuning a pretrained checkpoint (`--init PATH`, e.g.
MiniLM-L6 converted with `python model.py convert`), 5 / 3 seeds, each method's PAIRED difference to the
baseline row with a 95% confidence interval over seeds (t distribution):
  pretrained-attendout   none / standard / attendout / scheduled / layerdrop / attn_layerdrop on SST-2 and
                         MR, low-resource (a fixed subsample of 1,000 training examples) and full size.
  attendout-ablation     which part of AttendOut moves the result (methods.md §3.4): standard, the default
                         G-Net, frozen, each --gnet-mask form, cooperative, per-layer budget (on logit and on
                         capped); low-resource SST-2 and MR, 5 seeds, each row's final per-layer rates and the
                         mask's tail.
  attendout-probe        what each mask form does to a pretrained encoder's attention rows (attention sinks)
                         and to its [CLS] output, in one training-mode forward (docs/probe_attendout_*.md).
  attendout-trained-probe  what a TRAINED G-Net does to them (--init: an AttendOut run's ckpt_last.pt): per
                         layer its drop rate, how often each row's largest key is dropped, the noise it adds
                         to a row against standard dropout's, the row sums; [CLS] output change against
                         standard dropout on the same weights (docs/probe_attendout_trained_*.md).
  pretrained-sparse      dense / sparse / hst / hst+sar / hst+rdrop, dev accuracy on the original topology and
                         under every shift s = 1 .. b-1 of the block boundaries (mean and worst case over s),
                         scored by each run itself on its final weights (train.py --eval-shift all).

And ERNIE-Sparse where topology matters, from scratch at LRA's lengths (issue 23):
  listops-long           the same five rows on generated ListOps of 500-1,000 tokens, blocks of 32 with one
                         random block, 3 seeds: accuracy on the original topology, mean and worst over every
                         shift and over 3 re-drawn random blocks (train.py --eval-shift all --eval-redraw 3),
                         the drop under shifting, paired differences to hst. --candidates: the learning curves
                         of 2-3 model sizes, to choose the grid's model (LONG_MODEL).
  listops-long-probe     what a shift does to those models' answers: the share of dev predictions it changes
                         and the symmetric KL of the outputs (SAR's own quantity), at s = 1, 8, 16, 24.

How to run it:
    python experiments.py listops                      # -> docs/results_listops.md / .json
    python experiments.py pretrained-attendout --init ckpt/minilm.pt --data-root DATA --threads 2
    python experiments.py attendout-ablation --init ckpt/minilm.pt --data-root DATA --threads 1
    python experiments.py attendout-probe --init ckpt/minilm.pt --data-root DATA --datasets sst2
    python experiments.py attendout-trained-probe --init RUN/ckpt_last.pt --data-root DATA --datasets mr
    python experiments.py pretrained-sparse --init ckpt/minilm.pt --data-root DATA --threads 2
    python experiments.py pretrained-sparse --init ckpt.pt --dry-run       # print the commands only
    python experiments.py listops-long --candidates --threads 1            # -> docs/results_listops_long_candidates.md
    python experiments.py listops-long --threads 1                         # -> docs/results_listops_long.md / .json
    python experiments.py listops-long-probe                                # after the grid (dense has no shift)
"""
import signal
import sys

if __name__ == "__main__":      # Ctrl-C while torch loads: exit 130 without a traceback (main takes over after)
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import argparse
import collections
import hashlib
import json
import math
import random
import os
import statistics
import subprocess
import time

from cli import ArgumentParser, fail, one_line_errors

LISTOPS_DATA = ["--train", "5000", "--val", "500", "--test", "100", "--min-len", "10", "--max-len", "60",
                "--max-depth", "3", "--max-args", "4", "--seed", "1"]
LISTOPS_COMMON = ["--task", "listops", "--init", "scratch", "--layers", "2", "--hidden", "64", "--heads", "4",
                  "--ffn", "128", "--block-size", "8", "--window", "1", "--num-global", "1", "--epochs", "5",
                  "--batch-size", "32", "--lr", "1e-3", "--eval-shift", "1"]
LISTOPS_VARIANTS = {
    "dense": ["--attention", "dense"],
    "sparse": ["--attention", "sparse"],
    "hst": ["--attention", "hst"],
    "hst+sar": ["--attention", "hst", "--sar", "1.0", "--sar-shift", "1"],
    "hst+rdrop": ["--attention", "hst", "--rdrop", "1.0"],
}

def run_train(args_list, out, threads, log_dir, dry_run=False):
    """One train.py run into `out`, unless its final.json exists. Returns the parsed final.json (None with
    dry_run: the command is only printed)."""
    final = os.path.join(out, "final.json")
    if not os.path.exists(final):
        cmd = [sys.executable, "train.py", *args_list, "--out", out, "--overwrite", "--threads", str(threads)]
        print("$ " + " ".join(cmd), flush=True)
        if dry_run:
            return None
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        t = time.time()
        with open(os.path.join(log_dir, os.path.basename(out) + ".log"), "w") as log:
            rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            fail(f"run failed (exit {rc}); see {log.name}")
        print(f"  done in {time.time() - t:.0f}s", flush=True)
    with open(final) as f:
        return json.load(f)


def mean_std(xs):
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(xs, scale=100.0):
    m, s = mean_std([x * scale for x in xs])
    return f"{m:.1f} +- {s:.1f}"


def chosen(a, rows, baseline=True):
    """The names of `rows` that --variants picks, in the table's order (all of them without --variants). One
    error line for a name that is not a row, or (baseline=True) a choice without the first row, the baseline
    that the paired differences are taken against."""
    unknown = [v for v in a.variants or [] if v not in rows]
    if unknown:
        fail(f"--variants {' '.join(unknown)}: not a row of {a.experiment}; choose among {' '.join(rows)}")
    first = next(iter(rows))
    if a.variants and baseline and first not in a.variants:
        fail(f"--variants: the baseline row {first} must be among them (the paired differences are taken against it)")
    return [name for name in rows if not a.variants or name in a.variants]


def listops(a):
    data_dir = os.path.join(a.out, "listops-data")
    if not os.path.exists(os.path.join(data_dir, "basic_val.tsv")):
        subprocess.check_call([sys.executable, "data.py", "listops", data_dir, *LISTOPS_DATA])
    rows, raw = [], {}
    for name, extra in LISTOPS_VARIANTS.items():
        finals = [run_train([*LISTOPS_COMMON, *extra, "--data", data_dir, "--seed", str(s)],
                            os.path.join(a.out, f"listops-{name}-s{s}"), a.threads, a.out) for s in a.seeds]
        acc = [f["dev"]["dev"]["acc"] for f in finals]
        shifted = [f["dev"]["dev"]["shift"]["by"]["1"]["acc"] for f in finals]      # train.py --eval-shift 1
        wall = [f["wall_time_s"] for f in finals]
        raw[name] = {"acc": acc, "acc_shifted": shifted, "wall_time_s": wall}
        rows.append(f"| {name} | {fmt(acc)} | {fmt(shifted)} | {statistics.mean(wall):.0f} |")
    base = finals[0]["majority_baseline"]
    table = ["| model | dev acc (%) | dev acc, topology shifted by 1 (%) | time per run (s) |",
             "|---|---|---|---|", *rows]
    note = (f"Generated ListOps ({' '.join(LISTOPS_DATA)}); majority-class baseline {100 * base:.1f}%. "
            f"Seeds {a.seeds}; mean +- std. Common flags: {' '.join(LISTOPS_COMMON)}")
    write_results(a, "listops", table, note, raw)


# -----------------------------------------------------------------------------
# ERNIE-Sparse where topology matters (issue 23): ListOps at LRA's lengths, from scratch, every perturbation.

# LRA's recipe (data.py listops: depth 10, up to 10 arguments) at 500-1,000 tokens, not LRA's 500-2,000: the
# longer half would double every run on 2 CPU cores. 20,000 training sequences (LRA: 96,000); dev 500.
LONG_DATA = ["--train", "20000", "--val", "500", "--test", "100", "--min-len", "500", "--max-len", "1000", "--seed", "1"]
# b = 32 cuts a sequence into 16-32 blocks; a token sees its own and the two neighbouring blocks (96 tokens),
# one random block, the global [CLS] token and (HST) its block's representative: any two tokens further apart
# than the window meet only through the random block, [CLS] or the representatives (methods.md §2.1, §2.2)
LONG_TOPOLOGY = ["--block-size", "32", "--window", "1", "--num-global", "1", "--num-random", "1"]
# the grid's model: the smallest of LONG_CANDIDATES that learned (docs/results_listops_long_candidates.md: 2 x 64
# stayed at the majority class for 1,000 steps, 2 x 128 reached 34% by step 300). LRA: 6 layers, d 512, 8 heads,
# MLP 2048. Choose it again with `python experiments.py listops-long --candidates`.
LONG_MODEL = ["--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "256"]
# No attention dropout (LRA: 0.1): without it the sparse kernel runs through PyTorch's fused attention
# (sparse.py), 1.9x faster per step on one CPU thread here (1.5 s -> 0.8 s, hst 2 x 64, batch 32); hidden dropout 0.1.
LONG_COMMON = ["--task", "listops", "--init", "scratch", "--max-len", "1000", "--batch-size", "32", "--lr", "1e-3",
               "--eval-every", "1000000",         # one evaluation, on the final weights
               "--attn-dropout", "none"]
# 500 steps of batch 32 (16,000 sequences, 0.8 epoch; LRA: 5,000 steps): the candidates' curves are flat after
# step 300 (2 x 128: 34.2 / 34.2 / 34.8% at steps 300 / 400 / 500), and 2 CPU cores allow no more for the grid
LONG_STEPS = ["--max-steps", "500"]
LONG_CURVE_STEPS = ["--max-steps", "1000"]       # --candidates: the learning curves run this long
# every shift s = 1 .. b-1 and 3 other draws of the random blocks, in the final evaluation (train.py)
LONG_PERTURB = ["--eval-shift", "all", "--eval-redraw", "3"]
LONG_CANDIDATES = {         # model sizes whose learning curves (hst, seed 0) choose LONG_MODEL
    "2x64": ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128"],
    "2x128": ["--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "256"],
    "4x64": ["--layers", "4", "--hidden", "64", "--heads", "4", "--ffn", "128"],
}
LONG_CURVE_EVERY = 100      # --candidates: a dev evaluation (original topology only) every this many steps


def listops_long_data(a):
    """OUT/listops-long-data: LONG_DATA generated once (a folder already there is used as it is)."""
    data_dir = os.path.join(a.out, "listops-long-data")
    if not os.path.exists(os.path.join(data_dir, "basic_val.tsv")):
        cmd = [sys.executable, "data.py", "listops", data_dir, *LONG_DATA]
        print("$ " + " ".join(cmd), flush=True)
        if not a.dry_run:
            subprocess.check_call(cmd)
    return data_dir


def listops_long(a):
    """dense / sparse / hst / hst+sar / hst+rdrop at 500-1,000 tokens, seed-major (every row's seed 0 first), each
    run's final weights scored on the original topology, under every shift and under other random-block draws;
    paired differences to hst. --candidates: the learning curves of LONG_CANDIDATES instead."""
    data_dir = listops_long_data(a)
    if a.candidates:
        return listops_long_candidates(a, data_dir)
    finals, dirs = {}, {}
    names = chosen(a, PRE_SPARSE_VARIANTS)                         # the same five rows, hst (baseline) first
    for s in a.seeds:
        for name in names:
            extra = PRE_SPARSE_VARIANTS[name]
            out = os.path.join(a.out, f"listops-long-{name.replace('+', '_')}-s{s}")
            cmd = [*LONG_COMMON, *LONG_STEPS, *LONG_MODEL, *LONG_TOPOLOGY, *LONG_PERTURB, *extra, "--data", data_dir, *a.extra,
                   "--seed", str(s)]
            finals.setdefault(name, []).append(run_train(cmd, out, a.threads, a.out, a.dry_run))
            dirs.setdefault(name, []).append(out)
    if a.dry_run:
        return
    rows, raw = [], {}
    for name, fs in finals.items():
        raw[name] = cols = perturbed_accuracies(fs, dirs[name])
        cols["wall_time_s"] = [f["wall_time_s"] for f in fs]
        diff = lambda col: fmt_diff(raw["hst"][col], cols[col])
        redrawn = (f"{fmt(cols['acc_redraw_mean'])} | {fmt(cols['acc_redraw_worst'])}" if "acc_redraw_mean" in cols
                   else "- | -")                                         # dense: no random blocks to draw
        per_seed = " / ".join(f"{100 * x:.1f}" for x in cols["acc"])      # shows a run left at the majority class
        rows.append(f"| {name} | {fmt(cols['acc'])} | {per_seed} | {fmt(cols['acc_shift_mean'])} | {fmt(cols['acc_shift_worst'])} "
                    f"| {redrawn} | {fmt(cols['shift_drop'])} | {diff('acc')} | {diff('acc_shift_worst')} "
                    f"| {diff('shift_drop')} | {statistics.mean(cols['wall_time_s']):.0f} |")
    table = ["| attention | dev acc (%) | per seed (%) | shifted, mean over s (%) | shifted, worst s (%) | redrawn, mean (%) "
             "| redrawn, worst (%) | drop under shift (acc - shifted mean, points) | paired diff to hst (points, 95% CI) "
             "| same, worst s | same, drop under shift | time per run (s) |", "|---" * 12 + "|",
             *rows]
    f0 = finals["hst"][0]
    note = (f"Command: `python experiments.py {' '.join(a.argv)}`. Generated ListOps ({' '.join(LONG_DATA)}; "
            f"data.py listops); majority-class baseline {100 * f0['majority_baseline']:.1f}%. Seeds {a.seeds}; mean "
            f"+- std over seeds of the final weights' dev accuracy; paired difference to the hst row with a 95% "
            f"t-interval over seeds. Shifted: every s = 1 .. {f0['config']['block_size'] - 1} (train.py --eval-shift "
            f"all; dense: s = 1 alone, a shift moves no block boundary); redrawn: other draws of the random blocks "
            f"(--eval-redraw). Flags: {' '.join(LONG_COMMON + LONG_STEPS + LONG_MODEL + LONG_TOPOLOGY + LONG_PERTURB + a.extra)}")
    write_results(a, "listops_long", table, note, raw)


def probe_shifts(b):
    """The shifts listops-long-probe scores: s = 1 and a quarter, half and three quarters of the block (b = 32:
    1, 8, 16, 24)."""
    return sorted({1, max(1, b // 4), max(1, b // 2), max(1, 3 * b // 4)})


def window_change(s, b):
    """The mean fraction of a token's window keys (window 1: its block and both neighbours, 3b tokens) that a
    shift by s replaces. A token at offset o in its block keeps its block when o + s < b (b - s offsets; the
    window moves by s tokens) and otherwise moves to the next one (s offsets; the window moves by b - s), so
    the mean is ((b - s) s + s (b - s)) / b / (3b) = 2 s (b - s) / (3 b^2): at most 1/6, at s = b/2."""
    return 2 * s * (b - s) / (3 * b * b)


def listops_long_probe(a):
    """What a shift does to each trained listops-long model's answers (methods.md §2.3): per run (its
    ckpt_last.pt), the dev predictions on the original topology against those under each shift of
    probe_shifts: the share of sequences whose predicted class changes, and the symmetric KL of the two output
    distributions (sar.consistency, the quantity SAR trains down). Accuracy moves only when predictions flip
    between right and wrong; these two say whether the shift changes the model's output at all."""
    import torch
    import tasks
    from model import build_model, read_checkpoint
    torch.set_num_threads(a.threads)
    data_dir = os.path.join(a.out, "listops-long-data")
    tok = tasks.fixed_tokenizer("listops")
    task = tasks.load_task("listops", data_dir, tok, max_len=1000)
    batches = data_batches(task.dev["dev"], 32, tok.pad_id)
    dev_ops = [outermost_operator(row) for bt in batches for row in bt["input_ids"].tolist()]   # batch order
    # the shortcut: each outermost operator's most frequent training label (MAX -> 9, MIN -> 0, ...)
    rule = operator_rule(task.train)
    rule_acc = statistics.mean(float(rule.get(outermost_operator(e.ids)) == e.label) for e in task.dev["dev"])
    rows, raw = [], {}
    for name in [n for n in chosen(a, PRE_SPARSE_VARIANTS) if n != "dense"]:   # dense: no boundary to move
        per_seed = []
        for s in a.seeds:
            path = os.path.join(a.out, f"listops-long-{name.replace('+', '_')}-s{s}", "ckpt_last.pt")
            if not os.path.exists(path):
                fail(f"{path}: no such checkpoint (run `python experiments.py listops-long` first)")
            cfg, state, _, _ = read_checkpoint(path)
            shifts = probe_shifts(cfg.block_size)
            kept = os.path.join(os.path.dirname(path), "shift_probe.json")   # resumable: a run is probed once
            if os.path.exists(kept) and os.path.getmtime(kept) > os.path.getmtime(path):
                with open(kept) as f:
                    effects = json.load(f)
            else:
                effects = shift_effects(build_model(cfg, state, path).eval(), batches, shifts)
                effects["0"]["by_operator"] = operator_share(effects["0"].pop("pred"), dev_ops)
                with open(kept, "w") as f:
                    json.dump(effects, f)
            per_seed.append(effects)
            print(f"{name} seed {s}: {per_seed[-1]}", flush=True)
        raw[name] = per_seed
        for s, r in zip(a.seeds, per_seed):                 # one line a run: a run left at the majority class shows
            cells = [f"{100 * r[sh]['flip']:.1f} / {r[sh]['kl']:.1e}" for sh in map(str, shifts)]
            rows.append(f"| {name} | {s} | {100 * r['0']['acc']:.1f} | {100 * r['0']['by_operator']:.1f} "
                        f"| {' | '.join(cells)} |")
    b = cfg.block_size
    table = [f"| attention | seed | dev acc (%) | answers fixed by the outermost operator (%) "
             f"| {' | '.join(f's = {sh}: changed (%) / KL' for sh in shifts)} |",
             "|---" * (len(shifts) + 4) + "|",
             f"| (window keys a shift replaces, %) | | | | {' | '.join(f'{100 * window_change(sh, b):.1f}' for sh in shifts)} |",
             *rows]
    note = (f"Command: `python experiments.py {' '.join(a.argv)}`. Each run's final weights (ckpt_last.pt), the "
            f"{len(task.dev['dev'])} dev sequences. Answers fixed by the outermost "
            f"operator: the share of sequences whose prediction is the model's most frequent prediction for that "
            f"sequence's first operator token (100% = the answer is a function of that one token, right after "
            f"[CLS]); predicting each operator's most frequent training label scores {100 * rule_acc:.1f}% "
            f"({', '.join(f'{tok.SYMBOLS[op]} -> {y}' for op, y in sorted(rule.items()))}). Shift cells: predictions changed by "
            f"the shift (%) / symmetric KL between the original and the shifted output distributions (mean). The "
            f"first row is the share of a token's window keys the shift replaces, 2 s (b - s) / (3 b^2) with "
            f"b = {b} (experiments.window_change).")
    write_results(a, "listops_long_shift_probe", table, note, raw)


def outermost_operator(ids):
    """The first operator token id of a ListOps sequence (the parentheses are not tokens, so it sits right after
    [CLS]); None if there is none."""
    from vocab import ListOpsTokenizer
    return next((i for i in ids if ListOpsTokenizer.SYMBOLS[i].startswith("[")), None)


def counts_by(keys, values):
    """{key: Counter of the values that come with it}."""
    counts = {}
    for k, v in zip(keys, values):
        counts.setdefault(k, collections.Counter())[v] += 1
    return counts


def operator_rule(examples):
    """{outermost operator id: its most frequent label} over `examples` (ListOps' one-token shortcut)."""
    counts = counts_by((outermost_operator(e.ids) for e in examples), (e.label for e in examples))
    return {op: c.most_common(1)[0][0] for op, c in counts.items()}


def operator_share(preds, ops):
    """The share of predictions equal to the most frequent prediction among sequences of the same outermost
    operator: 1.0 when the prediction is a function of that one token."""
    return sum(c.most_common(1)[0][1] for c in counts_by(ops, preds).values()) / len(preds)


def data_batches(examples, batch_size, pad_id):
    """The examples in fixed, longest-first batches on the CPU (as the tasks' evaluation makes them)."""
    import data
    return list(data.make_batches(data.longest_first(examples), batch_size, pad_id=pad_id, seed=0, epoch=0,
                                  shuffle=False))


def shift_effects(model, batches, shifts):
    """{str(s): {"acc", "flip": share of changed argmax, "kl": mean symmetric KL}} of `model` (eval mode) under
    each shift s against the original topology ("0": the original's accuracy and predictions, batch order)."""
    import torch
    import sar
    correct = lambda z, bt: (z.argmax(-1) == bt["labels"]).float().sum().item()
    n = sum(bt["labels"].numel() for bt in batches)
    with torch.no_grad():
        base = [model(bt["input_ids"], bt["attention_mask"], bt["token_type_ids"]) for bt in batches]   # [B, C]
        out = {"0": {"acc": sum(correct(z0, bt) for z0, bt in zip(base, batches)) / n,
                     "pred": torch.cat([z0.argmax(-1) for z0 in base]).tolist()}}
        for s in shifts:
            acc = flips = kls = 0.0
            for bt, z0 in zip(batches, base):
                ids, mask, pos, types = sar.shift(bt["input_ids"], bt["attention_mask"], s, model.cfg.pad_id,
                                                  model.position_ids(bt["input_ids"]), bt["token_type_ids"])
                z = model(ids, mask, types, pos)                                                        # [B, C]
                acc += correct(z, bt)
                flips += (z.argmax(-1) != z0.argmax(-1)).float().sum().item()
                kls += sar.consistency(z0, z).item() * z.size(0)
            out[str(s)] = {"acc": acc / n, "flip": flips / n, "kl": kls / n}
    return out


def listops_long_candidates(a, data_dir):
    """The learning curve (dev accuracy every LONG_CURVE_EVERY steps, original topology) of each LONG_CANDIDATES
    model, hst attention, the first --seeds value: the smallest one that learns well above the majority class
    is the grid's LONG_MODEL."""
    s, curves, walls = a.seeds[0], {}, {}
    for name in chosen(a, LONG_CANDIDATES, baseline=False):          # --variants 2x64 2x128: only these sizes
        model = LONG_CANDIDATES[name]
        out = os.path.join(a.out, f"listops-long-candidate-{name}-s{s}")
        cmd = [*LONG_COMMON, *LONG_CURVE_STEPS, *model, *LONG_TOPOLOGY, "--attention", "hst", "--data", data_dir,
               "--eval-every", str(LONG_CURVE_EVERY), *a.extra, "--seed", str(s)]
        f = run_train(cmd, out, a.threads, a.out, a.dry_run)
        if f is not None:
            curves[name] = {r["step"]: r["dev"]["dev"]["acc"] for r in read_jsonl(os.path.join(out, "log.jsonl"))
                            if "dev" in r}
            walls[name] = f["wall_time_s"]
    if a.dry_run:
        return
    steps = sorted({step for c in curves.values() for step in c})
    cell = lambda c, step: f"{100 * c[step]:.1f}" if step in c else "-"
    table = [f"| step | {' | '.join(curves)} |", "|---" * (len(curves) + 1) + "|",
             *[f"| {step} | {' | '.join(cell(c, step) for c in curves.values())} |" for step in steps],
             f"| time per run (s) | {' | '.join(f'{w:.0f}' for w in walls.values())} |"]
    note = (f"Command: `python experiments.py {' '.join(a.argv)}`. Dev accuracy (%) on the original topology; "
            f"hst attention, seed {s}; majority-class baseline {100 * f['majority_baseline']:.1f}%. Candidates "
            f"(layers x hidden): {({n: LONG_CANDIDATES[n] for n in curves})}. Flags: {' '.join(LONG_COMMON + LONG_CURVE_STEPS + LONG_TOPOLOGY + a.extra)}")
    write_results(a, "listops_long_candidates", table, note, {"curves": curves, "wall_time_s": walls})


# -----------------------------------------------------------------------------
# The papers' regime: fine-tuning a pretrained checkpoint (--init), seeds, paired confidence intervals.

# Sized for 2 CPU cores (README, docs/results_pretrained_*.md): max length 64 covers 99.9% of SST-2 / MR
# sentences in MiniLM's WordPiece tokens (mean 23 / 26, longest 67 / 77); lr 1e-4 is the usual rate for
# a 6-layer MiniLM; final weights are scored (no dev-based checkpoint picking: SST-2's dev file is its test).
PRE_COMMON = ["--task", "tsv", "--text-col", "1", "--label-col", "0", "--max-len", "64", "--batch-size", "32",
              "--lr", "1e-4", "--attn-dropout-p", "0.1",
              "--eval-every", "1000000", "--save-every", "0"]   # one evaluation and one checkpoint, at the end
SUBSAMPLE = 1000            # low-resource setting: the first 1,000 lines of the training file after a seeded shuffle
SUBSAMPLE_SEED = 0          # one fixed subsample for every run (independent of the training seed)
PRE_SETTINGS = {            # setting -> (training examples or None for all, epochs)
    "lowres": (SUBSAMPLE, 3),       # 96 steps; pilot (SST-2, standard dropout, seed 0): 73.1 / 83.3 / 84.4% after epoch 1 / 2 / 3
    "full": (None, 1),
}
PRE_ATTENDOUT_VARIANTS = {  # baseline first; "scheduled" replays the attendout run of the same set, setting, seed
    "standard": ["--attn-dropout", "standard"],
    "none": ["--attn-dropout", "none"],
    "attendout": ["--attn-dropout", "attendout"],
    "scheduled": ["--attn-dropout", "scheduled", "--schedule", "{attendout_out}/droprates.jsonl"],
    "layerdrop": ["--attn-dropout", "standard", "--layerdrop", "0.1"],
    "attn_layerdrop": ["--attn-dropout", "standard", "--attn-layerdrop", "0.1"],
}
# what AttendOut's choice of pairs costs or buys beyond its per-layer rates (scheduled replays those rates)
PRE_ATTENDOUT_CONTRASTS = [("scheduled", "attendout")]
# The AttendOut ablation (methods.md §3.4): which part of the G-Net moves the result. Every row but the
# baseline is an AttendOut run with its mask form given explicitly, so the table means the same whatever
# Config.gnet_mask's default is; frozen, cooperative and layer_budget change one thing each against the logit
# form (the default while the grid was planned), and the two capped_ rows change the same against capped.
ABL = ["--attn-dropout", "attendout", "--gnet-mask"]
ABLATION_VARIANTS = {
    "standard": ["--attn-dropout", "standard"],
    "logit": [*ABL, "logit"],                                    # rows renormalised over the kept keys
    "rowscale": [*ABL, "rowscale"],                              # logit's forward, the row sum a constant
    "capped": [*ABL, "capped"],                                  # A k / (1 - pi), pi <= 0.5
    "inverted": [*ABL, "inverted"],                              # A k / (1 - pi), unbounded
    "frozen": [*ABL, "logit", "--gnet-lr", "0"],                 # the same path, no learning: pi = rho everywhere
    "cooperative": [*ABL, "logit", "--gnet-cooperative"],        # no gradient reversal
    "layer_budget": [*ABL, "logit", "--gnet-budget-scope", "layer"],   # rho in every layer
    "capped_cooperative": [*ABL, "capped", "--gnet-cooperative"],
    "capped_layer_budget": [*ABL, "capped", "--gnet-budget-scope", "layer"],
}
# The contrasts the ablation is read by (row B against row A, same seed): what one change does on its own.
ABLATION_CONTRASTS = [("capped", "inverted"),              # the cap alone (same rescaling form)
                      ("logit", "capped"),                 # the two bounded forms
                      ("frozen", "logit"),                 # the G-Net's learning under logit
                      ("logit", "cooperative"), ("logit", "layer_budget"),
                      ("capped", "capped_cooperative"),    # gradient reversal under the default form
                      ("capped", "capped_layer_budget")]   # the learned per-layer rates under the default form
# ERNIE-Sparse: b = 8 gives 3-4 blocks for a typical sentence (up to 8 at max length 64); window 1 and one
# global token ([CLS]); no random blocks, so a block outside the window is seen only through the global token.
PRE_SPARSE_TOPOLOGY = ["--block-size", "8", "--window", "1", "--num-global", "1", "--num-random", "0"]
DEFAULT_DATASETS = ["sst2", "mr"]

PRE_SPARSE_VARIANTS = {     # baseline first (HST without SAR)
    "hst": ["--attention", "hst"],
    "dense": ["--attention", "dense"],
    "sparse": ["--attention", "sparse"],
    "hst+sar": ["--attention", "hst", "--sar", "1.0", "--sar-shift", "1"],
    "hst+rdrop": ["--attention", "hst", "--rdrop", "1.0"],
}

# two-sided 95% quantiles of Student's t, t_{0.975, df}, df = 1 .. 30 (any statistics table)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df):
    """t_{0.975, df}: the table for df <= 30, the normal quantile 1.960 beyond (within 2% there)."""
    if df < 1:
        raise ValueError(f"a confidence interval needs at least 2 paired seeds (df = {df})")
    return T975[df - 1] if df <= len(T975) else 1.960


def paired_ci(xs, ys):
    """Paired difference ys - xs over seeds: (mean d, half-width of its 95% CI). d_s = y_s - x_s,
    mean +- t_{0.975, n-1} * sd(d) / sqrt(n), sd with n - 1 (the seeds are the samples)."""
    if len(xs) != len(ys):
        raise ValueError(f"paired_ci: {len(xs)} baseline seeds against {len(ys)}")
    d = [y - x for x, y in zip(xs, ys)]
    n = len(d)
    return statistics.mean(d), t975(n - 1) * statistics.stdev(d) / math.sqrt(n)


def fmt_diff(xs, ys, scale=100.0):
    """'+1.2 [-0.3, +2.7]': the paired difference and its 95% CI, in points; '(baseline)' for the baseline
    itself; with one seed the difference alone."""
    if xs is ys:
        return "(baseline)"
    if len(xs) == len(ys) == 1:                  # a grid run with one --seeds value: no interval to give
        return f"{(ys[0] - xs[0]) * scale:+.1f} (one seed: no interval)"
    m, h = paired_ci([x * scale for x in xs], [y * scale for y in ys])
    return f"{m:+.1f} [{m - h:+.1f}, {m + h:+.1f}]"


def write_subsample(src, n, seed, path):
    """The low-resource training file: the first n lines of `src` after random.Random(seed).shuffle. Same input,
    same file, on any machine (python's Mersenne Twister shuffle is fixed across versions). Returns path."""
    with open(src) as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
    random.Random(seed).shuffle(lines)
    text = "".join(lines[:n])
    if not (os.path.exists(path) and open(path).read() == text):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    return path


def setting_flags(a, ds, setting):
    """(--data and --train-file flags, epochs) of one data set in one setting."""
    data_dir = os.path.join(a.data_root, ds)
    if not os.path.isfile(os.path.join(data_dir, "train.tsv")):
        fail(f"--data-root {a.data_root}: no {ds}/train.tsv (label<TAB>sentence, with dev.tsv)")
    n, epochs = PRE_SETTINGS[setting]
    flags = ["--data", data_dir]
    if n is not None:       # named by the source file's content too: another --data-root never reuses it
        with open(os.path.join(data_dir, "train.tsv"), "rb") as f:
            tag = hashlib.md5(f.read()).hexdigest()[:8]
        sub = os.path.join(a.out, "subsample", f"{ds}-train-{n}-seed{SUBSAMPLE_SEED}-{tag}.tsv")
        flags += ["--train-file", write_subsample(os.path.join(data_dir, "train.tsv"), n, SUBSAMPLE_SEED, sub)]
    return flags, epochs


def drop_checkpoints(run_dir):
    """The grids keep final.json, logs and droprates.jsonl; the 270 MB of checkpoints per run go (--keep-ckpt)."""
    for name in ("ckpt_last.pt", "ckpt_best.pt"):
        p = os.path.join(run_dir, name)
        if os.path.exists(p):
            os.remove(p)


def pretrained_runs(a, variants, extra_common):
    """Run (or only print, --dry-run) the grid; returns {(ds, setting, variant): [final.json, ...]} in seed
    order, and the run folder of each. Seed-major: every row's seed 0, then every row's seed 1, ..., so a grid
    stopped early has whole rows at fewer seeds (rerun with --seeds 0 1 2 for their table)."""
    finals, dirs = {}, {}
    names = chosen(a, variants)
    for setting in a.settings:
        for ds in a.datasets:
            flags, epochs = setting_flags(a, ds, setting)
            for s in a.seeds:
                for name in names:
                    extra = variants[name]
                    out = os.path.join(a.out, f"{ds}-{setting}-{name.replace('+', '_')}-s{s}")
                    ao_out = os.path.join(a.out, f"{ds}-{setting}-attendout-s{s}")
                    cmd = [*PRE_COMMON, *extra_common, "--init", a.init, *flags, "--epochs", str(epochs),
                           *[x.format(attendout_out=ao_out) for x in extra], *a.extra, "--seed", str(s)]
                    f = run_train(cmd, out, a.threads, a.out, a.dry_run)
                    finals.setdefault((ds, setting, name), []).append(f)
                    dirs.setdefault((ds, setting, name), []).append(out)
    return finals, dirs


def pretrained_attendout(a):
    finals, dirs = pretrained_runs(a, PRE_ATTENDOUT_VARIANTS, [])
    if a.dry_run:
        return
    rows, raw = [], {}
    for (ds, setting, name), fs in finals.items():
        acc = [f["dev"]["dev"]["acc"] for f in fs]
        raw.setdefault(f"{ds}-{setting}", {})[name] = acc
        base = raw[f"{ds}-{setting}"]["standard"]            # the first variant: the baseline row
        if not a.keep_ckpt:
            for d in dirs[(ds, setting, name)]:
                drop_checkpoints(d)
        rows.append(f"| {ds} | {setting} | {name} | {fmt(acc)} | {fmt_diff(base, acc)} "
                    f"| {statistics.mean(f['wall_time_s'] for f in fs):.0f} |")
    table = ["| data | setting | attention dropout | dev acc (%) | paired diff to standard, 95% CI (points) | time per run (s) |",
             "|---|---|---|---|---|---|", *rows, *contrast_table(raw, PRE_ATTENDOUT_CONTRASTS)]
    write_results(a, "pretrained_attendout" + settings_suffix(a), table, pretrained_note(a), raw)
    if a.variants is None or "attendout" in a.variants:
        plot_pretrained_droprates(a)


def contrast_table(raw, contrasts, accs=lambda r: r):
    """Rows against each other, paired by seed: '| DS-SETTING | B - A | diff [CI] |' for each (A, B) of `contrasts`
    whose two rows are in the grid (raw: {"DS-SETTING": {row: entry}}, accs(entry): the seeds' accuracies)."""
    lines = [f"| {key} | {row} - {base} | {fmt_diff(accs(r[base]), accs(r[row]))} |"
             for key, r in raw.items() for base, row in contrasts if base in r and row in r]
    return ["", "| data-setting | contrast (row - row) | paired diff, 95% CI (points) |", "|---|---|---|", *lines] if lines else []


def attendout_ablation(a):
    """Every row's dev accuracy, its paired difference to standard dropout, and from each run's droprates.jsonl
    the final per-layer rates and the largest pi / attention-row sum seen in training."""
    import model
    default = model.Config().gnet_mask
    finals, dirs = pretrained_runs(a, ABLATION_VARIANTS, [])
    if a.dry_run:
        return
    rows, raw = [], {}
    for (ds, setting, name), fs in finals.items():
        acc = [f["dev"]["dev"]["acc"] for f in fs]
        key = f"{ds}-{setting}"
        raw.setdefault(key, {})[name] = {"acc": acc}
        base = raw[key]["standard"]["acc"]
        rates, tail = "", ""
        if name != "standard":
            logs = [read_jsonl(os.path.join(d, "droprates.jsonl")) for d in dirs[(ds, setting, name)]]
            final = [statistics.mean(log[-1]["drop_rate"][l] for log in logs) for l in range(len(logs[0][-1]["drop_rate"]))]
            pi_max = max(max(r.get("max_pi", [math.nan])) for log in logs for r in log)
            row_max = max(max(r.get("max_row_sum", [math.nan])) for log in logs for r in log)
            raw[key][name].update(final_rates=final, max_pi=pi_max, max_row_sum=row_max)
            rates = " / ".join(f"{r:.3f}" for r in final)
            tail = f"{pi_max:.2f} | {row_max:.2f}"
        else:
            tail = "- | -"
        if not a.keep_ckpt:
            for d in dirs[(ds, setting, name)]:
                drop_checkpoints(d)
        label = f"{name} (default)" if name == default else name
        rows.append(f"| {ds} | {label} | {fmt(acc)} | {fmt_diff(base, acc)} | {rates or '-'} | {tail} "
                    f"| {statistics.mean(f['wall_time_s'] for f in fs):.0f} |")
    table = ["| data | row | dev acc (%) | paired diff to standard, 95% CI (points) | final drop rate, layers 1..L "
             "| largest pi | largest row sum | time per run (s) |", "|---|---|---|---|---|---|---|---|", *rows]
    table += contrast_table(raw, ABLATION_CONTRASTS, lambda r: r["acc"])
    write_results(a, "attendout_ablation" + settings_suffix(a), table, pretrained_note(a), raw)
    plot_ablation_rates(a, raw)


def attendout_probe(a):
    """What each --gnet-mask form does to a pretrained encoder's attention (methods.md §3.1), on the first 32
    dev sentences of the first --datasets set: per layer, how much of a row the largest key takes and that
    key's value norm against the row's mean (attention sinks); then, per form, how far one training-mode
    forward (attention dropout only, G-Net at its start: pi = p0 everywhere) moves the [CLS] output from the
    eval output, mean over 10 draws."""
    import torch
    from model import apply_overrides, build_model
    quiet, state, ids, mask = probe_inputs(a, 32)
    plain = build_model(quiet, state, a.init).eval()
    qkv = []                                                    # each layer's fused q|k|v projection output
    hooks = [layer.attn.qkv.register_forward_hook(lambda mod, inp, out: qkv.append(out)) for layer in plain.layers]
    with torch.no_grad():
        h_eval = plain.encode(ids, mask)[:, 0]                  # [B, d], the [CLS] output
    for h in hooks:
        h.remove()
    keys = mask.bool()                                          # [B, L]
    lines = ["| layer | mean largest weight in a row | rows with one key > 0.5 | value norm of that key / row mean |",
             "|---|---|---|---|"]
    H, d = quiet.num_heads, quiet.hidden_size
    for l, out in enumerate(qkv):
        B, L, _ = out.shape
        q, k, v = (t.view(B, L, H, d // H).transpose(1, 2) for t in out.split(d, dim=-1))    # [B, H, L, d_h]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d // H)
        A = s.masked_fill(~keys[:, None, None, :], float("-inf")).softmax(-1)                  # [B, H, L, L]
        top, arg = A.max(-1)                                                                    # [B, H, L]
        vn = v.norm(dim=-1)                                                                     # [B, H, L]
        row_mean = (vn * keys[:, None]).sum(-1, keepdim=True) / keys.sum(-1)[:, None, None]
        real = keys[:, None, :].expand_as(top)
        lines.append(f"| {l + 1} | {top[real].mean():.2f} | {(top[real] > 0.5).float().mean():.2f} "
                     f"| {(vn.gather(-1, arg) / row_mean)[real].mean():.2f} |")
    lines += ["", "| attention dropout | [CLS] output change against eval (relative L2, mean of 10 draws) |", "|---|---|"]
    forms = {"standard": {"attn_dropout": "standard"},
             **{f"attendout, {m}": {"attn_dropout": "attendout", "gnet_mask": m} for m in ("logit", "rowscale", "capped", "inverted")}}
    for name, over in forms.items():
        m = build_model(apply_overrides(quiet, over), state, a.init).train()
        change = []
        with torch.no_grad():
            for seed in range(10):
                torch.manual_seed(seed)
                change.append(cls_change(m, ids, mask, h_eval))
        lines.append(f"| {name} | {statistics.mean(change):.3f} |")
    note = (f"Command: `python experiments.py {' '.join(a.argv)}`. {a.init}, the first 32 dev sentences of "
            f"{a.datasets[0]}, hidden dropout off, attention dropout rate {quiet.attn_dropout_p}.")
    write_doc(a, f"probe_attendout_{a.datasets[0]}.md", lines, note)


def cls_change(model, ids, mask, h_eval):
    """How far one training-mode forward of `model` moves the [CLS] output from h_eval [B, d] (the eval output):
    relative L2, mean over the batch. The caller seeds the draw."""
    h = model.train().encode(ids, mask)[:, 0]                                            # [B, d]
    return ((h - h_eval).norm(dim=-1) / h_eval.norm(dim=-1)).mean().item()


def probe_inputs(a, n):
    """The probes' inputs: the checkpoint --init (config with hidden dropout off, weights) and the first n dev
    sentences of the first --datasets set as one batch (input ids, attention mask)."""
    import torch
    import data
    from model import apply_overrides, read_checkpoint
    torch.set_num_threads(a.threads)
    cfg, state, tok_files, _ = read_checkpoint(a.init)
    tok = data.tokenizer_from_files(data.tensors_to_files(tok_files))
    task = data.load_task("tsv", os.path.join(a.data_root, a.datasets[0]), tok, max_len=64, text_col=1, label_col=0)
    batch = data.collate(task.dev["dev"][:n], tok.pad_id)
    return apply_overrides(cfg, {"hidden_dropout_p": 0.0}), state, batch["input_ids"], batch["attention_mask"]


TRAINED_PROBE_DRAWS = 20    # training-mode forwards (mask draws) per model in attendout-trained-probe


def attendout_trained_probe(a):
    """What a trained G-Net does to the attention rows (methods.md §3.4): --init is the ckpt_last.pt of an
    AttendOut run (dense attention). On the first 64 dev sentences, TRAINED_PROBE_DRAWS training-mode forwards
    (hidden dropout off), per layer, over the real (query, key) pairs with A > 0:
        drop rate        r_l, the share of pairs with A' = 0 (the mean pi the budget holds)
        largest key      how often each row's largest key is dropped (plain dropout: r_l, like any key)
        noise            E sum_j (A'_ij - A_ij)^2 over rows, against plain inverted dropout on the same A, whose
                         noise is sum_j A_ij^2 p / (1 - p): at p = p0 (standard dropout), and at p = r_l (the
                         G-Net's own layer rate: what its choice of pairs adds beyond the rate)
        row sum          mean and largest sum_j A'_ij (1 under plain dropout on average)
    and how far the [CLS] output moves from the eval output (relative L2, mean over draws) under the trained
    G-Net, under plain dropout at its layer rates r_l (what scheduled dropout does), and under standard dropout
    at p0, all on the same weights."""
    import torch
    import attendout
    from model import apply_overrides, build_model
    quiet, state, ids, mask = probe_inputs(a, 64)
    if quiet.attn_dropout != "attendout" or quiet.attention != "dense":
        fail(f"--init {a.init}: attendout-trained-probe needs the checkpoint of a dense AttendOut run "
             f"(this one: {quiet.attention} attention, --attn-dropout {quiet.attn_dropout})")
    p0, L = quiet.attn_dropout_p, quiet.num_layers
    trained = build_model(quiet, state, a.init)
    seen = []                                            # (layer, A, A', valid) of every G-Net mask in one forward

    def recording(l, mod):
        hook = mod.hook
        def wrapped(x):
            drop_fn = hook(x)
            def record(A, valid, pair_scores):
                out = drop_fn(A, valid, pair_scores)
                seen.append((l, A.detach(), out.detach(), valid))
                return out
            return record
        return wrapped
    for l, mod in enumerate(attendout.attendout_modules(trained)):
        mod.hook = recording(l, mod)                     # the instance's hook: the model's code path is unchanged
    with torch.no_grad():
        h_eval = trained.eval().encode(ids, mask)[:, 0]                                  # [B, d]

        def moved(m):                                    # per draw: [CLS] change of one training-mode forward,
            for draw in range(TRAINED_PROBE_DRAWS):      # and the G-Net masks it recorded
                torch.manual_seed(draw)
                seen.clear()
                yield cls_change(m, ids, mask, h_eval), list(seen)
        sums = {k: [0.0] * L for k in ("pairs", "dropped", "rows", "top_dropped", "noise", "A2", "rowsum")}
        row_max = [0.0] * L
        change = {"AttendOut (trained G-Net)": []}
        for c, masks in moved(trained):
            change["AttendOut (trained G-Net)"].append(c)
            for l, A, out, valid in masks:               # A, A' [B, H, L, L]; valid [B, 1, L, L]
                pair = valid.expand_as(A) & (A > 0)
                row = pair.any(-1)                                                   # [B, H, L] real query rows
                top = A.argmax(-1, keepdim=True)                                     # [B, H, L, 1]
                sums["pairs"][l] += pair.sum().item()
                sums["dropped"][l] += (pair & (out == 0)).sum().item()
                sums["rows"][l] += row.sum().item()
                sums["top_dropped"][l] += (out.gather(-1, top).squeeze(-1) == 0)[row].sum().item()
                sums["noise"][l] += ((out - A) ** 2).sum(-1)[row].sum().item()           # sum_j (A' - A)^2
                sums["A2"][l] += (A ** 2).sum(-1)[row].sum().item()                      # sum_j A^2
                rs = out.sum(-1)[row]
                sums["rowsum"][l] += rs.sum().item()
                row_max[l] = max(row_max[l], rs.max().item())
        rates = [sums["dropped"][l] / sums["pairs"][l] for l in range(L)]
        plain = build_model(apply_overrides(quiet, {"attn_dropout": "standard"}), state, a.init)   # rate p0
        at_p0 = [c for c, _ in moved(plain)]
        for layer, r in zip(plain.layers, rates):
            layer.attn.drop.p = r                        # plain Bernoulli dropout at the G-Net's layer rate
        change["plain dropout at the G-Net's layer rates"] = [c for c, _ in moved(plain)]
        change[f"standard dropout {p0:g}"] = at_p0
    inverted_noise = lambda l, p: sums["A2"][l] * p / (1 - p)        # plain inverted dropout's noise on the same A
    lines = ["| layer | drop rate | largest key dropped | noise / standard's | noise / plain at the layer's rate "
             "| mean row sum | largest row sum |", "|---|---|---|---|---|---|---|"]
    for l in range(L):
        c = {k: v[l] for k, v in sums.items()}
        lines.append(f"| {l + 1} | {rates[l]:.3f} | {c['top_dropped'] / c['rows']:.3f} "
                     f"| {c['noise'] / inverted_noise(l, p0):.2f} | {c['noise'] / inverted_noise(l, rates[l]):.2f} "
                     f"| {c['rowsum'] / c['rows']:.3f} | {row_max[l]:.2f} |")
    lines += ["", "| attention dropout | [CLS] output change against eval (relative L2, mean of draws) |", "|---|---|"]
    lines += [f"| {name} | {statistics.mean(v):.3f} |" for name, v in change.items()]
    note = (f"Command: `python experiments.py {' '.join(a.argv)}`. {a.init} ({quiet.gnet_mask} mask), the first "
            f"{ids.size(0)} dev sentences of {a.datasets[0]}, hidden dropout off, {TRAINED_PROBE_DRAWS} draws; "
            f"noise against plain inverted dropout on the same attention probabilities, at p0 = {p0:g} and at "
            f"the layer's measured drop rate.")
    write_doc(a, f"probe_attendout_trained_{a.datasets[0]}.md", lines, note)
    return sums


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pyplot_or_none(name):
    """matplotlib.pyplot (headless), or None with a note when matplotlib is not installed (figures are optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no docs/{name}.png")
        return None
    return plt


def plot_ablation_rates(a, raw):
    """docs/droprates_ablation[_SUFFIX].png: each AttendOut row's final per-layer drop rate (mean over seeds), one
    panel per data set and setting."""
    name = "droprates_ablation" + settings_suffix(a)
    plt = pyplot_or_none(name)
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(raw), figsize=(5.5 * len(raw), 3.6), squeeze=False)
    for ax, (key, rows) in zip(axes[0], raw.items()):
        for row, r in rows.items():
            if "final_rates" in r:
                ax.plot(range(1, len(r["final_rates"]) + 1), r["final_rates"], marker="o", label=row)
        ax.set_title(f"final drop rate per layer ({key})")
        ax.set_xlabel("layer")
        ax.set_ylabel("mean drop probability")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(a.docs, f"{name}.png"), dpi=120)
    print(f"wrote {a.docs}/{name}.png")


def pretrained_sparse(a):
    finals, dirs = pretrained_runs(a, PRE_SPARSE_VARIANTS, PRE_SPARSE_TOPOLOGY + ["--eval-shift", "all"])
    b = int(PRE_SPARSE_TOPOLOGY[PRE_SPARSE_TOPOLOGY.index("--block-size") + 1])
    if a.dry_run:
        return
    rows, raw = [], {}
    for (ds, setting, name), fs in finals.items():
        if not a.keep_ckpt:
            for d in dirs[(ds, setting, name)]:
                drop_checkpoints(d)
        key = f"{ds}-{setting}"
        raw.setdefault(key, {})[name] = cols = perturbed_accuracies(fs, dirs[(ds, setting, name)])
        diff = lambda col: fmt_diff(raw[key]["hst"][col], cols[col])         # the hst row itself: "(baseline)"
        rows.append(f"| {ds} | {setting} | {name} | {fmt(cols['acc'])} | {fmt(cols['acc_shift_mean'])} "
                    f"| {fmt(cols['acc_shift_worst'])} | {diff('acc')} | {diff('acc_shift_worst')} "
                    f"| {statistics.mean(f['wall_time_s'] for f in fs):.0f} |")
    table = ["| data | setting | attention | dev acc (%) | shifted, mean over s (%) | shifted, worst s (%) "
             "| paired diff to hst (points, 95% CI) | same, worst s | time per run (s) |",
             "|---|---|---|---|---|---|---|---|---|", *rows]
    write_results(a, "pretrained_sparse" + settings_suffix(a), table, pretrained_note(a, f"Shifts s = 1 .. {b - 1} "
                  "(train.py --eval-shift all, on the final weights; dense attention: s = 1 alone, a shift moves no "
                  "block boundary). Topology: " + " ".join(PRE_SPARSE_TOPOLOGY) + ". "), raw)


def perturbed_accuracies(fs, dirs):
    """Per seed, from each run's final.json (train.py --eval-shift all, --eval-redraw K): the dev accuracy on the
    original topology ("acc"), its mean and worst over the shifts s = 1 .. b-1, the accuracy at every shift
    ("acc_by_shift": [original, s = 1, 2, ...]), the drop acc - shift mean, and where random blocks were
    re-drawn, the mean and worst over the draws."""
    cols = {}
    add = lambda col, v: cols.setdefault(col, []).append(v)
    for f, d in zip(fs, dirs):
        dev = f["dev"]["dev"]
        if "shift" not in dev:
            fail(f"{d}/final.json has no shifted scores (a run from before train.py's --eval-shift all): remove "
                 "the folder to run it again")
        add("acc", dev["acc"])
        add("acc_shift_mean", dev["shift"]["mean"]["acc"])
        add("acc_shift_worst", dev["shift"]["worst"]["acc"])
        add("acc_by_shift", [dev["acc"]] + [m["acc"] for m in dev["shift"]["by"].values()])
        add("shift_drop", dev["acc"] - dev["shift"]["mean"]["acc"])
        if "redraw" in dev:
            add("acc_redraw_mean", dev["redraw"]["mean"]["acc"])
            add("acc_redraw_worst", dev["redraw"]["worst"]["acc"])
    return cols


def settings_suffix(a):
    """'' for the default settings and data sets (lowres; sst2 and mr), else e.g. '_full' or '_mr': each choice
    writes its own docs/results_*.md and drop-rate figure, so a partial run does not overwrite the full table."""
    parts = ([] if a.settings == ["lowres"] else a.settings) + ([] if a.datasets == DEFAULT_DATASETS else a.datasets)
    return "".join("_" + p for p in parts)


def pretrained_note(a, extra=""):
    settings = "; ".join(f"{s}: {'all' if PRE_SETTINGS[s][0] is None else PRE_SETTINGS[s][0]} training examples, "
                         f"{PRE_SETTINGS[s][1]} epoch(s)" for s in a.settings)
    sub = (f" (subsample: first {SUBSAMPLE} lines after random.Random({SUBSAMPLE_SEED}).shuffle, "
           f"experiments.write_subsample)" if any(PRE_SETTINGS[s][0] is not None for s in a.settings) else "")
    return (f"Command: `python experiments.py {' '.join(a.argv)}`. Fine-tuned from {a.init}; {settings}{sub}. Seeds {a.seeds}; mean +- std "
            f"over seeds of the final weights' dev accuracy; paired difference to the baseline row with a 95% "
            f"t-interval over seeds. {extra}Common flags: {' '.join(PRE_COMMON + a.extra)}")


def plot_pretrained_droprates(a):
    """docs/droprates_pretrained[_SETTINGS].png: the attendout runs' per-layer drop rate over training (mean
    over seeds), one panel per (data set, setting)."""
    name = "droprates_pretrained" + settings_suffix(a)
    plt = pyplot_or_none(name)
    if plt is None:
        return
    panels = [(ds, st) for st in a.settings for ds in a.datasets]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    summary = {}
    for ax, (ds, st) in zip(axes[0], panels):
        runs = []
        for s in a.seeds:
            runs.append(read_jsonl(os.path.join(a.out, f"{ds}-{st}-attendout-s{s}", "droprates.jsonl")))
        n = min(len(r) for r in runs)
        frac = [runs[0][i]["step_frac"] for i in range(n)]
        layers = len(runs[0][0]["drop_rate"])
        for l in range(layers):
            ax.plot(frac, [statistics.mean(r[i]["drop_rate"][l] for r in runs) for i in range(n)], label=f"layer {l + 1}")
        ax.plot(frac, [statistics.mean(statistics.mean(r[i]["drop_rate"]) for r in runs) for i in range(n)],
                "k--", label="mean")
        summary[f"{ds}-{st}"] = [round(statistics.mean(r[n - 1]["drop_rate"][l] for r in runs), 3) for l in range(layers)]
        ax.set_title(f"AttendOut drop rate per layer ({ds}, {st})")
        ax.set_xlabel("fraction of training")
        ax.set_ylabel("mean drop probability")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(a.docs, f"{name}.png"), dpi=120)
    print(f"wrote {a.docs}/{name}.png; final per-layer drop rates: {summary}")
    with open(os.path.join(a.docs, f"{name}_final.json"), "w") as f:
        json.dump(summary, f)


def write_doc(a, filename, lines, note):
    """A table (its lines) and the note under it, printed and written to --docs/filename."""
    text = "\n".join(lines) + "\n\n" + note + "\n"
    print("\n" + text)
    os.makedirs(a.docs, exist_ok=True)
    with open(os.path.join(a.docs, filename), "w") as f:
        f.write(text)


def write_results(a, name, table, note, raw):
    """docs/results_NAME.md (the table) and docs/results_NAME.json (its raw numbers)."""
    write_doc(a, f"results_{name}.md", table, note)
    with open(os.path.join(a.docs, f"results_{name}.json"), "w") as f:
        json.dump(raw, f, indent=1)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=["listops", "listops-long", "listops-long-probe", "pretrained-attendout",
                                           "attendout-ablation", "attendout-probe", "attendout-trained-probe",
                                           "pretrained-sparse"])
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="default: 0 1 2 (pretrained-attendout: 0 1 2 3 4)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of each run (train.py --threads; OMP_NUM_THREADS too)")
    ap.add_argument("--out", default=None, help="where the runs go (default out/experiments, out/pretrained-*)")
    ap.add_argument("--docs", default="docs", help="where the tables (results_*.md / .json) and figures go")
    ap.add_argument("--data-root", default=os.path.join("data", "text"),
                    help="pretrained-*: a folder with sst2/ and mr/, each train.tsv and dev.tsv as label<TAB>sentence")
    ap.add_argument("--datasets", nargs="+", default=DEFAULT_DATASETS)
    ap.add_argument("--init", default=None, help="pretrained-*: a converted checkpoint (python model.py convert)")
    ap.add_argument("--settings", nargs="+", default=["lowres"], choices=list(PRE_SETTINGS),
                    help="pretrained-*: lowres (1,000 training examples) and / or full")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="pretrained-*, listops-long: only these rows (default: all; the first row, the baseline, must be among "
                         "them); listops-long --candidates: only these model sizes")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                    help="pretrained-*, listops-long: more train.py flags for every run (last on the line, so they win; "
                         "e.g. --extra --gnet-lr 1e-3)")
    ap.add_argument("--dry-run", action="store_true",
                    help="pretrained-*, listops-long: print the commands of unfinished runs, run nothing")
    ap.add_argument("--candidates", action="store_true",
                    help="listops-long: the learning curves of the candidate model sizes (LONG_CANDIDATES), not the grid")
    ap.add_argument("--keep-ckpt", action="store_true", help="pretrained-*: keep each run's ckpt_*.pt (270 MB each)")
    a = ap.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else list(argv)       # for the tables' "Command:" line
    pre = a.experiment not in ("listops", "listops-long", "listops-long-probe")
    if a.seeds is None:
        a.seeds = [0, 1, 2, 3, 4] if "attendout" in a.experiment else [0, 1, 2]
    if a.out is None:
        # the ablation shares pretrained-attendout's folder: its standard rows are the same runs
        a.out = (os.path.join("out", "pretrained-attendout") if a.experiment == "attendout-ablation"
                 else os.path.join("out", "listops-long") if a.experiment == "listops-long-probe"
                 else os.path.join("out", a.experiment) if pre or a.experiment == "listops-long"
                 else os.path.join("out", "experiments"))
    if pre and a.init is None:
        ap.error(f"{a.experiment} needs --init PATH (a converted checkpoint)")
    if pre and not os.path.exists(a.init):
        fail(f"--init {a.init}: no such checkpoint (python model.py convert HF_DIR OUT.pt)")
    if a.threads < 1:
        fail(f"--threads {a.threads}: must be >= 1")
    if not a.seeds or min(a.seeds) < 0 or len(set(a.seeds)) != len(a.seeds):
        fail(f"--seeds {' '.join(map(str, a.seeds))}: give distinct seeds >= 0")
    with one_line_errors():
        os.makedirs(a.out, exist_ok=True)
        return {"listops": listops, "listops-long": listops_long, "listops-long-probe": listops_long_probe,
                "pretrained-attendout": pretrained_attendout,
                "attendout-ablation": attendout_ablation, "attendout-probe": attendout_probe,
                "attendout-trained-probe": attendout_trained_probe,
                "pretrained-sparse": pretrained_sparse}[a.experiment](a)


if __name__ == "__main__":
    main()
