"""data.py: files -> token ids -> padded batches, and their scores (methods.md §4). The bottom of the imports.

The two methods need their baselines' exact inputs: AttendOut (learned attention dropout) is scored on GLUE with
the checkpoints' own tokenizers (equal to HF's); ERNIE-Sparse (sparse + hierarchical attention, SAR) on Long
Range Arena (LRA's byte / pixel inputs, readers/lra.py) and long-document QA (readers/qa.py, loaded on first use).

In reading order: 0. one-line errors; 1. tokenizers; 2. readers (GLUE, TSV/CSV/JSONL, ListOps; masked LM is in
readers/mlm.py); 3. the task table (TASKS: each task's reader and objective); 4. batching; 5. metrics; 6. ListOps.

Run: python data.py listops data/listops --train 96000 --val 2000 --test 2000 --min-len 500 --max-len 2000
"""
import argparse
import csv
import hashlib
import io
import json
import os
import random
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

csv.field_size_limit(2**31 - 1)  # long documents (LRA text, ListOps) exceed csv's 128 KiB default

# ---- 0. One-line errors: a bad flag, file or checkpoint is one `error:` line that names it, exit 2 ----------

class DataError(ValueError):
    """A problem with the user's files or flags; the message names the file (FILE:LINE) or the flag."""

def fail(msg, code=2):
    print(f"error: {msg}", file=sys.stderr, flush=True)      # the one line, no traceback
    sys.exit(code)

def warn(msg):
    if not dist.is_initialized() or dist.get_rank() == 0:     # once per run, not once per torchrun process
        tqdm.write(f"warning: {msg}", file=sys.stderr)

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):                                 # an unknown flag or a bad value: one line too
        fail(f"{message} (see {self.prog} --help)")

@contextmanager
def one_line_errors(interrupted="interrupted"):
    """Every entry point runs inside it: what user input can raise becomes one line; Ctrl-C exits 130."""
    try:
        yield
    except KeyboardInterrupt:
        fail(interrupted, code=130)
    except (ValueError, OSError, KeyError, SafetensorError) as e:   # DataError, CheckpointError, bad JSON, ...
        if isinstance(e, OSError):                                   # no such file, disk full, ...
            fail(f"{e.filename}: {e.strerror or e}" if e.filename else f"{e.strerror or e}")
        if isinstance(e, KeyError):                                  # a config from elsewhere lacks a field
            fail(f"missing field {e.args[0]!r} (a config or checkpoint from elsewhere?)")
        fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)

# ---- 1. Tokenizers: encode_plus(text, pair=None, max_len=None) -> (ids, type_ids), specials in, cut to max_len;
# encode, decode, pad_id / unk_id / cls_id / sep_id / mask_id, vocab_size, and `files` ({name: bytes}), what a
# checkpoint embeds to rebuild it (tokenizer_from_files).

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                      "sentencepiece.bpe.model")                 # what we read of an HF folder
KIND_FILE, SPM_FILE = "attnreg_tokenizer.json", "attnreg_spm.model"          # our own tokenizers' files
SPECIAL_TOKENS = {"pad": ("<pad>", "[PAD]"), "unk": ("<unk>", "[UNK]"), "cls": ("<s>", "[CLS]"),  # RoBERTa's,
                  "sep": ("</s>", "[SEP]"), "mask": ("<mask>", "[MASK]")}                         # then BERT's
FIXED_IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}  # our own tokenizers' (ListOps, bytes, scratch)

def _named(config, role):
    value = config.get(f"{role}_token")            # tokenizer_config.json: "<mask>" or {"content": "<mask>"}
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None

def _special_ids(token_to_id, config):
    """{role: id}: the config's token first, then the usual spellings; pad, cls and sep must exist."""
    ids = {}
    for role, spellings in SPECIAL_TOKENS.items():
        found = [token_to_id(t) for t in (_named(config, role), *spellings) if t is not None]
        ids[role] = next((i for i in found if i is not None), None)
        if ids[role] is None and role in ("pad", "cls", "sep"):
            raise DataError(f"tokenizer has no {role} token (looked for {spellings})")
    return ids

class _Tokenizer:
    def _set_ids(self, ids):                                  # ids: {role: id}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (ids[r] for r in SPECIAL_TOKENS)
    def encode(self, text, pair=None):
        return self.encode_plus(text, pair)[0]

class HFTokenizer(_Tokenizer):
    """A `tokenizers.Tokenizer` (a tokenizer.json: RoBERTa's BPE, BERT's WordPiece, ...), exactly HF's fast one."""
    def __init__(self, tok, files, config):
        tok.no_truncation()
        tok.no_padding()
        self.tok, self.files, self._cut = tok, files, {}       # _cut: max_len -> a copy that truncates there
        self._set_ids(_special_ids(tok.token_to_id, config))
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    def encode_plus(self, text, pair=None, max_len=None):
        if max_len is not None and max_len not in self._cut:    # HF's longest_first: cut the longer text first
            self._cut[max_len] = Tokenizer.from_str(self.tok.to_str())
            self._cut[max_len].enable_truncation(max_len, strategy="longest_first")
        enc = (self.tok if max_len is None else self._cut[max_len]).encode(text, pair)
        return list(enc.ids), list(enc.type_ids)
    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

