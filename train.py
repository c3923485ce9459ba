"""train.py: the one training loop (fine-tuning, training from scratch, masked-LM pretraining).

What it is: nanoGPT's train.py for encoders. AdamW (no decay on biases and LayerNorm), linear warmup then
linear decay, gradient clipping and accumulation, bf16 autocast on CUDA (fp32 on the CPU), evaluation with
the task's official metrics, atomic checkpoints, exact resume, torchrun / DDP.

Exact resume: ckpt_last.pt holds the weights (G-Nets included), AdamW's state, every process's RNG states
(python, numpy, torch, CUDA), the step and the position in the epoch (the batch order is a function of
(seed, epoch), data.batch_plan). The learning-rate schedule is a pure function of the step (lr_factor), so
restoring the step restores it. A run killed at any moment (SIGKILL too) and resumed with --resume ends
bit-identical on the CPU to an uninterrupted one; log lines written after the last checkpoint are dropped.

The ideas it switches on, each by a flag (and the Config field of the same name, model.py):
  --attention sparse|hst            ERNIE-Sparse's block-sparse attention and Hierarchical Sparse Transformer
  --sar ALPHA / --rdrop ALPHA       Self-Attention Regularization (shifted topology) / R-Drop (sar.py)
  --attn-dropout attendout          AttendOut's learned G-Net attention dropout (attendout.py)

How to run it:
  python train.py                                   # the demo: generated ListOps, HST + SAR + AttendOut
  python train.py --init roberta.pt --task cola --data glue/CoLA
  torchrun --nproc_per_node 4 train.py --init roberta.pt --task mnli --data glue/MNLI
  python train.py --resume --out out/run          # continue a stopped / killed run
"""
import argparse
import io
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import data
import sar
from attendout import DropRateLogger, budget_loss, drop_rates
from model import (CheckpointError, Config, Model, apply_overrides, build_model, checkpoint_dict, read_checkpoint,
                   save_atomic)

# The demo that `python train.py` runs with no arguments: a small generated ListOps set, a small model from
# scratch, with the project's ideas on (HST attention, SAR, AttendOut). Printed before it starts.
DEMO = ["--task", "listops", "--init", "scratch", "--out", "out/demo", "--overwrite",
        "--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "256",
        "--attention", "hst", "--block-size", "8", "--sar", "1.0", "--attn-dropout", "attendout",
        "--epochs", "10", "--batch-size", "32", "--lr", "1e-3", "--eval-every", "200"]
DEMO_LISTOPS = dict(n_train=6000, n_val=500, n_test=500, min_len=10, max_len=60, max_depth=3, max_args=4, seed=0)


# -----------------------------------------------------------------------------
# Flags. Model and method flags default to None: "keep the checkpoint's value, or Config's default".

