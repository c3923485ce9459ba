"""`python model.py export CKPT OUT_DIR --hf` (issue 30): a fine-tuned model goes back to transformers.

Per family (roberta, xlm-roberta, bert): a tiny random transformers masked LM and its tokenizer are saved as an HF
folder, converted (model.py convert), fine-tuned 3 steps through train.py (AttendOut on), exported with --hf and
loaded back with transformers' Auto classes: no missing or unexpected weight, our eval logits to 1e-4 on padded
batches (right and left padding), and the tokenizer loaded back gives the same ids. Then the other heads (masked
LM, regression, QA spans), the one-line refusals, and a mapping broken on purpose, which the comparison catches.
Run: python -m pytest -q tests/test_export.py
"""
import json
import os
import random
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import data  # noqa: E402
import model as M  # noqa: E402
import train  # noqa: E402

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=40, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
CLASS = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "bert": "Bert"}     # transformers' class prefixes
WORDS = "the cat sat on a mat dog ran eat hello there quick".split()
TEXTS = ["the cat sat on the mat", "hello there", "a quick dog ran", "eat"]


def sentences(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))) for _ in range(n)]


def write_tokenizer(family, folder):
    """The family's tokenizer in its own file format, then as transformers saves it (tokenizer.json and config)."""
    if family == "bert":                               # WordPiece
        (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
        tok = transformers.BertTokenizerFast.from_pretrained(str(folder))
    elif family == "roberta":                          # byte-level BPE: the byte alphabet and a few merges
        from tokenizers.pre_tokenizers import ByteLevel
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at")]
        for piece in sorted(ByteLevel.alphabet()) + [a + b for a, b in merges] + ["<mask>"]:
            vocab[piece] = len(vocab)
        (folder / "vocab.json").write_text(json.dumps(vocab))
        (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        tok = transformers.RobertaTokenizerFast.from_pretrained(str(folder))
    else:                                              # XLM-R: SentencePiece, fairseq's id layout
        import sentencepiece as spm
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences(200, 0)), model_prefix=str(folder / "m"),
                                       vocab_size=30, model_type="unigram", minloglevel=2)
        os.replace(folder / "m.model", folder / "sentencepiece.bpe.model")
        tok = transformers.XLMRobertaTokenizer.from_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return tok


