"""data.py: datasets, batching and metrics for attnreg (methods.md §4).

Everything that turns files into batches of tensors, in reading order:
  1. datasets: what an example is (Example, TaskData), the readers for the nine GLUE tasks, any labelled
     TSV/CSV/JSONL, LRA ListOps and plain text for masked LM (the other LRA tasks: lra.py; extractive QA: qa.py;
     the table of every task, with its loss and evaluation: tasks.py, which imports this module, never the reverse);
  2. batching: deterministic length-bucketed batches, dynamic padding (collate), BERT-style MLM masking;
  3. metrics: accuracy, F1, Matthews correlation, Pearson, Spearman (numpy, by hand);
  4. the LRA ListOps generator (the Long Range Arena recipe, methods.md §4);
  5. the CLI.
The tokenizers (text -> ids) are plumbing a student can skip: they live in vocab.py and are re-exported here
(data.load_tokenizer, data.ListOpsTokenizer, data.DataError, ... work as before).

The paper ideas this serves: AttendOut (learned attention dropout) is evaluated on GLUE; ERNIE-Sparse
(sparse + hierarchical attention, SAR) is evaluated on Long Range Arena, long text classification and
question answering. Both need exactly the data pipeline of their baselines, so the tokenizers equal the
checkpoints' HF tokenizers and the LRA readers follow LRA's input pipeline.

Run:
  python data.py listops data/listops --train 96000 --val 2000 --test 2000 --min-len 500 --max-len 2000 --seed 0
  python data.py listops data/listops_small --train 2000 --val 200 --test 200 --min-len 20 --max-len 100
  python data.py tokenize PATH_TO_HF_FOLDER_OR_PT "first sentence" ["second sentence"]
Library use: load_tokenizer, load_task, make_batches, mask_tokens, compute_metrics.
"""

import signal
import sys

if __name__ == "__main__":      # Ctrl-C while torch loads: exit 130 without a traceback (main takes over after)
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import csv
import io
import json
import math
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

# the tokenizers, re-exported: data.X keeps working for every name below (vocab.py)
from cli import ArgumentParser, one_line_errors
from vocab import (HF_TOKENIZER_FILES, KIND_FILE, SPECIAL_TOKENS, SPM_FILE, ByteTokenizer, DataError,  # noqa: F401
                   HFTokenizer, ListOpsTokenizer, SentencePieceTokenizer, build_bert_wordpiece, build_roberta_bpe,
                   files_to_tensors, load_tokenizer, read_tokenizer_folder, tensors_to_files, tokenizer_from_files,
                   train_sentencepiece)

csv.field_size_limit(2**31 - 1)  # long documents (LRA text, ListOps) exceed csv's 128 KiB default

# ----------------------------------------------------------------------------------------------------------
# 1. Datasets
# ----------------------------------------------------------------------------------------------------------

@dataclass
class Example:
    ids: list[int]              # token ids, special tokens included
    type_ids: list[int] | None  # segment ids, or None (= all zeros)
    label: int | float          # class index, or float score for regression (STS-B); qa.py: (start, end)


@dataclass
class PairExample:
    """Two documents and one label (LRA Retrieval): the dual encoder encodes each document on its own."""
    ids: list[int]              # first document, [cls] + tokens
    ids2: list[int]             # second document
    label: int
    type_ids: None = None


@dataclass
class TaskData:
    train: list           # list[Example]
    dev: dict             # split name -> list[Example] (MNLI: dev_matched, dev_mismatched)
    num_labels: int       # 1 for regression, 0 for mlm
    is_regression: bool
    metric_name: str      # the main metric, a key of compute_metrics' dict
    label_names: list     # class index -> label string
    n_truncated: int = 0  # examples cut to max_len (the caller warns once)
    skipped: list = field(default_factory=list)   # "FILE:LINE" of rows skipped on purpose (QQP's short rows,
                                                  # SQuAD 2.0's unanswerable questions, Pathfinder's empty images)
    head: str = "cls"     # the model head it needs (model.Config.head): "cls", "pair" (lra-retrieval), "span" (squad)

    @property
    def n_skipped(self):
        return len(self.skipped)


def skipped_warning(skipped, shown=5):
    """The one `warning:` line (without the prefix) for a task's skipped rows, or None: the count and the first few."""
    if not skipped:
        return None
    more = f", ... ({len(skipped) - shown} more)" if len(skipped) > shown else ""
    return f"{len(skipped)} rows skipped: {', '.join(skipped[:shown])}{more}"


