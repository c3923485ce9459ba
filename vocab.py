"""vocab.py: the tokenizers (text -> token ids) that data.py's readers call.

What it is: the plumbing a student can skip on a first read of data.py. Every tokenizer has the same small
interface (encode, encode_plus, decode, the special ids, vocab_size, and `files` to rebuild it from a
checkpoint):
  - a pretrained checkpoint's own tokenizer (byte-level BPE for RoBERTa, WordPiece for BERT, SentencePiece for
    XLM-R), read from its files, so ids equal the HF tokenizer's (methods.md §4);
  - a from-scratch SentencePiece model trained on the training text (cached beside the data);
  - fixed vocabularies: ListOps' symbols, and bytes (LRA Text / Retrieval) or pixel intensities (LRA Image /
    Pathfinder) as 256 ids after the specials.
DataError lives here, the lowest module; data.py re-exports it (data.DataError is the same class).

Run:  python data.py tokenize PATH_TO_HF_FOLDER_OR_PT "first sentence" ["second sentence"]
"""

import hashlib
import json
import os

import sentencepiece as spm
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors


class DataError(ValueError):
    """A problem with the user's data or files; the CLI prints the one-line message, no traceback."""

# ----------------------------------------------------------------------------------------------------------
# 1. Tokenizers
#
# Every tokenizer class has the same small interface:
#   encode(text, pair=None) -> ids                     (special tokens included)
#   encode_plus(text, pair=None, max_len=None) -> (ids, type_ids)   (truncated to max_len if given)
#   decode(ids) -> str                                  (special tokens skipped)
#   pad_id, mask_id, cls_id, sep_id, unk_id, vocab_size
#   files: {filename: bytes}, everything needed to rebuild it (embedded in checkpoints, see model.py)
# ----------------------------------------------------------------------------------------------------------

# the files of an HF tokenizer folder that we read (and embed in converted checkpoints)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                      "merges.txt", "vocab.txt", "sentencepiece.bpe.model", "spiece.model")
KIND_FILE = "attnreg_tokenizer.json"  # marker for our own tokenizers: {"kind": "sentencepiece" | "listops"}
SPM_FILE = "attnreg_spm.model"        # the from-scratch SentencePiece model inside `files`

# candidate token strings per role, RoBERTa/XLM-R spelling first, then BERT's
SPECIAL_TOKENS = {"pad": ("<pad>", "[PAD]"), "unk": ("<unk>", "[UNK]"), "cls": ("<s>", "[CLS]"),
                  "sep": ("</s>", "[SEP]"), "mask": ("<mask>", "[MASK]")}


def _config_token(config, role):
    """The token string tokenizer_config.json / special_tokens_map.json give for a role, or None."""
    value = config.get(f"{role}_token")
    if isinstance(value, dict):  # {"content": "<mask>", "lstrip": true, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_ids(token_to_id, config):
    """Resolve {role: id} from the token strings (config's names first, then the usual spellings)."""
    ids = {}
    for role, defaults in SPECIAL_TOKENS.items():
        names = [_config_token(config, role)] + list(defaults)
        found = [token_to_id(name) for name in names if name is not None]
        ids[role] = next((i for i in found if i is not None), None)
    for role in ("pad", "cls", "sep"):
        if ids[role] is None:
            raise DataError(f"tokenizer has no {role} token (looked for {SPECIAL_TOKENS[role]})")
    return ids


def _longest_first(a, b, budget):
    """Truncate two token lists to len(a) + len(b) <= budget, removing from the longer one (HF longest_first)."""
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        if len(a) >= len(b):
            a.pop()
        else:
            b.pop()
    return a, b


class HFTokenizer:
    """A `tokenizers.Tokenizer`: read from tokenizer.json, or built from vocab.json+merges.txt / vocab.txt.

    The post-processor adds the special tokens and type ids (RoBERTa `<s> A </s></s> B </s>`, all type 0;
    BERT `[CLS] A [SEP] B [SEP]`, types 0..0 1..1), exactly as the checkpoint's own fast tokenizer does.
    """

    def __init__(self, tok, files, config):
        tok.no_truncation()
        tok.no_padding()
        self.tok, self.files = tok, files
        ids = _special_ids(tok.token_to_id, config)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            ids["pad"], ids["unk"], ids["cls"], ids["sep"], ids["mask"])
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        self._truncating = {}  # max_len -> a copy of tok with HF's longest_first truncation

    def encode_plus(self, text, pair=None, max_len=None):
        tok = self.tok if max_len is None else self._truncating_at(max_len)
        enc = tok.encode(text, pair)           # truncation leaves an input within max_len as it is
        return list(enc.ids), list(enc.type_ids)

    def _truncating_at(self, max_len):
        if max_len not in self._truncating:
            t = Tokenizer.from_str(self.tok.to_str())
            t.enable_truncation(max_len, strategy="longest_first")
            self._truncating[max_len] = t
        return self._truncating[max_len]

    def encode(self, text, pair=None):
        return self.encode_plus(text, pair)[0]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _add_specials(tok, vocab, config, lstrip_mask=False):
    """Register the special tokens that exist in the vocabulary, so "<s>" / "[MASK]" in text stay whole."""
    added = config.get("added_tokens_decoder", {})  # HF: {id: {"content", "lstrip", ...}}
    lstrip = {v.get("content"): bool(v.get("lstrip")) for v in added.values() if isinstance(v, dict)}
    names = []
    for role, defaults in SPECIAL_TOKENS.items():
        names += [n for n in [_config_token(config, role), *defaults] if n is not None and n in vocab]
    seen = []
    for n in names:
        if n not in seen:
            seen.append(n)
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False,
                                       lstrip=lstrip.get(n, lstrip_mask and n == "<mask>")) for n in seen])


