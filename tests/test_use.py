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
from PIL import Image, ImageDraw, ImageFont

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
              "--lr", "1e-3", "--batch-size", "8", "--max-steps", "12", "--eval-every", "3", "--device", "cpu"]
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
    M.main(["predict", *map(str, argv), "--device", "cpu"])         # as the runs: on the CPU
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
    M.main(["predict", str(tmp_path / "old.pt"), str(tmp_path / "plain.txt"), "--out", str(tmp_path / "p.jsonl"),
            "--device", "cpu"])
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
    M.main(["predict", str(ckpt), str(tmp_path / "plain.txt"), "--out", str(tmp_path / "p.jsonl"), "--device", "cpu"])
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
def test_look_on_the_command_line(runs, name, tmp_path, capsys, monkeypatch):
    """A line per layer; the PNG's title keeps its spaces (its font's space at least 3 px wide: pillow's default
    10 px font draws 2, and the words run together), a colour scale (white to blue, many levels) and, with
    AttendOut, red dots and the legend line that says what they are."""
    png = tmp_path / "look.png"
    drawn = []
    text = ImageDraw.ImageDraw.text
    monkeypatch.setattr(ImageDraw.ImageDraw, "text", lambda self, xy, s, *a, **kw: drawn.append(
        (xy, s, kw.get("font") or ImageFont.load_default())) or text(self, xy, s, *a, **kw))
    capsys.readouterr()
    M.main(["look", str(runs[name] / "ckpt_best.pt"), "the cat sat on the mat", "--png", str(png), "--device",
            "cpu"])
    lines = capsys.readouterr().out.splitlines()
    layers = [line for line in lines if line.startswith("layer ")]
    assert [line.split(":")[0] for line in layers] == ["layer 1", "layer 2"]
    assert all(len(line.split(":", 1)[1].split(",")) >= 3 for line in layers)        # the top 3 keys
    assert ("G-Net masks" in layers[0]) == (name == "dense")                       # AttendOut's run only
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (xy, title, font), *_ = drawn
    assert title == "ckpt_best.pt: the cat sat on the mat" and xy[1] < 20                  # the title, on top
    assert font.getlength("a a") - font.getlength("aa") >= 3
    legend = [s for xy, s, _ in drawn if xy[1] < 44]                                # the title and the legend
    assert ("a pair the layer's G-Net masks (AttendOut)" in legend) == (name == "dense")
    with Image.open(png) as image:
        top = np.asarray(image.convert("RGB"))[:44].astype(int)                   # the title and the legend
    scale = {int(r) for r, g, b in top.reshape(-1, 3) if r == g and b == 255 and r < 250}
    red = ((top[..., 0] > 200) & (top[..., 1] < 60) & (top[..., 2] < 60)).any()
    assert len(scale) >= 50 and red == (name == "dense")


def test_a_short_run_from_epochs_is_warned(runs, tmp_path, capsys):
    common = ["--init", str(runs["conv"]), "--task", "tsv", "--data", str(runs["data"]), "--text-col", "sentence",
              "--label-col", "label", "--batch-size", "8", "--device", "cpu"]
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
              "--batch-size", "8", "--max-steps", "2", "--device", "cpu"]
    capsys.readouterr()
    train.main(["--init", str(folder), *common, "--out", str(tmp_path / "a")])
    warned = [line for line in capsys.readouterr().err.splitlines() if "classified" in line]
    assert len(warned) == 1 and "['negative', 'positive']" in warned[0] and "['neg', 'pos']" in warned[0]
    train.main(["--init", str(runs["dense"] / "ckpt_best.pt"), *common, "--out", str(tmp_path / "b")])
    assert "classified" not in capsys.readouterr().err


