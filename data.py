"""data.py: files on disk -> padded batches of token ids, and the scores of a model's predictions.

The bottom layer of attnreg: it imports no other module of the project. Its sections follow the
data: 1 files, 2 tokenizers, 3 examples and the task table TASKS, 4 batches, 5 metrics, 6 the
ListOps generator, 7 plumbing (the one-line `error:`, the lock on --out, the command line).

Run: python data.py listops data/listops    # LRA's ListOps: 96,000 / 2,000 / 2,000, 500-2,000 long
"""
import argparse
import csv
import fcntl
import hashlib
import io
import json
import os
import random
import re
import sys
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

# -----------------------------------------------------------------------------
# 1. Files -> records (where, text, pair, label): `where` is the "FILE:LINE" an error names, `pair`
# the second text (or None), `label` the label as the file writes it. Files are UTF-8; TSV is read
# as GLUE writes it (no quoting), CSV with quoting, JSONL as one JSON value a line.
csv.field_size_limit(2**31 - 1)                     # LRA's long texts pass the default 128 KiB

# A file's text, a byte-order mark dropped. Not UTF-8 is an error naming the line and column of the
# first bad byte.
def read_text(path, encoding="utf-8-sig"):
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    raw = Path(path).read_bytes()
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                        f"{column}); convert the file to UTF-8") from None

# A TSV or CSV file as [(line, row)], blank lines skipped; a row's line is the one it starts on.
# strict=True stops at a quote that never closes (else the rest of the file is one field).
def read_rows(path, delimiter="\t", quoting=csv.QUOTE_NONE):
    text = io.StringIO(read_text(path), newline="")
    reader = csv.reader(text, delimiter=delimiter, quoting=quoting, strict=True)
    rows = []
    line = 1                                        # the line the next row starts on
    try:
        for row in reader:
            if row:
                rows.append((line, row))
            line = reader.line_num + 1
    except csv.Error as e:
        unclosed = "end of data" in str(e)
        what = "a quoted field opens here and never closes" if unclosed else f"bad quoting ({e})"
        raise DataError(f"{path}:{line}: {what}") from None
    if not rows:
        raise DataError(f"{path}:1: empty file")
    return rows

def _column(header, col, path):                     # a header name or a 0-based index -> the index
    if isinstance(col, str) and col not in header:
        raise DataError(f"{path}:1: no column {col!r} in header {header}")
    return header.index(col) if isinstance(col, str) else col

# A JSONL line is a JSON object (a column by key, or by index in key order) or a list (by index).
# Labels become classes by their text, so 1, 1.0, "1" and true would be four classes: a label must
# be a scalar, and a file's labels all of one type (true is not 1, though bool is an int).
JSON_LABEL_TYPES = {str: "a string", int: "an integer", float: "a decimal number",
                    bool: "true / false"}

def _json_value(obj, col, where):
    if isinstance(obj, dict) and not isinstance(col, str):
        obj = list(obj.values())
    if not isinstance(obj, (dict, list)):
        obj = []                                    # a line of one scalar has no columns
    try:
        return obj[col]
    except (KeyError, IndexError, TypeError):
        raise DataError(f"{where}: no column {col!r} (a line is a JSON object or list)") from None

def read_jsonl(path, cols, label_optional=False):
    records = []
    first = None                                    # (line, label) that fixes the label type
    for line, s in enumerate(io.StringIO(read_text(path), newline=None), 1):
        if not s.strip():
            continue
        where = f"{path}:{line}"
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg})") from None
        if label_optional and not records:          # the first line decides: labels or none
            try:
                _json_value(obj, cols[2], where)
            except DataError:
                cols = [cols[0], cols[1], None]
        got = [None if c is None else _json_value(obj, c, where) for c in cols]
        if cols[2] is None:
            records.append((where, *[None if v is None else str(v) for v in got]))
            continue
        label = got[2]
        shown = json.dumps(label)[:40]
        if type(label) not in JSON_LABEL_TYPES:
            raise DataError(f"{where}: label {shown} is not a label (a label is a string, a "
                            "number or true / false)")
        first = first or (line, label)
        if type(label) is not type(first[1]):
            kinds = [JSON_LABEL_TYPES[type(v)] for v in (label, first[1])]
            raise DataError(f"{where}: label {shown} is {kinds[0]}, but line {first[0]}'s label "
                            f"{json.dumps(first[1])[:40]} is {kinds[1]}; a file's labels are "
                            "all of one type")
        texts = [None if c is None else str(v) for c, v in zip(cols, got)]
        records.append((where, *texts))
    if not records:
        raise DataError(f"{path}:1: empty file")
    return records

# Any labelled file -> (records, skipped FILE:LINEs). cols: (text, pair or None, label), each a
# header name or a 0-based index ("3" is 3); a TSV or CSV file has a header row exactly when a
# column is named. A row with another column count than the first is an error, or skipped (QQP's).
# label_optional (python model.py predict): a file without the label column gives label None.
def read_generic(path, cols, skip_bad_rows=False, label_optional=False):
    if cols[0] is None or (cols[2] is None and not label_optional):
        raise DataError(f"{path}: --task tsv needs --text-col and --label-col (header names or "
                        "0-based indices)")
    flags = ("--text-col", "--text-pair-col", "--label-col")
    cols = [int(c) if isinstance(c, str) and c.strip().lstrip("-").isdigit() else c for c in cols]
    for col, flag in zip(cols, flags):
        if isinstance(col, int) and col < 0:        # no counting from the end
            raise DataError(f"{flag} {col}: a column is a header name or a 0-based index (>= 0)")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".json"):
        return read_jsonl(path, cols, label_optional), []
    rows = read_rows(path, ",", csv.QUOTE_MINIMAL) if ext == ".csv" else read_rows(path)
    head = None
    if any(isinstance(c, str) for c in cols):       # a column by name: the first row is a header
        head = [h.strip() for h in rows.pop(0)[1]]
    if not rows:
        raise DataError(f"{path}:2: no rows after the header")
    ncols = len(head or rows[0][1])
    if label_optional and cols[2] is not None:      # no such column: no labels
        missing = cols[2] not in head if isinstance(cols[2], str) else cols[2] >= ncols
        cols = cols if not missing else [cols[0], cols[1], None]
    ti, pi, li = [_column(head, c, path) if c is not None else None for c in cols]
    for flag, i in zip(flags, (ti, pi, li)):
        if i is not None and i >= ncols:
            raise DataError(f"{path}:{rows[0][0]}: {flag} asks for column {i} (0-based), but the "
                            f"line has {ncols} column{'s' * (ncols != 1)}")
    records = []
    skipped = []
    for line, row in rows:
        if len(row) != ncols and skip_bad_rows:
            skipped.append(f"{path}:{line}")
        elif len(row) != ncols:
            raise DataError(f"{path}:{line}: expected {ncols} columns, got {len(row)}")
        else:
            pair = row[pi] if pi is not None else None
            label = row[li].strip() if li is not None else None
            records.append((f"{path}:{line}", row[ti], pair, label))
    return records, skipped

def _find_split(folder, stem):                      # DIR/STEM.tsv, else .csv, else .jsonl
    for ext in (".tsv", ".csv", ".jsonl"):
        if os.path.isfile(os.path.join(folder, stem + ext)):
            return os.path.join(folder, stem + ext)
    raise DataError(f"{folder}: no {stem}.tsv, {stem}.csv or {stem}.jsonl")

# -----------------------------------------------------------------------------
# 2. Tokenizers (§4): a checkpoint's own, SentencePiece (XLM-R's or trained here), and the fixed
# vocabularies of ListOps and LRA's bytes. One interface: encode_plus(text, pair=None, max_len=None)
# -> (ids, type_ids), the specials in as the family puts them, a pair cut as HuggingFace's
# "longest_first" cuts it; encode (ids alone), decode, pad_id ... mask_id, vocab_size, and `files`
# ({name: bytes}) from which a checkpoint rebuilds the very same tokenizer (tokenizer_from_files).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "vocab.txt", "sentencepiece.bpe.model")
KIND_FILE = "attnreg_tokenizer.json"        # ours: {"kind": "sentencepiece" | "listops" | "bytes"}
SPM_FILE = "attnreg_spm.model"              # a SentencePiece model trained here

