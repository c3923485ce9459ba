"""readers/mlm.py: masked-LM pretraining on plain text: the reader, BERT's masking, the loss and its evaluation.

What it is: `python train.py --task mlm --data DIR` pretrains (or keeps pretraining) an encoder on .txt files, a
document a line, with BERT's objective. Not part of the course (the two papers fine-tune): train.py loads this
module on first use (train.reader), as it loads readers/qa.py for extractive QA.
  - a line -> [cls] pieces [sep], cut into chunks of --max-len (each chunk counted as truncated);
  - mask_tokens: 15% of the real tokens selected; of those 80% -> [mask], 10% -> a random token, 10% kept;
  - loss = the mean cross-entropy over the selected tokens (model.MLMHead's logits); dev: the same with fixed masks.
Files: DIR/train.txt (else DIR's other .txt files), DIR/dev.txt or DIR/valid.txt; --train-file / --dev-file.
How to run: python train.py --task mlm --data DIR --init roberta.pt    (docs/tasks.md)
"""
import io
import math
import os

import torch
import torch.nn.functional as F

import sar
from data import DataError, Example, TaskData, autocast, longest_first, make_batches, read_text


def text_files(data_dir, train_file=None, dev_file=None):
    """(training .txt files, dev .txt files): --train-file, else DIR/train.txt, else DIR's other .txt files
    (not dev.txt / valid.txt), else --data itself; dev: --dev-file, DIR/dev.txt or DIR/valid.txt."""
    in_dir = lambda names: [os.path.join(data_dir, n) for n in names if os.path.isfile(os.path.join(data_dir, n))]
    if train_file or not os.path.isdir(data_dir):
        train = [train_file or data_dir]
    else:
        train = in_dir(["train.txt"]) or in_dir(sorted(f for f in os.listdir(data_dir) if f.endswith(".txt")
                                                      and f not in ("dev.txt", "valid.txt")))
    if not train or not all(os.path.isfile(p) for p in train):
        raise DataError(f"{data_dir}: no .txt files for mlm")
    dev = [dev_file] if dev_file else in_dir(["dev.txt", "valid.txt"])[:1] if os.path.isdir(data_dir) else []
    return train, dev


def read_lines(paths, tok, max_len, stats):
    """A document a line -> [cls] pieces [sep] chunks of max_len - 2 pieces (label 0: mask_tokens draws the
    labels per batch); stats["truncated"] counts the lines split into chunks."""
    examples = []
    for path in paths:
        for line in io.StringIO(read_text(path), newline=None):
            content = tok.encode(line.rstrip("\n"))[1:-1] if line.strip() else []   # without [cls] and [sep]
            chunk = max(1, max_len - 2 if max_len is not None else len(content))    # no max_len: the whole line
            stats["truncated"] += len(content) > chunk
            examples += [Example([tok.cls_id] + content[s:s + chunk] + [tok.sep_id], None, 0)
                         for s in range(0, len(content), chunk)]
    return examples


def load_task(name, data_dir, tok, *, max_len, train_file=None, dev_file=None, **columns):
    (train_paths, dev_paths), stats = text_files(data_dir, train_file, dev_file), {"truncated": 0}
    train = read_lines(train_paths, tok, max_len, stats)
    if not train:
        raise DataError(f"{train_paths[0]}:1: empty file")
    dev = {"dev": read_lines(dev_paths, tok, max_len, stats)} if dev_paths else {}
    return TaskData(train, dev, 0, False, "loss", [], stats["truncated"])


def training_texts(name, data_dir, *, train_file=None, **files):     # the lines load_task trains on
    return [s.strip() for p in text_files(data_dir, train_file)[0] for s in io.StringIO(read_text(p), newline=None)
            if s.strip()]


def mask_tokens(input_ids, attention_mask, *, mask_id, vocab_size, special_ids, generator=None, mlm_prob=0.15):
    """BERT's masking -> (masked ids [B, L], labels [B, L]: the original id where selected, -100 elsewhere).
    generator: on input_ids' device, or None (the global RNG)."""
    dev, shape = input_ids.device, input_ids.shape
    draw = lambda p: torch.bernoulli(torch.full(shape, p, device=dev), generator=generator).bool()   # [B, L]
    special = torch.tensor(sorted(set(int(i) for i in special_ids)), dtype=input_ids.dtype, device=dev)
    selected = draw(mlm_prob) & attention_mask.bool() & ~torch.isin(input_ids, special)             # [B, L]
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    to_mask = draw(0.8) & selected                                                                 # 80%
    to_random = draw(0.5) & selected & ~to_mask                   # half of the other 20%: 10% overall
    random_ids = torch.randint(vocab_size, shape, generator=generator, dtype=input_ids.dtype, device=dev)
    masked = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    return torch.where(to_random, random_ids, masked), labels


def loss(model, batch, args, task, tok, generator=None, shift_by=0):
    """The mean CE over the selected tokens; masks drawn on the CPU (the global RNG, so a resumed run draws the
    same ones). Also the dev loss: fixed masks (generator), maybe on a shifted topology (sar.shift)."""
    ids, labels = mask_tokens(batch["input_ids"].cpu(), batch["attention_mask"].cpu(), mask_id=tok.mask_id,
                              vocab_size=tok.vocab_size, generator=generator,
                              special_ids=[tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id])
    device, mask, pos = batch["input_ids"].device, batch["attention_mask"], None
    ids, labels = ids.to(device), labels.to(device).flatten()                     # labels: -100 where not masked
    raw = getattr(model, "module", model)                                         # also under DDP
    if shift_by:
        ids, mask, pos, _ = sar.shift(ids, mask, shift_by, raw.cfg.pad_id, raw.position_ids(ids))
    logits = sar.unshift(model(ids, mask, None, pos, head="mlm"), shift_by)        # [B, L, V]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=-100, reduction="sum")
    return ce / (labels != -100).sum().clamp(min=1), {}


@torch.no_grad()
def evaluate(raw, task, args, device, tok, shift_by=0):
    """{split: {"loss", "ppl"}}: the masked-LM loss with fixed masks (batch i draws them from seed i)."""
    raw.eval()
    out = {}
    for split, examples in task.dev.items():
        losses = []
        for i, batch in enumerate(make_batches(longest_first(examples), args.batch_size, pad_id=tok.pad_id, seed=0,
                                               epoch=0, shuffle=False)):
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast(device):
                losses.append(loss(raw, batch, args, task, tok, torch.Generator().manual_seed(i), shift_by)[0].item())
        out[split] = {"loss": sum(losses) / len(losses), "ppl": math.exp(min(sum(losses) / len(losses), 50))}
    raw.train()
    return out