# The nine GLUE tasks, in the official GLUE folder layout (methods.md §4). Columns are header names, or 0-based
# indices for CoLA (no header). labels: the label strings in class-index order (None: regression).
TASKS = {
    "cola": dict(train="train.tsv", dev={"dev": "dev.tsv"}, header=False, ncols=4,
                 text=3, pair=None, label=1, labels=["0", "1"], metric="mcc"),
    "sst2": dict(train="train.tsv", dev={"dev": "dev.tsv"}, header=True,
                 text="sentence", pair=None, label="label", labels=["0", "1"], metric="acc"),
    "mrpc": dict(train="train.tsv", dev={"dev": "dev.tsv"}, header=True,
                 text="#1 String", pair="#2 String", label="Quality", labels=["0", "1"], metric="f1"),
    "stsb": dict(train="train.tsv", dev={"dev": "dev.tsv"}, header=True,
                 text="sentence1", pair="sentence2", label="score", labels=None, metric="pearson"),
    "qqp": dict(train="train.tsv", dev={"dev": "dev.tsv"}, header=True, skip_bad_rows=True,
                text="question1", pair="question2", label="is_duplicate", labels=["0", "1"], metric="f1"),
    "mnli": dict(train="train.tsv", dev={"dev_matched": "dev_matched.tsv", "dev_mismatched": "dev_mismatched.tsv"},
                 header=True, text="sentence1", pair="sentence2", label="gold_label",
                 labels=["contradiction", "entailment", "neutral"], metric="acc"),
    "qnli": dict(train="train.tsv", dev={"dev": "dev.tsv"}, header=True, text="question", pair="sentence",
                 label="label", labels=["entailment", "not_entailment"], metric="acc"),
    "rte": dict(train="train.tsv", dev={"dev": "dev.tsv"}, header=True, text="sentence1", pair="sentence2",
                label="label", labels=["entailment", "not_entailment"], metric="acc"),
    "wnli": dict(train="train.tsv", dev={"dev": "dev.tsv"}, header=True, text="sentence1", pair="sentence2",
                 label="label", labels=["0", "1"], metric="acc"),
}
# QQP: transformers' GLUE processor skips QQP rows with missing columns; we do the same (and count them).
LRA_TASKS = ("lra-text", "lra-retrieval", "lra-image", "lra-pathfinder")   # readers in lra.py, scored by accuracy
OWN_TASKS = list(TASKS) + ["tsv", "listops", "mlm"]                           # the tasks load_task reads


def read_text(path, encoding="utf-8-sig"):
    """A text file's contents (utf-8-sig: a BOM stripped). Every reader opens its files here, so a file that is
    not UTF-8 is one DataError naming the file and line (not "can't decode byte 0xe9 in position 6130")."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}); "
                        "convert the file to UTF-8") from None


def read_rows(path, delimiter="\t", quoting=csv.QUOTE_NONE):
    """[(line_number, row)] of a TSV/CSV file (empty lines skipped; BOM stripped). QUOTE_NONE for GLUE."""
    rows = []
    reader = csv.reader(io.StringIO(read_text(path), newline=""), delimiter=delimiter, quoting=quoting)
    for row in reader:
        if row:
            rows.append((reader.line_num, row))
    if not rows:
        raise DataError(f"{path}:1: empty file")
    return rows


def _column(header, col, path):
    """Index of a column given by name (needs the header) or by 0-based index."""
    if isinstance(col, int):
        return col
    if header is None:
        raise DataError(f"{path}:1: column {col!r} given by name but the file has no header")
    if col not in header:
        raise DataError(f"{path}:1: no column {col!r} in header {header}")
    return header.index(col)


def _encode(tokenizer, text, pair, max_len, stats):
    """Example ids for (text, pair); counts truncation in stats['truncated']."""
    ids, type_ids = tokenizer.encode_plus(text, pair)
    if max_len is not None and len(ids) > max_len:
        ids, type_ids = tokenizer.encode_plus(text, pair, max_len=max_len)
        stats["truncated"] += 1
    return ids, type_ids


def _labelled_examples(records, tokenizer, max_len, label_index, stats):
    """records: (where, text, pair, label_string). label_index: {string: class} or None (float regression)."""
    examples = []
    for where, text, pair, label in records:
        if not text.strip() or (pair is not None and not pair.strip()):
            raise DataError(f"{where}: empty text")
        if label_index is None:
            try:
                y = float(label)
            except ValueError:
                raise DataError(f"{where}: non-numeric score {label!r}") from None
            if not math.isfinite(y):
                raise DataError(f"{where}: non-finite score {label!r}")
        elif label in label_index:
            y = label_index[label]
        else:
            raise DataError(f"{where}: unknown label {label!r} (expected one of {sorted(label_index)})")
        ids, type_ids = _encode(tokenizer, text, pair, max_len, stats)
        examples.append(Example(ids, type_ids, y))
    return examples


def read_glue(task, path):
    """[(where, text, pair, label)] of one GLUE file, rows validated (column count)."""
    spec = TASKS[task]
    rows = read_rows(path)
    header = None
    if spec["header"]:
        header = [h.strip() for h in rows[0][1]]
        rows = rows[1:]
    ncols = len(header) if header is not None else spec["ncols"]
    ti = _column(header, spec["text"], path)
    pi = _column(header, spec["pair"], path) if spec["pair"] is not None else None
    li = _column(header, spec["label"], path)
    records, skipped = [], []
    for line, row in rows:
        if len(row) != ncols:
            if spec.get("skip_bad_rows"):
                skipped.append(f"{path}:{line}")
                continue
            raise DataError(f"{path}:{line}: expected {ncols} columns, got {len(row)}")
        records.append((f"{path}:{line}", row[ti], row[pi] if pi is not None else None, row[li].strip()))
    return records, skipped


def _as_column(col, flag):
    """CLI column spec: "3" -> 3, "sentence" -> "sentence", None stays None; "-1" is refused (no counting from the end)."""
    if isinstance(col, str) and col.strip().lstrip("-").isdigit():
        col = int(col)
    if isinstance(col, int) and col < 0:
        raise DataError(f"{flag} {col}: a column is a header name or a 0-based index (>= 0)")
    return col


def _label_kind(value):
    """A JSONL label's JSON type: labels keep it (1, "1" and true are three different labels), so one file
    holds one type. None for what cannot be a label (null, an object, a list)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else None


