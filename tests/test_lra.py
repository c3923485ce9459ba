"""Tests of readers/lra.py: each Long Range Arena reader on a tiny fixture in its release's format, the pair head, the
bad-input errors, and a 2-step run of every task through train.main on dense, sparse and HST attention.

The fixtures are written here, byte by byte as the releases lay them out (aclImdb folders, AAN TSV rows,
CIFAR-10 binary records, Pathfinder metadata lines + PNGs). Run: python -m pytest tests/test_lra.py -q
"""
import json
import os

import numpy as np
import pytest
import torch

import data
from readers import lra
from test_train import check_eval_shift_all, run_main
from model import Config, Model, PairHead

TINY = ["--init", "scratch", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--device", "cpu"]
OFF = 5   # ByteTokenizer: id = byte / pixel value + 5, [cls] = 2


# -----------------------------------------------------------------------------
# fixtures in the releases' formats

def write_imdb(root, n=4):
    """aclImdb layout: {train,test}/{pos,neg}/ID_RATING.txt, one review a file."""
    texts = {}
    for split in ("train", "test"):
        for sub, word in (("neg", "awful"), ("pos", "great")):
            os.makedirs(os.path.join(root, split, sub))
            for i in range(n):
                text = f"{word} film number {i}<br />caf\u00e9"          # an HTML tag and a 2-byte character, as in IMDB
                with open(os.path.join(root, split, sub, f"{i}_{7 if sub == 'pos' else 2}.txt"), "w", encoding="utf-8") as f:
                    f.write(text)
                texts[(split, sub, i)] = text
    return texts


def write_aan(root, n=8, bad_row=None):
    """new_aan_pairs.{train,eval,test}.tsv: label, id1, id2, text1, text2; no header, no quoting."""
    os.makedirs(root, exist_ok=True)
    for split in ("train", "eval", "test"):
        with open(os.path.join(root, f"new_aan_pairs.{split}.tsv"), "w", encoding="utf-8") as f:
            for i in range(n):
                y = i % 2
                f.write(f"{y}.0\tP{i}a\tP{i}b\tpaper {i} cites \"{'x' * (i + 1)}\"\t{'same' if y else 'other'} topic {i}\n")
            if bad_row and split == "train":
                f.write(bad_row)
    return root


def cifar_record(label, rgb):
    """1 label byte + R plane + G plane + B plane (1,024 bytes each, row-major)."""
    return bytes([label]) + rgb[..., 0].tobytes() + rgb[..., 1].tobytes() + rgb[..., 2].tobytes()


def write_cifar(root, per_file=4, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    records = []
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        with open(os.path.join(root, name), "wb") as f:
            for _ in range(per_file):
                label, rgb = int(rng.integers(10)), rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                f.write(cifar_record(label, rgb))
                records.append((name, label, rgb))
    return records


def write_pathfinder(root, n=10, size=32, bad_size_at=None):
    """DIR/metadata/0.npy (text lines: folder, file, index, label, ...) and DIR/imgs/0/sample_K.png."""
    from PIL import Image
    os.makedirs(os.path.join(root, "metadata"))
    os.makedirs(os.path.join(root, "imgs", "0"))
    rng = np.random.default_rng(1)
    items = []
    with open(os.path.join(root, "metadata", "0.npy"), "w") as f:
        for k in range(n):
            s = size if k != bad_size_at else size // 2
            px = rng.integers(0, 256, (s, s), dtype=np.uint8)
            Image.fromarray(px, mode="L").save(os.path.join(root, "imgs", "0", f"sample_{k}.png"))
            label = (k // 2) % 2                                           # not the index's parity
            f.write(f"imgs/0 sample_{k}.png {k} {label} 2 1.5 14 20\n")
            items.append((px, label))
    return items


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("lra")
    d = {t: str(base / t) for t in lra.TASKS}
    write_imdb(d["lra-text"])
    write_aan(d["lra-retrieval"])
    write_cifar(d["lra-image"])
    write_pathfinder(d["lra-pathfinder"])
    return d


# -----------------------------------------------------------------------------
# readers: ids, labels, lengths

def test_text_reader_bytes_labels_lengths(tmp_path):
    texts = write_imdb(str(tmp_path))
    task = lra.load_task("lra-text", str(tmp_path), data.ByteTokenizer(), max_len=4000)
    assert len(task.train) == 8 and len(task.dev["dev"]) == 8 and task.num_labels == 2
    first = task.train[0]                                   # neg/0_2.txt: neg first, sorted file names
    raw = texts[("train", "neg", 0)].encode("utf-8")
    assert list(first.ids) == [2] + [b + OFF for b in raw] and first.label == 0
    assert len(raw) == len(texts[("train", "neg", 0)]) + 1  # the 2-byte character counts as 2 ids
    assert [e.label for e in task.train] == [0] * 4 + [1] * 4
    cut = lra.load_task("lra-text", str(tmp_path), data.ByteTokenizer(), max_len=10)
    assert all(len(e.ids) == 10 for e in cut.train) and cut.n_truncated == 16


def test_retrieval_reader_pairs(tmp_path):
    write_aan(str(tmp_path))
    task = lra.load_task("lra-retrieval", str(tmp_path), data.ByteTokenizer(), max_len=4000)
    assert task.head == "pair" and set(task.dev) == {"dev", "test"}
    e = task.train[3]
    assert e.label == 1
    assert list(e.ids) == [2] + [b + OFF for b in b'paper 3 cites "xxxx"']      # quotes kept: no quoting in LRA's TSV
    assert list(e.ids2) == [2] + [b + OFF for b in b"same topic 3"]
    batch = data.collate(task.train[:3], pad_id=0)
    assert batch["input_ids"].shape == (3, 2, 20) and batch["labels"].tolist() == [0, 1, 0]
    flat = data.flatten_pairs(batch)
    assert flat["input_ids"].shape == (6, 20)
    p1 = task.train[1]                                      # pair 1 -> rows 2 and 3
    assert flat["input_ids"][2, :len(p1.ids)].tolist() == list(p1.ids)
    assert flat["input_ids"][3, :len(p1.ids2)].tolist() == list(p1.ids2)
    assert flat["attention_mask"][3].sum() == len(p1.ids2)


def gray_reference(rgb):
    """tf.image.rgb_to_grayscale on uint8, written out in float64: floor(255.5 * (w . rgb) / 255)."""
    y = (0.2989 * rgb[..., 0] + 0.5870 * rgb[..., 1] + 0.1140 * rgb[..., 2]) / 255.0
    return np.floor(y * 255.5).astype(np.int64)


def test_image_reader_grayscale_and_split(tmp_path):
    records = write_cifar(str(tmp_path))
    task = lra.load_task("lra-image", str(tmp_path), data.ByteTokenizer(), max_len=1025)
    assert len(task.train) == 18 and len(task.dev["dev"]) == 2 and len(task.dev["test"]) == 4   # 90% / 10% / test
    for e, (_, label, rgb) in zip(task.train + task.dev["dev"], records):
        ref = gray_reference(rgb.reshape(-1, 3).astype(np.float64))
        got = np.array(e.ids[1:]) - OFF
        assert e.label == label and len(e.ids) == 1025 and e.ids[0] == 2
        assert list(e.ids) == data.ByteTokenizer().encode_values(got)              # the tokenizer's ids
        assert np.abs(got - ref).max() <= 1 and np.mean(got == ref) > 0.99   # float32 vs float64 at the floor
    # hand-computed pixels: pure red 255 -> floor(0.2989 * 255.5) = 76; (10, 20, 30) -> 18
    assert lra.rgb_to_gray(np.array([[255, 0, 0], [10, 20, 30], [255, 255, 255]], np.uint8)).tolist() == [76, 18, 255]


def test_pathfinder_reader(tmp_path):
    items = write_pathfinder(str(tmp_path))
    task = lra.load_task("lra-pathfinder", str(tmp_path), data.ByteTokenizer(), max_len=1025)
    assert len(task.train) == 8 and len(task.dev["dev"]) == 1 and len(task.dev["test"]) == 1
    for e, (px, y) in zip(task.train + task.dev["dev"] + task.dev["test"], items):
        assert list(e.ids) == [2] + [int(p) + OFF for p in px.reshape(-1)] and e.label == y


# -----------------------------------------------------------------------------
# bad inputs: one line naming the file and line

def test_bad_inputs_name_file_and_line(tmp_path):
    tok = data.ByteTokenizer()
    write_aan(str(tmp_path / "aan"), bad_row="1.0\tA\tB\tonly four columns\n")
    with pytest.raises(data.DataError, match=r"new_aan_pairs\.train\.tsv:9: expected 5 columns"):
        lra.load_task("lra-retrieval", str(tmp_path / "aan"), tok, max_len=100)
    write_aan(str(tmp_path / "aan2"), bad_row="2.0\tA\tB\tt1\tt2\n")
    with pytest.raises(data.DataError, match=r"new_aan_pairs\.train\.tsv:9: label '2\.0' is not 0 or 1"):
        lra.load_task("lra-retrieval", str(tmp_path / "aan2"), tok, max_len=100)
    write_pathfinder(str(tmp_path / "pf"), bad_size_at=3)
    with pytest.raises(data.DataError, match=r"metadata/0\.npy:4: .*sample_3\.png: image is 16 x 16, expected 32 x 32"):
        lra.load_task("lra-pathfinder", str(tmp_path / "pf"), tok, max_len=1025)
    write_cifar(str(tmp_path / "c"))
    with open(tmp_path / "c" / "data_batch_2.bin", "ab") as f:
        f.write(b"\x00" * 10)                                              # a cut record
    with pytest.raises(data.DataError, match=r"data_batch_2\.bin: .* not a whole number of 3073-byte records"):
        lra.load_task("lra-image", str(tmp_path / "c"), tok, max_len=1025)
    with pytest.raises(data.DataError, match="pixel intensities"):
        lra.load_task("lra-image", str(tmp_path / "c"), data.ListOpsTokenizer(), max_len=1025)


# -----------------------------------------------------------------------------
# the pair head

def test_pair_head_shapes_and_pairing():
    cfg = Config(vocab_size=261, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=40,
                 pad_id=0, position_style="bert", num_labels=2, head="pair", hidden_dropout_p=0.0, attn_dropout_p=0.0)
    head = PairHead(cfg).eval()
    h = torch.randn(6, 5, 16)                                              # 3 pairs, rows 2i and 2i + 1
    z = head(h)
    assert z.shape == (3, 2)
    u, v = h[0::2, 0], h[1::2, 0]
    ref = head.mlp(torch.cat([u, v, u * v, u - v], -1))                    # [u, v, u*v, u-v] of each pair
    assert torch.allclose(z, ref)
    swapped = h.clone()
    swapped[2, 0] = h[3, 0]
    swapped[3, 0] = h[2, 0]                                                # swap the documents of pair 1 only
    z2 = head(swapped)
    assert torch.allclose(z2[[0, 2]], z[[0, 2]]) and not torch.allclose(z2[1], z[1])
    model = Model(cfg).eval()                                             # through the model: [2B, L] -> [B, 2]
    ids = torch.randint(5, 261, (4, 7))
    logits = model(ids)
    assert logits.shape == (2, 2)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1]))
    loss.backward()
    assert model.cls.mlp[1].weight.grad is not None and torch.isfinite(loss)


