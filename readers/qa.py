"""readers/qa.py: extractive question answering (SQuAD-format JSON): windows, the span loss, EM / F1.

What it is: ERNIE-Sparse reports question answering over long documents (74.67 against 71.43, methods.md §5).
The model reads "[cls] question [sep] context [sep]" and model.SpanHead gives every token a start and an end
logit; the answer is the best span (start <= end, at most MAX_ANSWER_TOKENS) inside the context. In three lines:
  - a context longer than --max-len is cut into windows that overlap (a new window every DOC_STRIDE tokens,
    BERT's run_squad); with dense attention --max-len stays small (512) and windows do the work, while sparse /
    HST attention take a long --max-len (e.g. 4096) and read a whole long context in one window;
  - loss = 1/2 (CE(start logits, start) + CE(end logits, end)); a window without the answer points at [cls];
  - evaluation takes, per question, the best span over all its windows and scores it with SQuAD v1.1's
    official exact match and F1 (normalisation: lowercase, no punctuation, no articles a/an/the, single spaces).
Tokens come from whitespace-separated words (as BERT's run_squad does): each word is tokenised on its own
(" " + word, so byte-level BPE sees the word as in running text), each token remembers its word, and a
predicted span is the text from its first word's first character to its last word's last character.

Input: DIR/train.json and DIR/dev.json (or the one train*.json / dev*.json there, e.g. SQuAD's
train-v1.1.json / dev-v1.1.json; TriviaQA and others are distributed in the same layout):
  {"data": [{"title": ..., "paragraphs": [{"context": "...", "qas": [{"id": "...", "question": "...",
      "answers": [{"text": "...", "answer_start": CHAR}, ...]}]}]}]}
Every answer must be its context's text at answer_start (an integer). SQuAD 2.0's unanswerable questions
("is_impossible": true) are skipped, counted and reported; any other question without answers is an error.

train.py loads this module on first use (train.reader: load_task, training_texts) and takes its objective "span"
from here: loss(model, batch, args, task, tok) and evaluate(raw, task, args, device, tok, shift_by=0).
How to run: python train.py --task squad --data DIR --max-len 384 ...   (docs/tasks.md)
"""
import glob
import json
import os
import re
import string
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import sar
from data import DataError, Example, TaskData, autocast, longest_first, make_batches, read_text

DOC_STRIDE = 128          # tokens between the starts of two windows of one context (BERT's run_squad)
MAX_QUERY_TOKENS = 64     # a longer question is cut
MAX_ANSWER_TOKENS = 30    # the longest span evaluation considers
TOP_K = 20                # start and end candidates per window


@dataclass
class SpanExample(Example):
    """One window of one question. label = (start, end) token positions of the answer, (0, 0) if not in it."""
    qid: str = ""
    word_of: list = None      # per token: index of the context word it belongs to, -1 outside the context
    words: list = None        # the context's words as (first char, end char), shared by the question's windows
    context: str = ""
    answers: list = None      # gold answer texts (evaluation)


# -----------------------------------------------------------------------------
# Reading SQuAD-format JSON

def _find(folder, stem):
    p = os.path.join(folder, stem + ".json")
    if os.path.isfile(p):
        return p
    found = sorted(glob.glob(os.path.join(folder, stem + "*.json")))
    if len(found) != 1:
        raise DataError(f"{folder}: no {stem}.json (or exactly one {stem}*.json) for --task squad")
    return found[0]


def _line_of(raw, qid):
    """The line of the file where question qid is written (1 if not found): errors name a line."""
    at = raw.find(json.dumps(qid))
    return raw.count("\n", 0, at) + 1 if at >= 0 else 1