def evaluation_probs(run, monkeypatch):
    """The reference predict must equal: each dev example's probabilities as train.evaluate computes them with
    ckpt_best.pt (its own reading of the dev file, cut at the run's --max-len; its batches, caught as data.collate
    makes them), in the file's order; and the examples."""
    final = json.load(open(run / "final.json"))
    args = argparse.Namespace(**final["args"])
    model, tok, _ = M.load_for_use(str(run / "ckpt_best.pt"), torch.device("cpu"))
    task = data.load_task("tsv", args.data, tok, max_len=args.max_len, **train.columns(args))
    batches = []
    logits = []
    collate = data.collate
    hook = model.register_forward_hook(lambda module, inputs, y: logits.append(y))
    with monkeypatch.context() as patch:
        patch.setattr(data, "collate", lambda examples, *a, **kw: batches.append(examples) or collate(
            examples, *a, **kw))
        train.evaluate(model, task, args, torch.device("cpu"), tok)
    hook.remove()
    found = {id(e): z for examples, y in zip(batches, logits) for e, z in zip(examples, y)}
    examples = next(iter(task.dev.values()))
    return torch.stack([found[id(e)] for e in examples]).softmax(-1), examples


def predicted_probs(capsys, ckpt, file, out):
    """predict's probabilities [N, 2] (--out, in the file's order), and what it printed."""
    capsys.readouterr()
    M.main(["predict", str(ckpt), str(file), "--out", str(out), "--device", "cpu"])
    printed = capsys.readouterr()
    records = [json.loads(line) for line in open(out)]
    return torch.tensor([[r["probs"][n] for n in ("neg", "pos")] for r in records]), printed


def test_predict_with_random_blocks_batches_as_evaluation(runs, tmp_path, capsys, monkeypatch):
    """A random-block model (--num-random 1) on a dev file whose file order and length order batch differently: a
    layout is drawn per batch, so predict gives evaluation's probabilities only where it batches as evaluation
    does (longest first, --batch-size at a time)."""
    ref, examples = evaluation_probs(runs["sparse"], monkeypatch)
    lengths = [len(e.ids) for e in examples]
    assert sorted(lengths, reverse=True) != lengths and len(set(lengths)) > 8     # not in length order
    probs, printed = predicted_probs(capsys, runs["sparse"] / "ckpt_best.pt", runs["long"] / "dev.tsv",
                                     tmp_path / "p.jsonl")
    assert float((probs - ref).abs().max()) < 2e-6                               # --out rounds to 6 places
    final = json.load(open(runs["sparse"] / "final.json"))
    assert printed.out.splitlines()[-1].endswith(f"acc {100 * final['best_dev']:.1f}%")


def test_predict_cuts_at_the_runs_max_len(runs, tmp_path, capsys, monkeypatch):
    """Lines longer than the run's --max-len (24) and shorter than the model's position table (40): predict cuts
    them at 24, as evaluation does, and says how many it cut."""
    ckpt = runs["sparse"] / "ckpt_best.pt"
    assert torch.load(ckpt, weights_only=True)["task"]["max_len"] == 24 and M.load_for_use(
        str(ckpt), torch.device("cpu"))[0].cfg.max_len == 40
    ref, examples = evaluation_probs(runs["sparse"], monkeypatch)
    tok = data.tokenizer_from_path(str(ckpt))
    texts = [line.split("\t")[1] for line in (runs["long"] / "dev.tsv").read_text().splitlines()[1:]]
    cut = [i for i, t in enumerate(texts) if 24 < len(tok.encode(t)) <= 40]
    assert len(cut) >= 3 and all(len(examples[i].ids) == 24 for i in cut)
    probs, printed = predicted_probs(capsys, ckpt, runs["long"] / "dev.tsv", tmp_path / "p.jsonl")
    assert float((probs[cut] - ref[cut]).abs().max()) < 2e-6
    longer = sum(len(tok.encode(t)) > 24 for t in texts)
    assert f"warning: {longer} examples were longer than 24 tokens (the run's --max-len)" in printed.err


def test_labels_on_some_lines_only_or_text_for_a_pair_task_is_one_error(runs, tmp_path, capsys):
    """A file labelled on some lines only is one error naming FILE:LINE (an empty cell, a JSON line without its
    label); plain text given to a pair task is one error naming the file; --out is not written."""
    ckpt = runs["dense"] / "ckpt_best.pt"
    out = tmp_path / "p.jsonl"
    some = tmp_path / "some.tsv"
    some.write_text("label\tsentence\npos\tthe cat\nneg\ta dog\n\thello there\n")
    some_json = tmp_path / "some.jsonl"
    some_json.write_text('{"sentence": "the cat", "label": "pos"}\n{"sentence": "hello there"}\n')
    one_error(capsys, ["predict", ckpt, some, "--out", out], f"{some}:4")
    one_error(capsys, ["predict", ckpt, some_json, "--out", out], f"{some_json}:2", "label")
    pair = torch.load(ckpt, weights_only=True)
    pair["task"]["text_pair_col"] = "sentence2"                       # a checkpoint of a pair task
    torch.save(pair, tmp_path / "pair.pt")
    (tmp_path / "plain.txt").write_text("the cat sat\nhello there\n")
    one_error(capsys, ["predict", tmp_path / "pair.pt", tmp_path / "plain.txt", "--out", out],
              str(tmp_path / "plain.txt"), "pairs")
    assert not out.exists()


