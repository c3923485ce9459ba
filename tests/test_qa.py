"""Tests of readers/qa.py: SQuAD's EM / F1 on hand-computed cases, the windows and their labels, the span head and its
loss (with SAR), the bad-answer error, and a 2-step run of --task squad through train.main on dense, sparse and
HST attention. Fixtures are SQuAD-format JSON written here. Run: python -m pytest tests/test_qa.py -q
"""
import json
import os
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
from readers import qa
from model import Config, Model, SpanHead
from test_train import check_eval_shift_all, run_main

TINY = ["--init", "scratch", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64",
        "--attn-dropout", "standard", "--device", "cpu"]       # AttendOut is refused for QA (methods.md §3.1)


class WordTok:
    """A whitespace tokenizer with BERT's pair layout ([cls] a [sep] b [sep], types 0 / 1): ids we can read."""

    def __init__(self, words):
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = 0, 1, 2, 3, 4
        self.vocab = {w: i + 5 for i, w in enumerate(sorted(set(words)))}

    def encode_plus(self, text, pair=None, max_len=None):
        ids = [self.cls_id] + [self.vocab.get(w, 1) for w in text.split()] + [self.sep_id]
        types = [0] * len(ids)
        if pair is not None:
            b = [self.vocab.get(w, 1) for w in pair.split()] + [self.sep_id]
            ids, types = ids + b, types + [1] * len(b)
        return ids, types

    def encode(self, text, pair=None):
        return self.encode_plus(text, pair)[0]


def squad_json(paragraphs):
    """[(context, [(qid, question, [(answer text, answer_start)])])] -> SQuAD v1.1 layout, one question a line."""
    lines = ['{"version": "1.1", "data": [{"title": "t", "paragraphs": [']
    for p, (context, qas) in enumerate(paragraphs):
        lines.append(('' if p == 0 else ',') + '{"context": ' + json.dumps(context) + ', "qas": [')
        for k, (qid, question, answers) in enumerate(qas):
            ans = [{"text": t, "answer_start": s} for t, s in answers]
            lines.append(('' if k == 0 else ',') + json.dumps({"id": qid, "question": question, "answers": ans}))
        lines.append(']}')
    lines.append(']}]}')
    return "\n".join(lines) + "\n"


CONTEXT = "Paris is the capital of France . It has the Eiffel Tower , built in 1889 ."


def answer(text, context=CONTEXT):
    return (text, context.index(text))


# -----------------------------------------------------------------------------
# the official metric

def test_normalisation_and_em_f1_hand_cases():
    assert qa.normalize_answer("The  Cat, sat!") == "cat sat"
    assert qa.normalize_answer("an apple and a pear") == "apple and pear"       # articles go, "and" stays
    assert qa.normalize_answer("Theory of the U.S.") == "theory of us"
    assert qa.exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert qa.exact_match("Eiffel", "Eiffel Tower") == 0.0
    # pred {red, apple, pie}, gold {red, apple}: P = 2/3, R = 1, F1 = 2 * 2/3 / (5/3) = 0.8
    assert qa.f1_score("a red apple pie", "the red apple") == pytest.approx(0.8)
    assert qa.f1_score("1990s", "1990") == 0.0
    assert qa.f1_score("the", "a") == 0.0                                      # both normalise to nothing
    # repeated tokens count as often as both sides have them: pred {a1 b b}, gold {b b b c}: common 2
    assert qa.f1_score("x b b", "b b b c") == pytest.approx(2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4))
    # the best gold answer counts; averaged over questions, in percent
    scores = qa.squad_scores({"q1": "Denver Broncos", "q2": "1990s"},
                             {"q1": ["Broncos", "Denver Broncos"], "q2": ["1990", "in 1990"]})
    assert scores == {"em": 50.0, "f1": 50.0}


# -----------------------------------------------------------------------------
# windows and labels