def bert_wordpiece(files, config):
    """BERT's WordPiece tokenizer of a vocab.txt (an HF folder without tokenizer.json), built as HF builds it."""
    lines = files["vocab.txt"].decode("utf-8").replace("\r\n", "\n").removesuffix("\n").split("\n")
    vocab = {t: i for i, t in enumerate(lines)}                  # id = line number
    unk = next((t for t in (_named(config, "unk"), "[UNK]", "<unk>") if t in vocab), "[UNK]")
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=bool(config.get("tokenize_chinese_chars", True)),
        strip_accents=config.get("strip_accents"), lowercase=bool(config.get("do_lower_case", True)))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(prefix="##")
    tok.add_special_tokens(list(dict.fromkeys(                   # "[MASK]" in text stays one token
        t for r, sp in SPECIAL_TOKENS.items() for t in (_named(config, r), *sp) if t in vocab)))
    ids = _special_ids(tok.token_to_id, config)                  # [CLS] A [SEP] B [SEP], types 0 .. 0 1 .. 1
    tok.post_processor = processors.BertProcessing(*((tok.id_to_token(ids[r]), ids[r]) for r in ("sep", "cls")))
    return tok

class SentencePieceTokenizer(_Tokenizer):
    """A SentencePiece model; type ids all 0. fairseq=True: XLM-R's sentencepiece.bpe.model as transformers maps
    it (<s>=0 <pad>=1 </s>=2 <unk>=3, piece p -> p + 1, <mask> last; pairs <s> A </s></s> B </s>); False: from
    scratch (train_sentencepiece), spm's own ids pad=0 unk=1 <s>=2 </s>=3 <mask>=4; pairs <s> A </s> B </s>."""
    def __init__(self, model_bytes, files, fairseq):
        self.sp, self.files, self.fairseq = spm.SentencePieceProcessor(model_proto=model_bytes), files, fairseq
        n = self.sp.get_piece_size()                               # fairseq: the offset 1 and <mask> on top
        self._set_ids({"cls": 0, "pad": 1, "sep": 2, "unk": 3, "mask": n + 1} if fairseq else FIXED_IDS)
        self.vocab_size = n + 2 if fairseq else n
    def _pieces(self, text):
        ids = self.sp.encode(text)
        return [p + 1 if p else self.unk_id for p in ids] if self.fairseq else ids   # fairseq: spm's unk 0 -> 3
    def encode_plus(self, text, pair=None, max_len=None):
        a, b = self._pieces(text), self._pieces(pair) if pair is not None else []
        while max_len is not None and len(a) + len(b) > max_len - (2 if pair is None else 3 + self.fairseq):
            (a if len(a) >= len(b) else b).pop()                   # HF's longest_first: cut the longer one
        ids = [self.cls_id] + a + [self.sep_id]
        if pair is not None:
            ids += [self.sep_id] * self.fairseq + b + [self.sep_id]   # fairseq: </s></s> between the two
        return ids, [0] * len(ids)
    def decode(self, ids):
        ids = [int(i) for i in ids if int(i) not in (self.cls_id, self.pad_id, self.sep_id, self.mask_id)]
        return self.sp.decode([i - 1 if i != self.unk_id else 0 for i in ids] if self.fairseq else ids)

def train_sentencepiece(texts, model_prefix_path, vocab_size=8000, model_type="unigram"):
    """A from-scratch SentencePiece model of the training texts (methods.md §4), cached beside the data as
    PREFIX-<hash of vocab size, type and every text>.model: the same data reuses it, changed data trains anew."""
    texts = [t for t in texts if t.strip()]
    key = hashlib.sha1("\n".join([f"{vocab_size} {model_type}", *texts]).encode("utf-8")).hexdigest()[:12]
    prefix = f"{model_prefix_path}-{key}"                          # the same data: the same file
    if not os.path.exists(prefix + ".model"):                     # the cache: trained once per data set
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size, model_type=model_type,
                character_coverage=0.9995, pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="<pad>",
                unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", user_defined_symbols=["<mask>"],
                input_sentence_size=2_000_000, shuffle_input_sentence=True, minloglevel=2)
        except RuntimeError as e:   # e.g. "Vocabulary size too high (8000). Please set it to a value <= 1234."
            raise DataError(f"sentencepiece training failed: {str(e).splitlines()[-1]}") from None
    return _scratch_spm(Path(prefix + ".model").read_bytes())

def _scratch_spm(model_bytes):
    files = {KIND_FILE: json.dumps({"kind": "sentencepiece"}).encode(), SPM_FILE: model_bytes}
    return SentencePieceTokenizer(model_bytes, files, fairseq=False)

class _FixedTokenizer(_Tokenizer):
    """A fixed vocabulary after pad=0 unk=1 <s>=2 </s>=3 <mask>=4; [cls] first, no [sep] at the end."""
    def __init__(self, kind, vocab_size):
        self._set_ids(FIXED_IDS)
        self.files, self.vocab_size = {KIND_FILE: json.dumps({"kind": kind}).encode()}, vocab_size
    def encode_plus(self, text, pair=None, max_len=None):
        ids = [self.cls_id] + self._pieces(text) + ([self.sep_id] + self._pieces(pair) if pair is not None else [])
        return ids[:max_len], [0] * len(ids[:max_len])            # LRA cuts its inputs at max_length

