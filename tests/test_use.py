"""Using a trained model (issue 51): the label names travel with it, `python model.py predict` scores a file and
`python model.py look` shows what it attends to in one text.

A tiny random BERT (transformers) is converted and fine-tuned through train.py on a TSV whose labels are words
(neg / pos), dense with AttendOut, block-sparse with random blocks (on a dev file of long and short lines, at
--max-len 24 under a position table of 40), and HST. Checked:
- the checkpoint, final.json and `export --hf` (id2label, label2id) carry the names; convert keeps an HF
  classifier's id2label; a checkpoint from before (no task record) still predicts and exports, by index, with one
  `note:` line;
- predict's probabilities equal transformers' on the exported folder (1e-4), on plain text and on the dev file;
  on the dev file with ckpt_best.pt its accuracy is final.json's best, exactly, for every topology; its table
  opens with a header;
- with random blocks, predict's probabilities are evaluation's own, example by example (train.evaluate's batches
  caught): it batches as evaluation does (longest first), and cuts at the run's --max-len, not the model's table;
- bad input is one `error:` line naming the file and line (wrong column count, unknown label, empty file, labels
  on some lines only), or the checkpoint (masked LM, plain text for a pair task), and --out is then not written;
- no command writes over a file it reads: predict --out naming its checkpoint or its input, look --png naming
  the checkpoint, export / convert naming their input (as ./name or through a link too) are one error line each,
  the file unchanged; --device naming a GPU this machine lacks is one error line (predict, look, train.py);
- look's weights equal transformers' output_attentions (1e-5); what it shows is the first token's row averaged
  over the heads, a word of several pieces once with the sum of its pieces' weights (transformers' word ids);
  under block-sparse and HST attention the weights are the kernel's (A V through W_o gives the layer's attention
  output); the pairs it says a G-Net masks are those the G-Net's own counters count in the masked pass, dense
  and block-sparse (where the layout leaves pairs out); the command prints a line per layer and writes the
  PNG, whose title keeps its spaces, with a colour scale and (AttendOut) what a red dot is;
- a run whose --epochs make fewer than 50 steps says so in one warning.
Run: python -m pytest -q tests/test_use.py
"""
import argparse
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from PIL import ImageDraw, ImageFont

transformers = pytest.importorskip("transformers")

import data  # noqa: E402
import model as M  # noqa: E402
import train  # noqa: E402
from test_export import hf_folder, sentences  # noqa: E402

TEXTS = ["the cat sat on the mat", "hello there", "a quick dog ran eat", "the mat"]


def write_split(path, n, seed, extra_rows=()):
    """label<TAB>sentence with a header; the label is a word: pos when the sentence has a cat."""
    rows = ["label\tsentence"] + [("pos" if "cat" in s else "neg") + "\t" + s for s in sentences(n, seed)]
    path.write_text("\n".join([*rows, *extra_rows]) + "\n")