def test_windows_ids_labels_and_stride():
    tok = WordTok(CONTEXT.split() + "What is in Paris ?".split())
    item = {"qid": "q", "question": "What is in Paris ?", "context": CONTEXT, "answers": [answer("Eiffel Tower")]}
    (w,) = qa.windows(item, tok, max_len=64, cache={})
    q = [tok.vocab[x] for x in "What is in Paris ?".split()]
    ctx = [tok.vocab[x] for x in CONTEXT.split()]
    assert w.ids == [2] + q + [3] + ctx + [3]
    assert w.type_ids == [0] * 7 + [1] * (len(ctx) + 1)
    s = 7 + CONTEXT.split().index("Eiffel")
    assert w.label == (s, s + 1) and w.ids[s:s + 2] == [tok.vocab["Eiffel"], tok.vocab["Tower"]]
    # windows of 7 + 6 + 1 = 14 tokens (6 context tokens each), a new one every 3 tokens (stride)
    ws = qa.windows(item, tok, max_len=14, cache={}, stride=3)
    assert all(len(x.ids) <= 14 for x in ws)
    assert len(ctx) == 17 and [x.word_of[7] for x in ws] == [0, 3, 6, 9, 12]      # the last one reaches the end
    covered = sorted({i for x in ws for i in x.word_of if i >= 0})
    assert covered == list(range(len(ctx)))                                     # every context token is in a window
    for x in ws:                                                                # the answer, or [cls]
        inside = [i for i, wd in enumerate(x.word_of) if wd in (10, 11)]       # "Eiffel", "Tower"
        assert x.label == ((inside[0], inside[-1]) if len(inside) == 2 else (0, 0))
    assert sum(x.label != (0, 0) for x in ws) >= 1


def test_windows_advance_by_the_doc_stride(tmp_path):
    """A long context is cut into windows that start every DOC_STRIDE = 128 tokens (BERT's run_squad), through
    the task's reader: each window as long as --max-len allows, neighbours overlapping by the rest."""
    assert qa.DOC_STRIDE == 128
    words = [f"w{i}" for i in range(400)]
    context = " ".join(words)
    tok = WordTok(words + ["where", "?"])
    qas = [("q", "where ?", [("w300", context.index("w300 "))])]
    for split in ("train", "dev"):
        (tmp_path / f"{split}.json").write_text(squad_json([(context, qas)]))
    task = qa.load_task("squad", str(tmp_path), tok, max_len=200)
    head = 4                                                                    # [cls] where ? [sep]
    for ws in (task.train, task.dev["dev"]):
        assert [w.word_of[head] for w in ws] == [0, 128, 256]                   # first context word of each
        assert [len(w.ids) for w in ws] == [200, 200, head + 400 - 256 + 1]     # budget 195 tokens, then the rest
        assert [w.label for w in ws] == [(0, 0), (head + 300 - 128,) * 2, (head + 300 - 256,) * 2]   # w300