def test_no_command_writes_over_a_file_it_reads(runs, tmp_path, capsys, monkeypatch):
    """predict --out naming its checkpoint or its input, look --png naming the checkpoint, export / convert
    naming their input: one error line naming the flag and the file, the file unchanged (real paths compared:
    ./name, a link)."""
    shutil.copy(runs["dense"] / "ckpt_best.pt", tmp_path / "ckpt.pt")
    shutil.copytree(runs["hf"], tmp_path / "hf")
    (tmp_path / "plain.txt").write_text("the cat sat\nhello there\n")
    os.symlink(tmp_path / "ckpt.pt", tmp_path / "link.pt")
    files = [tmp_path / name for name in ("ckpt.pt", "plain.txt", "hf/model.safetensors", "hf/config.json")]
    before = [f.read_bytes() for f in files]
    monkeypatch.chdir(tmp_path)
    cases = [(["predict", "ckpt.pt", "plain.txt", "--out", "./ckpt.pt"], "--out ./ckpt.pt", "the checkpoint"),
             (["predict", tmp_path / "ckpt.pt", "plain.txt", "--out", "link.pt"], "--out link.pt", "checkpoint"),
             (["predict", "ckpt.pt", "plain.txt", "--out", tmp_path / "plain.txt"], "--out", "the input file"),
             (["predict", "ckpt.pt", "./plain.txt", "--out", "plain.txt"], "--out plain.txt", "input file"),
             (["look", "ckpt.pt", "the cat", "--png", "./ckpt.pt"], "--png ./ckpt.pt", "the checkpoint"),
             (["look", "./ckpt.pt", "the cat", "--png", "link.pt"], "--png link.pt", "the checkpoint"),
             (["export", "ckpt.pt", "./ckpt.pt", "--force"], "OUT ./ckpt.pt", "the checkpoint"),
             (["export", "hf", "hf", "--hf", "--force"], "OUT hf", "the checkpoint"),
             (["convert", "hf", "hf/model.safetensors", "--force"], "OUT hf/model.safetensors", "checkpoint")]
    for argv, *names in cases:
        one_error(capsys, argv, *names)
    assert [f.read_bytes() for f in files] == before
    M.main(["predict", "ckpt.pt", "plain.txt", "--out", "p.jsonl"])          # another file: written
    assert len(open("p.jsonl").read().splitlines()) == 2


