"""tasks.py: one table of tasks: how each is read, what loss trains it, how it is scored.

What it is: the only place that knows every task. train.py looks its task up here (TASKS[args.task]) and calls
the entry's functions; it has no branch per task. Imports run one way, from the bottom up:
    vocab.py   tokenizers
    data.py    what an example is (Example, PairExample, TaskData), batching, metrics, the GLUE / TSV / ListOps /
               masked-LM readers
    lra.py     the readers of four LRA tasks              (imports data)
    qa.py      extractive QA: reader, span loss, EM / F1  (imports data, sar)
    tasks.py   this table, and the loss and evaluation of classification, LRA Retrieval's pairs and masked LM
    train.py   the loop                                   (imports tasks, data)
A new task: its reader (and, if its head is new, its loss and evaluation) in its own module, and one entry below.

Each entry (Kind) holds, for one task:
  load(name, data_dir, tok, max_len=..., **files)   -> data.TaskData   (files: files_and_columns(args))
  loss(model, batch, args, task, tok)               -> (loss, {part: float} to log), the training objective
  evaluate(raw, task, args, device, tok, shift_by)  -> {dev split: {metric: value}}, the model in eval mode
  max_len, tokenizer, texts, percent                 defaults and the console's percent (see Kind)

Run: python tasks.py lra-text DIR   (also lra-retrieval, lra-image, lra-pathfinder, squad --tokenizer CKPT):
     reads a task folder and prints its statistics.
"""
import signal
import sys

if __name__ == "__main__":      # Ctrl-C while torch loads: exit 130 without a traceback (main takes over after)
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import json
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

import data
import lra
import qa
import sar
from data import DataError
from cli import ArgumentParser, one_line_errors
from infra import autocast, warn


# -----------------------------------------------------------------------------
# Classification (GLUE, tsv, ListOps, LRA Text / Image / Pathfinder) and LRA Retrieval's pairs

def classification_loss(model, batch, args, task, tok):
    """Cross-entropy (MSE for a regression head, methods.md §1); with --sar / --rdrop both views' losses plus
    alpha x their consistency (sar.py, methods.md §2.3), logged apart as ce and consistency."""
    if args.sar > 0:          # SAR: the original and the shifted topology, CE + alpha * symmetric KL
        loss, ce, cons = sar.sar_loss(model, batch, args.sar, args.sar_shift, task.is_regression)
    elif args.rdrop > 0:      # R-Drop: two unshifted views
        loss, ce, cons = sar.rdrop_loss(model, batch, args.rdrop, task.is_regression)
    else:
        logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        return sar.task_loss(logits, batch["labels"], task.is_regression), {}
    return loss, {"ce": ce.item(), "consistency": cons.item()}


def pair_loss(model, batch, args, task, tok):
    """LRA Retrieval's dual encoder: [B, 2, L] -> [2B, L] (pair i = rows 2i, 2i + 1; model.PairHead pairs them
    back), then the classifier's loss."""
    return classification_loss(model, data.flatten_pairs(batch), args, task, tok)


@torch.no_grad()
def classification_evaluate(raw, task, args, device, tok, shift_by=0, pairs=False):
    """The task's metrics (data.compute_metrics) on every dev split: one pass, the original topology unless
    shift_by (train.py --eval-shift: shifted by shift_by tokens, sar.shift). pairs: LRA Retrieval's batches."""
    raw.eval()
    out = {}
    for split, examples in task.dev.items():
        preds, labels = [], []
        # longest first (data.longest_first), each batch padded to its longest example only: the model pads to
        # its block size itself (Model.pad_to_block)
        for batch in data.make_batches(data.longest_first(examples), args.batch_size, pad_id=tok.pad_id, seed=0,
                                       epoch=0, shuffle=False):
            batch = {k: v.to(device) for k, v in batch.items()}
            if pairs:
                batch = data.flatten_pairs(batch)
            ids, mask, pos, types = batch["input_ids"], batch["attention_mask"], None, batch["token_type_ids"]
            if shift_by:
                ids, mask, pos, types = sar.shift(ids, mask, shift_by, raw.cfg.pad_id, raw.position_ids(ids), types)
            with autocast(device):
                logits = raw(ids, mask, types, pos).float()
            preds.append(logits.squeeze(-1) if task.is_regression else logits.argmax(-1))
            labels.append(batch["labels"])
        out[split] = data.compute_metrics(args.task, torch.cat(preds).cpu().numpy(), torch.cat(labels).cpu().numpy())
    raw.train()
    return out


def pair_evaluate(raw, task, args, device, tok, shift_by=0):
    return classification_evaluate(raw, task, args, device, tok, shift_by, pairs=True)


# -----------------------------------------------------------------------------
# Masked-LM pretraining

def special_ids(tok):
    """The ids masking never selects."""
    return [tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id]