def read_jsonl(path, text_col, text_pair_col, label_col):
    """[(where, text, pair, label)] of a JSONL file: each line an object (columns by key, or an index in key
    order) or a list; texts are strings, labels keep their JSON type (one type in a file, never null)."""
    lines = [(i, s) for i, s in enumerate(io.StringIO(read_text(path), newline=None), 1) if s.strip()]
    if not lines:
        raise DataError(f"{path}:1: empty file")
    records, first = [], None                         # first: (line, label) that fixes the file's label type
    for line, s in lines:
        where = f"{path}:{line}"
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, (dict, list)):
            raise DataError(f"{where}: expected a JSON object or list, got {type(obj).__name__} {s.strip()[:40]}")
        values = list(obj.values()) if isinstance(obj, dict) else obj

        def get(c, what):
            try:
                v = obj[c] if isinstance(c, str) else values[c]
            except (KeyError, IndexError, TypeError):
                raise DataError(f"{where}: no column {c!r} (the line has {len(values)})") from None
            if what == "text" and not isinstance(v, str):
                raise DataError(f"{where}: text column {c!r} is {json.dumps(v)[:40]}, not a string")
            if what == "label" and _label_kind(v) is None:
                raise DataError(f"{where}: label column {c!r} is {json.dumps(v)[:40]}, not a string, number or boolean")
            return v
        label = get(label_col, "label")
        if first is None:
            first = (line, label)
        elif _label_kind(label) != _label_kind(first[1]):
            raise DataError(f"{where}: label {json.dumps(label)} is a {_label_kind(label)}, but line {first[0]}'s "
                            f"label {json.dumps(first[1])} is a {_label_kind(first[1])}; a file's labels are of one type")
        pair = get(text_pair_col, "text") if text_pair_col is not None else None
        records.append((where, get(text_col, "text"), pair, label))
    return records


def read_generic(path, *, text_col, label_col, text_pair_col=None, header="auto"):
    """[(where, text, pair, label)] of a TSV / CSV / JSONL file (TSV / CSV labels are strings; JSONL labels keep
    their JSON type, read_jsonl).

    Columns are names or 0-based indices. header: True, False or "auto" (= a header row exactly when some
    column is given by name). JSONL lines are objects (by key; an index counts in key order) or lists.
    """
    text_col, label_col = _as_column(text_col, "--text-col"), _as_column(label_col, "--label-col")
    text_pair_col = _as_column(text_pair_col, "--text-pair-col")
    cols = [c for c in (text_col, text_pair_col, label_col) if c is not None]
    ext = os.path.splitext(path)[1].lower()
    records = []
    if ext in (".jsonl", ".json"):
        return read_jsonl(path, text_col, text_pair_col, label_col)
    if ext == ".csv":
        rows = read_rows(path, delimiter=",", quoting=csv.QUOTE_MINIMAL)
    else:
        rows = read_rows(path)
    has_header = any(isinstance(c, str) for c in cols) if header == "auto" else bool(header)
    head = [h.strip() for h in rows[0][1]] if has_header else None
    if has_header:
        rows = rows[1:]
        if not rows:
            raise DataError(f"{path}:2: no rows after the header")
    idx = [_column(head, c, path) if c is not None else None for c in (text_col, text_pair_col, label_col)]
    ncols = len(head) if head is not None else len(rows[0][1])
    for line, row in rows:
        if len(row) != ncols:
            raise DataError(f"{path}:{line}: expected {ncols} columns, got {len(row)}")
        for flag, i in zip(("--text-col", "--text-pair-col", "--label-col"), idx):
            if i is not None and i >= len(row):
                raise DataError(f"{path}:{line}: {flag} asks for column {i} (0-based), but the line has "
                                f"{len(row)} column{'s' if len(row) != 1 else ''}")
        ti, pi, li = idx
        records.append((f"{path}:{line}", row[ti], row[pi] if pi is not None else None, row[li].strip()))
    return records