# The five special tokens by role, RoBERTa's spelling first, then BERT's; and the ids our own
# tokenizers (ListOps, bytes, SentencePiece from scratch) give them.
SPECIAL_TOKENS = {"pad": ("<pad>", "[PAD]"), "unk": ("<unk>", "[UNK]"), "cls": ("<s>", "[CLS]"),
                  "sep": ("</s>", "[SEP]"), "mask": ("<mask>", "[MASK]")}
FIXED_IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}

# The token tokenizer_config.json names for a role: "mask_token": "<mask>" or {"content": ...}.
def _named(config, role):
    value = config.get(f"{role}_token")
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None

# {role: id} of a vocabulary: the token the config names first, then the usual spellings. pad, cls
# and sep must exist (padding and the [cls] ... [sep] layout need them); unk and mask may be None.
def _special_ids(token_to_id, config):
    ids = {}
    for role, spellings in SPECIAL_TOKENS.items():
        found = [token_to_id(t) for t in (_named(config, role), *spellings) if t is not None]
        ids[role] = next((i for i in found if i is not None), None)
        if ids[role] is None and role in ("pad", "cls", "sep"):
            raise DataError(f"tokenizer has no {role} token (looked for {spellings})")
    return ids

class _Tokenizer:                                   # what every tokenizer shares
    def _set_ids(self, ids):
        for role, i in ids.items():
            setattr(self, f"{role}_id", i)          # pad_id, unk_id, cls_id, sep_id, mask_id

    def encode(self, text, pair=None):
        return self.encode_plus(text, pair)[0]

    # A text as encode_plus's ids, and the words they make (python model.py look): words[w] the
    # word's text, word_of[t] the word of token t. Word pieces join back into their word where
    # the tokenizer keeps that (HF's word ids, SentencePiece's "▁"); here each token is a word.
    def encode_words(self, text, max_len=None):
        ids = self.encode_plus(text, max_len=max_len)[0]
        return ids, [self.token_text(i) for i in ids], list(range(len(ids)))

    def token_text(self, i):                        # a special token by its role: <cls>, <sep>
        roles = {getattr(self, f"{r}_id"): r for r in SPECIAL_TOKENS}
        return f"<{roles[i]}>" if i in roles else self.decode([i])

# A checkpoint's tokenizer.json, run by the `tokenizers` library as HuggingFace's fast tokenizer
# runs it (tests/test_data.py checks three families).
class HFTokenizer(_Tokenizer):
    def __init__(self, tok, files, config):
        tok.no_truncation()
        tok.no_padding()
        self.tok = tok
        self.files = files
        self._cut = {}                              # max_len -> a copy that truncates there
        self._set_ids(_special_ids(tok.token_to_id, config))
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    def _cut_at(self, max_len):                     # a copy that truncates at max_len
        if max_len not in self._cut:
            self._cut[max_len] = Tokenizer.from_str(self.tok.to_str())
            self._cut[max_len].enable_truncation(max_len, strategy="longest_first")
        return self._cut[max_len]

    def encode_plus(self, text, pair=None, max_len=None):
        tok = self.tok if max_len is None else self._cut_at(max_len)
        enc = tok.encode(text, pair)
        return list(enc.ids), list(enc.type_ids)

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_words(self, text, max_len=None):     # a word: the pieces of one word id
        enc = (self.tok if max_len is None else self._cut_at(max_len)).encode(text)
        words = []
        word_of = []
        for t, (w, (start, end)) in enumerate(zip(enc.word_ids, enc.offsets)):
            if w is None:                           # a special token
                words.append(self.token_text(enc.ids[t]))
                first = None
            elif t == 0 or w != enc.word_ids[t - 1]:  # a new word
                words.append(text[start:end])
                first = start
            else:                                   # the word's next piece
                words[-1] = text[first:end]
            word_of.append(len(words) - 1)
        return list(enc.ids), words, word_of

# BERT's WordPiece of a vocab.txt (an HF folder without tokenizer.json), built as HuggingFace builds
# it: a token's id is its line number; BERT's normalizer and pre-tokenizer; special tokens kept
# whole; [CLS] A [SEP] B [SEP] with type ids 0 up to the first [SEP], 1 after it.
def bert_wordpiece(files, config):
    text = files["vocab.txt"].decode("utf-8").replace("\r\n", "\n").removesuffix("\n")
    vocab = {token: i for i, token in enumerate(text.split("\n"))}
    unk = next((t for t in (_named(config, "unk"), "[UNK]", "<unk>") if t in vocab), "[UNK]")
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=bool(config.get("tokenize_chinese_chars", True)),
        strip_accents=config.get("strip_accents"),
        lowercase=bool(config.get("do_lower_case", True)))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    specials = [t for role, spellings in SPECIAL_TOKENS.items()
                for t in (_named(config, role), *spellings) if t in vocab]
    tok.add_special_tokens(list(dict.fromkeys(specials)))     # each once, in order
    ids = _special_ids(tok.token_to_id, config)
    sep, cls = [(tok.id_to_token(ids[role]), ids[role]) for role in ("sep", "cls")]
    tok.post_processor = processors.BertProcessing(sep, cls)
    return tok

# A SentencePiece model, in one of two id layouts; type ids are all 0. fairseq=True: XLM-R's
# sentencepiece.bpe.model as transformers maps it (<s>=0 <pad>=1 </s>=2 <unk>=3, piece p -> p + 1,
# <mask> last; a pair is <s> A </s></s> B </s>). fairseq=False: one trained here, SentencePiece's
# own ids (FIXED_IDS; a pair is <s> A </s> B </s>). A cut takes a piece off the longer text.
class SentencePieceTokenizer(_Tokenizer):
    def __init__(self, model_bytes, files, fairseq):
        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.files = files
        self.fairseq = fairseq
        n = self.sp.get_piece_size()
        if fairseq:
            self._set_ids({"cls": 0, "pad": 1, "sep": 2, "unk": 3, "mask": n + 1})
            self.vocab_size = n + 2                 # the offset of 1, and <mask> on top
        else:
            self._set_ids(FIXED_IDS)
            self.vocab_size = n

    def _pieces(self, text):
        ids = self.sp.encode(text)
        return [p + 1 if p else self.unk_id for p in ids] if self.fairseq else ids   # unk: 0 -> 3

    def encode_plus(self, text, pair=None, max_len=None):
        a = self._pieces(text)
        b = self._pieces(pair) if pair is not None else []
        specials = 2 if pair is None else 3 + self.fairseq
        while max_len is not None and len(a) + len(b) > max_len - specials:
            (a if len(a) >= len(b) else b).pop()
        ids = [self.cls_id] + a + [self.sep_id]
        if pair is not None:
            ids += [self.sep_id] * self.fairseq + b + [self.sep_id]   # fairseq: </s></s> between
        return ids, [0] * len(ids)

    def encode_words(self, text, max_len=None):     # a word starts at a piece with "▁"
        ids = self.encode_plus(text, max_len=max_len)[0]
        pieces = self.sp.encode(text, out_type=str)[:len(ids) - 2]
        words = [self.token_text(self.cls_id)]
        word_of = [0]
        for p in pieces:
            if p.startswith("▁") or len(words) == 1:
                words.append("")
            words[-1] += p.removeprefix("▁")
            word_of.append(len(words) - 1)
        words.append(self.token_text(self.sep_id))
        word_of.append(len(words) - 1)
        return ids, words, word_of

    def decode(self, ids):
        specials = (self.cls_id, self.pad_id, self.sep_id, self.mask_id)
        ids = [int(i) for i in ids if int(i) not in specials]
        if self.fairseq:
            ids = [i - 1 if i != self.unk_id else 0 for i in ids]
        return self.sp.decode(ids)

