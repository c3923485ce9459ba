"""Tests for data.py: tokenizers equal transformers' own, GLUE/generic readers (and their one-line errors), the
task table, metrics by hand, the LRA ListOps generator against an independent evaluator, MLM masking rates and
deterministic batching.

Run: python -m pytest tests/test_data.py -q
All fixtures (vocabularies, SentencePiece models, GLUE files) are written into tmp_path by the tests.
"""

import glob
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
from data import DataError, Example  # noqa: E402
from readers import mlm  # noqa: E402

STRINGS = ["the cat sat on the mat.", "The Cat is eating, quickly!", "  two  spaces ", "héllo wörld ünïcode",
           "running runner ran", "xyz qqq 123"]
PAIRS = [("the cat sat.", "A dog ran on the mat"), ("Hello there", "héllo"), ("mat", "the the the")]


def _sentences(n=300, seed=0):
    rng = random.Random(seed)
    words = ("the cat dog sat on a mat quick brown fox jumps over lazy river bank money tree house running "
             "runner ran eat eating hello there two spaces 123").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize() + "." for _ in range(n)]


def _save_pt(path, tok):
    """A converted-checkpoint-like file holding only the tokenizer (format of model.py's convert)."""
    torch.save({"format": "attnreg-v1", "config": {}, "model": {},
                "tokenizer": {"files": data.files_to_tensors(tok.files)}}, path)


# --------------------------------------------------------------------------------------- tokenizers

@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    """Tiny byte-level BPE: the 256-symbol byte alphabet plus a few merges (RoBERTa layout)."""
    from tokenizers.pre_tokenizers import ByteLevel
    d = tmp_path_factory.mktemp("roberta")
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at"), ("i", "n"),
              ("in", "g"), ("Ġ", "m"), ("Ġm", "at"), ("e", "r")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<mask>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return d


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert")
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "dog", "sat", "on", "mat", ".", ",",
              "a", "!", "##s", "##ing", "eat", "run", "##ner", "ran", "hello", "there", "two", "space", "##t",
              "h", "##e", "##l", "##o", "w", "##r", "##d", "quick", "##ly", "is", "x", "##y", "##z", "1", "##2"]
    (d / "vocab.txt").write_text("\n".join(tokens) + "\n")
    return d


@pytest.fixture(scope="module")
def xlmr_dir(tmp_path_factory):
    """A tiny SentencePiece model in XLM-R's file name (unigram, like XLM-R's own model)."""
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("xlmr")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_sentences()), model_prefix=str(d / "m"),
                                   vocab_size=60, model_type="unigram", character_coverage=1.0, minloglevel=2)
    shutil.copy(d / "m.model", d / "sentencepiece.bpe.model")
    os.remove(d / "m.model")
    os.remove(d / "m.vocab")
    return d


def _assert_same(ours, hf, with_types=False):
    for s in STRINGS:
        assert ours.encode(s) == hf(s)["input_ids"], s
    for a, b in PAIRS:
        ref = hf(a, b)
        ids, types = ours.encode_plus(a, b)
        assert ids == ref["input_ids"], (a, b)
        if with_types:
            assert types == ref["token_type_ids"], (a, b)
        else:
            assert types == [0] * len(ids)


def test_roberta_tokenizer_matches_transformers(roberta_dir, tmp_path):
    from transformers import RobertaTokenizerFast
    # transformers 5 ignores vocab_file=/merges_file= in the constructor; from_pretrained reads the files
    hf = RobertaTokenizerFast.from_pretrained(str(roberta_dir))
    saved = tmp_path / "saved"
    hf.save_pretrained(str(saved))
    assert (saved / "tokenizer.json").exists()
    ours = data.tokenizer_from_path(str(saved))  # tokenizer.json path (what every RoBERTa checkpoint ships)
    _assert_same(ours, hf)
    assert (ours.pad_id, ours.cls_id, ours.sep_id, ours.mask_id) == (
        hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id)
    assert ours.vocab_size == len(hf)
    assert ours.encode_plus("a b", "c")[0][:1] == [0] and ours.encode("a", "b").count(2) == 3  # <s> A </s></s> B </s>
    assert ours.decode(ours.encode("the cat sat")) == "the cat sat"
    long_a = " ".join(["the cat"] * 20)                     # truncation: HF's longest_first, the specials kept
    ref = hf(long_a, "the mat", truncation=True, max_length=12)["input_ids"]
    assert ours.encode_plus(long_a, "the mat", max_len=12)[0] == ref and len(ref) == 12
    pt = tmp_path / "ck.pt"
    _save_pt(pt, ours)
    _assert_same(data.tokenizer_from_path(str(pt)), hf)
    with pytest.raises(DataError, match="no supported tokenizer files"):   # vocab.json + merges.txt alone
        data.tokenizer_from_path(str(roberta_dir))


