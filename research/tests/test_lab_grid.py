"""Tests of research/experiments.py lab: the receptive field's bound against reachability propagated through
sparse.dense_mask, and the grid's commands (--dry-run, --quick).

Run: python -m pytest -q research/tests/test_lab_grid.py
"""
import os

import torch

import data
import experiments
import sparse


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


def commands(capfd):
    out = capfd.readouterr().out
    return [line.split(" --out ")[1].split()[0] for line in out.splitlines() if line.startswith("$ ")]


def test_dry_run_prints_the_grid(tmp_path, capfd):
    out = str(tmp_path / "lab")
    experiments.main(["lab", "--dry-run", "--out", out])
    runs = commands(capfd)
    names = [experiments.lab_name(*row[:4]) for row in experiments.LAB_ROWS]
    assert runs == [os.path.join(out, f"{n}-s{s}") for s in (0, 1, 2) for n in names]
    assert not os.path.exists(os.path.join(out, "lab.json"))                   # nothing ran
    experiments.main(["lab", "--dry-run", "--quick", "--seeds", "4", "--out", out])
    quick = commands(capfd)
    assert quick == [os.path.join(out, f"reach-{v}-s4") for v in ("dense-g0", "hst-g0", "sparse-g0", "sparse-g1")]


def test_table_of_a_grid():
    """lab.md from lab.json's runs: nulls where nothing was scored, the bound beside block-sparse without a global
    token, and the targets' contrasts paired by seed."""
    runs = []
    for s, (hi, lo) in enumerate([(100.0, 60.0), (98.0, 64.0)]):
        for task, attention, g, alpha, _ in experiments.LAB_ROWS:
            shifted = task == "lab-boundary"
            acc = lo if attention == "sparse" and task != "lab-boundary" else hi
            runs.append({"task": task, "attention": attention, "num_global": g, "sar": alpha, "seed": s,
                         "dev_acc": acc, "shifted_mean": (acc - 40 + 38 * alpha) if shifted else None,
                         "shifted_worst": (acc - 45 + 40 * alpha) if shifted else None,
                         "bound": 62.0 if attention == "sparse" and g == 0 else None})
    walls = {row[:4]: [30.0, 32.0] for row in experiments.LAB_ROWS}
    table = experiments.lab_table(runs, walls, [0, 1])
    assert "| lab-reach | dense | 0 | 0 | 600 | 100.0 / 98.0 | 99.0 +- 1.4 | - | - | - | 31 |" in table
    assert "| lab-reach | sparse | 0 | 0 | 600 | 60.0 / 64.0 | 62.0 +- 2.8 | - | - | 62.0 +- 0.0 | 31 |" in table
    assert "| reach | hst - sparse (no global token) | +37.0 [" in table
    assert "| reach | sparse - its bound | +0.0 [" in table
    assert "| boundary | drop under shift (dev - shifted mean), SAR alpha 0 | +40.0 [+40.0, +40.0] |" in table
    assert "| boundary | drop with SAR - drop without | -38.0 [-38.0, -38.0] |" in table