def build_roberta_bpe(files, config):
    """RoBERTa's byte-level BPE from vocab.json + merges.txt (GPT-2 byte-to-unicode alphabet, no unk)."""
    vocab = json.loads(files["vocab.json"].decode("utf-8"))
    merges = []
    for line in files["merges.txt"].decode("utf-8").split("\n"):
        line = line.rstrip("\r")
        if not line or line.startswith("#version"):
            continue
        a, b = line.split(" ")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    add_prefix_space = bool(config.get("add_prefix_space", False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    _add_specials(tok, vocab, config)
    ids = _special_ids(tok.token_to_id, config)
    cls, sep = tok.id_to_token(ids["cls"]), tok.id_to_token(ids["sep"])
    # <s> A </s>  and  <s> A </s> </s> B </s>, type ids all 0
    tok.post_processor = processors.RobertaProcessing((sep, ids["sep"]), (cls, ids["cls"]),
                                                      trim_offsets=bool(config.get("trim_offsets", True)),
                                                      add_prefix_space=add_prefix_space)
    return tok


def build_bert_wordpiece(files, config):
    """BERT's WordPiece from vocab.txt (one token a line, id = line number), BertNormalizer + pre-tokenizer."""
    lines = files["vocab.txt"].decode("utf-8").replace("\r\n", "\n").split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    vocab = {}
    for i, token in enumerate(lines):
        vocab[token] = i
    unk = next((n for n in (_config_token(config, "unk"), "[UNK]", "<unk>") if n in vocab), "[UNK]")
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=bool(config.get("tokenize_chinese_chars", True)),
        strip_accents=config.get("strip_accents"), lowercase=bool(config.get("do_lower_case", True)))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    _add_specials(tok, vocab, config)
    ids = _special_ids(tok.token_to_id, config)
    cls, sep = tok.id_to_token(ids["cls"]), tok.id_to_token(ids["sep"])
    # [CLS] A [SEP]  and  [CLS] A [SEP] B [SEP] with type ids 0 .. 0 1 .. 1
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, ids["cls"]), (sep, ids["sep"])])
    return tok


class SentencePieceTokenizer:
    """A SentencePiece model, in one of two id layouts.

    fairseq=True (XLM-R's sentencepiece.bpe.model, as transformers' XLMRobertaTokenizer maps it):
      <s>=0 <pad>=1 </s>=2 <unk>=3; spm piece p (p >= 3) -> p + 1; spm 0 '<unk>' -> 3; <mask> = len(spm) + 1.
      Pairs: <s> A </s> </s> B </s>, type ids all 0.
    fairseq=False (our from-scratch model, see train_sentencepiece): ids are the spm ids,
      pad=0 unk=1 cls(<s>)=2 sep(</s>)=3 mask=4. Pairs: <s> A </s> B </s>, type ids all 0 (RoBERTa style).
    A literal "<mask>" in text is not recognised in the fairseq layout (the HF tokenizer.json path does).
    """

    def __init__(self, model_bytes, files, fairseq):
        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.files, self.fairseq = files, fairseq
        n = self.sp.get_piece_size()
        if fairseq:
            self.cls_id, self.pad_id, self.sep_id, self.unk_id, self.mask_id = 0, 1, 2, 3, n + 1
            self.vocab_size = n + 2
        else:
            ids = _special_ids(self._piece_id, {})
            self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
                ids["pad"], ids["unk"], ids["cls"], ids["sep"], ids["mask"])
            self.vocab_size = n

    def _piece_id(self, piece):
        i = self.sp.piece_to_id(piece)  # spm answers unk_id for an unknown piece
        return i if self.sp.id_to_piece(i) == piece else None

    def _pieces(self, text):
        ids = self.sp.encode(text)
        if self.fairseq:
            return [p + 1 if p else self.unk_id for p in ids]  # fairseq offset 1, spm <unk> (0) -> 3
        return ids

    def encode_plus(self, text, pair=None, max_len=None):
        a = self._pieces(text)
        b = self._pieces(pair) if pair is not None else None
        n_special = 2 if b is None else (4 if self.fairseq else 3)
        if max_len is not None:
            a, b = _longest_first(a, b or [], max_len - n_special)
            b = b if pair is not None else None
        ids = [self.cls_id] + a + [self.sep_id]
        if b is not None:
            ids += ([self.sep_id] if self.fairseq else []) + b + [self.sep_id]
        return ids, [0] * len(ids)

    def encode(self, text, pair=None):
        return self.encode_plus(text, pair)[0]

    def decode(self, ids):
        special = {self.cls_id, self.pad_id, self.sep_id, self.mask_id}
        ids = [int(i) for i in ids if int(i) not in special]
        if self.fairseq:
            ids = [i - 1 if i != self.unk_id else 0 for i in ids]
        return self.sp.decode(ids)


