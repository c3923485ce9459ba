"""readers/lra.py: readers for four Long Range Arena tasks (Text, Retrieval, Image, Pathfinder); ListOps: data.py.

What it is: each reader takes the files of the public LRA release (or of the public dataset that LRA's input
pipeline loads through tfds) and returns data.TaskData, tokenised as LRA tokenises (methods.md §4):
  - lra-text        IMDB reviews, the UTF-8 bytes of each review (256 byte ids), cut at 4,000 bytes (+ [cls]);
  - lra-retrieval   AAN citation pairs, both documents at the byte level, each cut at 4,000 bytes (+ [cls]); a dual
                    encoder (model.PairHead) encodes each document separately with the same encoder;
  - lra-image       CIFAR-10 as 1,024 grayscale pixel ids (256 intensities), row-major;
  - lra-pathfinder  32 x 32 Pathfinder images as 1,024 pixel ids, label 1 = the two dots are connected.
Every sequence starts with [cls] (the classifier / global token); ids are data.ByteTokenizer's (value + 5).

The files each reader expects (--data DIR):
  lra-text        DIR/train/{pos,neg}/*.txt and DIR/test/{pos,neg}/*.txt: the aclImdb folder of
                  aclImdb_v1.tar.gz (ai.stanford.edu/~amaas/data/sentiment), which tfds' imdb_reviews reads.
                  label 1 = pos, 0 = neg (tfds' order). dev = test, as LRA validates on IMDB's test split.
  lra-retrieval   DIR/new_aan_pairs.{train,eval,test}.tsv of lra_release/tsv_data: no header, no quoting,
                  five tab-separated columns label, id1, id2, text1, text2 (label "0"/"1", LRA reads it as a
                  float). dev = eval, test = test.
  lra-image       DIR/data_batch_{1..5}.bin and DIR/test_batch.bin of cifar-10-binary.tar.gz: records of 1
                  label byte + 3,072 pixel bytes (1,024 R, then G, then B, row-major). Never unpickled (the
                  binary release is plain bytes). train = the first 45,000 training images, dev = the last
                  5,000 (LRA: tfds train[:90%] / train[90%:]), test = test_batch.
  lra-pathfinder  DIR = one difficulty folder of lra_release/pathfinder32 (curv_baseline = easy,
                  curv_contour_length_9, curv_contour_length_14 = hard): DIR/metadata/N.npy are text files,
                  one image a line, space-separated: image folder, file name, (unused), label, ...;
                  the images are DIR/<folder>/<file> grayscale 32 x 32 PNGs (read with pillow). All
                  metadata files in numeric order, split 80% / 10% / 10% into train / dev / test as LRA does;
                  empty image files are skipped (LRA filters them too).
Grayscale (lra-image) is tf.image.rgb_to_grayscale as LRA calls it: y = 0.2989 R + 0.5870 G + 0.1140 B on
[0, 1] floats, converted back to uint8 as TF does (multiply by 255.5, truncate).

train.py loads this module on first use (train.reader), and readers.lra.load_task("lra-text", DIR, tok, ...) reads a
folder in Python; the default --max-len of each task (LRA's lengths + [cls]: 4,001 for Text and each Retrieval
document, 1,025 for Image and Pathfinder) is its entry's in data.TASKS.
How to run: python train.py --task lra-text --data aclImdb ...   (docs/tasks.md: every task)
"""
import csv
import os

import numpy as np

from data import ByteTokenizer, DataError, Example, PairExample, TaskData, read_rows, read_text

TASKS = ("lra-text", "lra-retrieval", "lra-image", "lra-pathfinder")    # their entries in data.TASKS

CIFAR_RECORD = 1 + 3 * 32 * 32      # label byte + R, G, B planes
CIFAR_TRAIN_KEPT = 45000            # LRA: tfds cifar10 train[:90%]; the rest is its validation split
GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)  # tf.image.rgb_to_grayscale


def _truncate(ids, max_len, stats):
    if max_len is not None and len(ids) > max_len:
        stats["truncated"] += 1
        return ids[:max_len]                                             # LRA: inputs[:max_length]
    return ids


def _text_ids(tok, text, max_len, stats):
    """Byte ids (ByteTokenizer) or a pretrained checkpoint's tokens of one document, cut at max_len; kept as a
    compact numpy array (LRA's 50,000 reviews of up to 4,000 ids as int lists would take ~2 GB)."""
    dtype = np.int16 if tok.vocab_size <= np.iinfo(np.int16).max else np.int32
    return np.array(_truncate(tok.encode(text), max_len, stats), dtype=dtype)


# -----------------------------------------------------------------------------
# Text: IMDB reviews, byte level

def read_imdb(folder, tok, max_len, stats):
    """Examples of folder/{pos,neg}/*.txt (one review a file), in sorted file order, neg before pos."""
    examples = []
    for label, sub in ((0, "neg"), (1, "pos")):
        d = os.path.join(folder, sub)
        if not os.path.isdir(d):
            raise DataError(f"{d}: no such folder (lra-text reads the aclImdb layout: train/pos, train/neg, test/...)")
        for name in sorted(os.listdir(d)):
            if not name.endswith(".txt"):
                continue
            path = os.path.join(d, name)
            text = read_text(path, encoding="utf-8")                   # the bytes as they are (LRA: tfds)
            if not text.strip():
                raise DataError(f"{path}:1: empty text")
            examples.append(Example(_text_ids(tok, text, max_len, stats), None, label))
    if not examples:
        raise DataError(f"{folder}: no .txt reviews under pos/ or neg/")
    return examples