# A SentencePiece model of the training texts, for a model trained from scratch on text (§4),
# cached as PREFIX-<hash>.model, the hash of vocabulary size, model type and every text: the same
# data reuses the file. SentencePiece's error (a vocabulary too large for the text) is one line.
# vocab_size is train.py's --vocab-size, and the line names the flag (sentencepiece_error).
def train_sentencepiece(texts, model_prefix_path, vocab_size=8000, model_type="unigram"):
    texts = [t for t in texts if t.strip()]
    key = "\n".join([f"{vocab_size} {model_type}", *texts]).encode("utf-8")
    prefix = f"{model_prefix_path}-{hashlib.sha1(key).hexdigest()[:12]}"
    if not os.path.exists(prefix + ".model"):
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size,
                model_type=model_type, character_coverage=0.9995, pad_id=0, unk_id=1, bos_id=2,
                eos_id=3, pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
                user_defined_symbols=["<mask>"], input_sentence_size=2_000_000,
                shuffle_input_sentence=True, minloglevel=2)
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[-1]
            raise DataError(sentencepiece_error(reason, vocab_size)) from None
    return _scratch_spm(Path(prefix + ".model").read_bytes())

# SentencePiece's reason, as one line that names --vocab-size and the value to give: a vocabulary
# larger than the texts allow ("Please set it to a value <= N."), smaller than their characters and
# the special pieces need ("smaller than required_chars. V vs N."), or another reason as it reads.
def sentencepiece_error(reason, vocab_size):
    most = re.search(r"value <= (\d+)", reason)
    least = re.search(r"required_chars\. \d+ vs (\d+)", reason)
    if most:
        return (f"--vocab-size {vocab_size}: too large for these training texts; sentencepiece "
                f"allows at most {most[1]}, so give --vocab-size {most[1]} or less")
    if least:
        return (f"--vocab-size {vocab_size}: too small for these training texts; sentencepiece "
                f"needs at least {least[1]} (their characters and the special pieces)")
    return f"--vocab-size {vocab_size}: sentencepiece training failed: {reason}"

def _scratch_spm(model_bytes):                      # trained here, with the files to rebuild it
    files = {KIND_FILE: json.dumps({"kind": "sentencepiece"}).encode(), SPM_FILE: model_bytes}
    return SentencePieceTokenizer(model_bytes, files, fairseq=False)

# A fixed vocabulary after the five specials (FIXED_IDS): [cls] first, no [sep] at the end, cut at
# max_len as LRA cuts its inputs. A subclass says how a text becomes pieces (_pieces).
class _FixedTokenizer(_Tokenizer):
    def __init__(self, kind, vocab_size):
        self._set_ids(FIXED_IDS)
        self.files = {KIND_FILE: json.dumps({"kind": kind}).encode()}
        self.vocab_size = vocab_size

    def encode_plus(self, text, pair=None, max_len=None):
        ids = [self.cls_id] + self._pieces(text)
        if pair is not None:
            ids += [self.sep_id] + self._pieces(pair)
        ids = ids[:max_len]
        return ids, [0] * len(ids)

# ListOps' 20 symbols (methods.md §4): the specials, the digits, the four operators and "]". A
# source is LRA's string with "(" and ")" dropped: "( ( ( [MAX 2 ) 9 ) ] )" -> [cls] [MAX 2 9 ].
class ListOpsTokenizer(_FixedTokenizer):
    SYMBOLS = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", *"0123456789",
               "[MIN", "[MAX", "[MED", "[SM", "]"]

    def __init__(self):
        super().__init__("listops", len(self.SYMBOLS))
        self.vocab = {s: i for i, s in enumerate(self.SYMBOLS)}

    def _pieces(self, text):
        return [self.vocab.get(t, self.unk_id) for t in text.split() if t not in ("(", ")")]

    def decode(self, ids):
        return " ".join(self.SYMBOLS[int(i)] for i in ids if int(i) > self.mask_id)

# LRA's character level, 261 ids: a byte + 5 (Text, Retrieval: tfds' ByteTextEncoder, shifted
# past our specials) or a pixel value + 5 (Image, Pathfinder: 256 grey levels, encode_values).
class ByteTokenizer(_FixedTokenizer):
    OFFSET = 5                                      # ids 0..4 are the specials

    def __init__(self):
        super().__init__("bytes", self.OFFSET + 256)

    def _pieces(self, text):
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def encode_values(self, values, max_len=None):
        return ([self.cls_id] + [int(v) + self.OFFSET for v in values])[:max_len]

    def decode(self, ids):
        raw = bytes(int(i) - self.OFFSET for i in ids if int(i) >= self.OFFSET)
        return raw.decode("utf-8", errors="replace")

# The tokenizer of {filename: bytes}: ours name their kind in KIND_FILE; an HF folder is read by
# what it holds, tokenizer.json first, with the special tokens special_tokens_map.json and
# tokenizer_config.json (which wins) name. Damaged files (plain Exceptions) are one DataError.
def tokenizer_from_files(files):
    try:
        if KIND_FILE in files:
            kind = json.loads(files[KIND_FILE].decode("utf-8")).get("kind")
            if kind == "sentencepiece":
                return _scratch_spm(files[SPM_FILE])
            return {"listops": ListOpsTokenizer, "bytes": ByteTokenizer}[kind]()
        config = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if name in files:
                config.update(json.loads(files[name].decode("utf-8")))
        if "tokenizer.json" in files:
            tok = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
            return HFTokenizer(tok, files, config)
        if "vocab.txt" in files:
            return HFTokenizer(bert_wordpiece(files, config), files, config)
        if "sentencepiece.bpe.model" in files:      # XLM-R
            return SentencePieceTokenizer(files["sentencepiece.bpe.model"], files, fairseq=True)
    except DataError:
        raise
    except Exception as e:
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        message = f"tokenizer files {sorted(files)} are damaged or of an unknown format ({why})"
        raise DataError(message) from None
    raise DataError(f"no supported tokenizer files (have {sorted(files)}; need tokenizer.json, "
                    "vocab.txt or sentencepiece.bpe.model)")

# A checkpoint stores the tokenizer's files as uint8 tensors (ckpt["tokenizer"]["files"]), which
# torch.load reads with weights_only=True: no pickled code. These two convert between the forms.
def files_to_tensors(files):
    return {name: torch.frombuffer(bytearray(b), dtype=torch.uint8) if b    # it refuses b""
            else torch.zeros(0, dtype=torch.uint8) for name, b in files.items()}

def tensors_to_files(stored):
    return {name: t.numpy().tobytes() for name, t in stored.items()}

def read_tokenizer_folder(folder):                  # {filename: bytes} of those a folder holds
    names = HF_TOKENIZER_FILES + (KIND_FILE, SPM_FILE)
    return {n: Path(folder, n).read_bytes() for n in names if Path(folder, n).is_file()}

# The tokenizer of an HF folder or of a .pt checkpoint (model.py convert, a run's ckpt_*.pt), for
# Python and the tests; train.py picks its own (the checkpoint's, the task's, or SentencePiece's).
def tokenizer_from_path(path):
    if os.path.isdir(path):
        return tokenizer_from_files(read_tokenizer_folder(path))
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such tokenizer folder or checkpoint")
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)["tokenizer"]["files"]
    except (KeyError, TypeError):
        raise DataError(f"{path}: checkpoint has no tokenizer files "
                        "(ckpt['tokenizer']['files'])") from None
    except Exception as e:                          # not a torch file, or weights_only refuses it
        raise DataError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None
    return tokenizer_from_files(tensors_to_files(stored))

# -----------------------------------------------------------------------------
# 3. Examples, each task's reader, the task table. data.py reads GLUE's nine tasks, any labelled
# TSV / CSV / JSONL file (--task tsv) and ListOps; readers/ reads LRA's other four, QA and MLM. A
# reader turns a task's files into a TaskData: training Examples, dev splits, what the model needs.
@dataclass
class Example:
    ids: list                   # token ids, special tokens included (a list, or LRA's numpy array)
    type_ids: list | None       # segment ids, or None (= all zeros)
    label: int | float          # a class index, or a float score (STS-B); QA: (start, end)

@dataclass
class PairExample:              # LRA Retrieval's: model.PairHead encodes each document on its own
    ids: list                   # the first document, [cls] + tokens
    ids2: list                  # the second document
    label: int
    type_ids: None = None