def sorted_labels(labels):
    """Labels in class order: label strings numerically if they are all integers ("2" < "10"), else sorted;
    JSONL numbers and booleans by value."""
    labels = set(labels)
    if not all(isinstance(label, str) for label in labels):
        return sorted(labels)
    try:
        return sorted(labels, key=int)
    except ValueError:
        return sorted(labels)


def load_generic(path, tokenizer, *, text_col, label_col, text_pair_col=None, header="auto", max_len=None,
                 label_names=None):
    """Examples of any labelled TSV/CSV/JSONL. label_names=None (a training file): built from its labels.

    Returns (examples, label_names, n_truncated). Dev labels unseen in training raise DataError.
    """
    records = read_generic(path, text_col=text_col, label_col=label_col, text_pair_col=text_pair_col,
                           header=header)
    if label_names is None:
        label_names = sorted_labels(r[3] for r in records)
    elif label_names and _label_kind(records[0][3]) != _label_kind(label_names[0]):   # one type per file (read_jsonl)
        raise DataError(f"{records[0][0]}: label {json.dumps(records[0][3])} is a {_label_kind(records[0][3])}, "
                        f"but the training file's labels are {_label_kind(label_names[0])}s")
    stats = {"truncated": 0}
    label_index = {name: i for i, name in enumerate(label_names)}
    examples = _labelled_examples(records, tokenizer, max_len, label_index, stats)
    return examples, label_names, stats["truncated"]


def _find_split(folder, stem):
    for ext in (".tsv", ".csv", ".jsonl"):
        p = os.path.join(folder, stem + ext)
        if os.path.isfile(p):
            return p
    raise DataError(f"{folder}: no {stem}.tsv, {stem}.csv or {stem}.jsonl")


def read_listops(path, tokenizer, max_len, stats):
    """Examples of a ListOps TSV (ours or LRA's released files): header Source<TAB>Target."""
    rows = read_rows(path)
    header = [h.strip() for h in rows[0][1]]
    si, ti = _column(header, "Source", path), _column(header, "Target", path)
    examples = []
    for line, row in rows[1:]:
        if len(row) != len(header):
            raise DataError(f"{path}:{line}: expected {len(header)} columns, got {len(row)}")
        try:
            label = int(row[ti])
        except ValueError:
            raise DataError(f"{path}:{line}: target {row[ti]!r} is not an integer 0-9") from None
        if not 0 <= label <= 9:
            raise DataError(f"{path}:{line}: target {label} is not in 0-9")
        if not row[si].strip():
            raise DataError(f"{path}:{line}: empty text")
        ids, type_ids = _encode(tokenizer, row[si], None, max_len, stats)
        examples.append(Example(ids, type_ids, label))
    return examples


def read_mlm(paths, tokenizer, max_len, stats):
    """Plain text, one document / sentence a line; each line -> [cls] pieces [sep], long lines chunked.

    Chunks hold max_len - 2 content tokens (labels 0; mask_tokens makes the MLM labels per batch).
    Content = encode(line)[1:-1], valid for every tokenizer here whose single format is cls A sep.
    """
    examples = []
    budget = max(1, max_len - 2) if max_len is not None else None
    for path in paths:
        for line in io.StringIO(read_text(path), newline=None):
            if not line.strip():
                continue
            content = tokenizer.encode(line.rstrip("\n"))[1:-1]
            if not content:
                continue
            step = budget or len(content)
            if len(content) > step:
                stats["truncated"] += 1  # here: lines split into several chunks
            for s in range(0, len(content), step):
                ids = [tokenizer.cls_id] + content[s:s + step] + [tokenizer.sep_id]
                examples.append(Example(ids, None, 0))
    return examples


def _train_path(name, data_dir, train_file):
    """The training file of a GLUE task or of "tsv" (--train-file wins)."""
    if train_file:
        return train_file
    if name in TASKS:
        return os.path.join(data_dir, TASKS[name]["train"])
    return _find_split(data_dir, "train")


def _mlm_paths(data_dir, train_file=None, dev_file=None):
    """(training text files, dev text files) of the mlm task: --train-file, else a folder's train.txt, else its
    other .txt files (not dev.txt / valid.txt), else --data itself; dev: --dev-file, dev.txt or valid.txt."""
    if train_file:
        train_paths = [train_file]
    elif os.path.isdir(data_dir):
        train_paths = sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir)
                             if f.endswith(".txt") and f not in ("dev.txt", "valid.txt"))
        if os.path.isfile(os.path.join(data_dir, "train.txt")):
            train_paths = [os.path.join(data_dir, "train.txt")]
    else:
        train_paths = [data_dir]
    if not train_paths or not all(os.path.isfile(p) for p in train_paths):
        raise DataError(f"{data_dir}: no .txt files for mlm")
    dev_paths = [dev_file] if dev_file else []
    for n in ("dev.txt", "valid.txt"):
        if not dev_paths and os.path.isdir(data_dir) and os.path.isfile(os.path.join(data_dir, n)):
            dev_paths = [os.path.join(data_dir, n)]
    return train_paths, dev_paths