def test_bert_tokenizer_matches_transformers(bert_dir, tmp_path):
    from transformers import BertTokenizerFast
    hf = BertTokenizerFast.from_pretrained(str(bert_dir))
    ours = data.tokenizer_from_path(str(bert_dir))  # vocab.txt path
    _assert_same(ours, hf, with_types=True)
    ids, types = ours.encode_plus("the cat", "a dog")
    assert ids == [2, 5, 6, 3, 13, 7, 3] and types == [0, 0, 0, 0, 1, 1, 1]  # [CLS] A [SEP] B [SEP]
    assert (ours.pad_id, ours.cls_id, ours.sep_id, ours.mask_id, ours.vocab_size) == (0, 2, 3, 4, 41)
    hf.save_pretrained(str(tmp_path / "saved"))
    _assert_same(data.tokenizer_from_path(str(tmp_path / "saved")), hf, with_types=True)
    # truncation keeps the special tokens and the pair structure (HF longest_first)
    long_a = " ".join(["the cat"] * 20)
    ids, types = ours.encode_plus(long_a, "a dog", max_len=12)
    ref = hf(long_a, "a dog", truncation=True, max_length=12)
    assert len(ids) == 12 and ids == ref["input_ids"] and types == ref["token_type_ids"]


def test_xlmr_sentencepiece_matches_transformers(xlmr_dir, tmp_path):
    import sentencepiece as spm
    from transformers import XLMRobertaTokenizer
    # transformers 5 has no slow (sentencepiece) XLMRobertaTokenizer; from_pretrained converts the .model
    # with its XLMRobertaConverter (the fairseq id layout), which is the reference here
    hf = XLMRobertaTokenizer.from_pretrained(str(xlmr_dir))
    ours = data.tokenizer_from_path(str(xlmr_dir))  # sentencepiece.bpe.model path
    assert isinstance(ours, data.SentencePieceTokenizer)
    _assert_same(ours, hf)
    n = spm.SentencePieceProcessor(model_file=str(xlmr_dir / "sentencepiece.bpe.model")).get_piece_size()
    assert (ours.cls_id, ours.pad_id, ours.sep_id, ours.mask_id) == (0, 1, 2, n + 1) == (
        hf.cls_token_id, hf.pad_token_id, hf.sep_token_id, hf.mask_token_id)
    assert ours.encode("a", "b")[:1] == [0] and ours.encode("a", "b").count(2) == 3
    assert ours.decode(ours.encode("the cat sat")) == "the cat sat"
    hf.save_pretrained(str(tmp_path / "saved"))
    _assert_same(data.tokenizer_from_path(str(tmp_path / "saved")), hf)
    _save_pt(tmp_path / "ck.pt", ours)
    _assert_same(data.tokenizer_from_path(str(tmp_path / "ck.pt")), hf)


def test_scratch_sentencepiece_and_listops_tokenizers(tmp_path):
    prefix = str(tmp_path / "spm" / "sp")
    tok = data.train_sentencepiece(_sentences(), prefix, vocab_size=70)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.vocab_size) == (0, 1, 2, 3, 4, 70)
    ids, types = tok.encode_plus("the cat", "a dog")
    assert ids[0] == 2 and ids[-1] == 3 and ids.count(3) == 2 and types == [0] * len(ids)  # <s> A </s> B </s>
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"
    cached = glob.glob(prefix + "-*.model")
    assert len(cached) == 1                                   # the cache key is in the name: vocab size + texts
    mtime = os.path.getmtime(cached[0])
    again = data.train_sentencepiece(_sentences(), prefix, vocab_size=70)  # same texts and size: reused
    assert os.path.getmtime(cached[0]) == mtime and again.encode("the cat") == tok.encode("the cat")
    data.train_sentencepiece(_sentences()[::-1][:-1], prefix, vocab_size=70)  # other texts: a model of its own
    assert len(glob.glob(prefix + "-*.model")) == 2
    _save_pt(tmp_path / "a.pt", tok)
    assert data.tokenizer_from_path(str(tmp_path / "a.pt")).encode("the dog ran", "x") == tok.encode("the dog ran", "x")
    with pytest.raises(DataError, match="sentencepiece"):
        data.train_sentencepiece(["a b"], str(tmp_path / "tiny"), vocab_size=5000)

    lo = data.ListOpsTokenizer()
    ids = lo.encode("( ( ( [MAX 2 ) 9 ) ] )")
    assert ids == [lo.cls_id, lo.vocab["[MAX"], lo.vocab["2"], lo.vocab["9"], lo.vocab["]"]]
    assert lo.decode(ids) == "[MAX 2 9 ]" and lo.vocab_size == 20
    _save_pt(tmp_path / "l.pt", lo)
    assert isinstance(data.tokenizer_from_path(str(tmp_path / "l.pt")), data.ListOpsTokenizer)