def hf_folder(tmp, family, head="MaskedLM", **extra):
    """A tiny random transformers model of the family (LayerNorms moved off 1 / 0) and its tokenizer, saved."""
    folder = tmp / f"hf-{family}-{head}"
    folder.mkdir()
    tok = write_tokenizer(family, folder)
    kw = dict(pad_token_id=0, type_vocab_size=2) if family == "bert" else dict(pad_token_id=1)
    cfg = getattr(transformers, CLASS[family] + "Config")(vocab_size=len(tok), **TINY, **kw, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{CLASS[family]}For{head}")(cfg)
    with torch.no_grad():                              # weights 10x HF's init: attention far from uniform, so
        for name, p in hf.named_parameters():          # a swapped query / key would show in the logits
            p.add_(torch.randn_like(p) * 0.1) if "LayerNorm" in name or "layer_norm" in name else p.mul_(10)
    hf.save_pretrained(str(folder))
    return folder, tok


def batch(tok, texts, padding, pairs=False):
    """Our tokenizer's ids of texts (each with a pair when pairs), padded on the right or the left."""
    enc = [tok.encode_plus(t, t[::-1] if pairs else None) for t in texts]
    L = max(len(ids) for ids, _ in enc)
    rows = [[(ids, types), ([tok.pad_id] * (L - len(ids)), [0] * (L - len(ids)))] for ids, types in enc]
    rows = [r if padding == "right" else r[::-1] for r in rows]
    ids = torch.tensor([a[0] + b[0] for a, b in rows])
    types = torch.tensor([a[1] + b[1] for a, b in rows])
    mask = torch.tensor([[1] * len(a[0]) + [0] * len(b[0]) if padding == "right" else [0] * len(a[0]) + [1] * len(b[0])
                         for a, b in rows])
    return ids, mask, types


def export(ckpt, out):
    M.main(["export", str(ckpt), str(out), "--hf"])


@pytest.fixture(scope="module", params=list(CLASS))
def finetuned(request, tmp_path_factory):
    """(family, fine-tuned checkpoint, its --hf export) after convert and 3 train.py steps with AttendOut."""
    family, tmp = request.param, tmp_path_factory.mktemp(request.param)
    folder, _ = hf_folder(tmp, family)
    M.main(["convert", str(folder), str(tmp / "conv.pt")])
    (tmp / "data").mkdir()
    for split, n in (("train", 24), ("dev", 8)):
        rows = [f"{s}\t{len(s.split()) % 3}" for s in sentences(n, 1 + n)]
        (tmp / "data" / f"{split}.tsv").write_text("text\tlabel\n" + "\n".join(rows) + "\n")
    train.main(["--init", str(tmp / "conv.pt"), "--task", "tsv", "--data", str(tmp / "data"), "--text-col", "text",
                "--label-col", "label", "--max-steps", "3", "--batch-size", "8", "--lr", "1e-3", "--out",
                str(tmp / "run"), "--attention", "dense", "--attn-dropout", "attendout", "--threads", "1",
                "--device", "cpu"])
    ckpt = tmp / "run" / "ckpt_last.pt"
    export(ckpt, tmp / "hf-out")
    return family, ckpt, tmp / "hf-out"


def test_finetuned_gnets_learn_at_the_backbone_rate(finetuned):
    """With --init and no --gnet-lr the G-Nets take --lr's peak (Config.gnet_lr None, the author's rule)."""
    final = json.loads((finetuned[1].parent / "final.json").read_text())
    assert final["config"]["gnet_lr"] == final["args"]["lr"] == 1e-3


def test_transformers_loads_it_without_missing_or_unexpected_weights(finetuned):
    family, ckpt, out = finetuned
    tokenizer_files = data.tokenizer_from_path(str(ckpt)).files
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors", *tokenizer_files])
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), output_loading_info=True)
    assert type(hf).__name__ == f"{CLASS[family]}ForSequenceClassification" and hf.config.model_type == family
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    trained = torch.load(ckpt, weights_only=True)
    assert trained["config"]["attn_dropout"] == "attendout" and any(".gnet." in k for k in trained["model"])


@pytest.mark.parametrize("padding", ["right", "left"])
def test_logits_match_ours_on_padded_batches(finetuned, padding):
    family, ckpt, out = finetuned
    ours = M.load_pretrained(str(ckpt)).eval()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    ids, mask, types = batch(data.tokenizer_from_path(str(ckpt)), TEXTS, padding, pairs=family == "bert")
    assert (mask == 0).any()
    types = types if family == "bert" else None
    with torch.no_grad():
        got, ref = ours(ids, mask, types), hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    assert got.shape == (4, 3) and (got - ref).abs().max() < 1e-4


def test_the_tokenizer_loaded_back_gives_the_same_ids(finetuned):
    family, ckpt, out = finetuned
    ours, hf = data.tokenizer_from_path(str(ckpt)), transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS + ["Hello, the cat!"]:
        assert hf(text)["input_ids"] == ours.encode(text), text
        assert hf(text, "a dog")["input_ids"] == ours.encode(text, "a dog"), text
    assert (hf.pad_token_id, hf.cls_token_id, hf.mask_token_id) == (ours.pad_id, ours.cls_id, ours.mask_id)


@pytest.mark.parametrize("family,head,auto", [("roberta", "MaskedLM", "AutoModelForMaskedLM"),
                                              ("bert", "SequenceClassification", "AutoModelForSequenceClassification"),
                                              ("xlm-roberta", "QuestionAnswering", "AutoModelForQuestionAnswering")])