def train_sentencepiece(texts, model_prefix_path, vocab_size=8000, model_type="unigram"):
    """Train (or reuse) a from-scratch SentencePiece model on the training texts (methods.md §4, from scratch).

    Writes MODEL_PREFIX_PATH-<key>.model beside the data, where <key> is a hash of the vocab size, the model
    type and every training text: the same data reuses the model, changed data trains a new one.
    Fixed ids: pad=0, unk=1, cls=<s>=2, sep=</s>=3, mask=<mask>=4 (a user-defined symbol).
    """
    texts = [t for t in texts if t.strip()]
    key = hashlib.sha1(f"{vocab_size} {model_type}".encode())
    for t in texts:
        key.update(t.encode("utf-8") + b"\n")
    model_prefix_path = f"{model_prefix_path}-{key.hexdigest()[:12]}"
    path = model_prefix_path + ".model"
    if os.path.exists(path):
        with open(path, "rb") as f:
            return _scratch_spm(f.read())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=model_prefix_path,
            vocab_size=vocab_size, model_type=model_type, character_coverage=0.9995,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="<pad>", unk_piece="<unk>",
            bos_piece="<s>", eos_piece="</s>", user_defined_symbols=["<mask>"],
            input_sentence_size=2_000_000, shuffle_input_sentence=True, minloglevel=2)
    except RuntimeError as e:  # e.g. "Vocabulary size too high (8000). Please set it to a value <= 1234."
        raise DataError(f"sentencepiece training failed: {str(e).splitlines()[-1]}") from None
    with open(path, "rb") as f:
        return _scratch_spm(f.read())


def _scratch_spm(model_bytes):
    files = {KIND_FILE: json.dumps({"kind": "sentencepiece"}).encode(), SPM_FILE: model_bytes}
    return SentencePieceTokenizer(model_bytes, files, fairseq=False)


class ListOpsTokenizer:
    """Fixed ListOps vocabulary (methods.md §4): specials, the 10 digits, the 4 operators and ']'.

    Input = whitespace tokens of LRA's Source string with "(" and ")" dropped, [cls] prepended (the first
    token is the global / classifier token). No [sep] is appended. (LRA's own pipeline also drops ']' and '[';
    we keep them, as methods.md §4 says only the parentheses go.)
    """

    SYMBOLS = ["<pad>", "<unk>", "<s>", "</s>", "<mask>"] + [str(d) for d in range(10)] + \
              ["[MIN", "[MAX", "[MED", "[SM", "]"]

    def __init__(self):
        self.vocab = {s: i for i, s in enumerate(self.SYMBOLS)}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = 0, 1, 2, 3, 4
        self.vocab_size = len(self.SYMBOLS)
        self.files = {KIND_FILE: json.dumps({"kind": "listops", "symbols": self.SYMBOLS}).encode()}

    def _pieces(self, text):
        return [self.vocab.get(t, self.unk_id) for t in text.split() if t not in ("(", ")")]

    def encode_plus(self, text, pair=None, max_len=None):
        ids = [self.cls_id] + self._pieces(text)
        if pair is not None:
            ids += [self.sep_id] + self._pieces(pair)
        if max_len is not None:
            ids = ids[:max_len]  # LRA cuts inputs at max_length
        return ids, [0] * len(ids)

    def encode(self, text, pair=None):
        return self.encode_plus(text, pair)[0]

    def decode(self, ids):
        return " ".join(self.SYMBOLS[int(i)] for i in ids if int(i) > self.mask_id)