def make_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("task and data")
    g.add_argument("--task", default="listops", help=f"one of {', '.join(data.VALID_TASKS)}")
    g.add_argument("--data", default=None, help="task folder or file (listops: generated into data/listops-demo if omitted)")
    g.add_argument("--train-file", default=None, help="override the training file inside --data")
    g.add_argument("--dev-file", default=None, help="override the dev file inside --data")
    g.add_argument("--text-col", default=None, help="--task tsv: text column (name or 0-based index)")
    g.add_argument("--text-pair-col", default=None, help="--task tsv: optional second text column")
    g.add_argument("--label-col", default=None, help="--task tsv: label column")
    g.add_argument("--max-len", type=int, default=None, help="tokens per example (default: 512, or the model's limit)")
    g.add_argument("--no-truncate", action="store_true", help="fail on examples longer than --max-len instead of truncating")
    g.add_argument("--vocab-size", type=int, default=8000, help="from scratch on text: SentencePiece vocabulary size")

    g = ap.add_argument_group("initialisation and model size")
    g.add_argument("--init", default="scratch", help="an HF folder, a converted .pt, or 'scratch'")
    g.add_argument("--layers", type=int, default=4, help="from scratch: number of layers")
    g.add_argument("--hidden", type=int, default=256, help="from scratch: hidden size d")
    g.add_argument("--heads", type=int, default=4, help="from scratch: attention heads")
    g.add_argument("--ffn", type=int, default=1024, help="from scratch: feed-forward size")

    g = ap.add_argument_group("optimisation")
    g.add_argument("--epochs", type=float, default=3, help="passes over the training set (ignored with --max-steps)")
    g.add_argument("--max-steps", type=int, default=0, help="optimizer steps; 0: from --epochs")
    g.add_argument("--batch-size", type=int, default=32, help="examples per optimizer step (all GPUs, before accumulation)")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=2e-5, help="peak learning rate")
    g.add_argument("--warmup", type=float, default=0.06, help="warmup: a fraction of the steps (< 1) or a step count")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decay on weight matrices and embeddings")
    g.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    g.add_argument("--seed", type=int, default=0)

    g = ap.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--out", default="out/run", help="run folder: log.jsonl, final.json, ckpt_best.pt, ckpt_last.pt")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end of each epoch)")
    g.add_argument("--save-every", type=int, default=500, help="write ckpt_last.pt every N steps (and at the end)")
    g.add_argument("--log-every", type=int, default=10, help="one log.jsonl line every N steps")
    g.add_argument("--eval-shift", type=int, default=0, help="also evaluate with the topology shifted by N tokens (robustness)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from ckpt_last.pt")
    g.add_argument("--overwrite", action="store_true", help="allow an --out folder that holds another run")
    g.add_argument("--skip-nonfinite", action="store_true", help="skip (and count) batches whose loss is NaN/inf instead of stopping")

    g = ap.add_argument_group("device")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--ffn-chunk", type=int, default=None,
                   help="feed-forward on this many positions at a time (same result; faster on long inputs on CPU)")

    g = ap.add_argument_group("attention topology (ERNIE-Sparse; Config fields, default: checkpoint / Config)")
    g.add_argument("--attention", choices=["dense", "sparse", "hst"], default=None)
    g.add_argument("--block-size", type=int, default=None, help="b, tokens per block")
    g.add_argument("--window", type=int, default=None, help="w, neighbour blocks on each side")
    g.add_argument("--num-global", type=int, default=None, help="g, global tokens at the start")
    g.add_argument("--num-random", type=int, default=None, help="r, random key blocks per query block")
    g.add_argument("--no-flex", dest="flex_attention", action="store_false", default=None,
                   help="sparse / hst on CUDA: use the gather kernel, not FlexAttention, when there is no attention dropout")
    g.add_argument("--max-positions", type=int, default=None, help="position-table rows; larger than the checkpoint's copies it")

    g = ap.add_argument_group("attention dropout (AttendOut; Config fields)")
    g.add_argument("--attn-dropout", choices=["standard", "none", "attendout", "scheduled"], default=None)
    g.add_argument("--attn-dropout-p", type=float, default=None, help="p0: standard rate and G-Net's starting rate")
    g.add_argument("--hidden-dropout-p", type=float, default=None, help="dropout on embeddings and residual branches")
    g.add_argument("--gnet-budget", type=float, default=None, help="rho, G-Net's mean drop-rate budget (default p0)")
    g.add_argument("--gnet-lambda", type=float, default=None, help="weight of the budget term")
    g.add_argument("--gnet-tau", type=float, default=None, help="relaxed-Bernoulli temperature")
    g.add_argument("--gnet-dim", type=int, default=None, help="d_g, G-Net projection size per head")
    g.add_argument("--schedule", default=None, help="scheduled dropout: a droprates.jsonl or linear:P_LOW:P_HIGH")
    g.add_argument("--layerdrop", type=float, default=None, help="LayerDrop probability")
    g.add_argument("--attn-layerdrop", type=float, default=None, help="Attn.LayerDrop probability")

    g = ap.add_argument_group("consistency regularisers (sar.py)")
    g.add_argument("--sar", type=float, default=0.0, help="SAR weight alpha (0: off)")
    g.add_argument("--sar-shift", type=int, default=1, help="SAR: padding tokens inserted after the first token")
    g.add_argument("--rdrop", type=float, default=0.0, help="R-Drop weight alpha (0: off)")
    return ap


# flag name -> Config field, for the flags that mirror Config
CONFIG_FLAGS = ("ffn_chunk", "attention", "block_size", "window", "num_global", "num_random", "flex_attention", "max_positions", "attn_dropout",
                "attn_dropout_p", "hidden_dropout_p", "gnet_budget", "gnet_lambda", "gnet_tau", "gnet_dim",
                "schedule", "layerdrop", "attn_layerdrop")


def parse_args(argv):
    if not argv:
        print("no arguments: running the demo:\n  python train.py " + " ".join(DEMO) + "\n", flush=True)
        argv = DEMO
    ap = make_parser()
    args = ap.parse_args(argv)
    # the flags given explicitly on the command line (they win over a resumed run's saved flags)
    quiet = make_parser()
    for a in quiet._actions:
        a.default = argparse.SUPPRESS
    args.given = sorted(vars(quiet.parse_args(argv)))
    return args


def fail(msg, code=2):
    """One clear line, no traceback."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def warn(msg):
    if is_main():
        tqdm.write(f"warning: {msg}", file=sys.stderr)


# -----------------------------------------------------------------------------
# Distributed (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK), seeding, RNG state for exact resume.

def setup_distributed(args):
    """(rank, world size, device). One process, or one of torchrun's (NCCL on GPUs, gloo on the CPU)."""
    if "RANK" not in os.environ:
        return 0, 1, resolve_device(args.device)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