def training_texts(task, data_dir, *, text_col=None, text_pair_col=None, label_col=None, train_file=None, dev_file=None):
    """The raw training texts of a task (both sides of pairs), to train a from-scratch SentencePiece model."""
    name = task.lower().replace("-", "")
    if name in TASKS:
        records, _ = read_glue(name, _train_path(name, data_dir, train_file))
    elif name == "tsv":
        records = read_generic(_train_path(name, data_dir, train_file), text_col=text_col, label_col=label_col,
                               text_pair_col=text_pair_col)
    elif name == "mlm":
        texts = []
        for path in _mlm_paths(data_dir, train_file)[0]:          # the files load_task trains on
            texts += [line.strip() for line in io.StringIO(read_text(path), newline=None) if line.strip()]
        return texts
    else:
        raise DataError(f"task {task!r} has no text to train a tokenizer on")
    return [t for _, text, pair, _ in records for t in (text, pair) if t]


def load_task(task, data_dir, tokenizer, *, max_len, text_col=None, text_pair_col=None, label_col=None,
              train_file=None, dev_file=None, header="auto"):
    """TaskData for a GLUE task, "tsv" (any labelled file), "listops" or "mlm" (methods.md §4). The other tasks'
    readers are lra.py's and qa.py's; tasks.load_task reads any task."""
    name = task.lower().replace("-", "")
    stats = {"truncated": 0}
    if name in TASKS:
        spec = TASKS[name]
        label_index = {s: i for i, s in enumerate(spec["labels"])} if spec["labels"] else None
        train_path = _train_path(name, data_dir, train_file)
        dev_paths = {"dev": dev_file} if dev_file else {k: os.path.join(data_dir, v) for k, v in spec["dev"].items()}
        records, skipped = read_glue(name, train_path)
        train = _labelled_examples(records, tokenizer, max_len, label_index, stats)
        dev = {}
        for split, path in dev_paths.items():
            records, more = read_glue(name, path)
            skipped += more
            dev[split] = _labelled_examples(records, tokenizer, max_len, label_index, stats)
        regression = spec["labels"] is None
        return TaskData(train, dev, 1 if regression else len(spec["labels"]), regression, spec["metric"],
                        list(spec["labels"] or []), stats["truncated"], skipped)
    if name == "tsv":
        if text_col is None or label_col is None:
            raise DataError("task tsv needs --text-col and --label-col (names or 0-based indices)")
        if train_file is None or dev_file is None:
            if os.path.isfile(data_dir):
                raise DataError(f"{data_dir}: task tsv needs a folder with train/dev files, or --train-file "
                                "and --dev-file")
        train_path = _train_path(name, data_dir, train_file)
        dev_path = dev_file or _find_split(data_dir, "dev")
        kw = dict(text_col=text_col, label_col=label_col, text_pair_col=text_pair_col, header=header,
                  max_len=max_len)
        train, labels, n1 = load_generic(train_path, tokenizer, **kw)
        dev, _, n2 = load_generic(dev_path, tokenizer, label_names=labels, **kw)
        return TaskData(train, {"dev": dev}, len(labels), False, "acc", labels, n1 + n2)
    if name == "listops":
        tokenizer = tokenizer if tokenizer is not None else ListOpsTokenizer()
        train = read_listops(train_file or os.path.join(data_dir, "basic_train.tsv"), tokenizer, max_len, stats)
        dev = read_listops(dev_file or os.path.join(data_dir, "basic_val.tsv"), tokenizer, max_len, stats)
        return TaskData(train, {"dev": dev}, 10, False, "acc", [str(d) for d in range(10)], stats["truncated"])
    if name == "mlm":
        train_paths, dev_paths = _mlm_paths(data_dir, train_file, dev_file)
        train = read_mlm(train_paths, tokenizer, max_len, stats)
        if not train:
            raise DataError(f"{train_paths[0]}:1: empty file")
        dev = {"dev": read_mlm(dev_paths, tokenizer, max_len, stats)} if dev_paths else {}
        return TaskData(train, dev, 0, False, "loss", [], stats["truncated"])
    raise DataError(f"unknown task {task!r} for data.load_task; valid: {', '.join(OWN_TASKS)} (tasks.py: every task)")


# ----------------------------------------------------------------------------------------------------------
# 2. Batching: deterministic length buckets, dynamic padding
# ----------------------------------------------------------------------------------------------------------