class ByteTokenizer:
    """256 byte (or pixel-intensity) ids after the specials: LRA's character-level input (methods.md §4).

    LRA Text and Retrieval encode the UTF-8 bytes of the text (tfds ByteTextEncoder: id = byte + 1, 0 = pad);
    LRA Image and Pathfinder feed the 256 grey levels of the pixels. Here id = value + 5 after pad=0 unk=1
    cls(<s>)=2 sep(</s>)=3 mask=4: the same one-to-one map, shifted, plus a [cls] in front for the classifier.
    No [sep] is appended (as for ListOps). vocab_size = 261.
    """

    OFFSET = 5  # ids 0..4 are the specials

    def __init__(self):
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = 0, 1, 2, 3, 4
        self.vocab_size = self.OFFSET + 256
        self.files = {KIND_FILE: json.dumps({"kind": "bytes"}).encode()}

    def encode_values(self, values, max_len=None):
        """[cls] + (value + 5 for each byte / pixel value 0..255), cut at max_len (LRA cuts at max_length)."""
        ids = [self.cls_id] + [int(v) + self.OFFSET for v in values]
        return ids if max_len is None else ids[:max_len]

    def encode_plus(self, text, pair=None, max_len=None):
        ids = self.encode_values(text.encode("utf-8"))
        if pair is not None:
            ids += [self.sep_id] + [b + self.OFFSET for b in pair.encode("utf-8")]
        ids = ids if max_len is None else ids[:max_len]
        return ids, [0] * len(ids)

    def encode(self, text, pair=None):
        return self.encode_plus(text, pair)[0]

    def decode(self, ids):
        return bytes(int(i) - self.OFFSET for i in ids if int(i) >= self.OFFSET).decode("utf-8", errors="replace")


def tokenizer_from_files(files):
    """Build the right tokenizer from {filename: bytes} (an HF folder's files or a checkpoint's). A damaged file
    (a cut tokenizer.json, a merges.txt of another format) is a one-line DataError naming the files."""
    try:
        return _tokenizer_from_files(files)
    except DataError:
        raise
    except Exception as e:       # tokenizers / sentencepiece / json raise their own types (tokenizers: Exception)
        raise DataError(f"tokenizer files {sorted(files)} are damaged or of an unknown format "
                        f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None


def _tokenizer_from_files(files):
    if KIND_FILE in files:
        kind = json.loads(files[KIND_FILE].decode("utf-8")).get("kind")
        if kind == "sentencepiece":
            return _scratch_spm(files[SPM_FILE])
        if kind == "listops":
            return ListOpsTokenizer()
        if kind == "bytes":
            return ByteTokenizer()
        raise DataError(f"unknown tokenizer kind {kind!r} in {KIND_FILE}")
    config = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        if name in files:
            config.update(json.loads(files[name].decode("utf-8")))
    if "tokenizer.json" in files:
        return HFTokenizer(Tokenizer.from_str(files["tokenizer.json"].decode("utf-8")), files, config)
    if "vocab.json" in files and "merges.txt" in files:
        return HFTokenizer(build_roberta_bpe(files, config), files, config)
    if "vocab.txt" in files:
        return HFTokenizer(build_bert_wordpiece(files, config), files, config)
    if "sentencepiece.bpe.model" in files:
        return SentencePieceTokenizer(files["sentencepiece.bpe.model"], files, fairseq=True)
    raise DataError(f"no supported tokenizer files (have {sorted(files)}; need tokenizer.json, "
                    "vocab.json+merges.txt, vocab.txt or sentencepiece.bpe.model)")


def files_to_tensors(files):
    """{name: bytes} -> {name: uint8 tensor}, the checkpoint format (torch.load weights_only=True safe)."""
    return {name: torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
            torch.zeros(0, dtype=torch.uint8) for name, data in files.items()}


def read_tokenizer_folder(folder):
    """{filename: bytes} of the tokenizer files in an HF folder (what converted checkpoints embed)."""
    files = {}
    for name in HF_TOKENIZER_FILES + (KIND_FILE, SPM_FILE):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                files[name] = f.read()
    return files


def tensors_to_files(stored):
    """{name: uint8 tensor} (a checkpoint's ckpt["tokenizer"]["files"]) -> {name: bytes}; see files_to_tensors."""
    return {name: t.numpy().tobytes() for name, t in stored.items()}


def load_tokenizer(path):
    """Tokenizer of an HF folder or of a converted / trained `.pt` checkpoint (files under ckpt["tokenizer"])."""
    if os.path.isdir(path):
        files = read_tokenizer_folder(path)
    elif os.path.isfile(path):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # not a torch file, or not weights_only-safe
            raise DataError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None
        try:
            stored = ckpt["tokenizer"]["files"]
        except (KeyError, TypeError):
            raise DataError(f"{path}: checkpoint has no tokenizer files (ckpt['tokenizer']['files'])") from None
        files = tensors_to_files(stored)
    else:
        raise DataError(f"{path}: no such tokenizer folder or checkpoint")
    return tokenizer_from_files(files)