class DDP(DistributedDataParallel):
    """DDP that also answers the wrapped Model's attributes (sar.py reads model.cfg and model.position_ids)."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def all_true(flag, device, world):
    """A bool that every process agrees on: True only if it is True on all of them."""
    if world == 1:
        return bool(flag)
    t = torch.tensor([float(bool(flag))], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def check_replicas(raw, device, world):
    """End of a torchrun run: DDP keeps the replicas in step, so every process must hold rank 0's weights.
    Compared through a per-tensor checksum (sum and sum of squares, float64), broadcast from rank 0."""
    mine = torch.stack([s for p in raw.parameters() for s in (p.detach().double().sum(), p.detach().double().square().sum())])
    ref = mine.clone()
    dist.broadcast(ref, 0)
    if not all_true(torch.equal(mine, ref), device, world):
        fail(f"process {dist.get_rank()}: the replicas' weights differ after training (DDP out of step)", code=1)


def is_main():
    return not dist.is_initialized() or dist.get_rank() == 0


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {name}: CUDA is not available here")
    return torch.device(name)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state():
    """Every RNG the run draws from, as plain tensors / lists (safe to load with weights_only=True)."""
    np_state = np.random.get_state()
    return {"python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(s):
    py = s["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state((s["numpy"][0], s["numpy"][1].numpy(), *s["numpy"][2:]))
    torch.set_rng_state(s["torch"])
    if torch.cuda.is_available() and s["cuda"]:
        torch.cuda.set_rng_state_all(s["cuda"])


# -----------------------------------------------------------------------------
# Data and model.

def task_data_dir(args):
    """--data, or (ListOps) the small demo set, generated on first use."""
    if args.data is not None:
        if not os.path.exists(args.data):
            fail(f"--data {args.data}: no such file or folder")
        return args.data
    if args.task != "listops":
        fail(f"--task {args.task} needs --data (a folder with train/dev files)")
    folder = os.path.join("data", "listops-demo")
    if not os.path.exists(os.path.join(folder, "basic_val.tsv")) and is_main():
        print(f"generating a small ListOps set in {folder} ({DEMO_LISTOPS})", flush=True)
        d = DEMO_LISTOPS
        data.write_listops(folder, d["n_train"], d["n_val"], d["n_test"], d["min_len"], d["max_len"], d["seed"],
                           d["max_depth"], d["max_args"], progress=True)
    if dist.is_initialized():
        dist.barrier()
    return folder


def load_tokenizer(args, data_dir, stored_files=None):
    """The run's tokenizer: the files stored with a resumed run or --init (already read with its weights), ListOps',
    or a SentencePiece model trained on the training texts (rank 0 trains it, the others read the cached file)."""
    if stored_files is not None:
        return data.tokenizer_from_files(data.tensors_to_files(stored_files))
    if args.task == "listops":
        return data.ListOpsTokenizer()
    if dist.is_initialized() and not is_main():
        dist.barrier()
    texts = data.training_texts(args.task, data_dir, text_col=args.text_col, text_pair_col=args.text_pair_col,
                                label_col=args.label_col, train_file=args.train_file)
    folder = data_dir if os.path.isdir(data_dir) else os.path.dirname(os.path.abspath(data_dir))
    if not os.access(folder, os.W_OK):      # read-only data: cache the tokenizer under data/spm-cache/ instead
        folder = os.path.join("data", "spm-cache", os.path.abspath(folder).strip(os.sep).replace(os.sep, "_"))
        os.makedirs(folder, exist_ok=True)
    tok = data.train_sentencepiece(texts, os.path.join(folder, f"spm{args.vocab_size}"), args.vocab_size)  # -HASH.model
    if dist.is_initialized() and is_main():
        dist.barrier()
    return tok


def read_init(args):
    """(Config, state dict, tokenizer files) of --init: an HF folder or a .pt checkpoint; anything else is a
    one-line error."""
    if not (os.path.isdir(args.init) or os.path.isfile(args.init)):
        fail(f"--init {args.init}: neither a model folder nor a checkpoint file (nor 'scratch')")
    try:
        cfg, state, tok_files, _ = read_checkpoint(args.init)
    except CheckpointError as e:
        fail(f"--init: {e}")
    return cfg, state, tok_files


def method_overrides(args):
    return {f: getattr(args, f) for f in CONFIG_FLAGS if getattr(args, f) is not None}


def make_model(args, tok, task, init):
    """Model from --init (checkpoint values, then flag overrides) or from scratch (size flags)."""
    overrides = method_overrides(args)
    if init is None:
        # BERT-style positions 0..L-1; room for the longest example plus SAR's inserted tokens
        room = args.max_len + max(args.sar_shift, args.eval_shift, 0) + 1
        cfg = Config(vocab_size=tok.vocab_size, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                     intermediate_size=args.ffn, max_positions=room, type_vocab_size=2, pad_id=tok.pad_id,
                     layer_norm_eps=1e-12, position_style="bert", num_labels=task.num_labels)
        cfg = apply_overrides(cfg, overrides)
        return Model(cfg)
    cfg, state, _ = init
    cfg = apply_overrides(cfg, {**overrides, "num_labels": task.num_labels})
    return build_model(cfg, state, args.init)


def choose_max_len(args, model_cfg):
    """--max-len, kept within the model's position table (model_cfg None: from scratch, sized from --max-len)."""
    limit = None if model_cfg is None else model_cfg.max_len
    if args.max_len is None:
        args.max_len = 512 if limit is None else min(512, limit)
    elif limit is not None and args.max_len > limit:
        warn(f"--max-len {args.max_len} is longer than the model allows ({limit} tokens; --max-positions extends "
             f"the position table): using {limit}")
        args.max_len = limit


