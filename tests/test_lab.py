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


@pytest.mark.parametrize("name", list(data.LAB))
def test_generators_are_deterministic_and_labelled_by_their_rule(name):
    rows = data.generate_lab(name, 400, seed=3)
    assert rows == data.generate_lab(name, 400, seed=3)
    assert rows != data.generate_lab(name, 400, seed=4)
    spec = data.LAB[name]
    assert all(len(t) + 1 == spec["length"] for t, _ in rows)                   # [cls] + the letters
    assert all(data.lab_label(name, t) == y for t, y in rows)
    assert 150 < sum(y for _, y in rows) < 250                                  # balanced
    if spec["kind"] == "reach":                                                 # one needle, in blocks near .. far
        b = spec["block"]
        assert all(sum(c in data.LAB_NEEDLES for c in t) == 1 for t, _ in rows)
        blocks = {data.lab_evidence(name, t) // b for t, _ in rows}
        assert blocks == set(range(spec["near"], spec["far"] + 1))


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