def load_text(data_dir, tok, max_len):
    stats = {"truncated": 0}
    train = read_imdb(os.path.join(data_dir, "train"), tok, max_len, stats)
    dev = read_imdb(os.path.join(data_dir, "test"), tok, max_len, stats)       # LRA validates on IMDB test
    return TaskData(train, {"dev": dev}, 2, False, "acc", ["neg", "pos"], stats["truncated"])


# -----------------------------------------------------------------------------
# Retrieval: AAN document pairs, byte level, a dual encoder

def read_aan(path, tok, max_len, stats):
    """PairExamples of one new_aan_pairs.*.tsv: label, id1, id2, text1, text2 (no header, no quoting)."""
    examples = []
    for line, row in read_rows(path, delimiter="\t", quoting=csv.QUOTE_NONE):
        if len(row) != 5:
            raise DataError(f"{path}:{line}: expected 5 columns (label, id1, id2, text1, text2), got {len(row)}")
        try:
            label = float(row[0])                                            # LRA: a tf.float32 column
        except ValueError:
            raise DataError(f"{path}:{line}: label {row[0]!r} is not 0 or 1") from None
        if label not in (0.0, 1.0):
            raise DataError(f"{path}:{line}: label {row[0]!r} is not 0 or 1")
        if not row[3].strip() or not row[4].strip():
            raise DataError(f"{path}:{line}: empty text")
        examples.append(PairExample(_text_ids(tok, row[3], max_len, stats), _text_ids(tok, row[4], max_len, stats),
                                    int(label)))
    return examples


def load_retrieval(data_dir, tok, max_len):
    stats = {"truncated": 0}
    split = lambda s: os.path.join(data_dir, f"new_aan_pairs.{s}.tsv")
    train = read_aan(split("train"), tok, max_len, stats)
    dev = {"dev": read_aan(split("eval"), tok, max_len, stats)}
    if os.path.isfile(split("test")):
        dev["test"] = read_aan(split("test"), tok, max_len, stats)
    return TaskData(train, dev, 2, False, "acc", ["0", "1"], stats["truncated"], head="pair")


# -----------------------------------------------------------------------------
# Image: CIFAR-10, grayscale pixels

def rgb_to_gray(rgb):
    """uint8 [..., 3] -> uint8 [...]: tf.image.rgb_to_grayscale on uint8 input, step by step in float32."""
    flt = rgb.astype(np.float32) * np.float32(1.0 / 255.0)                 # convert_image_dtype(uint8 -> float)
    gray = flt @ GRAY_WEIGHTS                                              # y = 0.2989 R + 0.5870 G + 0.1140 B
    return (gray * np.float32(255.5)).astype(np.uint8)                     # back to uint8: x 255.5, truncated


def read_cifar_bin(path):
    """(pixels uint8 [N, 1024] grayscale, labels [N]) of one CIFAR-10 binary batch file."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file (lra-image reads CIFAR-10's binary release, cifar-10-batches-bin)")
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % CIFAR_RECORD:
        raise DataError(f"{path}: {raw.size} bytes is not a whole number of {CIFAR_RECORD}-byte records "
                        "(1 label byte + 32 x 32 x 3 pixel bytes): not a CIFAR-10 binary file")
    rec = raw.reshape(-1, CIFAR_RECORD)
    labels = rec[:, 0].astype(np.int64)
    bad = np.flatnonzero(labels > 9)
    if bad.size:
        raise DataError(f"{path}: record {bad[0] + 1}: label {labels[bad[0]]} is not in 0-9")
    rgb = rec[:, 1:].reshape(-1, 3, 32 * 32).transpose(0, 2, 1)           # [N, 1024, 3], row-major pixels
    return rgb_to_gray(rgb), labels


def pixel_ids(tok, pixels, max_len, stats):
    """[cls] + pixel ids as a compact int16 array (200,000 Pathfinder images as lists of ints would take ~2 GB);
    the same ids as tok.encode_values, and collate reads arrays as it reads lists."""
    ids = np.concatenate([[tok.cls_id], pixels.astype(np.int16) + tok.OFFSET]).astype(np.int16)
    return _truncate(ids, max_len, stats)


def _pixel_examples(pixels, labels, tok, max_len, stats):
    return [Example(pixel_ids(tok, p, max_len, stats), None, int(y)) for p, y in zip(pixels, labels)]


def load_image(data_dir, tok, max_len):
    stats = {"truncated": 0}
    parts = [read_cifar_bin(os.path.join(data_dir, f"data_batch_{i}.bin")) for i in range(1, 6)]
    pixels, labels = np.concatenate([p for p, _ in parts]), np.concatenate([y for _, y in parts])
    keep = min(CIFAR_TRAIN_KEPT, len(labels) * 9 // 10)                    # 45,000 of 50,000 (90%)
    test_pixels, test_labels = read_cifar_bin(os.path.join(data_dir, "test_batch.bin"))
    train = _pixel_examples(pixels[:keep], labels[:keep], tok, max_len, stats)
    dev = {"dev": _pixel_examples(pixels[keep:], labels[keep:], tok, max_len, stats),
           "test": _pixel_examples(test_pixels, test_labels, tok, max_len, stats)}
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    return TaskData(train, dev, 10, False, "acc", names, stats["truncated"])


# -----------------------------------------------------------------------------
# Pathfinder: 32 x 32 grayscale PNGs listed in metadata files

def _metadata_rows(path):
    """[(line, fields)] of one metadata file: text lines (the release), or a numpy array of strings."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(b"\x93NUMPY"):                                       # a real .npy: strings, never pickles
        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise DataError(f"{path}: unreadable .npy ({e})") from None
        return [(i + 1, [str(x) for x in np.atleast_1d(r)]) for i, r in enumerate(np.atleast_2d(arr))]
    lines = read_text(path).split("\n")
    return [(i + 1, s.split()) for i, s in enumerate(lines) if s.strip()]