def check_data(args, task, data_dir):
    """Truncation (one summary line), empty splits."""
    if not task.train:
        fail(f"{args.train_file or data_dir}: no training examples")
    for split, examples in task.dev.items():
        if not examples:
            fail(f"{args.dev_file or data_dir}: the dev split {split!r} has no examples")
    if not task.dev:
        warn(f"{data_dir}: no dev file: no evaluation and no ckpt_best.pt")
    if task.n_truncated and task.num_labels == 0:
        warn(f"{task.n_truncated} lines were longer than --max-len {args.max_len} and were split into chunks")
    elif task.n_truncated:
        if args.no_truncate:
            fail(f"{task.n_truncated} examples are longer than --max-len {args.max_len} (--no-truncate)")
        warn(f"{task.n_truncated} examples were longer than --max-len {args.max_len} and were truncated")


def check_flags(args, cfg, task):
    """Contradictory or useless flag combinations: fail, or warn, in one line each (errors first)."""
    if args.sar > 0 and args.rdrop > 0:
        fail("--sar and --rdrop are alternatives; give one")
    if (args.sar > 0 or args.rdrop > 0) and task.num_labels == 0:
        fail("--sar / --rdrop need a classification or regression task, not mlm")
    if cfg.attn_dropout == "scheduled" and not cfg.schedule:
        fail("--attn-dropout scheduled needs --schedule FILE or linear:P_LOW:P_HIGH")
    if (args.sar > 0) and cfg.attention == "dense":
        warn("--sar with dense attention has no effect: shifting moves no block boundary (the consistency term "
             "only sees dropout); use --attention sparse or hst")
    longest = max(len(e.ids) for split in [task.train, *task.dev.values()] for e in split)
    if cfg.attention != "dense" and cfg.block_size > longest:
        warn(f"--block-size {cfg.block_size} is larger than the longest sequence ({longest} tokens): every sequence "
             "is one block (sparse attention is then dense)")
    if cfg.attn_dropout != "attendout" and any(f in args.given for f in ("gnet_budget", "gnet_lambda", "gnet_tau", "gnet_dim")):
        warn("--gnet-* flags have no effect without --attn-dropout attendout")
    model_flags = [f for f in args.given if f in CONFIG_FLAGS or f in ("layers", "hidden", "heads", "ffn", "init")]
    if args.resume and model_flags:
        warn(f"--resume continues the run's own model: ignoring --{', --'.join(f.replace('_', '-') for f in model_flags)}")


# -----------------------------------------------------------------------------
# Optimizer and schedule (nanoGPT's recipe).

def make_optimizer(model, args, device):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]  # biases, LayerNorm, scalars
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6, fused=device.type == "cuda")