def read_squad(path):
    """[{qid, question, context, answers: [(text, char start)], where}] of a SQuAD-format file; bad input ->
    DataError naming the file, line and question. SQuAD 2.0's unanswerable questions have answers []."""
    raw = read_text(path)
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataError(f"{path}:1: not SQuAD format (expected {{\"data\": [...]}})")
    out = []
    for i, article in enumerate(doc["data"]):
        paragraphs = _list_of_objects(article.get("paragraphs", []) if isinstance(article, dict) else None,
                                      f"{path}: data[{i}].paragraphs")
        for j, para in enumerate(paragraphs):
            context = para.get("context")
            for q in _list_of_objects(para.get("qas", []), f"{path}: data[{i}].paragraphs[{j}].qas"):
                qid = str(q.get("id", ""))
                at = f"{path}:{_line_of(raw, q.get('id', ''))}"
                where = f"{at}: question {qid!r}"
                if not isinstance(context, str) or not context.strip():
                    raise DataError(f"{where}: empty or missing context")
                if not isinstance(q.get("question"), str) or not q["question"].strip():
                    raise DataError(f"{where}: empty or missing question")
                answers = [_answer(a, context, where)
                           for a in _list_of_objects(q.get("answers", []), f"{where}: answers")]
                if not answers and q.get("is_impossible") is not True:
                    raise DataError(f"{where}: no answers (only SQuAD 2.0's \"is_impossible\": true questions may "
                                    "have none)")
                out.append({"qid": qid, "question": q["question"], "context": context, "answers": answers,
                            "where": at})
    if not out:
        raise DataError(f"{path}:1: no questions")
    return out


def _list_of_objects(value, where):
    """A SQuAD list (paragraphs, qas, answers) whose items are JSON objects; anything else is a DataError."""
    if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
        raise DataError(f"{where}: expected a list of objects, got {json.dumps(value)[:60]}")
    return value


def _answer(a, context, where):
    """(text, start) of one answer, checked against its context: an integer start, and the text is exactly the
    context's characters there (a wrong offset would train on the wrong span)."""
    text, start = a.get("text"), a.get("answer_start")
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{where}: an answer needs a non-empty \"text\", got {json.dumps(text)[:40]}")
    if not isinstance(start, int) or isinstance(start, bool):
        raise DataError(f"{where}: answer {text!r}: \"answer_start\" {json.dumps(start)} is not an integer")
    if start < 0 or start + len(text) > len(context):
        raise DataError(f"{where}: answer {text!r} at character {start} lies outside its context "
                        f"({len(context)} characters)")
    if context[start:start + len(text)] != text:
        raise DataError(f"{where}: answer {text!r} does not match its context at character {start} "
                        f"({context[start:start + len(text)]!r})")
    return text, start


def training_texts(task, data_dir, *, train_file=None, **files):
    """Contexts and questions of the training file (a from-scratch SentencePiece model is trained on them)."""
    items = read_squad(train_file or _find(data_dir, "train"))
    contexts = list(dict.fromkeys(q["context"] for q in items))          # each paragraph once
    return contexts + [q["question"] for q in items]


# -----------------------------------------------------------------------------
# Windows: [cls] question [sep] context window [sep]

def split_words(text):
    """Whitespace-separated words as (first char, end char)."""
    return [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]


def _word_ids(tok, word, cache):
    """A word's tokens in running text: the content of tok.encode(" " + word) without [cls] / [sep]."""
    if word not in cache:
        ids = tok.encode(" " + word)[1:]
        cache[word] = ids[:-1] if ids and ids[-1] == tok.sep_id else ids
    return cache[word]


def _layout(tok):
    """(separators between question and context, the context's type id): the tokenizer's own pair format,
    e.g. RoBERTa <s> q </s></s> c </s> (type 0), BERT [CLS] q [SEP] c [SEP] (type 1)."""
    ids, types = tok.encode_plus("a", "b")
    return [tok.sep_id] * max(1, ids.count(tok.sep_id) - 1), types[-1]