def test_reader_errors_name_file_line_and_question(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(squad_json([(CONTEXT, [("q1", "Where ?", [answer("Paris")]),
                                           ("q2", "When ?", [("1889 .", len(CONTEXT) - 3)])])]))
    with pytest.raises(data.DataError, match=r"train\.json:4: question 'q2': answer '1889 \.' at character \d+ lies "
                                             r"outside its context \(\d+ characters\)"):
        qa.read_squad(str(path))
    path.write_text('{"data": [\n{"paragraphs": [}\n]}')
    with pytest.raises(data.DataError, match=r"train\.json:2: invalid JSON"):
        qa.read_squad(str(path))


# -----------------------------------------------------------------------------
# the span head, its loss, SAR on spans, the best span

def tiny_model(attention="dense", dropout=0.0, std=None):
    """A span model; std: redraw every weight from N(0, std^2), so that its logits are far from uniform."""
    cfg = Config(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=64,
                 pad_id=0, position_style="bert", num_labels=2, head="span", attention=attention, block_size=4,
                 hidden_dropout_p=dropout, attn_dropout_p=dropout)
    model = Model(cfg)
    if std is not None:
        for p in model.parameters():
            torch.nn.init.normal_(p, std=std)
    return model


def test_span_head_shapes_and_loss():
    torch.manual_seed(0)
    head = SpanHead(tiny_model().cfg)
    h = torch.randn(3, 9, 16)
    assert head(h).shape == (3, 9, 2)
    logits = torch.randn(3, 9, 2)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    labels = torch.tensor([[1, 4], [2, 5], [0, 0]])
    loss = qa.span_loss(logits, labels, mask)
    # by hand: -1/2 (log softmax(start)[s] + log softmax(end)[e]) averaged over the batch, padding excluded
    ref = 0.0
    for b in range(3):
        n = int(mask[b].sum())
        ref += -0.5 * (F.log_softmax(logits[b, :n, 0], 0)[labels[b, 0]] + F.log_softmax(logits[b, :n, 1], 0)[labels[b, 1]])
    assert loss.item() == pytest.approx(ref.item() / 3, rel=1e-5)
    logits[1, 7] = 100.0                                                        # padding never wins
    assert qa.span_loss(logits, labels, mask).item() == pytest.approx(loss.item(), rel=1e-5)


def test_sar_span_views_line_up():
    """Dense attention, no dropout: the shifted view computes the same logits once the inserted positions are
    dropped, so the consistency term is 0 and the loss equals the plain span loss; HST's views differ."""
    torch.manual_seed(0)
    ids = torch.randint(5, 40, (2, 30))                                         # 8 blocks of 4: HST is not dense
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
             "labels": torch.tensor([[3, 5], [1, 2]])}
    model = tiny_model(std=0.3).eval()
    loss, ce, cons = qa.sar_span_loss(model, batch, 1.0, 2)
    plain = qa.span_loss(model(ids, mask), batch["labels"], mask)
    assert cons.item() < 1e-9 and ce.item() == pytest.approx(plain.item(), rel=1e-5)
    hst = tiny_model("hst", std=0.3).eval()
    assert qa.sar_span_loss(hst, batch, 1.0, 2)[2].item() > 1e-5                  # dense: 3e-15


def test_best_span_in_context_only():
    word_of = [-1, -1, -1, 0, 1, 2, 3, -1]                                     # [cls] q [sep] c0 c1 c2 c3 [sep]
    start = np.array([9.0, 5, 0, 1, 4, 0, 0, 0])
    end = np.array([9.0, 0, 0, 0, 0, 3, 2, 0])
    assert qa.best_span(start, end, word_of) == (7.0, 1, 2)                    # [cls] and the question never count


# -----------------------------------------------------------------------------
# end to end through train.py