# -----------------------------------------------------------------------------
# end to end through train.py



MAX_LEN = {"lra-text": "64", "lra-retrieval": "48", "lra-image": "1025", "lra-pathfinder": "1025"}


@pytest.mark.parametrize("attention", ["dense", "sparse", "hst"])
@pytest.mark.parametrize("task", lra.TASKS)
def test_every_task_trains_end_to_end(folders, task, attention, tmp_path, capfd):
    out = tmp_path / "out"
    argv = ["--task", task, "--data", folders[task], "--out", str(out), "--max-steps", "2", "--batch-size", "4",
            "--max-len", MAX_LEN[task], "--attention", attention, "--block-size", "16", "--lr", "1e-3", *TINY]
    if attention == "hst":
        argv += ["--sar", "1.0"]                                           # SAR on the classification tasks
    code, _, err = run_main(argv, capfd)
    assert code == 0, err
    final = json.load(open(out / "final.json"))
    assert final["steps"] == 2 and 0.0 <= final["acc"] <= 1.0
    assert final["config"]["attention"] == attention
    assert final["config"]["head"] == ("pair" if task == "lra-retrieval" else "cls")
    assert isinstance(data.tokenizer_from_path(str(out / "ckpt_last.pt")), data.ByteTokenizer)   # rebuilt from the checkpoint
    if attention == "hst":
        log = [json.loads(line) for line in open(out / "log.jsonl")]
        assert any("consistency" in r for r in log)


def test_eval_shift_all_on_the_pair_head(folders, tmp_path, capfd):
    """LRA Retrieval's pairs (model.PairHead): both documents of a pair shifted, every shift s = 1 .. 15."""
    argv = ["--task", "lra-retrieval", "--data", folders["lra-retrieval"], "--max-steps", "2", "--batch-size", "4",
            "--max-len", MAX_LEN["lra-retrieval"], "--attention", "hst", "--block-size", "16", *TINY]
    check_eval_shift_all(argv, tmp_path, capfd, range(1, 16), "acc")


def test_bad_row_through_train_is_one_line(tmp_path, capfd):
    write_aan(str(tmp_path / "aan"), bad_row="x\tA\tB\tt1\tt2\n")
    code, _, lines = run_main(["--task", "lra-retrieval", "--data", str(tmp_path / "aan"), "--out", str(tmp_path / "o"),
                        "--max-steps", "1", *TINY], capfd)
    assert code == 2 and lines == [f"error: {tmp_path / 'aan' / 'new_aan_pairs.train.tsv'}:9: label 'x' is not 0 or 1"]