def windows(item, tok, max_len, cache, stride=DOC_STRIDE):
    """SpanExamples of one question: the context in windows of at most max_len tokens in all, overlapping."""
    question = []
    for s, e in split_words(item["question"]):
        question += _word_ids(tok, item["question"][s:e], cache)
    question = question[:MAX_QUERY_TOKENS]
    mid, ctx_type = _layout(tok)
    head = [tok.cls_id] + question + mid                                   # the window's tokens start after this
    budget = max_len - len(head) - 1                                       # room for context tokens (+ final sep)
    if budget < 1:
        raise DataError(f"--max-len {max_len} leaves no room for the context after a {len(question)}-token question")
    words = split_words(item["context"])
    ctx, word_of = [], []                                                  # every context token and its word
    for w, (s, e) in enumerate(words):
        pieces = _word_ids(tok, item["context"][s:e], cache)
        ctx += pieces
        word_of += [w] * len(pieces)
    # the first answer as a token span (training label): its first word's first token .. last word's last token
    span = None
    if item["answers"]:
        text, start = item["answers"][0]
        end = start + len(text)
        first = next(w for w, (s, e) in enumerate(words) if e > start)    # the words the answer touches
        last = max(w for w, (s, e) in enumerate(words) if s < end)
        inside = [t for t, w in enumerate(word_of) if first <= w <= last]  # their tokens
        span = (inside[0], inside[-1]) if inside else None
    out, a = [], 0
    while True:
        b = min(a + budget, len(ctx))
        ids = head + ctx[a:b] + [tok.sep_id]
        types = [0] * len(head) + [ctx_type] * (b - a + 1)
        label = (0, 0)                                                     # answer not inside: point at [cls]
        if span is not None and a <= span[0] and span[1] < b:
            label = (len(head) + span[0] - a, len(head) + span[1] - a)
        out.append(SpanExample(ids, types, label, qid=item["qid"], word_of=[-1] * len(head) + word_of[a:b] + [-1],
                               words=words, context=item["context"], answers=[t for t, _ in item["answers"]]))
        if b >= len(ctx):
            return out
        a += min(stride, budget)


def load_task(task, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    """TaskData of SQuAD-format train / dev files: windows of every answered question (head "span").
    columns (train.py's --text-col etc.) do not apply: the JSON format names its fields."""
    if tok is None or not hasattr(tok, "encode"):
        raise DataError("--task squad needs a text tokenizer")
    if not os.path.isdir(data_dir) and (train_file is None or dev_file is None):
        raise DataError(f"{data_dir}: --task squad needs a folder with train.json and dev.json")
    cache, skipped, splits = {}, [], {}
    paths = (("train", train_file or _find(data_dir, "train")), ("dev", dev_file or _find(data_dir, "dev")))
    for split, path in paths:
        examples = []
        for item in read_squad(path):
            if not item["answers"]:
                skipped.append(item["where"])                              # unanswerable (SQuAD 2.0): not supported
                continue
            examples += windows(item, tok, max_len, cache)
        splits[split] = examples
    return TaskData(splits["train"], {"dev": splits["dev"]}, 2, False, "f1", [], 0, skipped, head="span")


# -----------------------------------------------------------------------------
# Loss and evaluation

def span_loss(logits, labels, attention_mask):
    """1/2 (CE(start) + CE(end)) over the real tokens. logits [B, L, 2], labels [B, 2], attention_mask [B, L]."""
    logits = logits.float().masked_fill(~attention_mask.bool().unsqueeze(-1), -1e4)   # padding never predicted
    return 0.5 * (F.cross_entropy(logits[..., 0], labels[:, 0]) + F.cross_entropy(logits[..., 1], labels[:, 1]))


def loss(model, batch, args, task, tok):
    """The training loss (train.py's objective "span"): the span loss, with SAR / R-Drop if asked (logged apart as ce,
    consistency)."""
    shift_by, alpha = sar.second_view(args)                             # SAR's shifted view, or R-Drop's copy
    if shift_by is not None:
        total, ce, cons = sar_span_loss(model, batch, alpha, shift_by, args.ce)
        return total, {"ce": ce.item(), "consistency": cons.item()}
    logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])   # [B, L, 2]
    return span_loss(logits, batch["labels"], batch["attention_mask"]), {}