def lr_factor(step, total, warmup):
    """Linear warmup to 1, then linear decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


# -----------------------------------------------------------------------------
# Losses and evaluation.

def mlm_loss(model, batch, tok):
    """Masked-LM: 15% of real tokens selected, 80/10/10 mask/random/keep (data.mask_tokens), CE on them."""
    ids, labels = data.mask_tokens(batch["input_ids"].cpu(), batch["attention_mask"].cpu(), mask_id=tok.mask_id,
                                   vocab_size=tok.vocab_size, special_ids=special_ids(tok))
    device = batch["input_ids"].device
    logits = model(ids.to(device), batch["attention_mask"], batch["token_type_ids"], head="mlm")   # [B, L, V]
    labels = labels.to(device).flatten()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=-100, reduction="sum")
    return ce / (labels != -100).sum().clamp(min=1)          # a batch with no selected token gives 0, not NaN


def special_ids(tok):
    return [tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id]


def compute_loss(model, raw, batch, args, task, tok):
    """The training loss and the numbers worth logging. model: what runs the forward (DDP / compiled), raw: the
    Model itself (for attributes)."""
    stats = {}
    if task.num_labels == 0:
        loss = mlm_loss(model, batch, tok)
    elif args.sar > 0:
        loss, ce, cons = sar.sar_loss(model, batch, args.sar, args.sar_shift, task.is_regression)
        stats.update(ce=ce.item(), consistency=cons.item())
    elif args.rdrop > 0:
        loss, ce, cons = sar.rdrop_loss(model, batch, args.rdrop, task.is_regression)
        stats.update(ce=ce.item(), consistency=cons.item())
    else:
        logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        loss = sar.task_loss(logits, batch["labels"], task.is_regression)
    if raw.cfg.attn_dropout == "attendout":
        b = budget_loss(raw)                            # SPEC 3.1: lambda (mean_l mean(pi_l) - rho)^2
        loss = loss + b.to(loss.device)
        stats["gnet_budget"] = b.item()
    return loss, stats


@torch.no_grad()
def evaluate(raw, task, args, device, tok, shift_by=0):
    """Dev metrics of every split (the model in eval mode; one pass, original topology unless shift_by)."""
    raw.eval()
    out = {}
    for split, examples in task.dev.items():
        preds, labels, losses = [], [], []
        # padded to the longest example only: the model pads to its block size itself (Model.pad_to_block)
        for batch in data.make_batches(examples, args.batch_size, pad_id=tok.pad_id, seed=0, epoch=0, shuffle=False):
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast(device):
                if task.num_labels == 0:
                    g = torch.Generator().manual_seed(len(losses))
                    ids, lab = data.mask_tokens(batch["input_ids"].cpu(), batch["attention_mask"].cpu(),
                                                mask_id=tok.mask_id, vocab_size=tok.vocab_size,
                                                special_ids=special_ids(tok), generator=g)
                    logits = raw.mlm_logits(ids.to(device), batch["attention_mask"])
                    losses.append(F.cross_entropy(logits.flatten(0, 1).float(), lab.to(device).flatten(),
                                                  ignore_index=-100).item())
                    continue
                ids, mask, pos, types = batch["input_ids"], batch["attention_mask"], None, batch["token_type_ids"]
                if shift_by:
                    ids, mask, pos, types = sar.shift(ids, mask, shift_by, raw.cfg.pad_id, raw.position_ids(ids), types)
                logits = raw(ids, mask, types, pos).float()
            preds.append(logits.squeeze(-1) if task.is_regression else logits.argmax(-1))
            labels.append(batch["labels"])
        if task.num_labels == 0:
            out[split] = {"loss": float(np.mean(losses)), "ppl": float(math.exp(min(np.mean(losses), 50)))}
        else:
            out[split] = data.compute_metrics(args.task, torch.cat(preds).cpu().numpy(), torch.cat(labels).cpu().numpy())
    raw.train()
    return out


def main_metric(metrics, task):
    """The number that picks ckpt_best.pt: the task's metric on its first dev split (lower loss is better)."""
    split = next(iter(metrics))
    v = metrics[split][task.metric_name]
    return -v if task.metric_name == "loss" else v


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


# -----------------------------------------------------------------------------
# Checkpoints.

def weights_finite(raw):
    """No NaN / inf in any parameter (one read off the device, not one per tensor)."""
    return bool(torch.stack([torch.isfinite(p).all() for p in raw.parameters()]).all())


def save_checkpoint(path, raw, tok, optimizer, state, args, rngs):
    """Atomic write (model.save_atomic: temporary file, then rename); never writes non-finite weights.
    rngs: the RNG states of every process, by rank."""
    if not weights_finite(raw):
        raise FloatingPointError(f"refusing to write {path}: the weights hold NaN/inf")
    save_atomic(checkpoint_dict(raw, data.files_to_tensors(tok.files), train_state=state,
                                optimizer=optimizer.state_dict(), rng=rngs, args=public_args(args)), path)


def public_args(args):
    return {k: v for k, v in vars(args).items() if k != "given"}


def prepare_out(args):
    """--out holding another run is refused unless --resume or --overwrite."""
    taken = any(os.path.exists(os.path.join(args.out, f)) for f in ("log.jsonl", "ckpt_last.pt", "final.json"))
    if is_main() and os.path.isdir(args.out):       # a run killed while saving leaves a half-written temp file
        for f in os.listdir(args.out):
            if f.startswith(("ckpt_last.pt.tmp", "ckpt_best.pt.tmp")):
                os.remove(os.path.join(args.out, f))
    if args.resume:                                  # run() has read its ckpt_last.pt already
        return
    if taken and not args.overwrite:
        fail(f"--out {args.out} holds another run (log.jsonl / checkpoints); pass --resume to continue it or "
             "--overwrite to replace it")
    if is_main():
        os.makedirs(args.out, exist_ok=True)
        for f in ("log.jsonl", "droprates.jsonl", "final.json", "ckpt_last.pt", "ckpt_best.pt"):
            if os.path.exists(os.path.join(args.out, f)):
                os.remove(os.path.join(args.out, f))