@dataclass
class TaskData:
    train: list                 # [Example]
    dev: dict                   # split -> [Example] (MNLI: dev_matched, dev_mismatched)
    num_labels: int             # 1 for regression, 0 for mlm
    is_regression: bool
    metric_name: str            # the main metric, a key of compute_metrics' dict
    label_names: list           # class index -> label string
    n_truncated: int = 0        # examples cut to max_len (the caller warns once)
    skipped: list = field(default_factory=list)  # "FILE:LINE" of rows skipped on purpose (QQP's)
    head: str = "cls"           # model.Config.head: "cls", "pair" (Retrieval) or "span" (QA)

    @property
    def n_skipped(self):
        return len(self.skipped)

# The `warning:` for rows skipped on purpose (None if none was): the count and the first few.
def skipped_warning(skipped, shown=5):
    more = f", ... ({len(skipped) - shown} more)" if len(skipped) > shown else ""
    return f"{len(skipped)} rows skipped: {', '.join(skipped[:shown])}{more}" if skipped else None

# A text (and its pair) -> (ids, type_ids), cut to max_len if it is longer; stats counts the cuts.
def _encode(tok, text, pair, max_len, stats):
    ids, type_ids = tok.encode_plus(text, pair)
    if max_len is not None and len(ids) > max_len:
        ids, type_ids = tok.encode_plus(text, pair, max_len=max_len)   # HF's longest_first
        stats["truncated"] += 1
    return ids, type_ids

# Records -> Examples. label_index maps a label string to its class; None means regression, where
# a label must be a number. An empty text or an unknown label is an error naming its line.
def _labelled_examples(records, tok, max_len, label_index, stats):
    examples = []
    for where, text, pair, label in records:
        if not text.strip() or (pair is not None and not pair.strip()):
            raise DataError(f"{where}: empty text")
        if label_index is None:
            try:
                y = float(label)
            except ValueError:
                raise DataError(f"{where}: non-numeric score {label!r}") from None
        elif label in label_index:
            y = label_index[label]
        else:
            expected = sorted(label_index)
            raise DataError(f"{where}: unknown label {label!r} (expected one of {expected})")
        examples.append(Example(*_encode(tok, text, pair, max_len, stats), y))
    return examples

# A labelled file -> (examples, label_names, n_truncated). A training file's own labels are the
# classes (label_names=None), sorted as numbers if all are integers ("2" before "10"); its dev file
# passes the training file's, so a label unseen in training is an error.
def load_generic(path, tok, *, text_col, label_col, text_pair_col=None, max_len=None,
                 label_names=None):
    records, _ = read_generic(path, (text_col, text_pair_col, label_col))
    if label_names is None:
        labels = set(r[3] for r in records)
        numeric = all(s.lstrip("-").isdigit() for s in labels)
        label_names = sorted(labels, key=int if numeric else None)
    stats = {"truncated": 0}
    index = {s: i for i, s in enumerate(label_names)}
    examples = _labelled_examples(records, tok, max_len, index, stats)
    return examples, label_names, stats["truncated"]

# GLUE's nine tasks in their official folders (§4): the (text, pair, label) columns, by header
# name or 0-based index (CoLA's files have none); the label strings in class order (None: STS-B's
# regression); the official main metric; the dev splits, DIR/<split>.tsv.
GLUE = {
    "cola": dict(cols=(3, None, 1), labels=["0", "1"], metric="mcc"),
    "sst2": dict(cols=("sentence", None, "label"), labels=["0", "1"]),
    "mrpc": dict(cols=("#1 String", "#2 String", "Quality"), labels=["0", "1"], metric="f1"),
    "stsb": dict(cols=("sentence1", "sentence2", "score"), labels=None, metric="pearson"),
    "qqp": dict(cols=("question1", "question2", "is_duplicate"), labels=["0", "1"], metric="f1"),
    "mnli": dict(cols=("sentence1", "sentence2", "gold_label"),
                 labels=["contradiction", "entailment", "neutral"],
                 dev=("dev_matched", "dev_mismatched")),
    "qnli": dict(cols=("question", "sentence", "label"), labels=["entailment", "not_entailment"]),
    "rte": dict(cols=("sentence1", "sentence2", "label"), labels=["entailment", "not_entailment"]),
    "wnli": dict(cols=("sentence1", "sentence2", "label"), labels=["0", "1"]),
}
# the defaults: one dev split named "dev", scored by accuracy
GLUE = {name: {"dev": ("dev",), "metric": "acc", **spec} for name, spec in GLUE.items()}