def test_a_gpu_this_machine_lacks_is_one_error_line(runs, tmp_path, capsys, monkeypatch):
    """--device cuda:N past the GPUs there are (and any cuda without one) is one error line naming it, from the one
    check predict, look and train.py share (model.pick_device)."""
    ckpt = runs["dense"] / "ckpt_best.pt"
    (tmp_path / "plain.txt").write_text("the cat sat\n")
    devices = [f"cuda:{torch.cuda.device_count()}", "cuda:5" if torch.cuda.device_count() < 6 else "gpu"]
    if not torch.cuda.is_available():
        devices += ["cuda", "cuda:0"]
    for device in devices:
        one_error(capsys, ["predict", ckpt, tmp_path / "plain.txt", "--device", device], f"--device {device}")
        one_error(capsys, ["look", ckpt, "the cat", "--device", device], f"--device {device}")
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:                    # fails in setup, before any data or --out
            train.main(["--device", device, "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: --device {device}:"), err
    assert not (tmp_path / "run").exists()
    # on a machine with one GPU: cuda and cuda:0 are it, cuda:1 is one error naming the one GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert M.pick_device("cuda") == M.pick_device("auto") == torch.device("cuda")
    assert M.pick_device("cuda:0") == torch.device("cuda:0")
    for device in ("cuda:1", "cuda:5", "cuda:x", "gpu"):
        with pytest.raises(ValueError, match=f"^--device {device}: .*this machine has 1 GPUs"):
            M.pick_device(device)


@pytest.fixture(scope="module")
def roberta(tmp_path_factory):
    """A tiny random RoBERTa masked LM (byte-level BPE with few merges: a word of the vocabulary's letters is
    several pieces), its HF folder and the converted .pt."""
    tmp = tmp_path_factory.mktemp("look")
    folder, _ = hf_folder(tmp, "roberta")
    M.main(["convert", str(folder), str(tmp / "conv.pt")])
    return folder, tmp / "conv.pt"


def test_look_shows_the_first_tokens_row_over_the_heads_by_word(roberta, capsys):
    """What look shows in each layer is transformers' output_attentions, averaged over the heads, in the first
    token's row, summed over each word's pieces (transformers' word ids): every word once, with its weight."""
    folder, ckpt = roberta
    text = "the zebra sat"
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    enc = hf_tok(text, return_offsets_mapping=True)
    word_ids = enc.word_ids()
    assert word_ids.count(1) >= 3                                                 # "zebra": several pieces
    names = []
    for t, w in enumerate(word_ids):
        start, end = enc.offset_mapping[t]
        if w is None:
            names.append("<cls>" if enc.input_ids[t] == hf_tok.cls_token_id else "<sep>")
        else:
            spans = [enc.offset_mapping[u] for u, v in enumerate(word_ids) if v == w]
            names.append(f'"{text[spans[0][0]:spans[-1][1]]}"')
    with torch.no_grad():
        attentions = hf(torch.tensor([enc.input_ids]), output_attentions=True).attentions    # [1, H, L, L]
    capsys.readouterr()
    shown = M.look(str(ckpt), text)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("layer ")]
    for layer, line, A in zip(shown, lines, attentions):
        heads = A[0, :, 0]                                                        # [H, L]: row 0
        assert float((heads[0] - heads[1]).abs().max()) > 0.05                    # the heads differ
        expected = {}
        for t, name in enumerate(names):
            expected[name] = expected.get(name, 0.0) + float(heads[:, t].mean())
        got = dict(layer["keys"])
        assert len(got) == len(layer["keys"]) and set(got) == set(expected), (got, expected)
        assert max(abs(got[n] - w) for n, w in expected.items()) < 1e-5
        assert line.split(": ", 1)[1] == ", ".join(f"{n} {w:.2f}" for n, w in layer["keys"][:3])
    assert len(shown) == len(attentions) == 2


def test_look_counts_g_net_masks_only_where_the_layout_attends(runs, tmp_path):
    """Block-sparse attention (no random blocks: the masked pass attends the evaluation's layout) leaves pairs out:
    the pairs look counts as masked, and their total, are those the G-Net's own counters count in the masked
    pass, over the layout (sparse.dense_mask), not over every pair."""
    model = M.load_pretrained(str(runs["conv"]), attention="sparse", block_size=4, attn_dropout="attendout")
    torch.manual_seed(1)
    for layer in model.layers:                        # G-Nets that mask about half of the pairs
        torch.nn.init.normal_(layer.attn.drop.gnet.weight, std=1.0)
    tok_files = M.read_checkpoint(str(runs["conv"]))[2]
    torch.save(M.checkpoint_dict(model, tok_files), tmp_path / "sparse.pt")
    text = "the cat sat on a mat hello there quick dog ran eat the mat on a cat"
    shown = M.look(str(tmp_path / "sparse.pt"), text, device="cpu")
    model, tok, _ = M.load_for_use(str(tmp_path / "sparse.pt"), torch.device("cpu"))
    ids = torch.tensor([tok.encode(text)])
    M.layer_inputs(model, ids, torch.zeros_like(ids), masked=True)                  # the G-Nets count
    L = ids.size(1)
    for layer, seen in zip(model.layers, shown):
        counted = float(layer.attn.drop.pairs - layer.attn.drop.kept)
        assert seen["masked"] == counted and seen["pairs"] == float(layer.attn.drop.pairs)
        assert 0 < seen["masked"] and seen["pairs"] < L * L                       # the layout leaves pairs out