# --------------------------------------------------------------------------------------- GLUE readers

GLUE_FILES = {
    "cola": ("gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n", None),
    "sst2": ("sentence\tlabel\nit 's a charming journey . \t1\nunflinchingly bleak\t0\n", None),
    "mrpc": ("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tThe cat sat.\tA cat sat.\n"
             "0\t3\t4\tHe ran.\tShe ate.\n", None),
    "stsb": ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
             "0\tmain\tf\t2012\t1\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t5.000\n"
             "1\tmain\tf\t2012\t4\tnone\tnone\tA man plays.\tA woman eats.\t0.500\n", None),
    "qqp": ("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t1\t2\tHow are you?\tHow do you do?\t1\n"
            "2\t3\t4\tWhat time?\tWhere?\t0\n", None),
    "qnli": ("index\tquestion\tsentence\tlabel\n0\tWhat is it?\tIt is a cat.\tentailment\n"
             "1\tWho?\tNobody knows.\tnot_entailment\n", None),
    "rte": ("index\tsentence1\tsentence2\tlabel\n0\tA dog runs.\tAn animal moves.\tentailment\n"
            "1\tA dog runs.\tA cat sleeps.\tnot_entailment\n", None),
    "wnli": ("index\tsentence1\tsentence2\tlabel\n0\tThe cup fell.\tIt fell.\t1\n1\tHe saw it.\tShe did.\t0\n", None),
}
MNLI_HEAD_TRAIN = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                   "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label")
MNLI_HEAD_DEV = MNLI_HEAD_TRAIN.replace("label1\tgold_label", "label1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label")


def _mnli_row(i, s1, s2, label, n_labels):
    return "\t".join([str(i), "1", "1", "fiction", "(x)", "(y)", "(X)", "(Y)", s1, s2] + [label] * n_labels)


