"""Tests of the lab's generated tasks (data.py, section 6b): each rule on texts built by hand, the generators'
labels by that rule, their determinism, and a folder generated on first use through train.py's reader.

Run: python -m pytest -q tests/test_lab.py
"""
import os

import pytest

import data
import train


def text_of(blocks, block=8):
    """A text whose token blocks are `blocks` (strings of `block` letters); block 0 loses its first letter, the
    place of [cls]."""
    return blocks[0][1:] + "".join(blocks[1:])


def test_rules_on_hand_built_texts():
    # reach: the needle alone decides, wherever it is
    assert data.lab_label("lab-reach", "abXcd") == 0 and data.lab_label("lab-reach", "abcdaY") == 1
    assert data.lab_evidence("lab-reach", "abXcd") == 3                       # text index 2 is token 3
    # bottleneck: blocks 1-4 against blocks 5-8; one differing pair makes label 0
    first = ["aaaaaaaa", "bbbbbbbb", "bbbbbbbb", "aaaaaaaa"]
    same = text_of(["cccccccc", *first, *first])
    assert data.lab_label("lab-bottleneck", same) == 1
    for j in range(4):
        second = list(first)
        second[j] = "b" * 8 if first[j][0] == "a" else "a" * 8
        assert data.lab_label("lab-bottleneck", text_of(["cccccccc", *first, *second])) == 0
    # boundary: token 15 (text index 14), the last token of block 1, and nothing else
    text = "a" * 63
    assert data.lab_label("lab-boundary", text) == 0
    assert data.lab_label("lab-boundary", text[:14] + "b" + text[15:]) == 1
    assert data.lab_label("lab-boundary", text[:13] + "bb" + text[15:]) == 1
    assert data.lab_label("lab-boundary", text[:15] + "b" * 48) == 0                 # every other token b
    assert data.lab_evidence("lab-boundary", text) == 15
    # shortcut: the count of b against c decides, never the first letter (the shortcut)
    filler = "abcd" * 15 + "ab"                                                     # 16 b, 15 c
    assert data.lab_label("lab-shortcut", "X" + filler) == 1
    assert data.lab_label("lab-shortcut", "Y" + filler.replace("b", "c", 2)) == 0    # 14 b, 17 c
    assert data.lab_label("lab-shortcut", "Y" + "c" + filler[1:].replace("b", "a", 1)) == 0
    assert data.lab_label("lab-shortcut", "X" + "bcbcbbd" + "a" * 55) == 1
    # sum: the digits' sum against 283, wherever the digits stand
    assert data.lab_label("lab-sum", "45" * 31 + "5") == 1                      # 284
    assert data.lab_label("lab-sum", "45" * 31 + "4") == 0                      # 283
    assert data.lab_label("lab-sum", "0" * 31 + "9" * 32) == 1                  # far digits decide


def test_no_single_deciding_token_and_unknown_kinds_are_errors(monkeypatch):
    """A kind where no single token decides has no evidence (and no bound); an unknown task or kind is an error
    naming the known ones, never another kind's rule."""
    for name in ("lab-bottleneck", "lab-shortcut", "lab-sum"):
        with pytest.raises(data.DataError, match="no single token decides"):
            data.lab_evidence(name, "a" * 63)
    with pytest.raises(data.DataError, match="unknown lab task 'lab-xor'; known: lab-reach"):
        data.lab_label("lab-xor", "a" * 63)
    monkeypatch.setitem(data.LAB, "lab-xor", dict(kind="xor", length=64))
    for call in (data.lab_label, data.lab_evidence):
        with pytest.raises(data.DataError, match="lab-xor: unknown lab kind 'xor'; known: reach, bottleneck"):
            call("lab-xor", "a" * 63)
    with pytest.raises(data.DataError, match="unknown lab kind 'xor'"):
        data.generate_lab("lab-xor", 3, seed=0)