class ListOpsTokenizer(_FixedTokenizer):
    """ListOps' 20 symbols (methods.md §4): LRA's Source string with "(" and ")" dropped ("[MAX" and "]" kept)."""
    SYMBOLS = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", *"0123456789", "[MIN", "[MAX", "[MED", "[SM", "]"]
    def __init__(self):
        super().__init__("listops", len(self.SYMBOLS))
        self.vocab = {s: i for i, s in enumerate(self.SYMBOLS)}
    def _pieces(self, text):
        return [self.vocab.get(t, self.unk_id) for t in text.split() if t not in ("(", ")")]
    def decode(self, ids):
        return " ".join(self.SYMBOLS[int(i)] for i in ids if int(i) > self.mask_id)

class ByteTokenizer(_FixedTokenizer):
    """LRA's character level, 261 ids: byte + 5 (Text, Retrieval: UTF-8 bytes, tfds' ByteTextEncoder shifted)
    or pixel value + 5 (Image, Pathfinder: 256 grey levels)."""
    OFFSET = 5                                                    # ids 0..4 are the specials
    def __init__(self):
        super().__init__("bytes", self.OFFSET + 256)
    def _pieces(self, text):
        return [b + self.OFFSET for b in text.encode("utf-8")]
    def encode_values(self, values, max_len=None):                # [cls] + (value + 5) per byte / pixel
        return ([self.cls_id] + [int(v) + self.OFFSET for v in values])[:max_len]
    def decode(self, ids):
        return bytes(int(i) - self.OFFSET for i in ids if int(i) >= self.OFFSET).decode("utf-8", errors="replace")

def tokenizer_from_files(files):
    """The tokenizer of {filename: bytes} (an HF folder's or a checkpoint's); damaged files: one DataError."""
    try:
        if KIND_FILE in files:                                    # ours: from scratch, ListOps, bytes
            kind = json.loads(files[KIND_FILE].decode("utf-8")).get("kind")
            fixed = {"listops": ListOpsTokenizer, "bytes": ByteTokenizer}
            return _scratch_spm(files[SPM_FILE]) if kind == "sentencepiece" else fixed[kind]()
        config = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):   # the latter wins
            config.update(json.loads(files[name].decode("utf-8")) if name in files else {})
        if "tokenizer.json" in files:
            return HFTokenizer(Tokenizer.from_str(files["tokenizer.json"].decode("utf-8")), files, config)
        if "vocab.txt" in files:
            return HFTokenizer(bert_wordpiece(files, config), files, config)
        if "sentencepiece.bpe.model" in files:                   # XLM-R
            return SentencePieceTokenizer(files["sentencepiece.bpe.model"], files, fairseq=True)
    except DataError:
        raise
    except Exception as e:       # tokenizers raises plain Exceptions: a cut file, a foreign format, ...
        raise DataError(f"tokenizer files {sorted(files)} are damaged or of an unknown format "
                        f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    raise DataError(f"no supported tokenizer files (have {sorted(files)}; need tokenizer.json, vocab.txt or "
                    "sentencepiece.bpe.model)")

def files_to_tensors(files):                 # {name: bytes} -> {name: uint8 tensor}, safe under weights_only
    return {name: torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
            for name, b in files.items()}

def tensors_to_files(stored):                # a checkpoint's ckpt["tokenizer"]["files"] -> {name: bytes}
    return {name: t.numpy().tobytes() for name, t in stored.items()}

def read_tokenizer_folder(folder):           # {filename: bytes} of the tokenizer files a folder holds
    return {n: Path(folder, n).read_bytes() for n in HF_TOKENIZER_FILES + (KIND_FILE, SPM_FILE)
            if Path(folder, n).is_file()}

def load_tokenizer(path):
    """The tokenizer of an HF folder or of a `.pt` checkpoint (its files under ckpt["tokenizer"]["files"])."""
    if os.path.isdir(path):
        return tokenizer_from_files(read_tokenizer_folder(path))
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such tokenizer folder or checkpoint")
    try:                                                           # weights_only: tensors and plain types only
        stored = torch.load(path, map_location="cpu", weights_only=True)["tokenizer"]["files"]
    except (KeyError, TypeError):
        raise DataError(f"{path}: checkpoint has no tokenizer files (ckpt['tokenizer']['files'])") from None
    except Exception as e:                                         # not a torch file, or not weights_only-safe
        raise DataError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None
    return tokenizer_from_files(tensors_to_files(stored))

# ---- 2. Readers: files -> examples. An error names FILE:LINE; skipped rows are counted and named -------------

@dataclass
class Example:
    ids: list                   # token ids, special tokens included
    type_ids: list | None       # segment ids, or None (= all zeros)
    label: int | float          # class index, or a float score (STS-B); readers/qa.py: (start, end)

@dataclass
class PairExample:              # LRA Retrieval: the dual encoder encodes each document on its own
    ids: list                   # first document, [cls] + tokens
    ids2: list                  # second document
    label: int
    type_ids: None = None

@dataclass
class TaskData:
    train: list                 # [Example]
    dev: dict                   # split -> [Example] (MNLI: dev_matched, dev_mismatched; LRA: dev, test)
    num_labels: int             # 1 for regression, 0 for mlm
    is_regression: bool
    metric_name: str            # the main metric, a key of compute_metrics' dict
    label_names: list           # class index -> label string
    n_truncated: int = 0        # examples cut to max_len (the caller warns once)
    skipped: list = field(default_factory=list)   # "FILE:LINE" of rows skipped on purpose (QQP's short rows, ...)
    head: str = "cls"           # model.Config.head: "cls", "pair" (lra-retrieval) or "span" (squad)
    @property
    def n_skipped(self):
        return len(self.skipped)

def skipped_warning(skipped, shown=5):
    """The `warning:` text for skipped rows (None if none): the count and the first few FILE:LINEs."""
    more = f", ... ({len(skipped) - shown} more)" if len(skipped) > shown else ""
    return f"{len(skipped)} rows skipped: {', '.join(skipped[:shown])}{more}" if skipped else None

def read_text(path, encoding="utf-8-sig"):
    """A text file's contents (a BOM stripped); a file that is not UTF-8 is a DataError naming file and line."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    raw = Path(path).read_bytes()
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}); "
                        "convert the file to UTF-8") from None

def read_rows(path, delimiter="\t", quoting=csv.QUOTE_NONE):
    """[(line, row)] of a TSV (GLUE: no quoting) or CSV file, blank lines skipped; a row's line is its first."""
    reader = csv.reader(io.StringIO(read_text(path), newline=""), delimiter=delimiter, quoting=quoting, strict=True)
    rows, line = [], 1
    try:
        for row in reader:
            rows += [(line, row)] if row else []
            line = reader.line_num + 1                            # where the next row starts
    except csv.Error as e:   # strict: a quote left open would swallow the rest of the file into one field
        what = "a quoted field opens here and never closes" if "end of data" in str(e) else f"bad quoting ({e})"
        raise DataError(f"{path}:{line}: {what}") from None
    if not rows:
        raise DataError(f"{path}:1: empty file")
    return rows

def _column(header, col, path):         # a column's index, from its name (the file has a header) or index
    if isinstance(col, str) and col not in header:
        raise DataError(f"{path}:1: no column {col!r} in header {header}")
    return header.index(col) if isinstance(col, str) else col

def _encode(tok, text, pair, max_len, stats):
    ids, type_ids = tok.encode_plus(text, pair)
    if max_len is not None and len(ids) > max_len:                # cut (HF's longest_first), and counted
        ids, type_ids = tok.encode_plus(text, pair, max_len=max_len)
        stats["truncated"] += 1
    return ids, type_ids

def _labelled_examples(records, tok, max_len, label_index, stats):
    """records: (where, text, pair, label string); label_index: {string: class}, or None (a float score)."""
    examples = []
    for where, text, pair, label in records:
        if not text.strip() or (pair is not None and not pair.strip()):
            raise DataError(f"{where}: empty text")
        if label_index is None:                                   # regression: a finite float
            try:
                y = float(label)
            except ValueError:
                raise DataError(f"{where}: non-numeric score {label!r}") from None
        elif label in label_index:
            y = label_index[label]
        else:
            raise DataError(f"{where}: unknown label {label!r} (expected one of {sorted(label_index)})")
        examples.append(Example(*_encode(tok, text, pair, max_len, stats), y))
    return examples

# The nine GLUE tasks in the official GLUE folders (methods.md §4): their (text, pair, label) columns, header
# names or 0-based indices (CoLA has no header); the label strings in class order (None: regression).
GLUE = {
    "cola": dict(cols=(3, None, 1), labels=["0", "1"], metric="mcc"),
    "sst2": dict(cols=("sentence", None, "label"), labels=["0", "1"]),
    "mrpc": dict(cols=("#1 String", "#2 String", "Quality"), labels=["0", "1"], metric="f1"),
    "stsb": dict(cols=("sentence1", "sentence2", "score"), labels=None, metric="pearson"),
    "qqp": dict(cols=("question1", "question2", "is_duplicate"), labels=["0", "1"], metric="f1"),
    "mnli": dict(cols=("sentence1", "sentence2", "gold_label"), labels=["contradiction", "entailment", "neutral"],
                 dev=("dev_matched", "dev_mismatched")),
    "qnli": dict(cols=("question", "sentence", "label"), labels=["entailment", "not_entailment"]),
    "rte": dict(cols=("sentence1", "sentence2", "label"), labels=["entailment", "not_entailment"]),
    "wnli": dict(cols=("sentence1", "sentence2", "label"), labels=["0", "1"]),
}
GLUE = {name: {"dev": ("dev",), "metric": "acc", **spec} for name, spec in GLUE.items()}   # the defaults

def read_jsonl(path, cols):
    """[(where, text, pair, label)] of a JSONL file: a line is an object (columns by key, or by index in key
    order) or a list; values are read as text (a label 1 as "1")."""
    records = []
    for line, s in enumerate(io.StringIO(read_text(path), newline=None), 1):
        if not s.strip():
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line}: invalid JSON ({e.msg})") from None
        values, got = list(obj.values()) if isinstance(obj, dict) else obj if isinstance(obj, list) else [], []
        for c in cols:
            try:                                                   # by key (an object) or by index
                got.append(None if c is None else str(obj[c] if isinstance(c, str) else values[c]))
            except (KeyError, IndexError, TypeError):             # (or the line is no object or list)
                raise DataError(f"{path}:{line}: no column {c!r} (a line is a JSON object or list)") from None
        records.append((f"{path}:{line}", *got))
    if not records:
        raise DataError(f"{path}:1: empty file")
    return records

def read_generic(path, cols, skip_bad_rows=False):
    """([(where, text, pair, label)], skipped FILE:LINEs) of a labelled .tsv (no quoting, as GLUE), .csv or
    .jsonl file. cols: (text, pair or None, label), header names or 0-based indices; a TSV / CSV file has a
    header row exactly when a column is a name. skip_bad_rows: skip rows of the wrong length (QQP)."""
    if cols[0] is None or cols[2] is None:                         # --task tsv with a column flag missing
        raise DataError(f"{path}: --task tsv needs --text-col and --label-col (header names or 0-based indices)")
    flags = ("--text-col", "--text-pair-col", "--label-col")
    cols = [int(c) if isinstance(c, str) and c.strip().lstrip("-").isdigit() else c for c in cols]   # "3" -> 3
    for col, flag in zip(cols, flags):
        if isinstance(col, int) and col < 0:                      # no counting from the end
            raise DataError(f"{flag} {col}: a column is a header name or a 0-based index (>= 0)")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".json"):
        return read_jsonl(path, cols), []
    rows = read_rows(path, ",", csv.QUOTE_MINIMAL) if ext == ".csv" else read_rows(path)
    head = [h.strip() for h in rows.pop(0)[1]] if any(isinstance(c, str) for c in cols) else None
    if not rows:
        raise DataError(f"{path}:2: no rows after the header")
    (ti, pi, li), ncols = [_column(head, c, path) if c is not None else None for c in cols], len(head or rows[0][1])
    for flag, i in zip(flags, (ti, pi, li)):                      # every row has ncols columns (below)
        if i is not None and i >= ncols:
            raise DataError(f"{path}:{rows[0][0]}: {flag} asks for column {i} (0-based), but the line has "
                            f"{ncols} column{'s' * (ncols != 1)}")
    records, skipped = [], []
    for line, row in rows:
        if len(row) != ncols and skip_bad_rows:                   # QQP: as transformers' GLUE processor
            skipped.append(f"{path}:{line}")
        elif len(row) != ncols:
            raise DataError(f"{path}:{line}: expected {ncols} columns, got {len(row)}")
        else:
            records.append((f"{path}:{line}", row[ti], row[pi] if pi is not None else None, row[li].strip()))
    return records, skipped

def load_generic(path, tok, *, text_col, label_col, text_pair_col=None, max_len=None, label_names=None):
    """(examples, label_names, n_truncated) of a labelled file. label_names None (a training file): its own
    labels, numerically if all are integers ("2" < "10"); a dev file passes the training file's."""
    records, _ = read_generic(path, (text_col, text_pair_col, label_col))
    if label_names is None:
        labels = set(r[3] for r in records)
        label_names = sorted(labels, key=int) if all(s.lstrip("-").isdigit() for s in labels) else sorted(labels)
    stats = {"truncated": 0}
    examples = _labelled_examples(records, tok, max_len, {s: i for i, s in enumerate(label_names)}, stats)
    return examples, label_names, stats["truncated"]

def _find_split(folder, stem):                                   # DIR/train.tsv, .csv or .jsonl
    found = [p for p in (os.path.join(folder, stem + e) for e in (".tsv", ".csv", ".jsonl")) if os.path.isfile(p)]
    if not found:
        raise DataError(f"{folder}: no {stem}.tsv, {stem}.csv or {stem}.jsonl")
    return found[0]

# ---- 3. The task table: each task's reader, the objective train.py trains it with, how the console shows it --
# A reader: (name, data_dir, tok, *, max_len, train_file, dev_file, text_col, text_pair_col, label_col) -> TaskData.

def load_glue(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    spec, stats, skipped, out = GLUE[name], {"truncated": 0}, [], {}
    index = {s: i for i, s in enumerate(spec["labels"])} if spec["labels"] else None   # None: STS-B's scores
    paths = {"train": train_file or os.path.join(data_dir, "train.tsv")}
    paths |= {"dev": dev_file} if dev_file else {s: os.path.join(data_dir, s + ".tsv") for s in spec["dev"]}
    for split, path in paths.items():
        records, more = read_generic(path, spec["cols"], skip_bad_rows=name == "qqp")   # QQP's short rows
        out[split], skipped = _labelled_examples(records, tok, max_len, index, stats), skipped + more
    return TaskData(out.pop("train"), out, len(index or [0]), index is None, spec["metric"],
                    list(spec["labels"] or []), stats["truncated"], skipped)

def load_tsv(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    train, labels, n1 = load_generic(train_file or _find_split(data_dir, "train"), tok, max_len=max_len, **columns)
    dev, _, n2 = load_generic(dev_file or _find_split(data_dir, "dev"), tok, max_len=max_len, label_names=labels,
                              **columns)                          # a label unseen in training is an error
    return TaskData(train, {"dev": dev}, len(labels), False, "acc", labels, n1 + n2)

def load_listops(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    tok, stats, digits = tok or ListOpsTokenizer(), {"truncated": 0}, {str(d): d for d in range(10)}
    read = lambda path: _labelled_examples(read_generic(path, ("Source", None, "Target"))[0], tok, max_len,
                                           digits, stats)         # LRA's basic_*.tsv: Source<TAB>Target
    train = read(train_file or os.path.join(data_dir, "basic_train.tsv"))
    dev = read(dev_file or os.path.join(data_dir, "basic_val.tsv"))
    return TaskData(train, {"dev": dev}, 10, False, "acc", list(digits), stats["truncated"])

def elsewhere(name):                                               # on first use: the six never load readers/
    from readers import lra, mlm, qa
    return {"squad": qa, "mlm": mlm}.get(name, lra)

def load_elsewhere(name, data_dir, tok, **files):
    return elsewhere(name).load(name, data_dir, tok, **files)

@dataclass(frozen=True)
class Task:
    load: callable                  # the reader (signature above)
    objective: str = "classify"     # train.py's loss: "classify" (CE; MSE for STS-B), "pair", "mlm" or "span"
    metric: str = "acc"             # the main dev metric (the best checkpoint's), a key of compute_metrics
    max_len: int = 512              # --max-len when not given (LRA: LRA's input lengths + [cls])
    tokenizer: type = None          # the task's own vocabulary; None: the checkpoint's, or from scratch a
                                    # SentencePiece model of training_texts (train_sentencepiece)
    percent: tuple = ("acc", "f1")  # metrics the console shows as percents ...
    scale: float = 100.0            # ... after multiplying by this (SQuAD's EM / F1 are percents already)
    @property
    def head(self):                 # model.Config.head
        return {"pair": "pair", "span": "span"}.get(self.objective, "cls")

TASKS = {
    **{name: Task(load_glue, metric=spec["metric"]) for name, spec in GLUE.items()},
    "tsv": Task(load_tsv),                                         # any labelled file (--text-col, --label-col)
    "listops": Task(load_listops, tokenizer=ListOpsTokenizer),
    "lra-text": Task(load_elsewhere, max_len=4001, tokenizer=ByteTokenizer),         # 4,000 bytes + [cls]
    "lra-retrieval": Task(load_elsewhere, "pair", max_len=4001, tokenizer=ByteTokenizer),   # per document
    "lra-image": Task(load_elsewhere, max_len=1025, tokenizer=ByteTokenizer),        # 32 x 32 pixels + [cls]
    "lra-pathfinder": Task(load_elsewhere, max_len=1025, tokenizer=ByteTokenizer),
    "squad": Task(load_elsewhere, "span", metric="f1", percent=("em", "f1"), scale=1.0),
    "mlm": Task(load_elsewhere, "mlm", metric="loss", percent=()),     # readers/mlm.py
}

def task_entry(name):
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    return TASKS[name]

def load_task(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, text_col=None, text_pair_col=None,
              label_col=None):
    """TaskData of any task (methods.md §4): its entry's reader on DIR (or --train-file / --dev-file)."""
    return task_entry(name).load(name, data_dir, tok, max_len=max_len, train_file=train_file, dev_file=dev_file,
                                 text_col=text_col, text_pair_col=text_pair_col, label_col=label_col)

def fixed_tokenizer(name):      # the tokenizer the task's inputs define (ListOps symbols, LRA bytes), or None
    make = task_entry(name).tokenizer
    return make() if make is not None else None

def training_texts(name, data_dir, *, train_file=None, dev_file=None, text_col=None, text_pair_col=None,
                   label_col=None):
    """The raw training texts (both sides of pairs) a from-scratch SentencePiece model is trained on."""
    if name in ("squad", "mlm"):
        return elsewhere(name).training_texts(name, data_dir, train_file=train_file)
    if name not in GLUE and name != "tsv":
        raise DataError(f"task {name!r} has no text to train a tokenizer on")
    cols = GLUE[name]["cols"] if name in GLUE else (text_col, text_pair_col, label_col)
    path = train_file or (os.path.join(data_dir, "train.tsv") if name in GLUE else _find_split(data_dir, "train"))
    return [t for _, text, pair, _ in read_generic(path, cols, name == "qqp")[0] for t in (text, pair) if t]

# ---- 4. Batching: deterministic length buckets, dynamic padding --------------------------------------------

def autocast(device):          # the precision batches run in: bf16 autocast on CUDA, fp32 on the CPU
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

def collate(examples, pad_id, multiple_of=1):
    """The batch dict: input_ids, attention_mask, token_type_ids [B, L] padded to the longest example (rounded
    up to multiple_of), labels [B]. PairExamples: both documents padded to one L, [B, 2, L] (flatten_pairs)."""
    if isinstance(examples[0], PairExample):
        flat = collate([Example(d, None, e.label) for e in examples for d in (e.ids, e.ids2)], pad_id, multiple_of)
        return {**{k: v.view(len(examples), 2, -1) for k, v in flat.items() if k != "labels"},   # [B, 2, L]
                "labels": flat["labels"][::2]}                     # pair i was rows 2i, 2i + 1; labels [B]
    B, L = len(examples), -(-max(len(e.ids) for e in examples) // multiple_of) * multiple_of
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)          # [B, L]
    attention_mask = torch.zeros((B, L), dtype=torch.long)            # [B, L], 1 = a real token
    token_type_ids = torch.zeros((B, L), dtype=torch.long)            # [B, L]
    for i, e in enumerate(examples):
        input_ids[i, :len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)   # a list, or LRA's numpy array
        attention_mask[i, :len(e.ids)] = 1
        token_type_ids[i, :len(e.ids)] = torch.tensor(e.type_ids or [0] * len(e.ids), dtype=torch.long)
    regression = any(isinstance(e.label, float) for e in examples)    # STS-B's scores
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
            "labels": torch.tensor([e.label for e in examples], dtype=torch.float if regression else torch.long)}

def flatten_pairs(batch):      # [B, 2, L] -> [2B, L], pair i in rows 2i and 2i + 1 (model.PairHead pairs them back)
    return {k: v.flatten(0, 1) if k != "labels" else v for k, v in batch.items()}

def batch_plan(lengths, batch_size, *, seed, epoch, shuffle=True, bucket_batches=50):
    """An epoch's batches as lists of example indices, a function of (seed, epoch) only (exact resume);
    shuffle=False: in order (evaluation)."""
    order = list(range(len(lengths)))
    if shuffle:
        rng = np.random.default_rng([seed, epoch])                    # shuffle, then sort by length within
        order = [int(i) for i in rng.permutation(len(lengths))]       # chunks of bucket_batches batches:
        chunk = batch_size * bucket_batches                          # similar lengths share a batch
        order = [i for s in range(0, len(order), chunk) for i in sorted(order[s:s + chunk], key=lambda j: lengths[j])]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    return [batches[int(i)] for i in rng.permutation(len(batches))] if shuffle else batches   # batches shuffled

def longest_first(examples):
    # evaluation order: little padding per batch, and a batch too large for the device fails at once (safe: an
    # output does not depend on the padding beside it, and every metric pairs a prediction with its label)
    return sorted(examples, key=lambda e: len(e.ids), reverse=True)

def make_batches(examples, batch_size, *, pad_id, seed, epoch, shuffle=True, multiple_of=1, bucket_batches=50):
    """Every batch of batch_plan, padded (dev sets and tests; the loop pads its batches one at a time)."""
    plan = batch_plan([len(e.ids) for e in examples], batch_size, seed=seed, epoch=epoch, shuffle=shuffle,
                      bucket_batches=bucket_batches)
    return [collate([examples[i] for i in b], pad_id, multiple_of) for b in plan]

# ---- 5. Metrics (numpy, by hand): the official GLUE metrics (methods.md §4) -----------------------------------

def accuracy(preds, labels):
    return float(np.mean(np.asarray(preds) == np.asarray(labels)))

def f1_binary(preds, labels):
    p, y = np.asarray(preds) == 1, np.asarray(labels) == 1
    tp, fp, fn = np.sum(p & y), np.sum(p & ~y), np.sum(~p & y)
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn > 0 else 0.0   # F1 = 2 tp / (2 tp + fp + fn)

def matthews_corrcoef(preds, labels):
    """MCC of the K x K confusion matrix C (0 when undefined, as sklearn); K = 2: (tp tn - fp fn) / sqrt(...)."""
    preds, labels = np.asarray(preds, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    k = int(max(preds.max(initial=0), labels.max(initial=0))) + 1
    C = np.zeros((k, k), dtype=np.float64)
    np.add.at(C, (labels, preds), 1)                                   # C[true, predicted] += 1
    t, p, c, s = C.sum(1), C.sum(0), np.trace(C), C.sum()              # true / predicted counts, hits, all
    denom = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - t @ p) / denom) if denom > 0 else 0.0       # (c s - t.p) / sqrt((s²-p.p)(s²-t.t))

def pearson(x, y):
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt(np.sum(dx * dx) * np.sum(dy * dy))
    return float(np.sum(dx * dy) / denom) if denom > 0 else 0.0     # r = sum dx dy / sqrt(sum dx² sum dy²)

def average_ranks(x):           # ranks 1..n, ties share the mean of theirs: [10, 20, 20, 30] -> [1, 2.5, 2.5, 4]
    _, inverse, counts = np.unique(np.asarray(x), return_inverse=True, return_counts=True)
    end = np.cumsum(counts)                                            # the last rank of each distinct value
    return ((end - counts + 1 + end) / 2.0)[inverse.reshape(-1)]       # the mean of its first and last rank

def spearman(x, y):
    return pearson(average_ranks(x), average_ranks(y))                 # rho = Pearson r of the ranks

def compute_metrics(task_name, preds, labels):
    """The task's official metrics, by its main metric. preds: class ids or logits [N, K] (argmax taken);
    STS-B: scores [N] or [N, 1]. MNLI: once per dev split."""
    entry = task_entry(task_name)
    if entry.objective not in ("classify", "pair"):                   # squad, mlm: their own evaluation
        raise DataError(f"task {task_name!r} is scored by its own evaluation, not compute_metrics")
    preds, labels = np.asarray(preds), np.asarray(labels)
    if entry.metric == "pearson":                                     # STS-B
        pr, sr = pearson(preds.reshape(-1), labels), spearman(preds.reshape(-1), labels)
        return {"pearson": pr, "spearman": sr, "corr": (pr + sr) / 2}
    preds = preds.argmax(-1) if preds.ndim == 2 else preds
    if entry.metric == "mcc":                                         # CoLA
        return {"mcc": matthews_corrcoef(preds, labels), "acc": accuracy(preds, labels)}
    if entry.metric == "f1":                                          # MRPC, QQP
        return {"f1": f1_binary(preds, labels), "acc": accuracy(preds, labels)}
    return {"acc": accuracy(preds, labels)}

# ---- 6. The LRA ListOps generator (methods.md §4; the Long Range Arena recipe, lra_benchmarks/data/listops.py) -

LISTOPS_OPS = ("[MIN", "[MAX", "[MED", "[SM")
LISTOPS_VALUE_P = 0.25  # LRA: a node is an operator when random() <= 0.25, else a leaf (p = 0.75)

def _apply_op(op, values):
    if op == "[MED":
        return int(np.median(values))    # an even count: int() of the mean of the middle two
    if op == "[SM":
        return sum(values) % 10          # sum modulo 10
    return min(values) if op == "[MIN" else max(values)

def _render(op, args):          # LRA's left-branching tuples: [MAX 2 9] -> "( ( ( [MAX 2 ) 9 ) ] )"
    return "( " * (len(args) + 1) + op + "".join(" " + a + " )" for a in args) + " ] )"

def listops_tree(rng, depth, max_depth, max_args, budget=float("inf")):
    """One random expression as (source, length, value), or None once its length would exceed budget.
    length: 1 per value, 2 per operator (it and its ']'): the model's tokens, parentheses dropped. Stopping at
    the budget only skips the rest of a tree that would be discarded anyway: LRA's distribution, faster."""
    if (rng.random() if depth < max_depth else 1.0) > LISTOPS_VALUE_P:  # a leaf (always at max_depth)
        v = rng.randrange(10)
        return str(v), 1, v
    args, values, length = [], [], 2
    for _ in range(rng.randint(2, max_args)):
        sub = listops_tree(rng, depth + 1, max_depth, max_args, budget - length)
        if sub is None or length + sub[1] > budget:
            return None
        args.append(sub[0])
        values.append(sub[2])
        length += sub[1]
    op = rng.choice(LISTOPS_OPS)  # LRA draws the operator after its arguments
    return _render(op, args), length, _apply_op(op, values)

def generate_listops(n, min_len, max_len, seed, max_depth=10, max_args=10, progress=False, max_misses=1_000_000):
    """n distinct (source, label) with min_len < length < max_len (LRA's exclusive bounds). Trees are drawn
    from the root at depth 1 and duplicates discarded (LRA keeps a set): samples are unique across splits."""
    if max_args < 2 or max_depth < 1:
        raise DataError(f"ListOps needs max_args >= 2 and max_depth >= 1 (got {max_args}, {max_depth})")
    rng, seen, out, misses = random.Random(seed), set(), [], 0
    with tqdm(total=n, desc="listops", disable=not progress) as bar:
        while len(out) < n:
            tree = listops_tree(rng, 1, max_depth, max_args, budget=max_len - 1)
            if tree is not None and tree[1] > min_len and tree[0] not in seen:   # LRA: min_len < length
                seen.add(tree[0])
                out.append((tree[0], int(tree[2])))
                bar.update(1)
                misses = 0
            elif (misses := misses + 1) >= max_misses:   # the range is exhausted (or holds no possible length)
                raise DataError(f"ListOps: no new sample with {min_len} < length < {max_len} in {max_misses} "
                                f"draws after {len(out)} samples; widen the range or lower the counts")
    return out

def write_listops(out_dir, n_train=96000, n_val=2000, n_test=2000, min_len=500, max_len=2000, seed=0,
                  max_depth=10, max_args=10, progress=False):
    """OUT/basic_{train,val,test}.tsv with header Source<TAB>Target (LRA's layout); returns the three paths."""
    rows = generate_listops(n_train + n_val + n_test, min_len, max_len, seed, max_depth, max_args, progress)
    splits = {"train": rows[:n_train], "val": rows[n_train:n_train + n_val], "test": rows[n_train + n_val:]}
    os.makedirs(out_dir, exist_ok=True)
    paths = {split: os.path.join(out_dir, f"basic_{split}.tsv") for split in splits}
    for split, part in splits.items():
        with open(paths[split], "w", encoding="utf-8", newline="") as f:
            csv.writer(f, delimiter="\t", lineterminator="\n").writerows([["Source", "Target"], *part])
    return paths

# ---- The command line: python data.py listops OUT_DIR [--train N ...] ----------------------------------------

def main(argv=None):
    parser = ArgumentParser(description="attnreg data tools")
    p = parser.add_subparsers(dest="command", required=True).add_parser(
        "listops", help="generate LRA ListOps basic_{train,val,test}.tsv")
    p.add_argument("out_dir")
    for flag, default in (("train", 96000), ("val", 2000), ("test", 2000), ("min-len", 500), ("max-len", 2000),
                          ("seed", 0), ("max-depth", 10), ("max-args", 10)):
        p.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args(argv)
    if min(args.train, args.val, args.test, args.min_len, args.max_len) < 0:   # refused before minutes of work
        parser.error("--train, --val, --test, --min-len and --max-len must be >= 0")
    if args.train + args.val + args.test == 0:
        parser.error("--train, --val and --test are all 0: nothing to generate")
    with one_line_errors():
        paths = write_listops(args.out_dir, args.train, args.val, args.test, args.min_len, args.max_len, args.seed,
                              args.max_depth, args.max_args, progress=True)
        print(" ".join(paths.values()))

if __name__ == "__main__":
    main()
