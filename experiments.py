"""experiments.py: the README's experiments, one command each: grids of `train.py` runs, 3 seeds, mean +- std.

What it is: a thin driver. Every cell of a table is an ordinary `python train.py ...` run (the exact command is
printed and stored in the run's final.json); this file only loops over variants and seeds, skips runs that
already finished (so an interrupted grid continues), and summarises the final.json files as a Markdown table.

The two experiments:
  listops    ERNIE-Sparse on generated ListOps: dense vs sparse vs HST vs HST+SAR vs HST+R-Drop, dev accuracy
             on the original topology and with the topology shifted by one token at evaluation (--eval-shift).
  attendout  AttendOut on real sentence classification (SST-2, MR: label<TAB>sentence files), small encoders
             from scratch: standard vs attendout vs scheduled (replaying AttendOut's own drop-rate log) vs
             LayerDrop vs Attn.LayerDrop vs none; and the learned per-layer drop rate over training.

How to run it:
    python experiments.py listops                      # -> docs/results_listops.md / .json
    python experiments.py attendout --data-root ../shared/data
    python experiments.py attendout --seeds 0 --threads 2   # one seed, quicker
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

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

TEXT_COMMON = ["--task", "tsv", "--text-col", "1", "--label-col", "0", "--init", "scratch", "--layers", "4",
               "--hidden", "128", "--heads", "4", "--ffn", "256", "--max-len", "64", "--vocab-size", "8000",
               "--epochs", "2", "--batch-size", "32", "--lr", "5e-4", "--attn-dropout-p", "0.1"]
TEXT_VARIANTS = {   # "scheduled" replays the attendout run of the same dataset and seed (SPEC 3.2)
    "standard": ["--attn-dropout", "standard"],
    "attendout": ["--attn-dropout", "attendout"],
    "scheduled": ["--attn-dropout", "scheduled", "--schedule", "{attendout_out}/droprates.jsonl"],
    "layerdrop": ["--attn-dropout", "standard", "--layerdrop", "0.1"],
    "attn_layerdrop": ["--attn-dropout", "standard", "--attn-layerdrop", "0.1"],
    "none": ["--attn-dropout", "none"],
}


def run_train(args_list, out, threads, log_dir):
    """One train.py run into `out`, unless its final.json exists. Returns the parsed final.json."""
    final = os.path.join(out, "final.json")
    if not os.path.exists(final):
        cmd = [sys.executable, "train.py", *args_list, "--out", out, "--overwrite"]
        print("$ " + " ".join(cmd), flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        t = time.time()
        with open(os.path.join(log_dir, os.path.basename(out) + ".log"), "w") as log:
            rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            sys.exit(f"error: run failed (exit {rc}); see {log.name}")
        print(f"  done in {time.time() - t:.0f}s", flush=True)
    with open(final) as f:
        return json.load(f)


def mean_std(xs):
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(xs, scale=100.0):
    m, s = mean_std([x * scale for x in xs])
    return f"{m:.1f} +- {s:.1f}"


def listops(a):
    data_dir = os.path.join(a.out, "listops-data")
    if not os.path.exists(os.path.join(data_dir, "basic_val.tsv")):
        subprocess.check_call([sys.executable, "data.py", "listops", data_dir, *LISTOPS_DATA])
    rows, raw = [], {}
    for name, extra in LISTOPS_VARIANTS.items():
        finals = [run_train([*LISTOPS_COMMON, *extra, "--data", data_dir, "--seed", str(s)],
                            os.path.join(a.out, f"listops-{name}-s{s}"), a.threads, a.out) for s in a.seeds]
        acc = [f["dev"]["dev"]["acc"] for f in finals]
        shifted = [f["dev"]["dev"]["acc_shifted"] for f in finals]
        wall = [f["wall_time_s"] for f in finals]
        raw[name] = {"acc": acc, "acc_shifted": shifted, "wall_time_s": wall}
        rows.append(f"| {name} | {fmt(acc)} | {fmt(shifted)} | {statistics.mean(wall):.0f} |")
    base = finals[0]["majority_baseline"]
    table = ["| model | dev acc (%) | dev acc, topology shifted by 1 (%) | time per run (s) |",
             "|---|---|---|---|", *rows]
    note = (f"Generated ListOps ({' '.join(LISTOPS_DATA)}); majority-class baseline {100 * base:.1f}%. "
            f"Seeds {a.seeds}; mean +- std. Common flags: {' '.join(LISTOPS_COMMON)}")
    write_results(a, "listops", table, note, raw)


def attendout(a):
    rows, raw = [], {}
    for ds in a.datasets:
        data_dir = os.path.join(a.data_root, ds)
        if not os.path.isdir(data_dir):
            sys.exit(f"error: --data-root {a.data_root}: no {ds}/ folder (train.tsv, dev.tsv as label<TAB>sentence)")
        for name, extra in TEXT_VARIANTS.items():
            finals = []
            for s in a.seeds:
                ao_out = os.path.join(a.out, f"{ds}-attendout-s{s}")
                flags = [x.format(attendout_out=ao_out) for x in extra]
                finals.append(run_train([*TEXT_COMMON, *flags, "--data", data_dir, "--seed", str(s)],
                                        os.path.join(a.out, f"{ds}-{name}-s{s}"), a.threads, a.out))
            acc = [f["dev"]["dev"]["acc"] for f in finals]
            raw.setdefault(ds, {})[name] = acc
            rows.append(f"| {ds} | {name} | {fmt(acc)} | {statistics.mean(f['wall_time_s'] for f in finals):.0f} |")
    table = ["| data | attention dropout | dev acc (%) | time per run (s) |", "|---|---|---|---|", *rows]
    note = f"Seeds {a.seeds}; mean +- std. Common flags: {' '.join(TEXT_COMMON)}"
    write_results(a, "attendout", table, note, raw)
    plot_droprates(a)


def write_results(a, name, table, note, raw):
    text = "\n".join(table) + "\n\n" + note + "\n"
    print("\n" + text)
    os.makedirs("docs", exist_ok=True)
    with open(os.path.join("docs", f"results_{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join("docs", f"results_{name}.json"), "w") as f:
        json.dump(raw, f, indent=1)


def plot_droprates(a):
    """docs/droprates.png: AttendOut's learned mean drop rate of each layer over training (mean over seeds)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no docs/droprates.png")
        return
    fig, axes = plt.subplots(1, len(a.datasets), figsize=(5 * len(a.datasets), 3.6), squeeze=False)
    summary = {}
    for ax, ds in zip(axes[0], a.datasets):
        runs = []
        for s in a.seeds:
            with open(os.path.join(a.out, f"{ds}-attendout-s{s}", "droprates.jsonl")) as f:
                runs.append([json.loads(line) for line in f if line.strip()])
        n = min(len(r) for r in runs)
        frac = [runs[0][i]["step_frac"] for i in range(n)]
        layers = len(runs[0][0]["drop_rate"])
        for l in range(layers):
            ys = [statistics.mean(r[i]["drop_rate"][l] for r in runs) for i in range(n)]
            ax.plot(frac, ys, label=f"layer {l + 1}")
        summary[ds] = [round(statistics.mean(r[n - 1]["drop_rate"][l] for r in runs), 3) for l in range(layers)]
        ax.set_title(f"AttendOut drop rate per layer ({ds})")
        ax.set_xlabel("fraction of training")
        ax.set_ylabel("mean drop probability")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join("docs", "droprates.png"), dpi=120)
    print(f"wrote docs/droprates.png; final per-layer drop rates: {summary}")
    with open(os.path.join("docs", "droprates_final.json"), "w") as f:
        json.dump(summary, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=["listops", "attendout"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    ap.add_argument("--out", default="out/experiments", help="where the runs go")
    ap.add_argument("--data-root", default=os.path.join("..", "shared", "data"), help="attendout: folder of sst2/, mr/")
    ap.add_argument("--datasets", nargs="+", default=["sst2", "mr"])
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    listops(a) if a.experiment == "listops" else attendout(a)


if __name__ == "__main__":
    main()