def sar_span_loss(model, batch, alpha, shift_by, ce="all"):
    """SAR for spans (methods.md §2.3): both topologies' span losses (ce="original": the original's alone) + alpha *
    the symmetric KL between their start distributions and between their end distributions (over the real tokens),
    averaged. shift_by = 0: R-Drop."""
    z1, z2 = sar.stacked_views(model, batch, second=shift_by)          # [B, L + s, 2] each
    mask = batch["attention_mask"]
    L = mask.size(1)
    z1, z2 = z1[:, :L], sar.unshift(z2, shift_by)                       # both [B, L, 2], the same positions
    if ce == "original":
        ce = span_loss(z1, batch["labels"], mask)
    else:
        ce = 0.5 * (span_loss(z1, batch["labels"], mask) + span_loss(z2, batch["labels"], mask))
    pad = ~mask.bool().unsqueeze(-1)
    z1, z2 = z1.float().masked_fill(pad, -1e4), z2.float().masked_fill(pad, -1e4)
    cons = 0.5 * (sar.consistency(z1[..., 0], z2[..., 0]) + sar.consistency(z1[..., 1], z2[..., 1]))
    return ce + alpha * cons, ce, cons


def best_span(start, end, word_of):
    """(score, first word, last word) of the best valid span of one window, or None. start, end: [L] numpy."""
    L = len(word_of)
    start, end = start[:L], end[:L]
    best = None
    for i in np.argsort(-start)[:TOP_K]:
        for j in np.argsort(-end)[:TOP_K]:
            if word_of[i] < 0 or word_of[j] < 0 or j < i or j - i + 1 > MAX_ANSWER_TOKENS:
                continue
            score = float(start[i] + end[j])
            if best is None or score > best[0]:
                best = (score, word_of[i], word_of[j])
    return best


@torch.no_grad()
def evaluate(raw, task, args, device, tok, shift_by=0):
    """{split: {"em", "f1", "questions"}}: the best span of each question over its windows, scored against
    every gold answer (the best match counts), as SQuAD v1.1's evaluate script does. shift_by: evaluate with the
    topology shifted (train.py --eval-shift). args: train.py's (its --batch-size)."""
    raw.eval()
    out = {}
    for split, examples in task.dev.items():
        best, golds = {}, {}                         # qid -> (score, predicted text); qid -> gold texts
        examples = longest_first(examples)           # little padding per batch; answers are matched by qid
        batches = make_batches(examples, args.batch_size, pad_id=raw.cfg.pad_id, seed=0, epoch=0, shuffle=False)
        i = 0
        for batch in batches:
            ids, mask, types = (batch[k].to(device) for k in ("input_ids", "attention_mask", "token_type_ids"))
            pos = None
            if shift_by:
                ids, mask, pos, types = sar.shift(ids, mask, shift_by, raw.cfg.pad_id, raw.position_ids(ids), types)
            with autocast(device):
                logits = sar.unshift(raw(ids, mask, types, pos), shift_by).float().cpu().numpy()    # [B, L, 2]
            for z in logits:
                ex = examples[i]
                i += 1
                golds[ex.qid] = ex.answers
                span = best_span(z[:, 0], z[:, 1], ex.word_of)
                if span is not None and (ex.qid not in best or span[0] > best[ex.qid][0]):
                    best[ex.qid] = (span[0], ex.context[ex.words[span[1]][0]:ex.words[span[2]][1]])
        preds = {q: best[q][1] if q in best else "" for q in golds}
        out[split] = {**squad_scores(preds, golds), "questions": len(golds)}
    raw.train()
    return out


# -----------------------------------------------------------------------------
# SQuAD v1.1's official metric

def normalize_answer(s):
    """Lowercase, drop punctuation, drop the articles a / an / the, collapse whitespace (SQuAD's order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction, gold):
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction, gold):
    """Token F1 of the normalised answers: 2 P R / (P + R), P = common / |pred|, R = common / |gold|."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_scores(preds, golds):
    """{"em", "f1"} in percent: the mean over questions of the best score against any gold answer."""
    em = [max(exact_match(preds[q], g) for g in golds[q]) for q in golds]
    f1 = [max(f1_score(preds[q], g) for g in golds[q]) for q in golds]
    return {"em": 100.0 * float(np.mean(em)), "f1": 100.0 * float(np.mean(f1))}