def masked_lm_ce(logits, labels):
    """Mean cross-entropy over the selected tokens (labels -100 elsewhere); a batch with none selected gives 0."""
    labels = labels.flatten()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=-100, reduction="sum")
    return ce / (labels != -100).sum().clamp(min=1)


def mlm_loss(model, batch, args, task, tok):
    """Masked-LM: 15% of real tokens selected, 80/10/10 mask/random/keep (data.mask_tokens), CE on them. The
    masking runs on the CPU (the global RNG, so a resumed run draws the same masks)."""
    ids, labels = data.mask_tokens(batch["input_ids"].cpu(), batch["attention_mask"].cpu(), mask_id=tok.mask_id,
                                   vocab_size=tok.vocab_size, special_ids=special_ids(tok))
    device = batch["input_ids"].device
    logits = model(ids.to(device), batch["attention_mask"], batch["token_type_ids"], head="mlm")   # [B, L, V]
    return masked_lm_ce(logits, labels.to(device)), {}


@torch.no_grad()
def mlm_evaluate(raw, task, args, device, tok, shift_by=0):
    """{split: {"loss", "ppl"}}: masked-LM loss on the dev text with fixed masks (one seed per batch), and its
    perplexity. shift_by: the same masks with the topology shifted (sar.shift; logits put back, sar.unshift)."""
    raw.eval()
    out = {}
    for split, examples in task.dev.items():
        losses = []
        for batch in data.make_batches(data.longest_first(examples), args.batch_size, pad_id=tok.pad_id, seed=0,
                                       epoch=0, shuffle=False):
            batch = {k: v.to(device) for k, v in batch.items()}
            g = torch.Generator().manual_seed(len(losses))
            ids, lab = data.mask_tokens(batch["input_ids"].cpu(), batch["attention_mask"].cpu(), mask_id=tok.mask_id,
                                        vocab_size=tok.vocab_size, special_ids=special_ids(tok), generator=g)
            ids, mask, pos = ids.to(device), batch["attention_mask"], None
            if shift_by:
                ids, mask, pos, _ = sar.shift(ids, mask, shift_by, raw.cfg.pad_id, raw.position_ids(batch["input_ids"]))
            with autocast(device):
                logits = sar.unshift(raw.mlm_logits(ids, mask, None, pos), shift_by)     # [B, L, V]
            losses.append(masked_lm_ce(logits, lab.to(device)).item())
        out[split] = {"loss": float(np.mean(losses)), "ppl": float(math.exp(min(np.mean(losses), 50)))}
    raw.train()
    return out


# -----------------------------------------------------------------------------
# The table

@dataclass(frozen=True)
class Kind:
    """How one task is read, trained and scored (the functions' signatures: the module docstring)."""
    load: Callable                  # the reader: files -> data.TaskData
    loss: Callable                  # the training objective of one batch
    evaluate: Callable              # dev metrics
    max_len: int = 512              # --max-len when not given (LRA: its own input lengths)
    tokenizer: Callable = None      # the task's own tokenizer class (ListOps symbols, bytes / pixels); None: the
                                    # checkpoint's, or from scratch a SentencePiece model trained on `texts`
    texts: Callable = None          # (name, data_dir, **files) -> the training texts, for that SentencePiece model
    percent: tuple = ("acc", "f1")  # metrics shown in percent on the console ...
    scale: float = 100.0            # ... after multiplying by this (100: fractions; 1: already percent, SQuAD)


CLASSIFY = Kind(data.load_task, classification_loss, classification_evaluate, texts=data.training_texts)
LRA = dict(load=lra.load, loss=classification_loss, evaluate=classification_evaluate, tokenizer=data.ByteTokenizer)

TASKS = {
    **{name: CLASSIFY for name in data.TASKS},       # the nine GLUE tasks (data.TASKS: files, columns, metric)
    "tsv": CLASSIFY,                                  # any labelled TSV / CSV / JSONL (--text-col, --label-col)
    "listops": Kind(data.load_task, classification_loss, classification_evaluate, tokenizer=data.ListOpsTokenizer),
    "lra-text": Kind(**LRA, max_len=lra.DEFAULT_MAX_LEN["lra-text"]),
    "lra-retrieval": Kind(**{**LRA, "loss": pair_loss, "evaluate": pair_evaluate},
                          max_len=lra.DEFAULT_MAX_LEN["lra-retrieval"]),
    "lra-image": Kind(**LRA, max_len=lra.DEFAULT_MAX_LEN["lra-image"]),
    "lra-pathfinder": Kind(**LRA, max_len=lra.DEFAULT_MAX_LEN["lra-pathfinder"]),
    "squad": Kind(qa.load, qa.loss, qa.evaluate, texts=qa.training_texts, percent=("em", "f1"), scale=1.0),
    "mlm": Kind(data.load_task, mlm_loss, mlm_evaluate, texts=data.training_texts, percent=()),
}