def read_pathfinder(data_dir, size=32, skipped=None):
    """[(pixels uint8 [size * size], label)] of every image listed in DIR/metadata/*.npy, in numeric file order.
    skipped: a list that gets the "FILE:LINE" of every empty image (LRA skips them; the caller reports them)."""
    try:
        from PIL import Image                                              # pillow: requirements.txt
    except ImportError:
        raise DataError("lra-pathfinder needs pillow to read its PNG images: pip install pillow") from None
    meta = os.path.join(data_dir, "metadata")
    if not os.path.isdir(meta):
        raise DataError(f"{meta}: no such folder (lra-pathfinder reads e.g. pathfinder32/curv_baseline)")
    files = [f for f in os.listdir(meta) if f.endswith(".npy")]
    files.sort(key=lambda f: (int(f[:-4]) if f[:-4].isdigit() else float("inf"), f))
    out = []
    for name in files:
        path = os.path.join(meta, name)
        for line, fields in _metadata_rows(path):
            where = f"{path}:{line}"
            if len(fields) < 4:
                raise DataError(f"{where}: expected at least 4 fields (folder, file, -, label), got {len(fields)}")
            if fields[3] not in ("0", "1"):
                raise DataError(f"{where}: label {fields[3]!r} is not 0 or 1")
            img_path = os.path.join(data_dir, fields[0], fields[1])
            if not os.path.isfile(img_path):
                raise DataError(f"{where}: image {img_path} does not exist")
            if os.path.getsize(img_path) == 0:
                if skipped is not None:
                    skipped.append(where)
                continue                                                   # LRA skips empty images too
            try:
                with Image.open(img_path) as im:
                    mode, im_size, pixels = im.mode, im.size, np.asarray(im)
            except OSError as e:
                raise DataError(f"{where}: {img_path}: not a readable image ({e})") from None
            if im_size != (size, size):
                raise DataError(f"{where}: {img_path}: image is {im_size[0]} x {im_size[1]}, expected {size} x {size}")
            if mode != "L":
                raise DataError(f"{where}: {img_path}: image mode {mode}, expected 8-bit grayscale (L)")
            out.append((pixels.reshape(-1), int(fields[3])))
    if not out:
        raise DataError(f"{meta}: no images listed in metadata/*.npy")
    return out


def load_pathfinder(data_dir, tok, max_len):
    stats = {"truncated": 0}
    skipped = []
    items = read_pathfinder(data_dir, skipped=skipped)
    n = len(items)
    a, b = n * 8 // 10, n * 9 // 10                                        # LRA: [:80%], [80%:90%], [90%:]
    make = lambda part: [Example(pixel_ids(tok, p, max_len, stats), None, y) for p, y in part]
    dev = {"dev": make(items[a:b])}
    if b < n:
        dev["test"] = make(items[b:])
    return TaskData(make(items[:a]), dev, 2, False, "acc", ["0", "1"], stats["truncated"], skipped)


# -----------------------------------------------------------------------------

def load_task(task, data_dir, tok, *, max_len, **files):
    """TaskData of an LRA task (its entry in data.TASKS). Image and Pathfinder need the pixel vocabulary.
    files (train.py's --train-file, --dev-file, column flags) do not apply: LRA's files are fixed."""
    if task in ("lra-image", "lra-pathfinder") and not isinstance(tok, ByteTokenizer):
        raise DataError(f"{task} feeds pixel intensities: it needs the 256-value vocabulary of a model trained "
                        "from scratch on it (--init scratch), not a text checkpoint's tokenizer")
    if not os.path.isdir(data_dir):
        raise DataError(f"{data_dir}: {task} needs a folder (see docs/tasks.md)")
    loader = {"lra-text": load_text, "lra-retrieval": load_retrieval, "lra-image": load_image,
              "lra-pathfinder": load_pathfinder}[task]
    return loader(data_dir, tok, max_len)