def write_long_split(path, n, seed):
    """As write_split, with lines of 2 to 45 words in no order of length (several of sentences' lines each)."""
    rng = random.Random(seed)
    texts = [" ".join(sentences(rng.randint(1, 5), 100 * seed + i)) for i in range(n)]
    path.write_text("\n".join(["label\tsentence"] + [("pos" if "cat" in s else "neg") + "\t" + s for s in texts]) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run folder} of three fine-tuning runs (dense + AttendOut, sparse with a random block at --max-len 24
    on the long dev file, HST), the converted masked LM and the data folders."""
    tmp = tmp_path_factory.mktemp("use")
    folder, _ = hf_folder(tmp, "bert")
    M.main(["convert", str(folder), str(tmp / "conv.pt")])
    for name in ("data", "long"):
        (tmp / name).mkdir()
        write_split(tmp / name / "train.tsv", 48, 1)
    write_split(tmp / "data" / "dev.tsv", 20, 2)
    write_long_split(tmp / "long" / "dev.tsv", 30, 3)
    common = ["--init", str(tmp / "conv.pt"), "--task", "tsv", "--text-col", "sentence", "--label-col", "label",
              "--lr", "1e-3", "--batch-size", "8", "--max-steps", "12", "--eval-every", "3"]
    flags = {"dense": ["--data", str(tmp / "data"), "--attn-dropout", "attendout"],
             "sparse": ["--data", str(tmp / "long"), "--max-len", "24", "--attention", "sparse", "--block-size",
                        "4", "--num-random", "1"],
             "hst": ["--data", str(tmp / "data"), "--attention", "hst", "--block-size", "4"]}
    found = {"conv": tmp / "conv.pt", "data": tmp / "data", "long": tmp / "long", "hf": folder, "tmp": tmp}
    for name, extra in flags.items():
        train.main([*common, *extra, "--out", str(tmp / name)])
        found[name] = tmp / name
    return found


def predict_lines(capsys, argv):
    capsys.readouterr()
    M.main(["predict", *map(str, argv)])
    return capsys.readouterr().out.splitlines()


def one_error(capsys, argv, *names):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        M.main(list(map(str, argv)))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for name in names:
        assert name in err[0], (name, err[0])


def test_the_label_names_travel_with_the_model(runs, tmp_path, capsys):
    ckpt = torch.load(runs["dense"] / "ckpt_best.pt", weights_only=True)
    assert ckpt["task"]["labels"] == ["neg", "pos"] and ckpt["task"]["name"] == "tsv"
    assert ckpt["task"]["text_col"] == "sentence" and ckpt["task"]["max_len"] == 40
    assert json.load(open(runs["dense"] / "final.json"))["label_names"] == ["neg", "pos"]
    M.main(["export", str(runs["dense"] / "ckpt_best.pt"), str(tmp_path / "hf"), "--hf"])
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["label2id"] == {"neg": 0, "pos": 1}
    # an HF classifier's own names survive convert -> export
    names = {0: "negative", 1: "positive"}
    folder, _ = hf_folder(tmp_path, "bert", head="SequenceClassification", num_labels=2, id2label=names,
                          label2id={v: k for k, v in names.items()})
    M.main(["convert", str(folder), str(tmp_path / "cls.pt")])
    assert torch.load(tmp_path / "cls.pt", weights_only=True)["task"]["labels"] == ["negative", "positive"]
    M.main(["export", str(tmp_path / "cls.pt"), str(tmp_path / "cls-hf"), "--hf"])
    assert json.load(open(tmp_path / "cls-hf" / "config.json"))["id2label"] == {"0": "negative", "1": "positive"}


def test_a_checkpoint_from_before_shows_its_classes_by_index(runs, tmp_path, capsys):
    old = torch.load(runs["dense"] / "ckpt_best.pt", weights_only=True)
    del old["task"]
    torch.save(old, tmp_path / "old.pt")
    (tmp_path / "plain.txt").write_text("the cat sat\nhello there\n")
    capsys.readouterr()
    M.main(["predict", str(tmp_path / "old.pt"), str(tmp_path / "plain.txt"), "--out", str(tmp_path / "p.jsonl")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("note: ") and "by index" in err[0], err
    records = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    assert all(set(r["probs"]) == {"0", "1"} and r["label"] in ("0", "1") for r in records)
    M.main(["export", str(tmp_path / "old.pt"), str(tmp_path / "hf"), "--hf"])
    assert json.load(open(tmp_path / "hf" / "config.json"))["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}
    assert "note: " in capsys.readouterr().err


def test_predict_gives_transformers_probabilities(runs, tmp_path, capsys):
    ckpt = runs["dense"] / "ckpt_best.pt"
    (tmp_path / "plain.txt").write_text("\n".join(TEXTS) + "\n\n")             # a blank line is no example
    M.main(["predict", str(ckpt), str(tmp_path / "plain.txt"), "--out", str(tmp_path / "p.jsonl")])
    M.main(["export", str(ckpt), str(tmp_path / "hf"), "--hf"])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    tok = data.tokenizer_from_path(str(ckpt))
    records = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    assert len(records) == len(TEXTS)
    for text, record in zip(TEXTS, records):
        with torch.no_grad():
            probs = hf(torch.tensor([tok.encode(text)])).logits.softmax(-1)[0]
        names = [hf.config.id2label[i] for i in range(2)]
        assert names == ["neg", "pos"] and record["label"] == names[int(probs.argmax())]
        assert max(abs(record["probs"][n] - float(p)) for n, p in zip(names, probs)) < 1e-4
    # the table on stdout: a header, then one row per example, its line, label and probability
    header, *rows = predict_lines(capsys, [ckpt, tmp_path / "plain.txt"])
    assert header.split() == ["line", "label", "p", "text"]
    assert [row.split()[:3] for row in rows] == [[str(i + 1), r["label"], f"{r['probs'][r['label']]:.3f}"]
                                                 for i, r in enumerate(records)]


@pytest.mark.parametrize("name", ["dense", "sparse", "hst"])
def test_predict_on_the_dev_file_gives_final_jsons_best(runs, name, capsys):
    final = json.load(open(runs[name] / "final.json"))
    dev = runs["long" if name == "sparse" else "data"] / "dev.tsv"
    n = len(dev.read_text().splitlines()) - 1
    lines = predict_lines(capsys, [runs[name] / "ckpt_best.pt", dev])
    assert len(lines) == n + 2 and lines[-1] == f"{dev}: acc {100 * final['best_dev']:.1f}%"
    assert lines[0].split()[0] == "line" and all(row.split()[1] in ("neg", "pos") for row in lines[1:-1])


def test_predict_reads_the_task_file_without_its_labels(runs, tmp_path, capsys):
    (tmp_path / "test.tsv").write_text("index\tsentence\n0\tthe cat sat\n1\thello there\n")   # GLUE's test files
    lines = predict_lines(capsys, [runs["dense"] / "ckpt_best.pt", tmp_path / "test.tsv"])
    assert len(lines) == 3 and lines[1].split()[0] == "2"                    # no score without labels


def test_bad_input_is_one_error_line_and_no_output(runs, tmp_path, capsys):
    ckpt = runs["dense"] / "ckpt_best.pt"
    out = tmp_path / "p.jsonl"
    bad_columns = tmp_path / "columns.tsv"
    bad_columns.write_text("label\tsentence\npos\tthe cat\nneg\thello\tthere\n")
    unknown = tmp_path / "unknown.tsv"
    unknown.write_text("label\tsentence\npos\tthe cat\nmaybe\thello\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    one_error(capsys, ["predict", ckpt, bad_columns, "--out", out], f"{bad_columns}:3", "columns")
    one_error(capsys, ["predict", ckpt, unknown, "--out", out], f"{unknown}:3", "unknown label 'maybe'")
    one_error(capsys, ["predict", ckpt, empty, "--out", out], f"{empty}:1", "empty")
    one_error(capsys, ["predict", runs["conv"], empty, "--out", out], str(runs["conv"]), "masked-LM")
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["columns.tsv", "empty.txt", "unknown.tsv"]


def test_look_weights_equal_transformers_attentions(runs, tmp_path):
    ckpt = runs["dense"] / "ckpt_best.pt"
    M.main(["export", str(ckpt), str(tmp_path / "hf"), "--hf"])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf"),
                                                                        attn_implementation="eager").eval()
    model, tok, _ = M.load_for_use(str(ckpt), torch.device("cpu"))
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():
        ref = hf(ids, output_attentions=True).attentions                          # per layer [1, H, L, L]
        ours = [M.attention_weights(model, layer, x, mask)[0]
                for layer, (x, mask) in zip(model.layers, M.layer_inputs(model, ids, torch.zeros_like(ids)))]
    assert len(ours) == len(ref) == 2
    assert max(float((a - r[0]).abs().max()) for a, r in zip(ours, ref)) < 1e-5


@pytest.mark.parametrize("name", ["sparse", "hst"])
def test_look_weights_are_the_kernels(runs, name):
    """A V through W_o is the attention output the model computes (first call of each layer: HST's stage 1), and
    every weight outside the layout is 0."""
    model, tok, _ = M.load_for_use(str(runs[name] / "ckpt_best.pt"), torch.device("cpu"))
    ids = torch.tensor([tok.encode("the cat sat on a mat hello there quick dog ran")])
    outputs = {}

    def catch(attn, args, y):                          # the first call's output; returns None
        outputs.setdefault(attn.layer_idx, y)

    hooks = [layer.attn.register_forward_hook(catch) for layer in model.layers]
    inputs = M.layer_inputs(model, ids, torch.zeros_like(ids))
    for h in hooks:
        h.remove()
    for i, (layer, (x, mask)) in enumerate(zip(model.layers, inputs)):
        with torch.no_grad():
            A, allowed = M.attention_weights(model, layer, x, mask)                # [H, L, K]
            v = layer.attn.qkv(x).chunk(3, dim=-1)[2].view(1, x.size(1), A.size(0), -1).transpose(1, 2)
            y = (A[None] @ v).transpose(1, 2).reshape(x.shape)
            assert float((layer.attn.out(y) - outputs[i]).abs().max()) < 1e-5
        assert not A[~allowed].any() and (~allowed).any()                        # the layout leaves keys out


def test_look_counts_the_pairs_the_g_nets_mask(runs):
    """On the masked pass's input, the pairs look says a G-Net masks are those its own counters count."""
    model, tok, _ = M.load_for_use(str(runs["dense"] / "ckpt_best.pt"), torch.device("cpu"))
    torch.manual_seed(1)
    for layer in model.layers:                        # G-Nets that mask about half of the pairs
        torch.nn.init.normal_(layer.attn.drop.gnet.weight, std=1.0)
    ids = torch.tensor([tok.encode(TEXTS[0])])
    types = torch.zeros_like(ids)
    masked_inputs = M.layer_inputs(model, ids, types, masked=True)
    for layer, (x, mask), (xm, _) in zip(model.layers, M.layer_inputs(model, ids, types), masked_inputs):
        _, allowed = M.attention_weights(model, layer, x, mask)
        masked = M.gnet_masked(layer, xm, allowed)
        counted = float(layer.attn.drop.pairs - layer.attn.drop.kept)
        assert int(masked.sum()) == counted and 0 < counted < masked.numel()
    assert not model.training


@pytest.mark.parametrize("name", ["dense", "hst"])
def test_look_on_the_command_line(runs, name, tmp_path, capsys):
    png = tmp_path / "look.png"
    capsys.readouterr()
    M.main(["look", str(runs[name] / "ckpt_best.pt"), "the cat sat on the mat", "--png", str(png)])
    lines = capsys.readouterr().out.splitlines()
    layers = [line for line in lines if line.startswith("layer ")]
    assert [line.split(":")[0] for line in layers] == ["layer 1", "layer 2"]
    assert all(len(line.split(":", 1)[1].split(",")) >= 3 for line in layers)        # the top 3 keys
    assert ("G-Net masks" in layers[0]) == (name == "dense")                       # AttendOut's run only
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_short_run_from_epochs_is_warned(runs, tmp_path, capsys):
    common = ["--init", str(runs["conv"]), "--task", "tsv", "--data", str(runs["data"]), "--text-col", "sentence",
              "--label-col", "label", "--batch-size", "8"]
    capsys.readouterr()
    train.main([*common, "--epochs", "1", "--out", str(tmp_path / "a")])
    warned = [line for line in capsys.readouterr().err.splitlines() if "optimizer steps" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: only 6 optimizer steps")
    assert "--epochs" in warned[0] and "--batch-size" in warned[0]
    train.main([*common, "--max-steps", "6", "--out", str(tmp_path / "b")])
    assert "optimizer steps" not in capsys.readouterr().err


def test_predicts_flags_reach_the_run(runs, tmp_path, capsys, monkeypatch):
    """--batch-size sets the batches (the run's 8 by default); a bad --batch-size or --device is one error line."""
    (tmp_path / "plain.txt").write_text("\n".join(TEXTS) + "\n")
    sizes = []
    collate = data.collate
    monkeypatch.setattr(data, "collate", lambda examples, *a, **kw: sizes.append(len(examples)) or collate(
        examples, *a, **kw))
    for flags, expected in (([], [4]), (["--batch-size", "3"], [3, 1])):
        sizes.clear()
        predict_lines(capsys, [runs["dense"] / "ckpt_best.pt", tmp_path / "plain.txt", *flags])
        assert sizes == expected
    ckpt = runs["dense"] / "ckpt_best.pt"
    one_error(capsys, ["predict", ckpt, tmp_path / "plain.txt", "--batch-size", "0"], "--batch-size 0")
    if not torch.cuda.is_available():
        one_error(capsys, ["predict", ckpt, tmp_path / "plain.txt", "--device", "cuda"], "--device cuda")


def test_a_classifiers_head_kept_for_other_names_is_warned(runs, tmp_path, capsys):
    """--init a classifier whose classes had other names: one warning names both; the same names: none."""
    names = {0: "negative", 1: "positive"}
    folder, _ = hf_folder(tmp_path, "bert", head="SequenceClassification", num_labels=2, id2label=names,
                          label2id={v: k for k, v in names.items()})
    common = ["--task", "tsv", "--data", str(runs["data"]), "--text-col", "sentence", "--label-col", "label",
              "--batch-size", "8", "--max-steps", "2"]
    capsys.readouterr()
    train.main(["--init", str(folder), *common, "--out", str(tmp_path / "a")])
    warned = [line for line in capsys.readouterr().err.splitlines() if "classified" in line]
    assert len(warned) == 1 and "['negative', 'positive']" in warned[0] and "['neg', 'pos']" in warned[0]
    train.main(["--init", str(runs["dense"] / "ckpt_best.pt"), *common, "--out", str(tmp_path / "b")])
    assert "classified" not in capsys.readouterr().err