def _write_glue(root, task):
    d = root / task
    d.mkdir(parents=True, exist_ok=True)
    if task == "mnli":
        (d / "train.tsv").write_text("\n".join([MNLI_HEAD_TRAIN, _mnli_row(0, "A cat.", "An animal.", "entailment", 2),
                                                _mnli_row(1, "A cat.", "A dog.", "contradiction", 2),
                                                _mnli_row(2, "A cat.", "It sleeps.", "neutral", 2)]) + "\n")
        (d / "dev_matched.tsv").write_text("\n".join([MNLI_HEAD_DEV, _mnli_row(0, "Hi.", "Hello.", "entailment", 6)]) + "\n")
        (d / "dev_mismatched.tsv").write_text("\n".join([MNLI_HEAD_DEV, _mnli_row(0, "Hi.", "Bye.", "contradiction", 6),
                                                         _mnli_row(1, "Hi.", "Hm.", "neutral", 6)]) + "\n")
    else:
        (d / "train.tsv").write_text(GLUE_FILES[task][0], encoding="utf-8")
        (d / "dev.tsv").write_text(GLUE_FILES[task][0], encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def bert_tok(bert_dir):
    return data.tokenizer_from_path(str(bert_dir))


@pytest.mark.parametrize("task", list(data.GLUE))
def test_glue_formats(task, tmp_path, bert_tok):
    d = _write_glue(tmp_path, task)
    td = data.load_task(task, str(d), bert_tok, max_len=64)
    expected = {"cola": [1, 0], "sst2": [1, 0], "mrpc": [1, 0], "stsb": [5.0, 0.5], "qqp": [1, 0],
                "mnli": [1, 0, 2], "qnli": [0, 1], "rte": [0, 1], "wnli": [1, 0]}[task]
    assert [e.label for e in td.train] == expected
    assert td.metric_name == {"cola": "mcc", "stsb": "pearson", "mrpc": "f1", "qqp": "f1"}.get(task, "acc")
    assert td.is_regression == (task == "stsb") and td.num_labels == {"stsb": 1, "mnli": 3}.get(task, 2)
    assert td.n_truncated == 0
    first = td.train[0]
    assert first.ids[0] == bert_tok.cls_id and first.ids[-1] == bert_tok.sep_id
    if TASK_HAS_PAIR[task]:
        assert first.ids.count(bert_tok.sep_id) == 2 and first.type_ids[-1] == 1
    else:
        assert first.ids.count(bert_tok.sep_id) == 1 and set(first.type_ids) == {0}
    if task == "mnli":
        assert sorted(td.dev) == ["dev_matched", "dev_mismatched"]
        assert [e.label for e in td.dev["dev_mismatched"]] == [0, 2]
    else:
        assert list(td.dev) == ["dev"] and len(td.dev["dev"]) == len(td.train)
    if task == "sst2":  # truncation is counted once per example, and keeps [CLS] ... [SEP]
        td = data.load_task(task, str(d), bert_tok, max_len=4)
        assert td.n_truncated == 2 and all(len(e.ids) <= 4 and e.ids[-1] == bert_tok.sep_id for e in td.train)


TASK_HAS_PAIR = {t: spec["cols"][1] is not None for t, spec in data.GLUE.items()}


@pytest.mark.parametrize("task, text, problem", [
    ("rte", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\n", "expected 4 columns"),
    ("rte", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tmaybe\n", "unknown label"),
    ("stsb", "index\tg\tf\ty\to\ts1\ts2\tsentence1\tsentence2\tscore\n0\tg\tf\ty\to\ts\ts\ta\tb\thigh\n",
     "non-numeric score"),
    ("sst2", "sentence\tlabel\ngood\t1\n \t0\n", "empty text"),
    ("cola", "src\t1\t\tfine\nsrc\t1\tbad row\n", "expected 4 columns"),
])
def test_malformed_rows(tmp_path, bert_tok, task, text, problem):
    d = tmp_path / task
    d.mkdir()
    (d / "train.tsv").write_text(text)
    (d / "dev.tsv").write_text(text)
    with pytest.raises(DataError) as err:
        data.load_task(task, str(d), bert_tok, max_len=32)
    line = 2 if task in ("cola",) else (3 if task != "stsb" else 2)
    assert f"train.tsv:{line}: {problem}" in str(err.value)
    (d / "empty.tsv").write_text("")
    with pytest.raises(DataError, match="empty.tsv:1: empty file"):
        data.load_task(task, str(d), bert_tok, max_len=32, train_file=str(d / "empty.tsv"))


def test_qqp_skips_short_rows_and_unknown_task(tmp_path, bert_tok):
    d = tmp_path / "qqp"
    d.mkdir()
    text = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t1\t2\tHow?\tWhy?\t1\n2\t3\t4\tbroken\n"
    (d / "train.tsv").write_text(text)
    (d / "dev.tsv").write_text(text)
    td = data.load_task("qqp", str(d), bert_tok, max_len=32)
    assert len(td.train) == 1 and td.n_skipped == 2
    with pytest.raises(DataError, match="unknown task 'foo'.*cola.*listops.*mlm"):
        data.load_task("foo", str(d), bert_tok, max_len=32)


def test_generic_tsv_csv_jsonl(tmp_path, bert_tok):
    d = tmp_path / "named"
    d.mkdir()
    (d / "train.tsv").write_text("text\tother\tlabel\nthe cat\tx\tpos\na dog\ty\tneg\nthe mat\tz\tneutral\n")
    (d / "dev.tsv").write_text("text\tother\tlabel\nthe dog\tx\tneg\n")
    td = data.load_task("tsv", str(d), bert_tok, max_len=32, text_col="text", label_col="label")
    assert td.label_names == ["neg", "neutral", "pos"] and [e.label for e in td.train] == [2, 0, 1]
    assert td.dev["dev"][0].label == 0 and td.num_labels == 3 and td.metric_name == "acc"
    # sst2-like `label<TAB>sentence`, no header, numeric labels sorted numerically
    (tmp_path / "simple.tsv").write_text("10\tthe cat\n2\ta dog\n0\tthe mat\n")
    ex, labels, _ = data.load_generic(str(tmp_path / "simple.tsv"), bert_tok, text_col="1", label_col="0")
    assert labels == ["0", "2", "10"] and [e.label for e in ex] == [2, 1, 0]
    # CSV with quoting and a text pair
    (tmp_path / "p.csv").write_text('s1,s2,y\n"the cat, the dog",a mat,1\nthe mat,"a ""dog""",0\n')
    ex, labels, _ = data.load_generic(str(tmp_path / "p.csv"), bert_tok, text_col="s1", text_pair_col="s2",
                                      label_col="y")
    assert ex[0].ids == bert_tok.encode("the cat, the dog", "a mat") and ex[1].ids == bert_tok.encode("the mat", 'a "dog"')
    # JSONL by key and by index
    (tmp_path / "j.jsonl").write_text('{"t": "the cat", "y": "b"}\n\n{"t": "a dog", "y": "a"}\n')
    ex, labels, _ = data.load_generic(str(tmp_path / "j.jsonl"), bert_tok, text_col="t", label_col="y")
    assert labels == ["a", "b"] and [e.label for e in ex] == [1, 0]
    ex2, _, _ = data.load_generic(str(tmp_path / "j.jsonl"), bert_tok, text_col=0, label_col=1)
    assert [e.ids for e in ex2] == [e.ids for e in ex]
    # errors: unseen dev label, missing column, wrong column count, empty file
    (d / "dev.tsv").write_text("text\tother\tlabel\nthe dog\tx\tneg\nthe cat\ty\tsurprise\n")
    with pytest.raises(DataError, match=r"dev.tsv:3: unknown label 'surprise'"):
        data.load_task("tsv", str(d), bert_tok, max_len=32, text_col="text", label_col="label")
    with pytest.raises(DataError, match=r"train.tsv:1: no column 'txt'"):
        data.load_task("tsv", str(d), bert_tok, max_len=32, text_col="txt", label_col="label")
    (tmp_path / "bad.tsv").write_text("1\tthe cat\n0\n")
    with pytest.raises(DataError, match=r"bad.tsv:2: expected 2 columns"):
        data.load_generic(str(tmp_path / "bad.tsv"), bert_tok, text_col=1, label_col=0)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="e.jsonl:1: empty file"):
        data.load_generic(str(tmp_path / "e.jsonl"), bert_tok, text_col="t", label_col="y")


# JSONL labels: one scalar type per file. (bad label, what the error says about it); line 1's label is 1.
BAD_JSONL_LABELS = [
    (None, "label null is not a label"),
    ({"a": 1}, 'label {"a": 1} is not a label'),
    ([1], "label [1] is not a label"),
    ("1", 'label "1" is a string, but line 1\'s label 1 is an integer'),
    (1.0, "label 1.0 is a decimal number, but line 1\'s label 1 is an integer"),
    (True, "label true is true / false, but line 1\'s label 1 is an integer"),
]


@pytest.mark.parametrize("bad, what", BAD_JSONL_LABELS, ids=["null", "object", "list", "string", "float", "bool"])
def test_jsonl_labels_are_one_scalar_type_per_file(tmp_path, bad, what):
    """A null, object or list label, or labels of mixed types (1, 1.0, "1", true: bool and int differ), would
    become extra classes: one DataError naming the file and the line."""
    path = tmp_path / "train.jsonl"
    lines = [{"text": "a cat", "label": 1}, {"text": "a dog", "label": 0}, {"text": "a mat", "label": bad}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(DataError) as err:
        data.read_generic(str(path), ("text", None, "label"))
    assert str(err.value).startswith(f"{path}:3: {what}"), str(err.value)


def test_jsonl_labels_of_one_type_are_read_as_text(tmp_path):
    """Every scalar type is a label type, as long as the file keeps to it (true and false; 0.5 and 1.0)."""
    for labels, texts in [([True, False], ["True", "False"]), ([0.5, 1.0], ["0.5", "1.0"]),
                          (["x", "y"], ["x", "y"]), ([3, -1], ["3", "-1"])]:
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps({"t": "a cat", "y": y}) + "\n" for y in labels))
        records, _ = data.read_generic(str(path), ("t", None, "y"))
        assert [r[3] for r in records] == texts


def test_tsv_without_columns_names_the_flags_and_the_file(tmp_path):
    """--task tsv without --text-col / --label-col: one DataError naming both flags and the file (it was a
    TypeError traceback, from the reader that collects the texts a from-scratch tokenizer trains on)."""
    (tmp_path / "train.tsv").write_text("text\tlabel\na cat\t1\na dog\t0\n")
    for cols in ({}, {"text_col": "text"}, {"label_col": "label"}):
        with pytest.raises(DataError) as err:
            data.training_texts("tsv", str(tmp_path), **cols)
        assert str(err.value) == (f"{tmp_path / 'train.tsv'}: --task tsv needs --text-col and --label-col "
                                  "(header names or 0-based indices)")
        with pytest.raises(DataError, match="--text-col and --label-col"):
            data.load_task("tsv", str(tmp_path), None, max_len=32, **cols)


def test_csv_with_an_unbalanced_quote_names_the_line(tmp_path, bert_tok):
    """A quote that never closes would swallow the rest of the file into one field: one DataError naming the
    file and the line where the quoted field opens."""
    path = tmp_path / "train.csv"
    path.write_text('text,label\na cat,1\n"a dog,0\nthe mat,1\nthe sun,0\n')     # opens on line 3
    with pytest.raises(DataError, match=re.escape(f"{path}:3: a quoted field opens here and never closes")):
        data.read_generic(str(path), ("text", None, "label"))
    path.write_text('text,label\na cat,"1\nthe mat,1\n')                          # in the last column
    with pytest.raises(DataError, match=re.escape(f"{path}:2: a quoted field opens here and never closes")):
        data.load_generic(str(path), bert_tok, text_col="text", label_col="label")
    path.write_text('text,label\n"a cat" sat,1\n')                                  # text after a closing quote
    with pytest.raises(DataError, match=re.escape(f"{path}:2: bad quoting")):
        data.read_generic(str(path), ("text", None, "label"))
    path.write_text('text,label\n"a cat\non two lines",1\nthe mat,0\n')            # a closed quote spans lines
    records, _ = data.read_generic(str(path), ("text", None, "label"))
    assert [(w, t) for w, t, _, _ in records] == [(f"{path}:2", "a cat\non two lines"), (f"{path}:4", "the mat")]


def test_task_table():
    """Every task names its objective, head and metric; LRA and QA are read by readers/, loaded on first use."""
    assert set(data.TASKS) == set(data.GLUE) | {"tsv", "listops", "mlm", "squad", "lra-text", "lra-retrieval",
                                                "lra-image", "lra-pathfinder", *data.LAB}
    heads = {"classify": "cls", "pair": "pair", "mlm": "cls", "span": "span"}
    for name, t in data.TASKS.items():
        assert t.objective in heads and t.head == heads[t.objective], name
    assert [n for n, t in data.TASKS.items() if t.objective != "classify"] == ["lra-retrieval", "squad", "mlm"]
    assert data.TASKS["cola"].metric == "mcc" and data.TASKS["stsb"].metric == "pearson"
    assert data.TASKS["lra-text"].max_len == 4001 and data.TASKS["lra-image"].max_len == 1025
    assert isinstance(data.fixed_tokenizer("lra-image"), data.ByteTokenizer) and data.fixed_tokenizer("sst2") is None
    assert data.TASKS["squad"].percent == ("em", "f1") and data.TASKS["squad"].scale == 1.0
    out = subprocess.run([sys.executable, "-c", "import data, sys; print(sorted(m for m in sys.modules "
                          "if m.startswith('readers')))"], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr                                # not imported with data


def test_mlm_task(tmp_path, bert_tok):
    (tmp_path / "a.txt").write_text("the cat sat on the mat\n\n" + " ".join(["the dog"] * 10) + "\n")
    (tmp_path / "b.txt").write_text("hello there\n")
    td = mlm.load_task("mlm", str(tmp_path), bert_tok, max_len=8)
    assert td.num_labels == 0 and td.metric_name == "loss" and td.dev == {}
    assert all(len(e.ids) <= 8 and e.ids[0] == bert_tok.cls_id and e.ids[-1] == bert_tok.sep_id for e in td.train)
    assert len(td.train) == 1 + 4 + 1 and td.n_truncated == 1  # 20 tokens -> chunks of 6


# --------------------------------------------------------------------------------------- metrics

def test_metrics_by_hand():
    preds, labels = [1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1]
    # tp = 2 (idx 0, 4), fp = 1 (idx 1), tn = 2 (idx 2, 3), fn = 1 (idx 5)
    # mcc = (tp tn - fp fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)) = (4 - 1) / sqrt(3*3*3*3) = 1/3
    assert data.matthews_corrcoef(preds, labels) == pytest.approx(1 / 3)
    # f1 = 2 tp / (2 tp + fp + fn) = 4 / 6
    assert data.f1_binary(preds, labels) == pytest.approx(2 / 3)
    assert data.accuracy(preds, labels) == pytest.approx(4 / 6)
    assert data.matthews_corrcoef([1, 1, 1], [1, 0, 1]) == 0.0  # constant predictions: defined as 0
    # pearson: dx = [-1.5 -.5 .5 1.5], dy = [-3 -1 0 4]; sum dxdy = 11, sum dx^2 = 5, sum dy^2 = 26
    assert data.pearson([1, 2, 3, 4], [2, 4, 5, 9]) == pytest.approx(11 / math.sqrt(130))
    # spearman with ties: ranks x = [1, 2.5, 2.5, 4], y = [1, 3, 2, 4]; sum dxdy = 4.5, 4.5, 5 -> 3/sqrt(10)
    assert list(data.average_ranks([10, 20, 20, 30])) == [1, 2.5, 2.5, 4]
    assert data.spearman([10, 20, 20, 30], [1, 3, 2, 4]) == pytest.approx(3 / math.sqrt(10))
    m = data.compute_metrics("stsb", np.array([[1.0], [2], [3], [4]]), np.array([2.0, 4, 5, 9]))
    assert m["pearson"] == pytest.approx(11 / math.sqrt(130)) and m["spearman"] == pytest.approx(1.0)
    assert m["corr"] == pytest.approx((m["pearson"] + 1) / 2)
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert data.compute_metrics("mrpc", logits, [1, 1, 1]) == {"f1": pytest.approx(0.8), "acc": pytest.approx(2 / 3)}
    assert set(data.compute_metrics("cola", [1, 0], [1, 0])) == {"mcc", "acc"}
    assert data.compute_metrics("mnli", [0, 1, 2, 2], [0, 1, 2, 0]) == {"acc": 0.75}
    with pytest.raises(DataError):
        data.compute_metrics("squad", [0], [0])


# --------------------------------------------------------------------------------------- ListOps

def _eval_listops(source):
    """Independent evaluator: a stack machine over the tokens (parentheses ignored); median by sorting."""
    stack, result = [], None
    for tok in source.split():
        if tok in ("(", ")"):
            continue
        if tok.startswith("["):
            stack.append((tok, []))
            continue
        if tok == "]":
            op, args = stack.pop()
            s = sorted(args)
            value = {"[MIN": s[0], "[MAX": s[-1], "[SM": sum(s) % 10,
                     "[MED": s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) // 2}[op]
        else:
            value = int(tok)
        if stack:
            stack[-1][1].append(value)
        else:
            result = value
    assert not stack
    return result


def _parse_pairs(tokens):
    """LRA's rendering is a binary tree: every "( x y )" group has exactly two children."""
    tok = tokens.pop(0)
    if tok != "(":
        return tok
    left, right = _parse_pairs(tokens), _parse_pairs(tokens)
    assert tokens.pop(0) == ")"
    return (left, right)


def test_listops_generator(tmp_path):
    assert data._render("[MAX", ["2", "9"]) == "( ( ( [MAX 2 ) 9 ) ] )"
    samples = data.generate_listops(300, 10, 60, seed=1, max_depth=6, max_args=5)
    assert samples == data.generate_listops(300, 10, 60, seed=1, max_depth=6, max_args=5)  # seeded
    assert len({s for s, _ in samples}) == 300  # unique, like LRA's set
    ops = set()
    for source, label in samples:
        n = len([t for t in source.split() if t not in "()"])
        assert 10 < n < 60  # LRA's exclusive bounds
        assert label == _eval_listops(source) and 0 <= label <= 9
        tokens = source.split()
        tree = _parse_pairs(tokens)
        assert not tokens and isinstance(tree, tuple) and tree[1] == "]"
        ops.update(t for t in source.split() if t.startswith("["))
    assert ops == {"[MIN", "[MAX", "[MED", "[SM"}
    with pytest.raises(DataError, match="no new sample"):  # no length in 2 < n < 4 exists (1, then 4..)
        data.generate_listops(5, 2, 4, seed=0, max_misses=20000)
    with pytest.raises(DataError, match="no new sample"):  # only 4 ops x 100 = 400 trees of length 4
        data.generate_listops(500, 3, 5, seed=0, max_misses=20000)

    out = tmp_path / "lo"
    data.main(["listops", str(out), "--train", "40", "--val", "10", "--test", "5", "--min-len", "5",
               "--max-len", "50", "--seed", "3", "--max-depth", "5"])
    assert sorted(os.listdir(out)) == ["basic_test.tsv", "basic_train.tsv", "basic_val.tsv"]
    for name, n in [("basic_train.tsv", 40), ("basic_val.tsv", 10), ("basic_test.tsv", 5)]:
        lines = (out / name).read_text().splitlines()
        assert lines[0] == "Source\tTarget" and len(lines) == n + 1
        for line in lines[1:]:
            source, target = line.split("\t")
            assert int(target) == _eval_listops(source)
    td = data.load_task("listops", str(out), None, max_len=30)
    assert len(td.train) == 40 and len(td.dev["dev"]) == 10 and td.num_labels == 10
    lo = data.ListOpsTokenizer()
    src0 = (out / "basic_train.tsv").read_text().splitlines()[1].split("\t")[0]
    assert td.train[0].ids[:30] == lo.encode(src0)[:30] and td.train[0].ids[0] == lo.cls_id
    assert all(len(e.ids) <= 30 for e in td.train)
    assert td.n_truncated == sum(len(lo.encode(l.split("\t")[0])) > 30 for f in ("basic_train.tsv", "basic_val.tsv")
                                 for l in (out / f).read_text().splitlines()[1:])
    # LRA's released files: written by csv.writer with \r\n line ends
    (tmp_path / "lra").mkdir()
    for f in ("basic_train.tsv", "basic_val.tsv"):
        (tmp_path / "lra" / f).write_bytes(b"Source\tTarget\r\n( ( ( [SM 3 ) 9 ) ] )\t2\r\n")
    td = data.load_task("listops", str(tmp_path / "lra"), lo, max_len=100)
    assert td.train[0].label == 2 and lo.decode(td.train[0].ids) == "[SM 3 9 ]"


# --------------------------------------------------------------------------------------- MLM, batching

def test_mask_tokens_rates():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (400, 250), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3  # cls / sep
    mask = torch.ones_like(ids)
    mask[:, 200:] = 0
    ids[:, 200:] = 1  # padding
    masked, labels = mlm.mask_tokens(ids, mask, mask_id=4, vocab_size=1000, special_ids=[0, 1, 2, 3, 4],
                                      generator=g)
    sel = labels != -100
    candidates = (mask.bool() & (ids > 4)).sum().item()
    assert abs(sel.sum().item() / candidates - 0.15) < 0.01
    assert not sel[:, 0].any() and not sel[:, 200:].any()  # specials and padding never chosen
    assert torch.equal(labels[sel], ids[sel]) and torch.equal(masked[~sel], ids[~sel])
    n = sel.sum().item()
    frac_mask = (masked[sel] == 4).sum().item() / n
    frac_same = (masked[sel] == ids[sel]).sum().item() / n
    assert abs(frac_mask - 0.8) < 0.02 and abs(frac_same - 0.1) < 0.02 and abs(1 - frac_mask - frac_same - 0.1) < 0.02


def test_make_batches():
    rng = random.Random(0)
    ex = [Example([2] + [rng.randrange(5, 50) for _ in range(rng.randint(1, 40))] + [3], None, i % 3)
          for i in range(500)]
    a = data.make_batches(ex, 16, pad_id=1, seed=7, epoch=2, multiple_of=8)
    b = data.make_batches(ex, 16, pad_id=1, seed=7, epoch=2, multiple_of=8)
    c = data.make_batches(ex, 16, pad_id=1, seed=7, epoch=3, multiple_of=8)
    assert len(a) == 32 and all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert not all(x["input_ids"].shape == y["input_ids"].shape and torch.equal(x["input_ids"], y["input_ids"])
                   for x, y in zip(a, c))
    seen = 0
    for batch in a:
        L = batch["input_ids"].shape[1]
        lengths = batch["attention_mask"].sum(1)
        assert L % 8 == 0 and L - 8 < lengths.max() <= L  # padded to the longest, rounded up to 8
        assert (batch["input_ids"][batch["attention_mask"] == 0] == 1).all()
        assert batch["labels"].dtype == torch.long and batch["token_type_ids"].abs().sum() == 0
        seen += len(lengths)
    assert seen == 500
    plan = data.batch_plan([len(e.ids) for e in ex], 16, seed=7, epoch=2)     # what the training loop uses
    assert sorted(i for b in plan for i in b) == list(range(500))           # every example once per epoch
    assert all(torch.equal(data.collate([ex[i] for i in p], 1, 8)["input_ids"], x["input_ids"]) for p, x in zip(plan, a))
    # length bucketing: far less padding than random batches
    real = sum(b["attention_mask"].sum().item() for b in a)
    padded = sum(b["attention_mask"].numel() for b in a)
    assert real / padded > 0.8
    # eval order is the original order; regression labels are float; type ids are kept
    ev = data.make_batches(ex, 64, pad_id=1, seed=0, epoch=0, shuffle=False)
    assert torch.equal(torch.cat([b["labels"] for b in ev]), torch.tensor([e.label for e in ex]))
    reg = data.make_batches([Example([2, 5, 3], [0, 0, 1], 0.5), Example([2, 3], None, 4.0)], 2, pad_id=0,
                            seed=0, epoch=0, shuffle=False)[0]
    assert reg["labels"].dtype == torch.float and reg["token_type_ids"].tolist() == [[0, 0, 1], [0, 0, 0]]
    assert reg["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