@pytest.mark.parametrize("name", list(data.LAB))
def test_generators_are_deterministic_and_labelled_by_their_rule(name):
    rows = data.generate_lab(name, 400, seed=3)
    assert rows == data.generate_lab(name, 400, seed=3)
    assert rows != data.generate_lab(name, 400, seed=4)
    spec = data.LAB[name]
    assert all(len(t) + 1 == spec["length"] for t, _ in rows)                   # [cls] + the letters
    assert all(data.lab_label(name, t) == y for t, y in rows)
    assert 150 < sum(y for _, y in rows) < 250                                  # balanced
    if spec["kind"] == "shortcut":                                              # never a tie
        assert all(t.count(spec["more"]) != t.count(spec["less"]) for t, _ in rows)
    if spec["kind"] == "reach":                                                 # one needle, in blocks near .. far
        b = spec["block"]
        assert all(sum(c in data.LAB_NEEDLES for c in t) == 1 for t, _ in rows)
        blocks = {data.lab_evidence(name, t) // b for t, _ in rows}
        assert blocks == set(range(spec["near"], spec["far"] + 1))


def test_shortcut_gives_the_label_away_in_training_only():
    """lab-shortcut: token 1 is the label's needle in every training example; on dev it is X or Y at random,
    independent of the label, and the count still decides."""
    rows = data.generate_lab("lab-shortcut", 2000, seed=1, n_train=1000)
    train, dev = rows[:1000], rows[1000:]
    assert all(t[0] == data.LAB_NEEDLES[y] for t, y in train)
    agree = sum(t[0] == data.LAB_NEEDLES[y] for t, y in dev)
    assert 430 < agree < 570                                                    # a coin, not the label
    assert all(data.lab_label("lab-shortcut", t) == y for t, y in dev)
    assert 430 < sum(y for _, y in dev) < 570
    assert set(t[0] for t, _ in dev) == set(data.LAB_NEEDLES)


def test_sum_is_digits_alone_and_far_blocks_count():
    """lab-sum: 63 digits from token 1 on (no letter, no needle), the label 1 iff their sum is over
    283; the digits within block-sparse's window-1 reach (tokens 1-23) give the label for about
    70% of texts only (their sum against its mean): the far blocks decide the rest."""
    rows = data.generate_lab("lab-sum", 1000, seed=2)
    assert all(t.isdigit() and len(t) == 63 for t, _ in rows)
    assert all(y == int(sum(int(c) for c in t) > 283) for t, y in rows)
    near = sum(int(sum(int(c) for c in t[:23]) > 23 * 4.5) == y for t, y in rows)
    assert 620 < near < 800
    assert set("".join(t for t, _ in rows)) == set("0123456789")


def test_folder_generated_on_first_use(tmp_path):
    folder = str(tmp_path / "reach")
    os.makedirs(folder)                                                         # train.py asks that --data exists
    task = train.reader("lab-reach").load_task("lab-reach", folder, None, max_len=64)
    assert sorted(os.listdir(folder)) == ["dev.tsv", "spec.json", "train.tsv"]
    assert (len(task.train), len(task.dev["dev"])) == (data.LAB_SIZES["n_train"], data.LAB_SIZES["n_dev"])
    texts = data.generate_lab("lab-reach", data.LAB_SIZES["n_train"] + 1, data.LAB_SIZES["seed"])
    first, label = texts[0]
    assert task.train[0].ids == data.ByteTokenizer().encode(first) and task.train[0].label == label
    assert len(task.train[0].ids) == data.LAB["lab-reach"]["length"]
    assert task.num_labels == 2 and task.label_names == ["0", "1"]


def test_train_py_without_data_generates_the_lab_task(tmp_path, monkeypatch, capsys):
    """python train.py --task lab-reach: no --data needed; the set is generated once into data/lab-reach."""
    monkeypatch.chdir(tmp_path)
    train.main(["--task", "lab-reach", "--max-steps", "1", "--sar", "0", "--out", "o", "--layers", "1",
                "--hidden", "16", "--heads", "2", "--ffn", "32"])
    assert sorted(os.listdir(tmp_path / "data" / "lab-reach")) == ["dev.tsv", "spec.json", "train.tsv"]
    assert "task lab-reach: 20000 train / 1000 dev examples" in capsys.readouterr().out