# The readers share one signature with those of readers/: (name, data_dir, tok, *, max_len,
# train_file, dev_file, text_col, text_pair_col, label_col) -> TaskData. GLUE's reads DIR/train.tsv
# and the dev splits, or --train-file and --dev-file; QQP's rows with missing columns are skipped.
def load_glue(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    spec = GLUE[name]
    labels = spec["labels"]
    index = {s: i for i, s in enumerate(labels)} if labels else None     # None: STS-B's scores
    paths = {"train": train_file or os.path.join(data_dir, "train.tsv")}
    if dev_file:
        paths["dev"] = dev_file
    else:
        paths.update({s: os.path.join(data_dir, s + ".tsv") for s in spec["dev"]})
    stats = {"truncated": 0}
    skipped = []
    out = {}
    for split, path in paths.items():
        records, more = read_generic(path, spec["cols"], skip_bad_rows=name == "qqp")
        out[split] = _labelled_examples(records, tok, max_len, index, stats)
        skipped += more
    train = out.pop("train")
    return TaskData(train, out, len(index or [0]), index is None, spec["metric"],
                    list(labels or []), stats["truncated"], skipped)

# --task tsv: DIR/train.* and DIR/dev.* (.tsv, .csv or .jsonl), the columns --text-col,
# --text-pair-col and --label-col name; the classes are the training file's labels. dev_file is a
# list: one file is the split "dev"; several are a split each, named by the file's stem.
def load_tsv(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    train_path = train_file or _find_split(data_dir, "train")
    train, labels, n_truncated = load_generic(train_path, tok, max_len=max_len, **columns)
    dev_paths = dev_file or [_find_split(data_dir, "dev")]
    names = [os.path.splitext(os.path.basename(p))[0] for p in dev_paths]
    if len(dev_paths) == 1:
        names = ["dev"]
    if len(set(names)) < len(names):
        raise DataError(f"--dev-file {' '.join(dev_paths)}: two files share a name; each names "
                        "its dev split")
    dev = {}
    for split, path in zip(names, dev_paths):
        dev[split], _, n = load_generic(path, tok, max_len=max_len, label_names=labels, **columns)
        n_truncated += n
    return TaskData(train, dev, len(labels), False, "acc", labels, n_truncated)

# ListOps: LRA's basic_train.tsv and basic_val.tsv (Source<TAB>Target, as section 6 writes them),
# ten classes (the digits); ListOps' own tokenizer unless one is given. The lab's files (below) have
# the same two columns: SOURCE_TARGET, (text, pair, label) as read_generic takes them.
SOURCE_TARGET = ("Source", None, "Target")

def load_listops(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    tok = tok or ListOpsTokenizer()
    stats = {"truncated": 0}
    digits = {str(d): d for d in range(10)}
    split = {}
    paths = {"train": train_file or os.path.join(data_dir, "basic_train.tsv"),
             "dev": dev_file or os.path.join(data_dir, "basic_val.tsv")}
    for which, path in paths.items():
        records, _ = read_generic(path, SOURCE_TARGET)
        split[which] = _labelled_examples(records, tok, max_len, digits, stats)
    return TaskData(split["train"], {"dev": split["dev"]}, 10, False, "acc", list(digits),
                    stats["truncated"])

# The lab's tasks (section 6b), the topology's built for blocks of `block` tokens: their
# generators' numbers (the length in tokens, [cls] included; where the evidence lies) and the sets'
# sizes and seed.
LAB = {
    # reach: a needle in a block drawn from near .. far (uniform over their tokens); with b = 8,
    # window 1 and no global token, 2 layers of block-sparse attention take [cls] to blocks 0-2
    "lab-reach": dict(kind="reach", length=64, block=8, near=1, far=7),
    # bottleneck: block j and block j + pairs hold a letter each (every token of the block);
    # label 1: each of the pairs matches; label 0: exactly one pair differs
    "lab-bottleneck": dict(kind="bottleneck", length=8 * 9, block=8, pairs=4, letters="ab"),
    # boundary: the label is the letter ("a" or "b") at token `at`, the last token of block 1,
    # known only by its position: every other token is "a" or "b" too
    "lab-boundary": dict(kind="boundary", length=64, block=8, at=15),
    # shortcut: label 1 iff `more` outnumbers `less` among the filler; token 1 gives the label away
    # in training (X for 0, Y for 1) and is X or Y at random on dev. Dense attention, no blocks.
    "lab-shortcut": dict(kind="shortcut", length=64, more="b", less="c"),
    # sum: 63 digits 0-9; label 1 iff their sum exceeds `above` (their mean sum is 283.5: never a
    # tie, the labels balanced). Every digit counts: under HST the far blocks reach [cls] through
    # the representatives; block-sparse with window 1 sees tokens 0-23 alone.
    "lab-sum": dict(kind="sum", length=64, block=8, above=283),
}
LAB_SIZES = dict(n_train=20000, n_dev=1000, seed=0)

# The lab's tasks (section 6b): DIR/train.tsv and DIR/dev.tsv (Source<TAB>Target, labels "0" and
# "1"), read as bytes. A folder without them gets them generated first (write_lab), so `mkdir DIR`
# and `python train.py --task lab-reach --data DIR` is the whole recipe.
def load_lab(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    tok = tok or ByteTokenizer()
    paths = {"train": train_file or os.path.join(data_dir, "train.tsv"),
             "dev": dev_file or os.path.join(data_dir, "dev.tsv")}
    if not any(os.path.exists(path) for path in paths.values()):
        write_lab(name, data_dir)
    stats = {"truncated": 0}
    index = {"0": 0, "1": 1}
    split = {}
    for which, path in paths.items():
        records, _ = read_generic(path, SOURCE_TARGET)
        split[which] = _labelled_examples(records, tok, max_len, index, stats)
    return TaskData(split["train"], {"dev": split["dev"]}, 2, False, "acc", list(index),
                    stats["truncated"])

# A task's entry in the table: how train.py trains it and the console shows it. The tasks readers/
# reads have no `load`: train.py picks their module (train.reader), as data.py imports none of them.
@dataclass(frozen=True)
class Task:
    load: callable = None           # its reader above, or None (readers/)
    objective: str = "classify"     # train.py's loss: classify (MSE for STS-B), pair, mlm or span
    metric: str = "acc"             # the main dev metric, which picks the best checkpoint
    max_len: int = 512              # --max-len when not given (LRA: its input lengths + [cls])
    tokenizer: type = None          # its own vocabulary; None: the checkpoint's, or SentencePiece's
    percent: tuple = ("acc", "f1")  # the metrics shown as percents, once multiplied by `scale`
    scale: float = 100.0            # 1.0 for SQuAD's exact match and F1, percents already

    @property
    def head(self):                                 # model.Config.head
        return {"pair": "pair", "span": "span"}.get(self.objective, "cls")

TASKS = {
    **{name: Task(load_glue, metric=spec["metric"]) for name, spec in GLUE.items()},
    "tsv": Task(load_tsv),                          # --text-col, --text-pair-col, --label-col
    "listops": Task(load_listops, tokenizer=ListOpsTokenizer),
    "lra-text": Task(max_len=4001, tokenizer=ByteTokenizer),            # readers/lra.py: bytes
    "lra-retrieval": Task(objective="pair", max_len=4001, tokenizer=ByteTokenizer),
    "lra-image": Task(max_len=1025, tokenizer=ByteTokenizer),           # 32 x 32 pixels + [cls]
    "lra-pathfinder": Task(max_len=1025, tokenizer=ByteTokenizer),
    "squad": Task(objective="span", metric="f1", percent=("em", "f1"), scale=1.0),  # readers/qa.py
    "mlm": Task(objective="mlm", metric="loss", percent=()),            # readers/mlm.py
    **{name: Task(load_lab, max_len=LAB[name]["length"], tokenizer=ByteTokenizer) for name in LAB},
}

def task_entry(name):
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    return TASKS[name]

# TaskData of one of data.py's tasks: its entry's reader on DIR (or on --train-file / --dev-file).
def load_task(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, text_col=None,
              text_pair_col=None, label_col=None):
    entry = task_entry(name)
    if entry.load is None:
        raise DataError(f"task {name!r} is read by a module of readers/ (train.reader picks it), "
                        "not by data.py")
    return entry.load(name, data_dir, tok, max_len=max_len, train_file=train_file,
                      dev_file=dev_file, text_col=text_col, text_pair_col=text_pair_col,
                      label_col=label_col)

def fixed_tokenizer(name):                          # ListOps' symbols, LRA's bytes, or None
    make = task_entry(name).tokenizer
    return make() if make is not None else None

# The raw training texts of a GLUE or --task tsv file, both sides of a pair: what a from-scratch
# SentencePiece model is trained on. (readers/qa.py and readers/mlm.py have their own.)
def training_texts(name, data_dir, *, train_file=None, dev_file=None, text_col=None,
                   text_pair_col=None, label_col=None):
    if name not in GLUE and name != "tsv":
        raise DataError(f"task {name!r} has no text to train a tokenizer on")
    if name in GLUE:
        cols = GLUE[name]["cols"]
        path = train_file or os.path.join(data_dir, "train.tsv")
    else:
        cols = (text_col, text_pair_col, label_col)
        path = train_file or _find_split(data_dir, "train")
    records, _ = read_generic(path, cols, name == "qqp")
    return [t for _, text, pair, _ in records for t in (text, pair) if t]

# A file to predict on (python model.py predict) -> (Examples, [(FILE:LINE, text)], has_labels,
# n_truncated), in the file's order. It is a file the task reads (.tsv, .csv, .jsonl), in its
# columns (task: the checkpoint's record, model.checkpoint_task), the label column optional; or
# plain text (any other file, a .txt), one example a line, for a task of one text. label_names:
# the model's classes (None: a regression). A record without a label gets class 0 (has_labels
# False); a file with some labels and not others is an error.
PREDICT_COLUMNS = {"listops": SOURCE_TARGET, **{name: SOURCE_TARGET for name in LAB}}

def prediction_examples(path, task, tok, label_names):
    name = task.get("name")
    if name in GLUE:
        cols = GLUE[name]["cols"]
    elif name == "tsv":
        cols = (task["text_col"], task["text_pair_col"], task["label_col"])
    else:
        cols = PREDICT_COLUMNS.get(name, (None, None, None))
    plain = os.path.splitext(path)[1].lower() not in (".tsv", ".csv", ".jsonl", ".json")
    if plain and cols[1] is not None:
        raise DataError(f"{path}: plain text holds one text a line, and task {name} reads pairs; "
                        f"give a .tsv, .csv or .jsonl file with its columns {cols[:2]}")
    if not plain and cols[0] is None:
        known = f"task {name}'s" if name else "a model without a task (converted)"
        raise DataError(f"{path}: {known} files are not read here; give plain text (a .txt), one "
                        "example a line")
    if plain:
        lines = read_text(path).splitlines()
        records = [(f"{path}:{n}", t, None, None) for n, t in enumerate(lines, 1) if t.strip()]
        if not records:
            raise DataError(f"{path}:1: empty file")
    else:
        records, _ = read_generic(path, cols, label_optional=True)
    unlabelled = [where for where, _, _, label in records if label is None]
    if unlabelled and len(unlabelled) < len(records):
        raise DataError(f"{unlabelled[0]}: no label, where other lines have one")
    index = None if label_names is None else {s: i for i, s in enumerate(label_names)}
    if unlabelled:
        records = [(where, text, pair, "0" if index is None else label_names[0])
                   for where, text, pair, _ in records]
    stats = {"truncated": 0}
    examples = _labelled_examples(records, tok, task.get("max_len"), index, stats)
    texts = [(where, text if pair is None else f"{text} | {pair}")
             for where, text, pair, _ in records]
    return examples, texts, not unlabelled, stats["truncated"]

# -----------------------------------------------------------------------------
# 4. Batches: Examples -> padded tensors (methods.md §4). A batch is padded to its own longest
# example, and examples of similar length share a batch. The order is a function of (seed, epoch)
# alone, so a resumed run takes exactly the batches the stopped run would have; the model pads
# further, to a multiple of the attention's block size.
def autocast(device):                               # bf16 on CUDA, fp32 on the CPU
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

# The batch of a list of Examples: input_ids, attention_mask (1 = a real token), token_type_ids,
# each [B, L] with L the longest example rounded up to multiple_of; labels [B], floats for a
# regression. PairExamples: both documents of every pair padded to one L, [B, 2, L].
def collate(examples, pad_id, multiple_of=1):
    if isinstance(examples[0], PairExample):
        # pair i becomes rows 2i and 2i + 1 of one flat batch, then each tensor is folded back
        docs = [Example(d, None, e.label) for e in examples for d in (e.ids, e.ids2)]
        flat = collate(docs, pad_id, multiple_of)
        batch = {k: v.view(len(examples), 2, -1) for k, v in flat.items() if k != "labels"}
        batch["labels"] = flat["labels"][::2]       # [B]
        return batch
    B = len(examples)
    L = -(-max(len(e.ids) for e in examples) // multiple_of) * multiple_of  # longest, rounded up
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((B, L), dtype=torch.long)    # [B, L]
    token_type_ids = torch.zeros((B, L), dtype=torch.long)    # [B, L]
    for i, e in enumerate(examples):
        n = len(e.ids)
        input_ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)   # a list, or LRA's numpy array
        attention_mask[i, :n] = 1
        token_type_ids[i, :n] = torch.tensor(e.type_ids or [0] * n, dtype=torch.long)
    regression = any(isinstance(e.label, float) for e in examples)    # STS-B's scores
    label_type = torch.float if regression else torch.long
    labels = torch.tensor([e.label for e in examples], dtype=label_type)      # [B]
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "token_type_ids": token_type_ids, "labels": labels}

# LRA Retrieval's [B, 2, L] -> [2B, L], pair i in rows 2i and 2i + 1 (model.PairHead re-pairs).
def flatten_pairs(batch):
    return {k: v.flatten(0, 1) if k != "labels" else v for k, v in batch.items()}

# An epoch's batches as lists of example indices: the examples shuffled, sorted by length within
# chunks of bucket_batches batches, cut into batches, the batches shuffled. shuffle=False gives the
# examples in order, as evaluation wants them.
def batch_plan(lengths, batch_size, *, seed, epoch, shuffle=True, bucket_batches=50):
    order = list(range(len(lengths)))
    if shuffle:
        rng = np.random.default_rng([seed, epoch])
        order = [int(i) for i in rng.permutation(len(lengths))]
        chunk = batch_size * bucket_batches
        buckets = [sorted(order[s:s + chunk], key=lambda j: lengths[j])
                   for s in range(0, len(order), chunk)]
        order = [i for bucket in buckets for i in bucket]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    if not shuffle:
        return batches
    return [batches[int(i)] for i in rng.permutation(len(batches))]

# Evaluation's order: little padding, and a batch too large for the device fails at once. Safe: an
# output does not depend on the padding beside it.
def longest_first(examples):
    return sorted(examples, key=lambda e: len(e.ids), reverse=True)

# Every batch of batch_plan, padded: for dev sets and tests (the loop pads one batch at a time).
def make_batches(examples, batch_size, *, pad_id, seed, epoch, shuffle=True, multiple_of=1,
                 bucket_batches=50):
    plan = batch_plan([len(e.ids) for e in examples], batch_size, seed=seed, epoch=epoch,
                      shuffle=shuffle, bucket_batches=bucket_batches)
    return [collate([examples[i] for i in b], pad_id, multiple_of) for b in plan]

# -----------------------------------------------------------------------------
# 5. Metrics: GLUE's official metrics, by hand in numpy (methods.md §4), each its formula
# (tests/test_data.py checks examples worked by hand); an undefined correlation is 0, as sklearn's.
def accuracy(preds, labels):
    return float(np.mean(np.asarray(preds) == np.asarray(labels)))

# F1 = 2 tp / (2 tp + fp + fn) of the class 1; 0 when nothing is positive in either.
def f1_binary(preds, labels):
    p = np.asarray(preds) == 1
    y = np.asarray(labels) == 1
    tp = np.sum(p & y)
    fp = np.sum(p & ~y)
    fn = np.sum(~p & y)
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn > 0 else 0.0

# Matthews correlation of the K x K confusion matrix C[true, predicted]: with t and p the true and
# predicted counts per class, c the hits and s the total,
#   MCC = (c s - t.p) / sqrt((s² - p.p) (s² - t.t)),
# which for K = 2 is the familiar (tp tn - fp fn) / sqrt((tp + fp)(tp + fn)(tn + fp)(tn + fn)).
def matthews_corrcoef(preds, labels):
    preds = np.asarray(preds, dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    k = int(max(preds.max(initial=0), labels.max(initial=0))) + 1
    C = np.zeros((k, k), dtype=np.float64)
    np.add.at(C, (labels, preds), 1)                # C[true, predicted] += 1
    t = C.sum(1)                                    # [K] how often each class is true
    p = C.sum(0)                                    # [K] how often each is predicted
    c = np.trace(C)                                 # the hits
    s = C.sum()                                     # every example
    denom = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - t @ p) / denom) if denom > 0 else 0.0

# Pearson's r = sum dx dy / sqrt(sum dx² sum dy²), dx and dy the deviations from the means.
def pearson(x, y):
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    dx = x - x.mean()
    dy = y - y.mean()
    denom = np.sqrt(np.sum(dx * dx) * np.sum(dy * dy))
    return float(np.sum(dx * dy) / denom) if denom > 0 else 0.0

# Ranks 1..n, ties sharing the mean of their ranks: [10, 20, 20, 30] -> [1, 2.5, 2.5, 4].
def average_ranks(x):
    _, inverse, counts = np.unique(np.asarray(x), return_inverse=True, return_counts=True)
    last = np.cumsum(counts)                        # each distinct value's last rank
    first = last - counts + 1                       # ... and its first
    return ((first + last) / 2.0)[inverse.reshape(-1)]

def spearman(x, y):                                 # Spearman's rho: Pearson's r of the ranks
    return pearson(average_ranks(x), average_ranks(y))

# A task's official metrics, its main one among them. preds: class ids or logits [N, K] (argmax
# taken); STS-B: scores [N] or [N, 1]. QA and masked LM have their own evaluation (readers/).
def compute_metrics(task_name, preds, labels):
    entry = task_entry(task_name)
    if entry.objective not in ("classify", "pair"):
        raise DataError(f"task {task_name!r} is scored by its own evaluation, not compute_metrics")
    preds = np.asarray(preds)
    labels = np.asarray(labels)
    if entry.metric == "pearson":                   # STS-B: "corr" is the mean of the two
        pr = pearson(preds.reshape(-1), labels)
        sr = spearman(preds.reshape(-1), labels)
        return {"pearson": pr, "spearman": sr, "corr": (pr + sr) / 2}
    if preds.ndim == 2:
        preds = preds.argmax(-1)
    if entry.metric == "mcc":                       # CoLA
        return {"mcc": matthews_corrcoef(preds, labels), "acc": accuracy(preds, labels)}
    if entry.metric == "f1":                        # MRPC, QQP
        return {"f1": f1_binary(preds, labels), "acc": accuracy(preds, labels)}
    return {"acc": accuracy(preds, labels)}

# A metric on the console: "83.4%" for the task's percent metrics (Task.percent), a count as
# it is, any other number as "0.5120"; after a bar, --eval-shift's mean and worst.
def show_value(task_name, metric, value):
    entry = TASKS[task_name]
    if metric in entry.percent:
        return f"{value * entry.scale:.1f}%"
    return f"{value}" if isinstance(value, int) else f"{value:.4f}"

def show_metrics(task_name, metrics):                    # "acc 83.4% | shifted mean ... worst ..."
    text = ", ".join(f"{m} {show_value(task_name, m, v)}" for m, v in metrics.items()
                     if m != "shift")
    if "shift" in metrics:
        mean = show_metrics(task_name, metrics["shift"]["mean"])
        worst = show_metrics(task_name, metrics["shift"]["worst"])
        text += f" | shifted mean {mean} worst {worst}"
    return text

# -----------------------------------------------------------------------------
# 6. The ListOps generator (methods.md §4; LRA's lra_benchmarks/data/listops.py). An expression is
# a tree of operators over the digits 0-9: [MIN, [MAX, [MED (median) and [SM (sum modulo 10), each
# closed by "]"; its label is its value. A node is an operator with probability 0.25 (a leaf at the
# maximum depth) of 2 to max_args arguments. Its length counts what the model reads: 1 per value, 2
# per operator (it and its "]"); LRA's parentheses, which the tokenizer drops, do not count.
LISTOPS_OPS = ("[MIN", "[MAX", "[MED", "[SM")
LISTOPS_VALUE_P = 0.25          # LRA: a node is an operator when random() <= 0.25, else a leaf

def _apply_op(op, values):
    if op == "[MED":
        return int(np.median(values))       # an even count: int() of the mean of the middle two
    if op == "[SM":
        return sum(values) % 10
    return min(values) if op == "[MIN" else max(values)

def _render(op, args):                              # LRA's: [MAX 2 9] -> "( ( ( [MAX 2 ) 9 ) ] )"
    return "( " * (len(args) + 1) + op + "".join(" " + a + " )" for a in args) + " ] )"

# One random expression as (source, length, value), or None once its length would pass `budget`:
# that skips only the rest of a tree that would be discarded anyway (LRA's distribution, faster).
def listops_tree(rng, depth, max_depth, max_args, budget=float("inf")):
    if depth >= max_depth or rng.random() > LISTOPS_VALUE_P:      # a leaf
        v = rng.randrange(10)
        return str(v), 1, v
    args = []
    values = []
    length = 2                                      # the operator and its "]"
    for _ in range(rng.randint(2, max_args)):
        sub = listops_tree(rng, depth + 1, max_depth, max_args, budget - length)
        if sub is None or length + sub[1] > budget:
            return None
        args.append(sub[0])
        values.append(sub[2])
        length += sub[1]
    op = rng.choice(LISTOPS_OPS)                    # LRA draws it after its arguments
    return _render(op, args), length, _apply_op(op, values)

# n distinct (source, label) with min_len < length < max_len (LRA's exclusive bounds), drawn from
# the root at depth 1. No new tree in max_misses draws in a row (the range is exhausted, or has no
# possible length) is an error, not an endless loop.
def generate_listops(n, min_len, max_len, seed, max_depth=10, max_args=10, progress=False,
                     max_misses=1_000_000):
    if max_args < 2 or max_depth < 1:
        raise DataError(f"ListOps needs max_args >= 2 and max_depth >= 1 (got {max_args}, "
                        f"{max_depth})")
    rng = random.Random(seed)
    seen = set()                                    # LRA keeps a set: no duplicates
    out = []
    misses = 0
    with tqdm(total=n, desc="listops", disable=not progress) as bar:
        while len(out) < n:
            tree = listops_tree(rng, 1, max_depth, max_args, budget=max_len - 1)
            if tree is not None and tree[1] > min_len and tree[0] not in seen:
                seen.add(tree[0])
                out.append((tree[0], int(tree[2])))
                bar.update(1)
                misses = 0
                continue
            misses += 1
            if misses >= max_misses:
                raise DataError(f"ListOps: no new sample with {min_len} < length < {max_len} "
                                f"in {max_misses} draws after {len(out)} samples; widen the "
                                "range or lower the counts")
    return out

# OUT/basic_{train,val,test}.tsv, header Source<TAB>Target (LRA's layout); returns the paths.
def write_listops(out_dir, n_train=96000, n_val=2000, n_test=2000, min_len=500, max_len=2000,
                  seed=0, max_depth=10, max_args=10, progress=False):
    rows = generate_listops(n_train + n_val + n_test, min_len, max_len, seed, max_depth, max_args,
                            progress)
    splits = {"train": rows[:n_train], "val": rows[n_train:n_train + n_val],
              "test": rows[n_train + n_val:]}
    os.makedirs(out_dir, exist_ok=True)
    paths = {split: os.path.join(out_dir, f"basic_{split}.tsv") for split in splits}
    for split, part in splits.items():
        with open(paths[split], "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerows([["Source", "Target"], *part])
    return paths

# -----------------------------------------------------------------------------
# 6b. The lab's generators (docs/results.md, "The lab"): five tasks, each with one path of
# information that a method has or lacks. A sequence is [cls] + letters, one byte a token, so the
# letter at text index i is token i + 1; blocks are counted in tokens, [cls] in block 0. The label,
# "0" or "1", is balanced. Every task's numbers (its length, the model's block size b that it is
# built for, the evidence's place) are its entry of LAB (section 3); its kind's entry of LAB_KINDS
# holds the generator, the label rule and the evidence together.
LAB_FILLER = "abcd"             # the letters that carry nothing
LAB_NEEDLES = "XY"              # reach: the marked letter; X means label 0, Y label 1

# reach: the filler, then the needle at a token of blocks near .. far; returns (text, label).
def lab_reach(rng, length, block, near, far, **unused):
    letters = [rng.choice(LAB_FILLER) for _ in range(length - 1)]
    label = rng.randrange(2)
    token = rng.randrange(max(1, near * block), (far + 1) * block)
    letters[token - 1] = LAB_NEEDLES[label]
    return "".join(letters), label

# The needle decides a reach text: label 1 iff it is Y; its token (text index + 1).
def reach_label(text, **spec):
    return int(text[reach_evidence(text) - 1] == LAB_NEEDLES[1])

def reach_evidence(text, **spec):
    return 1 + next(i for i, c in enumerate(text) if c in LAB_NEEDLES)

# bottleneck: block 0 is [cls] and filler; blocks 1 .. 2 pairs hold one letter each, block j's
# letter equal to block j + pairs' in every pair (label 1) or in all pairs but one (label 0).
def lab_bottleneck(rng, length, block, pairs, letters, **unused):
    first = [rng.choice(letters) for _ in range(pairs)]
    second = list(first)
    label = rng.randrange(2)
    if label == 0:
        j = rng.randrange(pairs)
        second[j] = rng.choice([c for c in letters if c != first[j]])
    letters = [rng.choice(LAB_FILLER) for _ in range(block - 1)]
    for c in first + second:
        letters += [c] * block
    letters += [rng.choice(LAB_FILLER) for _ in range(length - 1 - len(letters))]
    return "".join(letters), label

# Label 1 iff every block j (1 .. pairs) holds the same letters as block j + pairs: many tokens
# decide together, no single one.
def bottleneck_label(text, block, pairs, **spec):
    blocks = [text[j * block - 1:(j + 1) * block - 1] for j in range(1, 2 * pairs + 1)]
    return int(all(blocks[j] == blocks[j + pairs] for j in range(pairs)))

# boundary: "a" and "b" at random; the label is 1 iff the letter at token `at` is "b".
def lab_boundary(rng, length, at, **unused):
    letters = [rng.choice("ab") for _ in range(length - 1)]
    return "".join(letters), int(letters[at - 1] == "b")

def boundary_label(text, at, **spec):
    return int(text[at - 1] == "b")

def boundary_evidence(text, at, **spec):
    return at

# shortcut: the filler (token 2 on) with `more` and `less` never equally often, label 1 iff `more`
# is the commoner; drawn for a label, then `more` and `less` swapped where the count says the other
# (the swap maps the filler's distribution onto itself). Token 1 is the shortcut: in training the
# needle of the label (X for 0, Y for 1), on dev X or Y at random, whatever the label.
def lab_shortcut(rng, length, more, less, train, **unused):
    label = rng.randrange(2)
    letters = [more, less]
    while letters.count(more) == letters.count(less):
        letters = [rng.choice(LAB_FILLER) for _ in range(length - 2)]
    if int(letters.count(more) > letters.count(less)) != label:
        swap = {more: less, less: more}
        letters = [swap.get(c, c) for c in letters]
    first = LAB_NEEDLES[label] if train else rng.choice(LAB_NEEDLES)
    return first + "".join(letters), label

# The count decides a shortcut text, read over the whole text (the shortcut X or Y is neither
# letter counted): label 1 iff `more` occurs more often than `less`. No single token decides.
def shortcut_label(text, more, less, **spec):
    return int(text.count(more) > text.count(less))

# sum: digits drawn uniformly, label 1 iff their sum exceeds `above` (a text of digits, not
# letters).
def lab_sum(rng, length, above, **unused):
    digits = [rng.randrange(10) for _ in range(length - 1)]
    return "".join(str(d) for d in digits), int(sum(digits) > above)

# Every digit decides a sum text together: label 1 iff the digits add up to more than `above`.
def sum_label(text, above, **spec):
    return int(sum(int(c) for c in text) > above)

# One lab kind: its generator ((rng, train, **spec) -> (text, label); `train` False for a dev
# example), its label rule ((text, **spec) -> 0 or 1, read off the text) and its evidence ((text,
# **spec) -> the token that decides the label), None where no single token decides.
@dataclass(frozen=True)
class LabKind:
    generate: callable
    label: callable
    evidence: callable = None

LAB_KINDS = {
    "reach": LabKind(lab_reach, reach_label, reach_evidence),
    "bottleneck": LabKind(lab_bottleneck, bottleneck_label),
    "boundary": LabKind(lab_boundary, boundary_label, boundary_evidence),
    "shortcut": LabKind(lab_shortcut, shortcut_label),
    "sum": LabKind(lab_sum, sum_label),
}

# A lab task's (kind, its LAB entry); an unknown task or kind is an error naming the known ones.
def lab_kind(name):
    if name not in LAB:
        raise DataError(f"unknown lab task {name!r}; known: {', '.join(LAB)}")
    spec = LAB[name]
    if spec["kind"] not in LAB_KINDS:
        known = ", ".join(LAB_KINDS)
        raise DataError(f"{name}: unknown lab kind {spec['kind']!r}; known: {known}")
    return LAB_KINDS[spec["kind"]], spec

# n (text, label) of a lab task, the same for the same seed; the first n_train are training
# examples (all of them if None), the rest dev examples (only the shortcut's differ).
def generate_lab(name, n, seed, n_train=None):
    kind, spec = lab_kind(name)
    rng = random.Random(f"{name}-{seed}")
    n_train = n if n_train is None else n_train
    return [kind.generate(rng, train=i < n_train, **spec) for i in range(n)]

# A text's label by its task's rule, read off the text (apart from the generators, which build a
# text for a label).
def lab_label(name, text):
    kind, spec = lab_kind(name)
    return kind.label(text, **spec)

# The token that decides a text's label (reach, boundary); an error for a kind where no single
# token decides (bottleneck, shortcut, sum): such a task has no receptive-field bound.
def lab_evidence(name, text):
    kind, spec = lab_kind(name)
    if kind.evidence is None:
        raise DataError(f"{name}: no single token decides a {spec['kind']} text, so it has no "
                        f"evidence token (and no receptive-field bound)")
    return kind.evidence(text, **spec)

# OUT/train.tsv and OUT/dev.tsv (header Source<TAB>Target), each written whole or not at all, and
# OUT/spec.json, the numbers that made them; returns the two paths.
def write_lab(name, out_dir, n_train=None, n_dev=None, seed=None):
    n_train = LAB_SIZES["n_train"] if n_train is None else n_train
    n_dev = LAB_SIZES["n_dev"] if n_dev is None else n_dev
    seed = LAB_SIZES["seed"] if seed is None else seed
    rows = generate_lab(name, n_train + n_dev, seed, n_train)
    splits = {"train": rows[:n_train], "dev": rows[n_train:]}
    os.makedirs(out_dir, exist_ok=True)
    spec = {"task": name, **LAB[name], "n_train": n_train, "n_dev": n_dev, "seed": seed}
    with open(os.path.join(out_dir, "spec.json"), "w") as f:
        json.dump(spec, f)                          # what made the folder (research/ checks it)
    paths = {split: os.path.join(out_dir, f"{split}.tsv") for split in splits}
    for split, part in splits.items():
        with open(paths[split] + ".tmp", "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerows([["Source", "Target"], *part])
        os.replace(paths[split] + ".tmp", paths[split])
    return paths

# -----------------------------------------------------------------------------
# 7. Plumbing: a bad flag, file or checkpoint ends a run with one line that names it, not a
# traceback. Readers raise DataError("FILE:LINE: what is wrong"); every entry point runs inside
# one_line_errors, which prints `error: MESSAGE` and exits 2.
class DataError(ValueError):
    """A problem with the user's files or flags; the message names the file (FILE:LINE) or flag."""

def fail(msg, code=2):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)

def warn(msg):                                      # once, not once per torchrun process
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        tqdm.write(f"warning: {msg}", file=sys.stderr)

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):                       # an unknown flag, a bad value: one line too
        fail(f"{message} (see {self.prog} --help)")

# What user input can raise becomes one `error:` line: a DataError, bad JSON, a missing file (its
# name and reason), a config lacking a field, a damaged safetensors file. Ctrl-C exits 130.
@contextmanager
def one_line_errors(interrupted="interrupted"):
    try:
        yield
    except KeyboardInterrupt:
        fail(interrupted, code=130)
    except (ValueError, OSError, KeyError, SafetensorError) as e:
        if isinstance(e, OSError):                  # no such file, disk full, ...
            reason = e.strerror or e
            fail(f"{e.filename}: {reason}" if e.filename else f"{reason}")
        if isinstance(e, KeyError):
            fail(f"missing field {e.args[0]!r} (a config or checkpoint from elsewhere?)")
        text = str(e).strip()
        fail(text.splitlines()[0] if text else type(e).__name__)

# One run at a time writes a --out folder: train.py takes this lock before it touches --out and
# holds it for the run's life. flock dies with its process (SIGKILL leaves OUT/.lock, naming the
# last holder's pid). Runs in one process follow one another (tests call train.main many times; an
# old run's handle may live on in a traceback), so a new lock first lets go of the earlier one.
_LOCKS = weakref.WeakValueDictionary()              # OUT/.lock -> this process's open file

def lock_out(folder):
    path = os.path.realpath(os.path.join(folder, ".lock"))
    earlier = _LOCKS.pop(path, None)
    if earlier is not None:
        earlier.close()
    f = open(path, "a+")                            # a+: not emptied before the lock is ours
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise DataError(f"--out {folder}: another run is using it (pid {pid}); wait for it or "
                        "choose another --out") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    _LOCKS[path] = f
    return f

# python data.py listops OUT_DIR [--train N ...]: counts are checked before minutes of generating.
def main(argv=None):
    parser = ArgumentParser(description="attnreg data tools")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("listops", help="generate LRA ListOps basic_{train,val,test}.tsv")
    p.add_argument("out_dir")
    defaults = {"train": 96000, "val": 2000, "test": 2000, "min-len": 500, "max-len": 2000,
                "seed": 0, "max-depth": 10, "max-args": 10}
    for flag, default in defaults.items():
        p.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args(argv)
    if min(args.train, args.val, args.test, args.min_len, args.max_len) < 0:
        parser.error("--train, --val, --test, --min-len and --max-len must be >= 0")
    if args.train + args.val + args.test == 0:
        parser.error("--train, --val and --test are all 0: nothing to generate")
    with one_line_errors():
        paths = write_listops(args.out_dir, args.train, args.val, args.test, args.min_len,
                              args.max_len, args.seed, args.max_depth, args.max_args, progress=True)
        print(" ".join(paths.values()))

if __name__ == "__main__":
    main()