def trim_log(path, step):
    """Resume: keep the JSON lines of steps <= the checkpoint's step. A killed run may have logged (or half
    written) lines after its last checkpoint; the resumed run writes them again."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue                                  # a line cut short by the kill
            if rec.get("step", 0) <= step:
                keep.append(json.dumps(rec) + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


# -----------------------------------------------------------------------------
# The loop.

class StopFlag:
    """Ctrl-C / SIGTERM: finish the current step, save ckpt_last.pt, exit cleanly. A second Ctrl-C aborts.
    Under torchrun every process stops at the same step (requested() agrees across processes)."""

    def __init__(self, device, world):
        self.stop, self.device, self.world = False, device, world

    def __enter__(self):
        self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)

    def handle(self, signum, frame):
        if self.stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop = True

    def requested(self):
        return not all_true(not self.stop, self.device, self.world)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except (data.DataError, CheckpointError, ValueError, FloatingPointError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail(f"interrupted; the last checkpoint (if any) is {os.path.join(args.out, 'ckpt_last.pt')}", code=130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args):
    rank, world, device = setup_distributed(args)
    resume_ckpt, resume_path, resume_state, init = None, None, None, None
    if args.resume:
        resume_path = os.path.join(args.out, "ckpt_last.pt")
        if not os.path.exists(resume_path):
            fail(f"--resume: {resume_path} does not exist")
        resume_cfg, resume_state, resume_tok, resume_ckpt = read_checkpoint(resume_path)   # as --init reads
        for k, v in resume_ckpt["args"].items():      # the run's own flags, except those given now
            if k not in args.given and k not in ("resume", "device"):
                setattr(args, k, v)
    elif args.init != "scratch":
        init = read_init(args)
    prepare_out(args)
    seed_everything(args.seed)

    # --- data -----------------------------------------------------------------
    data_dir = task_data_dir(args)
    stored = resume_tok if resume_ckpt is not None else (init[2] if init else None)
    tok = load_tokenizer(args, data_dir, stored)
    if resume_ckpt is not None:
        model_cfg = resume_cfg
    else:
        model_cfg = None if init is None else apply_overrides(init[0], method_overrides(args))
    choose_max_len(args, model_cfg)
    task = data.load_task(args.task, data_dir, tok, max_len=args.max_len, text_col=args.text_col,
                          text_pair_col=args.text_pair_col, label_col=args.label_col,
                          train_file=args.train_file, dev_file=args.dev_file)
    check_data(args, task, data_dir)

    # --- model ----------------------------------------------------------------
    if resume_ckpt is not None:
        raw = build_model(model_cfg, resume_state, resume_path)
    else:
        raw = make_model(args, tok, task, init)
    init = resume_state = None              # free the --init / resumed state dict
    cfg = raw.cfg
    check_flags(args, cfg, task)
    raw.to(device)
    if task.num_labels > 0:
        raw.mlm.requires_grad_(False)       # heads that this task does not train stay out of the optimizer
    elif raw.cls is not None:
        raw.cls.requires_grad_(False)
    model = raw
    if args.compile:
        model = torch.compile(model)
    if world > 1:
        # frozen heads have requires_grad False, so only LayerDrop leaves trained parameters without a gradient
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    find_unused_parameters=cfg.layerdrop > 0 or cfg.attn_layerdrop > 0)
    model.train()
    seed_everything(args.seed + rank)       # nanoGPT: every process draws its own dropout masks

    # --- schedule -------------------------------------------------------------
    micro = args.batch_size // args.grad_accum
    if micro < world or args.batch_size % (args.grad_accum * world):
        fail(f"--batch-size {args.batch_size} must be a multiple of --grad-accum x processes ({args.grad_accum} x {world})")

    train_lengths = [len(e.ids) for e in task.train]

    def epoch_batches(epoch):
        # the epoch's batches as example indices, a function of (seed, epoch): resuming mid-epoch only needs
        # state["micro"]; each batch is padded when it is used (data.collate)
        plan = data.batch_plan(train_lengths, micro, seed=args.seed, epoch=epoch)
        return [b for b in plan if len(b) >= world]

    per_epoch = len(epoch_batches(0)) // args.grad_accum
    if per_epoch == 0:
        fail(f"{len(task.train)} training examples make no full step of --batch-size {args.batch_size}")
    total = args.max_steps if args.max_steps > 0 else max(1, int(args.epochs * per_epoch))
    warmup = int(args.warmup * total) if args.warmup < 1 else int(args.warmup)
    optimizer = make_optimizer(raw, args, device)
    # dev: the last evaluation's metrics; saved_step: the step of ckpt_last.pt
    state = {"step": 0, "epoch": 0, "micro": 0, "best": None, "best_step": None, "skipped": 0, "wall": 0.0,
             "dev": {}, "saved_step": None}
    if resume_ckpt is not None:
        optimizer.load_state_dict(resume_ckpt["optimizer"])
        state.update(resume_ckpt["train_state"])
        rngs = resume_ckpt["rng"]
        if len(rngs) != world:
            warn(f"--resume: the run had {len(rngs)} processes, now {world}: the data split and RNG streams change")
        set_rng_state(rngs[rank % len(rngs)])
        del resume_ckpt

    if is_main():
        print(f"task {args.task}: {len(task.train)} train examples, dev {', '.join(f'{k} {len(v)}' for k, v in task.dev.items())}; "
              f"model {raw.num_params() / 1e6:.2f}M parameters, attention {cfg.attention}, attn-dropout {cfg.attn_dropout}; "
              f"{total} steps on {device}" + (f" x {world} processes" if world > 1 else "")
              + (f"; resuming at step {state['step']}" if args.resume else ""), flush=True)
    log_path, gnet_path = os.path.join(args.out, "log.jsonl"), os.path.join(args.out, "droprates.jsonl")
    last_path = os.path.join(args.out, "ckpt_last.pt")
    if args.resume and is_main():
        trim_log(log_path, state["step"])
        trim_log(gnet_path, state["step"])
    gnet_log = DropRateLogger(gnet_path, args.log_every, append=args.resume) \
        if cfg.attn_dropout == "attendout" and is_main() else None

    def log(rec):
        if is_main():
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def do_eval(step):
        """Dev metrics (rank 0), logged; a better main metric writes ckpt_best.pt."""
        metrics = evaluate(raw, task, args, device, tok) if task.dev else {}
        if args.eval_shift and task.dev:
            shifted = evaluate(raw, task, args, device, tok, shift_by=args.eval_shift)
            for split, m in shifted.items():
                metrics[split].update({f"{k}_shifted": v for k, v in m.items()})
        if not metrics:
            return metrics
        log({"step": step, "dev": metrics})
        state["dev"] = metrics
        score = main_metric(metrics, task)
        if (state["best"] is None or score > state["best"]) and weights_finite(raw):
            state["best"], state["best_step"] = score, step
            save_checkpoint(os.path.join(args.out, "ckpt_best.pt"), raw, tok, optimizer, state, args, [rng_state()])
        return metrics

    def save_last():
        """ckpt_last.pt, everything --resume needs. Every process calls it: their RNG states are gathered."""
        if not all_true(weights_finite(raw), device, world):
            stop_nonfinite(f"non-finite weights after step {state['step']}")
        state["wall"] = time.time() - t0
        rngs = [rng_state()]
        if world > 1:                       # tensors travel as torch.save bytes (all_gather_object pickles)
            buf, blobs = io.BytesIO(), [None] * world
            torch.save(rngs[0], buf)
            dist.all_gather_object(blobs, buf.getvalue())
            rngs = [torch.load(io.BytesIO(b), weights_only=True) for b in blobs]
        if is_main():
            save_checkpoint(last_path, raw, tok, optimizer, {**state, "saved_step": state["step"]}, args, rngs)
        state["saved_step"] = state["step"]

    def stop_nonfinite(what):
        good = f"{last_path} (step {state['saved_step']})" if state["saved_step"] is not None else "none written yet"
        fail(f"{what}; last good checkpoint: {good}; lower --lr, or pass --skip-nonfinite to skip such batches", code=1)

    use_bar = is_main() and sys.stderr.isatty()        # a log file gets plain lines instead of a progress bar
    t0 = time.time() - state["wall"]
    bar = tqdm(total=total, initial=state["step"], disable=not use_bar, dynamic_ncols=True, desc=args.task)
    seen, t_last, bad_in_row, batches, batches_epoch = 0, time.time(), 0, None, None
    with StopFlag(device, world) as stop:
        while state["step"] < total and not stop.requested():
            if batches_epoch != state["epoch"]:
                batches, batches_epoch = epoch_batches(state["epoch"]), state["epoch"]
            step = state["step"] + 1            # the step being taken; log.jsonl counts steps from 1
            lr = args.lr * lr_factor(step - 1, total, warmup)
            for grp in optimizer.param_groups:
                grp["lr"] = lr
            raw.set_progress((step - 1) / total)
            loss_sum, stats, finite = 0.0, {}, True
            for i in range(args.grad_accum):
                # padded to the longest example; the model pads to its block size (and SAR shifts) itself
                batch = data.collate([task.train[j] for j in batches[state["micro"] + i]], tok.pad_id)
                batch = {k: v[rank::world].to(device, non_blocking=True) for k, v in batch.items()}
                seen += batch["input_ids"].size(0) * world
                sync = i == args.grad_accum - 1 or world == 1
                with (nullcontext() if sync else model.no_sync()), autocast(device):
                    loss, stats = compute_loss(model, raw, batch, args, task, tok)
                finite = all_true(torch.isfinite(loss.detach()), device, world)
                if not finite:
                    break
                (loss / args.grad_accum).backward()
                loss_sum += loss.item() / args.grad_accum
            # the batches are consumed, stepped or skipped; the epoch ends when no full step is left
            state["micro"] += args.grad_accum
            epoch_done = state["micro"] + args.grad_accum > len(batches)
            if epoch_done:
                state["epoch"], state["micro"] = state["epoch"] + 1, 0
            gnorm, what = None, "loss"
            if finite:
                # clip (or, with --clip 0, only measure): a finite loss can still give inf/NaN gradients
                gnorm = torch.nn.utils.clip_grad_norm_(raw.parameters(), args.clip if args.clip > 0 else float("inf"))
                finite, what = bool(torch.isfinite(gnorm)), "gradient"
            if not finite:
                optimizer.zero_grad(set_to_none=True)
                if not args.skip_nonfinite:
                    bar.close()
                    stop_nonfinite(f"non-finite {what} at step {step} (lr {lr:.3g})")
                state["skipped"] += 1
                bad_in_row += 1
                warn(f"non-finite {what} at step {step}: batch skipped ({state['skipped']} so far)")
                if bad_in_row > per_epoch:
                    stop_nonfinite(f"non-finite loss on every batch for a whole epoch (step {step})")
                continue
            bad_in_row = 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] = step
            bar.update(1)

            if step % args.log_every == 0 or step == total:
                now = time.time()
                rate = seen / max(now - t_last, 1e-9)
                seen, t_last = 0, now
                rec = {"step": step, "loss": loss_sum, "lr": lr, "examples_per_s": rate, **stats}
                if gnorm is not None:
                    rec["grad_norm"] = float(gnorm)
                log(rec)
                bar.set_postfix(loss=f"{loss_sum:.4f}", lr=f"{lr:.2e}", ex_s=f"{rate:.0f}")
                if is_main() and not use_bar:
                    print(f"step {step}/{total}: loss {loss_sum:.4f}, lr {lr:.2e}, {rate:.0f} examples/s", flush=True)
            if gnet_log is not None:
                gnet_log.log(step, step / total, drop_rates(raw))
            if step == total and world > 1:
                check_replicas(raw, device, world)
            # evaluate, then checkpoint: everything logged up to a step is in that step's ckpt_last.pt
            if step == total or (args.eval_every and step % args.eval_every == 0) or (not args.eval_every and epoch_done):
                if is_main():
                    metrics = do_eval(step)
                    if metrics:
                        bar.write(f"step {step}: dev {json.dumps(metrics)}")
                if world > 1:
                    dist.barrier()
            if step == total or (args.save_every and step % args.save_every == 0):
                save_last()
        bar.close()
        if state["step"] < total:               # Ctrl-C / SIGTERM
            if state["saved_step"] != state["step"]:
                save_last()
            if is_main():
                print(f"stopped at step {state['step']}: saved {last_path}; continue with --resume --out {args.out}")
            return
    if is_main():
        report(args, task, cfg, state)


def majority_baseline(task):
    """Accuracy of always predicting the most common training label, on the first dev split."""
    if task.is_regression or task.num_labels == 0:
        return None
    counts = np.bincount([e.label for e in task.train], minlength=task.num_labels)
    dev = next(iter(task.dev.values()))
    return float(np.mean([e.label == int(counts.argmax()) for e in dev]))


def report(args, task, cfg, state):
    """final.json and the one-line summary."""
    metrics, best = state["dev"], state["best"]
    final = {"task": args.task, "metric": task.metric_name, "dev": metrics,
             "best_dev": -best if best is not None and task.metric_name == "loss" else best,
             "best_step": state["best_step"], "steps": state["step"], "skipped_batches": state["skipped"],
             "wall_time_s": round(state["wall"], 2), "majority_baseline": majority_baseline(task),
             "config": asdict(cfg), "args": public_args(args)}
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump(final, f, indent=1)
    line = f"done in {state['wall']:.0f}s, {state['step']} steps"
    if metrics:
        split = next(iter(metrics))
        line += f": dev {task.metric_name} {metrics[split][task.metric_name]:.4f}"
    if final["majority_baseline"] is not None:
        line += f" (majority-class baseline {final['majority_baseline']:.4f})"
    print(line + f"; results in {args.out}/final.json")


if __name__ == "__main__":
    main()