def write_squad_dir(folder, n=24, seed=0):
    """Tiny SQuAD folder: "NAME lives in CITY ." contexts, "Where does NAME live ?" questions, CITY the answer."""
    rng = random.Random(seed)
    names = "anna ben carl dora emil fay gus hana ivo jan kim lea".split()
    cities = "paris rome oslo lima cairo tokyo delhi quito".split()
    filler = "the river is long and the hills are green in spring".split()
    os.makedirs(folder, exist_ok=True)
    for split, count in (("train", n), ("dev", n // 3)):
        paras = []
        for i in range(count):
            name, city = rng.choice(names), rng.choice(cities)
            pre = " ".join(rng.choice(filler) for _ in range(rng.randint(4, 12)))
            context = f"{pre} {name} lives in {city} . {' '.join(rng.choice(filler) for _ in range(8))}"
            paras.append((context, [(f"{split}{i}", f"where does {name} live ?",
                                     [(city, context.index(f" {city} .") + 1)])]))
        with open(os.path.join(folder, f"{split}.json"), "w") as f:
            f.write(squad_json(paras))
    return folder


@pytest.mark.parametrize("attention", ["dense", "sparse", "hst"])
def test_squad_trains_end_to_end(attention, tmp_path, capfd):
    folder = write_squad_dir(str(tmp_path / "squad"))
    out = tmp_path / "out"
    # dense: short windows (the contexts need several); sparse / HST: one long window per context
    max_len = "24" if attention == "dense" else "64"
    argv = ["--task", "squad", "--data", folder, "--out", str(out), "--max-steps", "2", "--batch-size", "4",
            "--max-len", max_len, "--attention", attention, "--block-size", "8", "--vocab-size", "60", "--lr", "1e-3",
            *TINY]
    if attention == "hst":
        argv += ["--sar", "1.0", "--eval-shift", "1"]
    code, _, err = run_main(argv, capfd)
    assert code == 0, err
    final = json.load(open(out / "final.json"))
    dev = final["dev_splits"]["dev"]
    assert final["metric"] == "f1" and dev["questions"] == 8 and 0 <= dev["em"] <= dev["f1"] <= 100
    assert final["config"]["head"] == "span" and final["majority_baseline"] is None
    if attention == "hst":
        assert list(dev["shift"]["by"]) == ["1"]
        assert any("consistency" in json.loads(line) for line in open(out / "log.jsonl"))
    task = qa.load_task("squad", folder, data.tokenizer_from_path(str(out / "ckpt_last.pt")), max_len=int(max_len))
    assert (len(task.dev["dev"]) > 8) == (attention == "dense")                # windows only where the text is long


def test_squad_runs_with_the_defaults(tmp_path, capfd):
    """python train.py --task squad --data DIR: the demo's AttendOut falls back to standard attention dropout (the
    opening line says so) and SAR stays; --attn-dropout attendout given is still one error line."""
    folder = write_squad_dir(str(tmp_path / "squad"))
    argv = ["--task", "squad", "--data", folder, "--max-steps", "2", "--batch-size", "4", "--vocab-size", "60"]
    code, out, err = run_main([*argv, "--out", str(tmp_path / "a")], capfd)
    assert code == 0, err
    opening = out.splitlines()[0]
    assert "| hst attention, attention dropout 0.1, SAR alpha 1 shift 1 (CE on the original view), the default " \
           "AttendOut falls back to standard attention dropout: it compares class or value predictions, not " \
           "squad's |" in opening, opening
    final = json.load(open(tmp_path / "a" / "final.json"))
    assert final["config"]["attn_dropout"] == "standard" and final["args"]["sar"] == 1.0
    code, _, err = run_main([*argv, "--out", str(tmp_path / "b"), "--attn-dropout", "attendout"], capfd)
    assert code == 2 and len(err) == 1 and "--attn-dropout attendout needs a classification" in err[0]


def test_eval_shift_all_on_spans(tmp_path, capfd):
    """QA's span head under every shift s = 1 .. 7 (the span logits put back on the original tokens, sar.unshift)."""
    folder = write_squad_dir(str(tmp_path / "squad"))
    argv = ["--task", "squad", "--data", folder, "--max-steps", "2", "--batch-size", "4", "--max-len", "64",
            "--attention", "sparse", "--block-size", "8", "--vocab-size", "60", "--lr", "1e-3", *TINY]
    final = check_eval_shift_all(argv, tmp_path, capfd, range(1, 8), "f1")
    assert set(final["shift"]["worst"]) == {"em", "f1"}          # the count of questions is no score


def test_answer_outside_context_through_train(tmp_path, capfd):
    folder = write_squad_dir(str(tmp_path / "squad"))
    with open(os.path.join(folder, "dev.json")) as f:
        text = f.read().replace('"answer_start": ', '"answer_start": 1000', 1)
    with open(os.path.join(folder, "dev.json"), "w") as f:
        f.write(text)
    code, _, lines = run_main(["--task", "squad", "--data", folder, "--out", str(tmp_path / "o"), "--vocab-size", "60",
                               *TINY], capfd)
    assert code == 2 and len(lines) == 1
    # line 1: the header, line 2: the first context, line 3: its question
    assert re.fullmatch(re.escape(f"error: {os.path.join(folder, 'dev.json')}:3: question 'dev0': answer ")
                        + r"'\w+' at character 1000\d+ lies outside its context \(\d+ characters\)", lines[0]), lines[0]