def test_masked_lm_regression_and_span_heads(tmp_path, family, head, auto):
    """A converted masked LM exports as *ForMaskedLM; a 1-label head as BERT's regression; a span head as
    *ForQuestionAnswering (qa_outputs). Each round trip gives our logits back."""
    folder, tok = hf_folder(tmp_path, family, head, **(dict(num_labels=1) if head != "MaskedLM" else {}))
    M.main(["convert", str(folder), str(tmp_path / "c.pt")])
    ours = M.load_pretrained(str(tmp_path / "c.pt")).eval()
    assert (ours.cfg.num_labels, ours.cfg.head) == {"MaskedLM": (0, "cls"), "SequenceClassification": (1, "cls"),
                                                    "QuestionAnswering": (2, "span")}[head]
    export(tmp_path / "c.pt", tmp_path / "out")
    hf, info = getattr(transformers, auto).from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert type(hf).__name__ == f"{CLASS[family]}For{head}"
    ids, mask, _ = batch(data.tokenizer_from_path(str(tmp_path / "c.pt")), TEXTS, "right")
    with torch.no_grad():
        out = hf.eval()(input_ids=ids, attention_mask=mask)
        if head == "MaskedLM":
            got, ref = ours.mlm_logits(ids, mask)[mask.bool()], out.logits[mask.bool()]
        elif head == "QuestionAnswering":
            got, ref = ours(ids, mask), torch.stack([out.start_logits, out.end_logits], dim=-1)
        else:
            got, ref = ours(ids, mask), out.logits
            assert hf.config.problem_type == "regression" and got.shape == (4, 1)
    assert (got - ref).abs().max() < 1e-4


def one_error_line(capsys, argv):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        M.main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_what_has_no_transformers_counterpart_is_one_line_before_anything_is_written(tmp_path, capsys):
    tok = data.files_to_tensors(data.read_tokenizer_folder(str(hf_folder(tmp_path, "bert")[0])))
    small = dict(vocab_size=20, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=20, max_positions=64,
                 pad_id=0, family="bert", position_style="bert", type_vocab_size=2, num_labels=2, block_size=4)
    cases = {"sparse": (dict(attention="sparse"), "sparse attention"),
             "hst": (dict(attention="hst"), "representatives"),
             "pair": (dict(head="pair"), "pair head"),
             "scratch": (dict(family=""), "no model family"),
             "spm": (dict(), "tokenizer")}
    for name, (fields, words) in cases.items():
        m = M.Model(M.Config(**{**small, **fields}))
        files = data.files_to_tensors(data.ListOpsTokenizer().files) if name == "spm" else tok
        M.save_atomic(M.checkpoint_dict(m, files), str(tmp_path / f"{name}.pt"))
        line = one_error_line(capsys, ["export", str(tmp_path / f"{name}.pt"), str(tmp_path / name), "--hf"])
        assert words in line and f"{name}.pt" in line and not (tmp_path / name).exists(), line
    M.save_atomic(M.checkpoint_dict(M.Model(M.Config(**small)), tok), str(tmp_path / "ok.pt"))
    (tmp_path / "taken").mkdir()
    line = one_error_line(capsys, ["export", str(tmp_path / "ok.pt"), str(tmp_path / "taken"), "--hf"])
    assert "exists; pass --force" in line and os.listdir(tmp_path / "taken") == []
    line = one_error_line(capsys, ["export", str(tmp_path / "ok.pt"), str(tmp_path / "no" / "dir"), "--hf"])
    assert f"no folder {tmp_path / 'no'}" in line
    M.main(["export", str(tmp_path / "ok.pt"), str(tmp_path / "taken"), "--hf", "--force"])
    assert "config.json" in os.listdir(tmp_path / "taken")


@pytest.mark.parametrize("finetuned", ["bert"], indirect=True)
def test_a_broken_mapping_is_caught(finetuned, tmp_path, monkeypatch):
    """HF_TABLE with query and key swapped: transformers still loads every weight, only the logits can tell."""
    family, ckpt, _ = finetuned
    swapped = [(h.replace(".query.", ".@.").replace(".key.", ".query.").replace(".@.", ".key."), o, f)
               for h, o, f in M.HF_TABLE]
    monkeypatch.setattr(M, "HF_TABLE", swapped)
    export(ckpt, tmp_path / "broken")
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "broken"),
                                                                             output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask, types = batch(data.tokenizer_from_path(str(ckpt)), TEXTS, "right", pairs=True)
    with torch.no_grad():
        diff = (M.load_pretrained(str(ckpt)).eval()(ids, mask, types) - hf.eval()(ids, mask, types).logits).abs().max()
    assert diff > 1e-4                                 # the comparison the tests above make would fail
    shutil.rmtree(tmp_path / "broken")
