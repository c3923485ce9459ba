"""Tests of experiments.py's statistics and data helpers (no checkpoint, no data set, no training).

The paired 95% confidence interval against numbers computed by hand, the t table against known quantiles,
the low-resource subsample (deterministic, the first n lines after a seeded shuffle).
Run: python -m pytest tests/test_experiments.py -q
"""
import math
import random

import pytest

import experiments


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