def kind(name):
    """TASKS[name], or a DataError that lists the tasks."""
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    return TASKS[name]


def files_and_columns(args):
    """train.py's flags that say where a task's files and columns are (every reader takes them by name)."""
    return dict(train_file=args.train_file, dev_file=args.dev_file, text_col=args.text_col,
                text_pair_col=args.text_pair_col, label_col=args.label_col)


def load_task(name, data_dir, tok, *, max_len, **files):
    """data.TaskData of any task: its entry's reader (files: files_and_columns)."""
    return kind(name).load(name, data_dir, tok, max_len=max_len, **files)


def fixed_tokenizer(name):
    """The tokenizer the task's inputs define (ListOps symbols, LRA bytes / pixels), or None."""
    make = kind(name).tokenizer
    return make() if make is not None else None


def training_texts(name, data_dir, **files):
    """The raw training texts of a task (both sides of pairs), to train a from-scratch SentencePiece model."""
    texts = kind(name).texts
    if texts is None:
        raise DataError(f"task {name!r} has no text to train a tokenizer on")
    return texts(name, data_dir, **files)


def show_value(name, metric, v):
    """One metric's value as the console shows it: "83.4%" for the task's fractions (acc, F1; SQuAD's EM / F1 are
    percent already), "0.5120" for the others (MCC, correlations, loss), a count as it is."""
    k = kind(name)
    if metric in k.percent:
        return f"{v * k.scale:.1f}%"
    return f"{v}" if isinstance(v, int) else f"{v:.4f}"


# train.py's perturbed evaluations (--eval-shift, --eval-redraw), as the console names them
PERTURBED = {"shift": "shifted", "redraw": "redrawn"}


def show_metrics(name, metrics):
    """{metric: value} -> "acc 83.4%, f1 80.2%" (show_value for each), then each perturbed evaluation's mean and
    worst: "acc 83.4% | shifted mean 82.9% worst 82.1%" (the metric's name too where there are several)."""
    plain = lambda ms: ", ".join(f"{m} {show_value(name, m, v)}" for m, v in ms.items())
    short = lambda ms: show_value(name, *next(iter(ms.items()))) if len(ms) == 1 else plain(ms)
    parts = [plain({m: v for m, v in metrics.items() if m not in PERTURBED})]
    parts += [f"{PERTURBED[p]} mean {short(metrics[p]['mean'])} worst {short(metrics[p]['worst'])}"
              for p in PERTURBED if p in metrics]
    return " | ".join(parts)


# -----------------------------------------------------------------------------
# CLI: read a task folder and print its statistics

def describe_task(name, data_dir, max_len=None, tokenizer_path=None):
    """({split: {examples, mean_len, max_len, labels}}, the skipped rows' "FILE:LINE"s) of a task folder: checks
    that its files read cleanly. Lengths in tokens ([cls] included; a pair: its longer document)."""
    tok = data.load_tokenizer(tokenizer_path) if tokenizer_path else fixed_tokenizer(name)
    task = load_task(name, data_dir, tok, max_len=max_len or kind(name).max_len)
    out = {}
    for split, examples in [("train", task.train), *task.dev.items()]:
        lengths = [max(len(e.ids), len(e.ids2)) if isinstance(e, data.PairExample) else len(e.ids) for e in examples]
        out[split] = {"examples": len(examples), "mean_len": round(float(np.mean(lengths)), 1),
                      "max_len": max(lengths)}
        if task.label_names:
            out[split]["labels"] = np.bincount([e.label for e in examples], minlength=task.num_labels).tolist()
    return {"task": name, "truncated": task.n_truncated, "skipped": task.n_skipped, **out}, task.skipped


def main(argv=None):
    parser = ArgumentParser(description="read a task's data folder (docs/tasks.md) and print its statistics")
    sub = parser.add_subparsers(dest="task", required=True)
    for name in lra.TASKS + ("squad",):
        c = sub.add_parser(name, help=f"read a {name} data folder")
        c.add_argument("data_dir")
        c.add_argument("--max-len", type=int, default=None, help="tokens per example (default: the task's)")
        if name == "squad":
            c.add_argument("--tokenizer", required=True, help="an HF folder or .pt checkpoint whose tokenizer to use")
    args = parser.parse_args(argv)
    if args.max_len is not None and args.max_len < 1:
        parser.error(f"--max-len {args.max_len}: must be >= 1")
    with one_line_errors():
        stats, skipped = describe_task(args.task, args.data_dir, args.max_len, getattr(args, "tokenizer", None))
        if skipped:
            warn(data.skipped_warning(skipped))
        print(json.dumps(stats))


if __name__ == "__main__":
    main()