def collate(examples, pad_id, multiple_of=1):
    """Pad to the longest example, rounded up to multiple_of. Returns the batch dict of the contract.
    PairExamples: both documents padded to one length, input_ids etc. [B, 2, L] (see flatten_pairs)."""
    if isinstance(examples[0], PairExample):
        docs = [Example(d, None, e.label) for e in examples for d in (e.ids, e.ids2)]   # pair i -> rows 2i, 2i+1
        flat = collate(docs, pad_id, multiple_of)
        B = len(examples)
        batch = {k: v.view(B, 2, -1) for k, v in flat.items() if k != "labels"}        # [B, 2, L]
        return {**batch, "labels": flat["labels"][::2]}                                # [B]
    L = max(len(e.ids) for e in examples)
    L = -(-L // multiple_of) * multiple_of
    B = len(examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)          # [B, L]
    attention_mask = torch.zeros((B, L), dtype=torch.long)            # [B, L], 1 = real token
    token_type_ids = torch.zeros((B, L), dtype=torch.long)            # [B, L]
    for i, e in enumerate(examples):
        n = len(e.ids)
        input_ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        if e.type_ids is not None:
            token_type_ids[i, :n] = torch.tensor(e.type_ids, dtype=torch.long)
    regression = any(isinstance(e.label, float) for e in examples)
    labels = torch.tensor([e.label for e in examples], dtype=torch.float if regression else torch.long)  # [B]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
            "labels": labels}


def flatten_pairs(batch):
    """[B, 2, L] pair tensors -> [2B, L], the two documents of pair i in rows 2i and 2i + 1 (model.PairHead pairs
    them back). Batches keep pairs as [B, 2, L] until here so that splitting a batch across processes keeps
    each pair whole."""
    return {k: v.flatten(0, 1) if k != "labels" else v for k, v in batch.items()}


def batch_plan(lengths, batch_size, *, seed, epoch, shuffle=True, bucket_batches=50):
    """An epoch's batches as lists of example indices, deterministic given (seed, epoch); no tensors yet, so
    a large task costs a list of ints, and each batch is padded (collate) only when it is used.

    shuffle=True: shuffle, sort by length inside chunks of bucket_batches batches (similar lengths share a
    batch, little padding), cut into batches, shuffle the batch order. shuffle=False: original order (eval).
    """
    order = list(range(len(lengths)))
    if shuffle:
        rng = np.random.default_rng([seed, epoch])
        order = [int(i) for i in rng.permutation(len(lengths))]
        chunk = batch_size * bucket_batches
        order = [i for s in range(0, len(order), chunk) for i in sorted(order[s:s + chunk], key=lambda j: lengths[j])]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    if shuffle:
        batches = [batches[int(i)] for i in rng.permutation(len(batches))]
    return batches


def longest_first(examples):
    """Evaluation order: the dev set sorted by length, longest first. Similar lengths share a batch, so a batch
    carries little padding (dev batches in file order were padded to their longest of 32 random sentences: on
    SST-2 about twice the mean length). Safe because an example's output does not depend on the padding beside
    it (tests/test_train.py) and every metric pairs a prediction with its own label; longest first so that a
    batch too large for the device fails at once."""
    return sorted(examples, key=lambda e: len(e.ids), reverse=True)


def make_batches(examples, batch_size, *, pad_id, seed, epoch, shuffle=True, multiple_of=1, bucket_batches=50):
    """All batches of batch_plan, padded (the batch dicts of the contract). For dev sets and tests; the
    training loop pads its batches one at a time."""
    plan = batch_plan([len(e.ids) for e in examples], batch_size, seed=seed, epoch=epoch, shuffle=shuffle,
                      bucket_batches=bucket_batches)
    return [collate([examples[i] for i in b], pad_id, multiple_of) for b in plan]



def mask_tokens(input_ids, attention_mask, *, mask_id, vocab_size, special_ids, generator=None, mlm_prob=0.15):
    """Select each real, non-special token with probability mlm_prob; of the selected: 80% -> mask_id,
    10% -> a uniformly random token, 10% unchanged. Returns (masked_ids [B, L], labels [B, L]) with
    labels = original id where selected, -100 elsewhere (ignored by cross-entropy).
    generator must live on input_ids' device (or be None: the global RNG)."""
    dev, shape = input_ids.device, input_ids.shape
    special = torch.tensor(sorted(set(int(i) for i in special_ids)), dtype=input_ids.dtype, device=dev)
    candidate = attention_mask.bool() & ~torch.isin(input_ids, special)                    # [B, L]
    selected = torch.bernoulli(torch.full(shape, mlm_prob, device=dev), generator=generator).bool() & candidate
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))            # [B, L]
    to_mask = torch.bernoulli(torch.full(shape, 0.8, device=dev), generator=generator).bool() & selected
    # half of the remaining 20% -> random token (10% overall), the other half unchanged
    to_random = torch.bernoulli(torch.full(shape, 0.5, device=dev), generator=generator).bool() & selected & ~to_mask
    random_ids = torch.randint(vocab_size, shape, generator=generator, dtype=input_ids.dtype, device=dev)
    masked = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    masked = torch.where(to_random, random_ids, masked)
    return masked, labels


# ----------------------------------------------------------------------------------------------------------
# 3. Metrics (numpy, by hand; methods.md §4: the official GLUE metrics)
# ----------------------------------------------------------------------------------------------------------

def accuracy(preds, labels):
    return float(np.mean(np.asarray(preds) == np.asarray(labels)))


def f1_binary(preds, labels):
    """F1 of the positive class 1: 2 tp / (2 tp + fp + fn); 0 when there is no positive at all."""
    p, y = np.asarray(preds) == 1, np.asarray(labels) == 1
    tp, fp, fn = np.sum(p & y), np.sum(p & ~y), np.sum(~p & y)
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn > 0 else 0.0


def matthews_corrcoef(preds, labels):
    """MCC from the confusion matrix C (K classes; = (tp tn - fp fn) / sqrt(...) for K = 2):
    mcc = (c s - t.p) / sqrt((s^2 - p.p)(s^2 - t.t)), c = trace C, s = sum C, t / p = true / predicted counts.
    0 when the denominator is 0 (sklearn's convention)."""
    preds, labels = np.asarray(preds, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    k = int(max(preds.max(initial=0), labels.max(initial=0))) + 1
    C = np.zeros((k, k), dtype=np.float64)
    np.add.at(C, (labels, preds), 1)
    t, p, c, s = C.sum(1), C.sum(0), np.trace(C), C.sum()
    denom = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - t @ p) / denom) if denom > 0 else 0.0


def pearson(x, y):
    """r = sum(dx dy) / sqrt(sum dx^2 sum dy^2); 0 for a constant input (undefined)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt(np.sum(dx * dx) * np.sum(dy * dy))
    return float(np.sum(dx * dy) / denom) if denom > 0 else 0.0


def average_ranks(x):
    """Ranks 1..n, ties get the mean of the ranks they span (e.g. [10, 20, 20, 30] -> [1, 2.5, 2.5, 4])."""
    _, inverse, counts = np.unique(np.asarray(x), return_inverse=True, return_counts=True)
    end = np.cumsum(counts)            # last rank of each distinct value
    start = end - counts + 1           # first rank
    return ((start + end) / 2.0)[inverse.reshape(-1)]


def spearman(x, y):
    """Spearman rho = Pearson correlation of the average ranks."""
    return pearson(average_ranks(x), average_ranks(y))


def compute_metrics(task_name, preds, labels):
    """The task's official metrics (methods.md §4). preds: class ids or logits [N, K] (argmax taken); regression:
    scores [N] or [N, 1]. MNLI: call once per dev split."""
    name = task_name.lower().replace("-", "")
    preds, labels = np.asarray(preds), np.asarray(labels)
    if name == "stsb":
        preds = preds.reshape(-1).astype(np.float64)
        pr, sr = pearson(preds, labels), spearman(preds, labels)
        return {"pearson": pr, "spearman": sr, "corr": (pr + sr) / 2}
    if preds.ndim == 2:
        preds = preds.argmax(-1)
    if name == "cola":
        return {"mcc": matthews_corrcoef(preds, labels), "acc": accuracy(preds, labels)}
    if name in ("mrpc", "qqp"):
        return {"f1": f1_binary(preds, labels), "acc": accuracy(preds, labels)}
    if name in TASKS or name in ("tsv", "listops") or task_name in LRA_TASKS:
        return {"acc": accuracy(preds, labels)}
    raise DataError(f"no metrics for task {task_name!r}; valid: {', '.join(OWN_TASKS[:-1] + list(LRA_TASKS))}")


# ----------------------------------------------------------------------------------------------------------
# 4. LRA ListOps generator (methods.md §4; the Long Range Arena recipe, lra_benchmarks/data/listops.py)
# ----------------------------------------------------------------------------------------------------------

LISTOPS_OPS = ("[MIN", "[MAX", "[MED", "[SM")
LISTOPS_END = "]"
LISTOPS_VALUE_P = 0.25  # LRA: a node is an operator when random() <= 0.25, else a leaf (p = 0.75)


def _apply_op(op, values):
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":
        return int(np.median(values))  # even count: int() of the mean of the middle two
    return sum(values) % 10            # [SM


def _render(op, args):
    """LRA's left-branching tuple rendering: ((((op, a1), a2), ...), ']') with "( x y )" per tuple.
    [MAX 2 9] -> "( ( ( [MAX 2 ) 9 ) ] )"."""
    parts = ["( " * (len(args) + 1) + op]
    for a in args:
        parts.append(" " + a + " )")
    parts.append(" " + LISTOPS_END + " )")
    return "".join(parts)


def listops_tree(rng, depth, max_depth, max_args, budget=float("inf")):
    """One random expression: (source string, length, value), or None once its length would exceed budget.

    Length counts 1 per value, 2 per operator (the operator token and its ']'), i.e. the number of model
    tokens once parentheses are dropped. Stopping early at the budget only skips the rest of a tree that
    would be discarded anyway, so the accepted samples have LRA's distribution (short ranges stay fast).
    """
    r = rng.random() if depth < max_depth else 1.0  # always a leaf at the maximum depth
    if r > LISTOPS_VALUE_P:
        v = rng.randrange(10)
        return str(v), 1, v
    n_args = rng.randint(2, max_args)
    args, values, length = [], [], 2
    for _ in range(n_args):
        sub = listops_tree(rng, depth + 1, max_depth, max_args, budget - length)
        if sub is None or length + sub[1] > budget:
            return None
        args.append(sub[0])
        values.append(sub[2])
        length += sub[1]
    op = rng.choice(LISTOPS_OPS)  # LRA draws the operator after its arguments
    return _render(op, args), length, _apply_op(op, values)


def _max_listops_length(max_depth, max_args, depth=1):
    if depth >= max_depth:
        return 1
    return 2 + max_args * _max_listops_length(max_depth, max_args, depth + 1)


def generate_listops(n, min_len, max_len, seed, max_depth=10, max_args=10, progress=False, max_misses=1_000_000):
    """n distinct (source, label) samples with min_len < length < max_len (LRA's bounds are exclusive).

    Like LRA, trees are drawn from the root at depth 1 and duplicates are discarded (LRA keeps a set),
    so samples are unique across the splits written by write_listops.
    """
    if max_args < 2 or max_depth < 1:
        raise DataError(f"ListOps needs max_args >= 2 and max_depth >= 1 (got {max_args}, {max_depth})")
    # achievable lengths: 1 (a lone value) and 4 .. longest (an operator with >= 2 arguments); the exclusive
    # range (min_len, max_len) must contain one of them, otherwise the loop below could never end
    longest = _max_listops_length(max_depth, max_args)
    if not (min_len < 1 < max_len or max(min_len + 1, 4) <= min(max_len - 1, longest)):
        raise DataError(f"ListOps length range {min_len} < length < {max_len} holds no possible length "
                        f"(1 or 4..{longest} with max_depth={max_depth}, max_args={max_args})")
    rng = random.Random(seed)
    seen, out, misses = set(), [], 0
    bar = tqdm(total=n, desc="listops", disable=not progress)
    while len(out) < n:
        tree = listops_tree(rng, 1, max_depth, max_args, budget=max_len - 1)
        if tree is not None and tree[1] > min_len and tree[0] not in seen:
            source, length, value = tree
            seen.add(source)
            out.append((source, int(value)))
            bar.update(1)
            misses = 0
        else:
            misses += 1
            if misses >= max_misses:
                bar.close()
                raise DataError(f"ListOps: no new sample with {min_len} < length < {max_len} in {max_misses} "
                                f"draws after {len(out)} samples; widen the range or lower the counts")
    bar.close()
    return out


def write_listops(out_dir, n_train=96000, n_val=2000, n_test=2000, min_len=500, max_len=2000, seed=0,
                  max_depth=10, max_args=10, progress=False):
    """basic_{train,val,test}.tsv with header Source<TAB>Target (LRA's layout). Returns the three paths."""
    data = generate_listops(n_train + n_val + n_test, min_len, max_len, seed, max_depth, max_args, progress)
    splits = {"train": data[:n_train], "val": data[n_train:n_train + n_val], "test": data[n_train + n_val:]}
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        paths[split] = os.path.join(out_dir, f"basic_{split}.tsv")
        with open(paths[split], "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerow(["Source", "Target"])
            writer.writerows(rows)
    return paths


# ----------------------------------------------------------------------------------------------------------
# 5. CLI
# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    parser = ArgumentParser(description="attnreg data tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("listops", help="generate LRA ListOps basic_{train,val,test}.tsv")
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=96000)
    p.add_argument("--val", type=int, default=2000)
    p.add_argument("--test", type=int, default=2000)
    p.add_argument("--min-len", type=int, default=500)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-depth", type=int, default=10)
    p.add_argument("--max-args", type=int, default=10)
    t = sub.add_parser("tokenize", help="print the ids of a text (and pair) with a checkpoint's tokenizer")
    t.add_argument("path")
    t.add_argument("text")
    t.add_argument("pair", nargs="?")
    args = parser.parse_args(argv)
    if args.command == "listops":        # refused up front: nothing generated for minutes, then not written
        for name in ("train", "val", "test", "min_len", "max_len"):
            if getattr(args, name) < 0:
                parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
        if args.train + args.val + args.test == 0:
            parser.error("--train, --val and --test are all 0: nothing to generate")
    with one_line_errors():
        if args.command == "listops":
            os.makedirs(args.out_dir, exist_ok=True)
            paths = write_listops(args.out_dir, args.train, args.val, args.test, args.min_len, args.max_len,
                                  args.seed, args.max_depth, args.max_args, progress=True)
            print(" ".join(paths.values()))
        else:
            ids, type_ids = load_tokenizer(args.path).encode_plus(args.text, args.pair)
            print(json.dumps({"ids": ids, "type_ids": type_ids}))


if __name__ == "__main__":
    main()
