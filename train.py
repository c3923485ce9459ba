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
  --eval-shift all / --eval-redraw K  also score every evaluation under perturbed topologies (methods.md §2.3)

How to run it:
  python train.py                                   # the demo: generated ListOps, HST + SAR + AttendOut
  python train.py --init roberta.pt --task cola --data glue/CoLA
  torchrun --nproc_per_node 4 train.py --init roberta.pt --task mnli --data glue/MNLI
  python train.py --resume --out out/run          # continue a stopped / killed run
"""
import signal
import sys

if __name__ == "__main__":      # Ctrl-C while torch loads: exit 130 without a traceback (main takes over after)
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import argparse
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data
import tasks
from attendout import GNET, DropRateLogger, hold_budget
from cli import ArgumentParser, fail, one_line_errors
from infra import (DDP, StopFlag, all_reduce_sum, all_true, append_jsonl, autocast, check_out, check_replicas,
                   clear_out, gather_rng_states, is_main, lock_out, public_args, resolve_device, rng_state,
                   run_in_progress, save_checkpoint, seed_everything, set_rng_state, setup_distributed, trim_log, warn,
                   weights_finite)
from model import CheckpointError, Config, Model, apply_overrides, build_model, read_checkpoint

# The demo that `python train.py` runs with no arguments: a small generated ListOps set, a small model from
# scratch, with the project's ideas on (HST attention, SAR, AttendOut). Printed before it starts.
DEMO = ["--task", "listops", "--init", "scratch", "--out", "out/demo", "--overwrite",
        "--layers", "2", "--hidden", "128", "--heads", "4", "--ffn", "256",
        "--attention", "hst", "--block-size", "8", "--sar", "1.0", "--attn-dropout", "attendout",
        "--epochs", "10", "--batch-size", "32", "--lr", "1e-3", "--eval-every", "200"]
DEMO_LISTOPS = dict(n_train=6000, n_val=500, n_test=500, min_len=10, max_len=60, max_depth=3, max_args=4, seed=0)
# --threads 0 on the CPU: one thread for a model smaller than this (parameters), whose operations are too small to
# split and which another job on the machine would slow down; every core this process may use for a larger one.
SMALL_MODEL = 20e6


# -----------------------------------------------------------------------------
# 1. Flags. Model and method flags default to None: "keep the checkpoint's value, or Config's default".

def make_parser():
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("task and data")
    g.add_argument("--task", default="listops", help=f"one of {', '.join(tasks.TASKS)} (tasks.py)")
    g.add_argument("--data", default=None, help="task folder or file (listops: generated into data/listops-demo if omitted)")
    g.add_argument("--train-file", default=None, help="override the training file inside --data")
    g.add_argument("--dev-file", default=None, help="override the dev file inside --data")
    g.add_argument("--text-col", default=None, help="--task tsv: text column (name or 0-based index)")
    g.add_argument("--text-pair-col", default=None, help="--task tsv: optional second text column")
    g.add_argument("--label-col", default=None, help="--task tsv: label column")
    g.add_argument("--max-len", type=int, default=None, help="tokens per example (default: 512, LRA tasks: LRA's lengths, docs/tasks.md; at most the model's limit)")
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
    g.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping, backbone and G-Nets apart (0: off)")
    g.add_argument("--seed", type=int, default=0)

    g = ap.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--out", default="out/run", help="run folder: log.jsonl, final.json, ckpt_best.pt, ckpt_last.pt")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end of each epoch)")
    g.add_argument("--save-every", type=int, default=500, help="write ckpt_last.pt every N steps (and at the end)")
    g.add_argument("--log-every", type=int, default=10, help="one log.jsonl line every N steps")
    g.add_argument("--eval-shift", default="0",
                   help="also evaluate with the topology shifted by N tokens (0 <= N < --block-size), or 'all': every "
                        "shift 1 .. b-1, their mean and worst (methods.md §2.3)")
    g.add_argument("--eval-redraw", type=int, default=0,
                   help="also evaluate under K other draws of the random blocks (--num-random > 0), their mean and worst")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from ckpt_last.pt")
    g.add_argument("--overwrite", action="store_true", help="allow an --out folder that holds another run")
    g.add_argument("--skip-nonfinite", action="store_true", help="skip (and count) batches whose loss is NaN/inf instead of stopping")

    g = ap.add_argument_group("device")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--threads", type=int, default=0,
                   help=f"CPU threads for torch (0: 1 for a model under {SMALL_MODEL / 1e6:g}M parameters, else every core "
                        "this process may use). The count moves the last bits of the results: give it to reproduce a run")
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
    g.add_argument("--gnet-budget", type=float, default=None,
                   help="rho: the G-Nets' mean drop rate is held here after every step (default p0)")
    g.add_argument("--gnet-lr", type=float, default=None, help="the G-Nets' own peak learning rate (default 3e-3)")
    g.add_argument("--gnet-tau", type=float, default=None, help="relaxed-Bernoulli temperature")
    g.add_argument("--gnet-dim", type=int, default=None, help="d_g, G-Net projection size per head")
    g.add_argument("--gnet-mask", choices=["logit", "rowscale", "capped", "inverted"], default=None,
                   help="how the G-Net's keep mask is applied (methods.md §3.1; default capped)")
    g.add_argument("--gnet-max-pi", type=float, default=None,
                   help="--gnet-mask capped: the largest drop probability of any pair (default 0.5)")
    g.add_argument("--gnet-cooperative", dest="gnet_reverse", action="store_false", default=None,
                   help="no gradient reversal: the G-Net minimises the task loss (an ablation)")
    g.add_argument("--gnet-budget-scope", choices=["mean", "layer"], default=None,
                   help="hold the mean drop rate over layers at rho (mean, default) or every layer's (layer)")
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
                "attn_dropout_p", "hidden_dropout_p", "gnet_budget", "gnet_lr", "gnet_tau", "gnet_dim",
                "gnet_mask", "gnet_max_pi", "gnet_reverse", "gnet_budget_scope", "schedule", "layerdrop", "attn_layerdrop")
GNET_FLAGS = tuple(f for f in CONFIG_FLAGS if f.startswith("gnet_"))   # AttendOut's own knobs


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


# the smallest value that means something, per flag (a flag left at None is not checked; --resume fills it in)
AT_LEAST_1 = ("batch_size", "grad_accum", "log_every", "vocab_size", "layers", "hidden", "heads", "ffn",
              "block_size", "gnet_dim", "max_positions")
AT_LEAST_0 = ("max_steps", "eval_every", "save_every", "eval_redraw", "warmup", "weight_decay", "clip", "lr", "sar",
              "rdrop", "gnet_lr", "window", "num_global", "num_random", "ffn_chunk", "threads")
MIN_MAX_LEN = 8                 # room for a pair's special tokens and some text


def check_args(args):
    """Values that mean nothing, refused before anything is read or written: one line naming the flag. Values
    that would only fail after training (an evaluation flag, --log-every 0) are caught here too."""
    def bad(name, why):
        fail(f"--{name.replace('_', '-')} {getattr(args, name)}: {why}")
    for name in AT_LEAST_1 + AT_LEAST_0:
        v = getattr(args, name)
        low = 1 if name in AT_LEAST_1 else 0
        if v is not None and not (math.isfinite(v) and v >= low):       # NaN fails too
            bad(name, f"must be >= {low}")
    if str(args.eval_shift) != "all" and not str(args.eval_shift).isdigit():    # below the block size: check_flags
        bad("eval_shift", "give 'all' or a number of tokens >= 0")
    args.eval_shift = args.eval_shift if args.eval_shift == "all" else int(args.eval_shift)
    if args.max_steps == 0 and not (math.isfinite(args.epochs) and args.epochs > 0):
        bad("epochs", "must be > 0 (or give --max-steps)")
    if args.gnet_tau is not None and not args.gnet_tau > 0:
        bad("gnet_tau", "the relaxed-Bernoulli temperature must be > 0")
    if args.max_len is not None and args.max_len < MIN_MAX_LEN:
        bad("max_len", f"must be at least {MIN_MAX_LEN} tokens (special tokens included)")
    if args.task not in tasks.TASKS:
        bad("task", f"unknown task; choose one of {', '.join(tasks.TASKS)}")
    resolve_device(args.device)                                   # --device gpu, cuda without CUDA: one line
    if args.schedule and not args.schedule.startswith("linear:"):
        if not os.path.isfile(args.schedule):
            bad("schedule", "no such file (a droprates.jsonl, or linear:P_LOW:P_HIGH)")
        if run_in_progress(os.path.dirname(os.path.abspath(args.schedule))):
            bad("schedule", "the AttendOut run writing it has not finished (its folder is locked); replay it once it has")
    for name in ("data", "train_file", "dev_file"):
        if getattr(args, name) is not None and not os.path.exists(getattr(args, name)):
            bad(name, "no such file or folder")


# -----------------------------------------------------------------------------
# 2. Data and model: where the examples, the tokenizer and the weights come from.

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
    fixed = tasks.fixed_tokenizer(args.task)    # ListOps symbols, LRA bytes / pixels
    if fixed is not None:
        return fixed
    if dist.is_initialized() and not is_main():
        dist.barrier()
    texts = tasks.training_texts(args.task, data_dir, **tasks.files_and_columns(args))
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
    if not tok_files:      # a fine-tuned model reads text through its own tokenizer only
        fail(f"--init {args.init}: no tokenizer files in it (an HF folder needs its tokenizer.json / vocab files; "
             "convert it again with python model.py convert)")
    return cfg, state, tok_files


def choose_threads(args, model, device):
    """--threads, or (0) a sensible count: 1 for a small model on the CPU (the demo: 21 s per 100 steps on one
    thread against 69-79 s on two while other jobs shared the 2 cores), every core this process may use for a
    larger one. On a GPU, torch's own default unless --threads is given. Returns the count in use."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu":
        torch.set_num_threads(1 if model.num_params() < SMALL_MODEL else len(os.sched_getaffinity(0)))
    return torch.get_num_threads()


def method_overrides(args):
    return {f: getattr(args, f) for f in CONFIG_FLAGS if getattr(args, f) is not None}


def make_model(args, tok, task, init):
    """Model from --init (checkpoint values, then flag overrides) or from scratch (size flags)."""
    overrides = method_overrides(args)
    if init is None:
        # BERT-style positions 0..L-1; room for the longest example plus SAR's inserted tokens (an evaluation flag
        # never changes the model: a shifted evaluation keeps every token's position, sar.shift)
        room = args.max_len + max(args.sar_shift, 0) + 1
        cfg = Config(vocab_size=tok.vocab_size, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                     intermediate_size=args.ffn, max_positions=room, type_vocab_size=2, pad_id=tok.pad_id,
                     layer_norm_eps=1e-12, position_style="bert", num_labels=task.num_labels, head=task.head)
        cfg = apply_overrides(cfg, overrides)
        return Model(cfg)
    cfg, state, _ = init
    cfg = apply_overrides(cfg, {**overrides, "num_labels": task.num_labels, "head": task.head})
    return build_model(cfg, state, args.init)


def choose_max_len(args, model_cfg):
    """--max-len, kept within the model's position table (model_cfg None: from scratch, sized from --max-len)."""
    limit = None if model_cfg is None else model_cfg.max_len
    if args.max_len is None:
        default = tasks.kind(args.task).max_len         # 512; LRA's lengths for its tasks
        args.max_len = default if limit is None else min(default, limit)
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
    if task.skipped:
        warn(data.skipped_warning(task.skipped))
    if args.batch_size > len(task.train):
        warn(f"--batch-size {args.batch_size} is larger than the training set ({len(task.train)} examples): every "
             "step sees all of them")
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
    if args.sar_shift < 1:
        fail(f"--sar-shift {args.sar_shift}: SAR needs a shift of at least 1 token (0 moves no block boundary; "
             "for two unshifted views use --rdrop)")
    if (args.sar > 0 or args.rdrop > 0) and task.num_labels == 0:
        fail("--sar / --rdrop need a classification or regression task, not mlm")
    if cfg.attn_dropout == "scheduled" and not cfg.schedule:
        fail("--attn-dropout scheduled needs --schedule FILE or linear:P_LOW:P_HIGH")
    check_eval_perturbations(args, cfg)
    if (args.sar > 0) and cfg.attention == "dense":
        warn("--sar with dense attention has no effect: shifting moves no block boundary (the consistency term "
             "only sees dropout); use --attention sparse or hst")
    longest = max(len(e.ids) for split in [task.train, *task.dev.values()] for e in split)
    if cfg.attention != "dense" and cfg.block_size > longest:
        warn(f"--block-size {cfg.block_size} is larger than the longest sequence ({longest} tokens): every sequence "
             "is one block (sparse attention is then dense)")
    if cfg.attn_dropout != "attendout" and any(f in args.given for f in GNET_FLAGS):
        warn("--gnet-* flags have no effect without --attn-dropout attendout")
    if "schedule" in args.given and cfg.attn_dropout != "scheduled":
        warn("--schedule has no effect without --attn-dropout scheduled")
    columns = [f for f in ("text_col", "text_pair_col", "label_col") if f in args.given]
    if columns and args.task != "tsv":
        warn(f"--{', --'.join(f.replace('_', '-') for f in columns)}: only --task tsv reads columns by flag; "
             f"--task {args.task} has its own")
    model_flags = [f for f in args.given if f in CONFIG_FLAGS or f in ("layers", "hidden", "heads", "ffn", "init")]
    if args.resume and model_flags:
        warn(f"--resume continues the run's own model: ignoring --{', --'.join(f.replace('_', '-') for f in model_flags)}")


def check_eval_perturbations(args, cfg):
    """--eval-shift ('all' or 0 <= N < b under sparse / hst; check_args made it 'all' or an int) and --eval-redraw,
    once the model's topology is known, before training: an error line naming the flag, or a warning where the
    perturbation changes nothing."""
    b, sparse, every = cfg.block_size, cfg.attention != "dense", args.eval_shift == "all"
    if sparse and not every and args.eval_shift >= b:
        fail(f"--eval-shift {args.eval_shift}: give 'all' or a shift in 0 .. {b - 1} (--block-size {b}: a shift of "
             "b tokens puts every block boundary back on a boundary)")
    if not sparse and args.eval_shift:
        warn("--eval-shift with dense attention: shifting moves no block boundary, so the shifted score repeats the "
             "original" + (" (all: only s = 1 is scored)" if every else ""))
    if args.eval_redraw and (not sparse or cfg.num_random == 0):
        warn("--eval-redraw has no effect without random blocks (dense attention or --num-random 0): not scored")


# -----------------------------------------------------------------------------
# 3. Optimizer and schedule (nanoGPT's recipe).

def is_gnet(name):
    """A G-Net parameter (AttendOut), by its name: it learns and is clipped apart from the backbone."""
    return GNET in name.split(".")


def make_optimizer(model, args, device):
    """AdamW in three groups: weight matrices (decayed), biases / LayerNorm / scalars (not decayed), and the
    G-Nets (AttendOut), which learn at their own rate cfg.gnet_lr without decay. Each group's peak rate is
    its "base_lr"; the schedule scales all of them by the same factor (lr_factor)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if not is_gnet(n) and p.dim() >= 2]
    no_decay = [p for n, p in params if not is_gnet(n) and p.dim() < 2]         # biases, LayerNorm, scalars
    gnet = [p for n, p in params if is_gnet(n)]
    groups = [{"params": decay, "weight_decay": args.weight_decay, "base_lr": args.lr},
              {"params": no_decay, "weight_decay": 0.0, "base_lr": args.lr}]
    if gnet:
        groups.append({"params": gnet, "weight_decay": 0.0, "base_lr": model.cfg.gnet_lr})
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6, fused=device.type == "cuda")


def clip_gradients(model, max_norm):
    """Clip the backbone's gradient norm to max_norm (0: measure only), and the G-Nets' on their own.

    Apart, because the G-Nets' reversed gradient can be orders of magnitude larger than the backbone's
    (measured on MiniLM: up to 1e5 under --gnet-mask logit, when a dropped attention sink leaves a row whose
    kept mass is tiny): clipped together, it would shrink the backbone's step to nothing. Returns
    {"grad_norm": backbone norm, "gnet_grad_norm": G-Nets' norm (AttendOut only)} before clipping."""
    limit = max_norm if max_norm > 0 else float("inf")
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    backbone = [p for n, p in params if not is_gnet(n)]
    norms = {"grad_norm": float(torch.nn.utils.clip_grad_norm_(backbone, limit))}
    gnet = [p for n, p in params if is_gnet(n)]
    if gnet:
        norms["gnet_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(gnet, limit))
    return norms


def lr_factor(step, total, warmup):
    """Linear warmup to 1, then linear decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def set_lr(optimizer, factor):
    """Every group at factor x its own peak rate (the backbone's --lr, the G-Nets' --gnet-lr). Returns the
    backbone's rate (logged as "lr")."""
    for grp in optimizer.param_groups:
        grp["lr"] = grp["base_lr"] * factor
    return optimizer.param_groups[0]["lr"]


# -----------------------------------------------------------------------------
# 4. Losses and evaluation: each task's own, in its entry of tasks.TASKS (classification, LRA Retrieval's pairs and
#    masked LM in tasks.py, extractive QA in qa.py); the loop calls r.kind.loss and r.kind.evaluate. Here: which
#    dev score picks ckpt_best.pt.

def main_metric(metrics, task):
    """The number that picks ckpt_best.pt: the task's metric on its first dev split (lower loss is better)."""
    split = next(iter(metrics))
    v = metrics[split][task.metric_name]
    return -v if task.metric_name == "loss" else v


# -----------------------------------------------------------------------------
# 5. The run, top to bottom: setup, then the loop (one optimizer step at a time, with evaluation and
#    checkpoints on their schedule), then the report. Plumbing (processes, RNG capture, the run folder,
#    atomic checkpoint writes, Ctrl-C) lives in infra.py.

def main(argv=None):
    """Errors of the user's input end in one `error:` line, exit 2 (infra.one_line_errors); a stop by Ctrl-C
    or SIGTERM exits 130 / 143 after saving, so `python train.py ... && next` does not carry on."""
    with one_line_errors():
        args = parse_args(sys.argv[1:] if argv is None else argv)
        check_args(args)
    with one_line_errors(f"interrupted; the last checkpoint (if any) is {os.path.join(args.out, 'ckpt_last.pt')}"):
        try:
            with lock_out(args.out):
                stopped_by = run(args)
        except FloatingPointError as e:
            fail(str(e))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if stopped_by:
        sys.exit(128 + stopped_by)


def run(args):
    # Reading guide. A run is three calls:
    #   setup(args)   what to train on and what to train: tokenizer and task data (section 2), the model from a
    #                 checkpoint or from scratch, the optimizer and the step count (section 3);
    #   train(r)      the loop: train_step (forward and the task's loss, r.kind.loss from tasks.py; backward,
    #                 clip, AdamW, AttendOut's budget), then logging, evaluation (r.kind.evaluate; ckpt_best.pt)
    #                 and ckpt_last.pt on their schedules;
    #   report(r)     final.json and the last line: the final and best dev score beside the majority class.
    r = setup(args)              # data, model, optimizer, schedule; or all of them as a resumed run left them
    train(r)                     # the loop; returns when the last step is done or a stop was asked for
    if r.state["step"] < r.total:
        return r.stopped_by      # the signal that stopped it (the exit code is 128 + it)
    if is_main():
        report(r)
    return None


class Run:
    """What one run holds. setup() fills it; the loop's functions read it and update `state`.
    `state` is the part that ckpt_last.pt saves (with the weights, AdamW and the RNGs): the step, the epoch and
    the position in it, the best dev score so far, the last dev metrics, skipped batches, wall time."""
    args = rank = world = device = tok = kind = task = raw = model = optimizer = stopped_by = None   # kind: tasks.TASKS[--task]
    threads = 0                  # CPU threads in use (--threads, choose_threads)
    total = warmup = per_epoch = 0
    state = None
    paths = None                 # log.jsonl, droprates.jsonl, ckpt_last.pt, ckpt_best.pt inside --out


def setup(args):
    """Everything the loop needs, in the order it is decided. Each step is a function of sections 2 and 3, or
    of infra.py for the plumbing."""
    r = Run()
    r.args = args
    r.rank, r.world, r.device = setup_distributed(args)
    # --- a resumed run takes its own flags back (except those given now), its weights, tokenizer and state
    check_out(args)
    resumed = read_resume(args)
    init = read_init(args) if resumed is None and args.init != "scratch" else None
    seed_everything(args.seed)

    # --- data: the task's entry in tasks.TASKS (reader, loss, evaluation), the tokenizer (the checkpoint's own,
    #     ListOps' or a SentencePiece model), then the task's examples
    r.kind = tasks.kind(args.task)
    data_dir = task_data_dir(args)
    stored_tok = resumed["tokenizer"] if resumed else (init[2] if init else None)
    r.tok = load_tokenizer(args, data_dir, stored_tok)
    model_cfg = resumed["config"] if resumed else (None if init is None else apply_overrides(init[0], method_overrides(args)))
    choose_max_len(args, model_cfg)
    r.task = tasks.load_task(args.task, data_dir, r.tok, max_len=args.max_len, **tasks.files_and_columns(args))
    check_data(args, r.task, data_dir)

    # --- the model: from the resumed checkpoint, --init (converted weights + flag overrides) or scratch
    r.raw = (build_model(model_cfg, resumed["model"], resumed["path"]) if resumed
             else make_model(args, r.tok, r.task, init))
    init = None                                   # free the --init state dict
    check_flags(args, r.raw.cfg, r.task)
    r.threads = choose_threads(args, r.raw, r.device)
    r.raw.to(r.device)
    if r.task.num_labels > 0:
        r.raw.mlm.requires_grad_(False)           # heads that this task does not train stay out of the optimizer
    elif r.raw.cls is not None:
        r.raw.cls.requires_grad_(False)
    r.model = torch.compile(r.raw) if args.compile else r.raw      # what runs the forward: compiled / DDP
    if r.world > 1:
        # frozen heads have requires_grad False, so only LayerDrop leaves trained parameters without a gradient
        c = r.raw.cfg
        r.model = DDP(r.model, device_ids=[r.device.index] if r.device.type == "cuda" else None,
                      find_unused_parameters=c.layerdrop > 0 or c.attn_layerdrop > 0)
    r.model.train()
    seed_everything(args.seed + r.rank)           # nanoGPT: every process draws its own dropout masks

    # --- the schedule: steps per epoch from the batch plan, total steps, warmup
    micro = args.batch_size // args.grad_accum
    if micro < r.world or args.batch_size % (args.grad_accum * r.world):
        fail(f"--batch-size {args.batch_size} must be a multiple of --grad-accum x processes "
             f"({args.grad_accum} x {r.world})")
    r.per_epoch = len(epoch_batches(r, 0)) // args.grad_accum
    if r.per_epoch == 0:
        fail(f"{len(r.task.train)} training examples make no full step of --batch-size {args.batch_size}")
    r.total = args.max_steps if args.max_steps > 0 else max(1, int(args.epochs * r.per_epoch))
    r.warmup = int(args.warmup * r.total) if args.warmup < 1 else int(args.warmup)
    r.optimizer = make_optimizer(r.raw, args, r.device)
    r.state = {"step": 0, "epoch": 0, "micro": 0, "best": None, "best_step": None, "skipped": 0, "wall": 0.0,
               "dev": {}, "saved_step": None}     # saved_step: the step that ckpt_last.pt holds
    r.paths = {name: os.path.join(args.out, name)
               for name in ("log.jsonl", "droprates.jsonl", "ckpt_last.pt", "ckpt_best.pt", "final.json")}
    clear_out(args)              # --overwrite: the old run goes only now, with the new one's data and model ready
    if resumed:
        restore(r, resumed)
    if is_main():
        print(opening_line(r), flush=True)
    return r


def opening_line(r):
    """The run in one line: task and data sizes | model | method | steps, device, threads (and resume)."""
    args, t, c = r.args, r.task, r.raw.cfg
    dev = " + ".join(f"{len(v)} {k}" for k, v in t.dev.items()) or "no dev"
    origin = "from scratch" if args.init == "scratch" and not args.resume else f"from {args.init}"
    dropout = {"attendout": "AttendOut attention dropout", "none": "no attention dropout",
               "standard": f"attention dropout {c.attn_dropout_p:g}",
               "scheduled": f"scheduled attention dropout ({c.schedule})"}[c.attn_dropout]
    if c.attention != "dense" and c.attn_dropout != "none" and not (c.attn_dropout == "standard" and c.attn_dropout_p == 0):
        # sparse.sparse_kernel takes PyTorch's fused attention only when nothing is dropped (1.5 -> 0.8 s a step
        # for HST 2 x 64 at 1,000 tokens on one CPU thread, README): say so where a user sees the run
        dropout += " (the sparse kernel's gather path; --attn-dropout none takes its fused one)"
    method = [f"{c.attention} attention", dropout]
    if args.sar > 0:
        method.append(f"SAR alpha {args.sar:g} shift {args.sar_shift}")
    elif args.rdrop > 0:
        method.append(f"R-Drop alpha {args.rdrop:g}")
    where = f"{r.total} steps on {r.device}" + (f" x {r.world} processes" if r.world > 1 else "")
    if r.device.type == "cpu":
        where += f", {r.threads} CPU thread{'s' if r.threads > 1 else ''} (--threads)"
    return (f"task {args.task}: {len(t.train)} train / {dev} examples | model {r.raw.num_params() / 1e6:.2f}M "
            f"parameters ({c.num_layers} layer{'s' if c.num_layers > 1 else ''}, hidden {c.hidden_size}, {origin}) | {', '.join(method)} | {where}"
            + (f"; resuming at step {r.state['step']}" if args.resume else ""))


# flags that change the data stream or the schedule: --resume refuses a new value (the others may change)
RESUME_FIXED = ("task", "data", "train_file", "dev_file", "text_col", "text_pair_col", "label_col", "vocab_size",
                "max_len", "batch_size", "grad_accum", "seed", "epochs", "max_steps", "warmup")


def read_resume(args):
    """--resume: the run's ckpt_last.pt (config, weights, tokenizer, optimizer, state, RNGs), read as --init
    reads a checkpoint; the run's own flags fill in every flag not given now. None without --resume."""
    if not args.resume:
        return None
    path = os.path.join(args.out, "ckpt_last.pt")
    if not os.path.exists(path):
        fail(f"--resume: {path} does not exist")
    cfg, state, tok_files, ckpt = read_checkpoint(path)
    if not all(k in ckpt for k in ("args", "train_state", "optimizer", "rng")):
        fail(f"--resume: {path} is not a training checkpoint (no run state; a converted or exported model? "
             "use it with --init)")
    for k in RESUME_FIXED:             # the saved position in the epoch means something only in the same stream
        if k in args.given and k in ckpt["args"] and getattr(args, k) != ckpt["args"][k]:
            fail(f"--resume: --{k.replace('_', '-')} {getattr(args, k)} differs from the run's "
                 f"{ckpt['args'][k]}; a resumed run keeps its data and schedule (start a new --out to change it)")
    for k, v in ckpt["args"].items():
        if k not in args.given and k not in ("resume", "device"):
            setattr(args, k, v)
    return {"path": path, "config": cfg, "model": state, "tokenizer": tok_files, "ckpt": ckpt}


def restore(r, resumed):
    """Continue where ckpt_last.pt stopped: AdamW, the loop state, this process's RNGs; logs written after
    the checkpoint are dropped (the resumed run writes them again)."""
    ckpt = resumed["ckpt"]
    r.optimizer.load_state_dict(ckpt["optimizer"])
    r.state.update(ckpt["train_state"])
    rngs = ckpt["rng"]
    if len(rngs) != r.world:
        warn(f"--resume: the run had {len(rngs)} processes, now {r.world}: the data split and RNG streams change")
    set_rng_state(rngs[r.rank % len(rngs)])
    if is_main():
        trim_log(r.paths["log.jsonl"], r.state["step"])
        trim_log(r.paths["droprates.jsonl"], r.state["step"])


def epoch_batches(r, epoch):
    """The epoch's batches as lists of example indices, a function of (seed, epoch) (data.batch_plan), so
    resuming mid-epoch needs only state["micro"]. Each batch is padded when it is used (data.collate)."""
    plan = data.batch_plan([len(e.ids) for e in r.task.train], r.args.batch_size // r.args.grad_accum,
                           seed=r.args.seed, epoch=epoch)
    return [b for b in plan if len(b) >= r.world]


# --- the loop -----------------------------------------------------------------

def train(r):
    """Optimizer steps until r.total (or Ctrl-C / SIGTERM). After each step: log it, evaluate on schedule
    (which may write ckpt_best.pt), then write ckpt_last.pt on schedule; everything logged up to a step is
    in that step's ckpt_last.pt.

    The batches of an epoch are fixed by (seed, epoch) (epoch_batches); state["micro"] says how many of them
    are used, so the loop can stop anywhere and a resumed run continues with the very next batch."""
    args, state = r.args, r.state
    use_bar = is_main() and sys.stderr.isatty()        # a log file gets plain lines instead of a progress bar
    bar = tqdm(total=r.total, initial=state["step"], disable=not use_bar, dynamic_ncols=True, desc=args.task)
    gnet_log = (DropRateLogger(r.paths["droprates.jsonl"], args.log_every, append=args.resume)
                if r.raw.cfg.attn_dropout == "attendout" and is_main() else None)
    meter = {"t0": time.time() - state["wall"], "seen": 0, "t_last": time.time(), "bad_in_row": 0}
    batches, batches_epoch = None, None
    with StopFlag(r.device, r.world) as stop:
        while state["step"] < r.total and not stop.requested():
            if batches_epoch != state["epoch"]:
                batches, batches_epoch = epoch_batches(r, state["epoch"]), state["epoch"]
            step = state["step"] + 1                    # the step being taken; log.jsonl counts steps from 1
            numbers, epoch_done = train_step(r, batches, step, meter, bar)
            if numbers is None:                         # a non-finite batch, skipped (--skip-nonfinite)
                continue
            state["step"] = step
            bar.update(1)
            log_step(r, step, numbers, meter, bar, use_bar)
            if gnet_log is not None:
                gnet_log.log(step, step / r.total, r.raw, last=step == r.total, **numbers.get("budget", {}))
            if step == r.total and r.world > 1:
                check_replicas(r.raw, r.device, r.world)
            if step == r.total or (args.eval_every and step % args.eval_every == 0) or (not args.eval_every and epoch_done):
                if is_main():
                    evaluate_and_keep_best(r, step, bar)
                if r.world > 1:
                    dist.barrier()
            if step == r.total or (args.save_every and step % args.save_every == 0):
                save_last(r, meter)
        bar.close()
        if state["step"] < r.total:                 # Ctrl-C / SIGTERM: save, say how to continue
            r.stopped_by = stop.signum or signal.SIGTERM    # under torchrun: the process that was not signalled
            if state["saved_step"] != state["step"]:
                save_last(r, meter)
            if is_main():
                print(f"stopped at step {state['step']}: saved {r.paths['ckpt_last.pt']}; "
                      f"continue with --resume --out {args.out}")


def train_step(r, batches, step, meter, bar):
    """One optimizer step: forward and backward over --grad-accum micro-batches, clip, AdamW, and AttendOut's
    budget. Returns (the step's numbers, or None if the batch was skipped as non-finite; epoch_done)."""
    args, state = r.args, r.state
    # the step's learning rates and training progress: both are pure functions of the step, so a resumed run
    # (which restores the step) gets the same ones
    lr_now = set_lr(r.optimizer, lr_factor(step - 1, r.total, r.warmup))   # warmup, then linear decay
    r.raw.set_progress((step - 1) / r.total)    # scheduled dropout follows training progress
    # forward and backward, one micro-batch at a time (gradients add up); under torchrun each process takes
    # every world-th example of the batch, and DDP averages the gradients at the last micro-batch
    loss_sum, parts, finite = 0.0, {}, True
    for i in range(args.grad_accum):
        # padded to the longest example; the model pads to its block size (and SAR shifts) itself
        batch = data.collate([r.task.train[j] for j in batches[state["micro"] + i]], r.tok.pad_id)
        batch = {k: v[r.rank::r.world].to(r.device, non_blocking=True) for k, v in batch.items()}
        meter["seen"] += batch["input_ids"].size(0) * r.world
        sync = i == args.grad_accum - 1 or r.world == 1
        with (nullcontext() if sync else r.model.no_sync()), autocast(r.device):
            loss, parts = r.kind.loss(r.model, batch, args, r.task, r.tok)    # the task's objective (tasks.py)
        finite = all_true(torch.isfinite(loss.detach()), r.device, r.world)
        if not finite:
            break
        (loss / args.grad_accum).backward()
        loss_sum += loss.item() / args.grad_accum
    # the batches are consumed, stepped or skipped; the epoch ends when no full step is left
    state["micro"] += args.grad_accum
    epoch_done = state["micro"] + args.grad_accum > len(batches)
    if epoch_done:
        state["epoch"], state["micro"] = state["epoch"] + 1, 0
    norms, what = None, "loss"
    if finite:
        # clip (or, with --clip 0, only measure): a finite loss can still give inf/NaN gradients
        norms = clip_gradients(r.raw, args.clip)
        finite, what = all(math.isfinite(n) for n in norms.values()), "gradient"
    if not finite:
        r.optimizer.zero_grad(set_to_none=True)
        if not args.skip_nonfinite:
            bar.close()
            stop_nonfinite(r, f"non-finite {what} at step {step} (lr {lr_now:.3g})")
        state["skipped"] += 1
        meter["bad_in_row"] += 1
        warn(f"non-finite {what} at step {step}: batch skipped ({state['skipped']} so far)")
        if meter["bad_in_row"] > r.per_epoch:
            stop_nonfinite(r, f"non-finite loss on every batch for a whole epoch (step {step})")
        return None, epoch_done
    meter["bad_in_row"] = 0
    # the update: AdamW on the backbone and heads (and the G-Nets, at their own rate, with reversed gradients)
    r.optimizer.step()
    r.optimizer.zero_grad(set_to_none=True)
    numbers = {"loss": loss_sum, "lr": lr_now, **norms, **parts}
    if r.raw.cfg.attn_dropout == "attendout":
        # AttendOut's budget (methods.md §3.1): shift every G-Net bias so the mean drop rate is back at rho
        held = hold_budget(r.raw, all_reduce_sum)
        if held is not None:
            numbers["drop"] = held[0]
            numbers["budget"] = {"mean": held[0], "shift": held[1]}
    return numbers, epoch_done


def log_step(r, step, numbers, meter, bar, use_bar):
    """Every --log-every steps: a log.jsonl line and the console line, with the loss in its parts."""
    if not (step % r.args.log_every == 0 or step == r.total):
        return
    now = time.time()
    rate = meter["seen"] / max(now - meter["t_last"], 1e-9)
    meter["seen"], meter["t_last"] = 0, now
    rec = {"step": step, **{k: v for k, v in numbers.items() if k != "budget"}, "examples_per_s": rate}
    append_jsonl(r.paths["log.jsonl"], rec)
    shown = console_parts(numbers, r.args)
    bar.set_postfix_str(", ".join(shown) + f", {rate:.0f} ex/s")
    if is_main() and not use_bar:
        print(f"step {step}/{r.total}: " + ", ".join(shown) + f", lr {numbers['lr']:.2e}, {rate:.0f} examples/s",
              flush=True)


def console_parts(numbers, args):
    """The loss as the reader should see it: task loss, consistency term and drop rate apart, not only summed."""
    shown = []
    if "ce" in numbers:          # SAR / R-Drop: loss = ce + alpha x consistency, written out as that sum
        alpha = args.sar if args.sar > 0 else args.rdrop
        shown.append(f"loss {numbers['loss']:.4f} = ce {numbers['ce']:.4f} + alpha {alpha:g} x "
                     f"{'SAR' if args.sar > 0 else 'R-Drop'} consistency {numbers['consistency']:.4f}")
    else:
        shown.append(f"loss {numbers['loss']:.4f}")
    if "drop" in numbers:        # AttendOut: the mean drop rate the budget holds
        shown.append(f"drop rate {numbers['drop']:.3f}")
    return shown


def evaluate_and_keep_best(r, step, bar):
    """Dev metrics (rank 0; with --eval-shift / --eval-redraw, again under each perturbed topology), logged; a
    better main metric (on the original topology) writes ckpt_best.pt."""
    args, task, state = r.args, r.task, r.state
    if not task.dev:
        return
    metrics = r.kind.evaluate(r.raw, task, args, r.device, r.tok)       # the task's metrics (tasks.py)
    add_perturbed(r, metrics)
    append_jsonl(r.paths["log.jsonl"], {"step": step, "dev": metrics})
    state["dev"] = metrics
    score = main_metric(metrics, task)
    if (state["best"] is None or score > state["best"]) and weights_finite(r.raw):
        state["best"], state["best_step"] = score, step
        save_checkpoint(r.paths["ckpt_best.pt"], r.raw, r.tok, r.optimizer, state, args, [rng_state()])
    bar.write(f"step {step}: " + "; ".join(f"{split} {tasks.show_metrics(args.task, m)}" for split, m in metrics.items()))


def eval_shifts(args, cfg):
    """The shifts --eval-shift scores: N alone, or (all) every s = 1 .. b-1; dense attention has no block
    boundary to move, so there 'all' scores s = 1 alone (check_flags warns)."""
    if args.eval_shift != "all":
        return [args.eval_shift] if args.eval_shift else []
    return [1] if cfg.attention == "dense" else list(range(1, cfg.block_size))


def eval_redraws(args, cfg):
    """The other random-block draws --eval-redraw scores (1 .. K; none without random blocks)."""
    return list(range(1, args.eval_redraw + 1)) if cfg.attention != "dense" and cfg.num_random > 0 else []


def add_perturbed(r, metrics):
    """The dev metrics under each perturbed topology (methods.md §2.3): every shift of eval_shifts (sar.shift,
    the task's evaluate(shift_by=s)) and every draw of eval_redraws (model.Model.set_eval_draw), added to each
    split's metrics as metrics[split]["shift" / "redraw"] = {"by": {s: {metric: v}}, "mean": {..}, "worst": {..}}."""
    args, raw = r.args, r.raw
    score = lambda **kw: r.kind.evaluate(raw, r.task, args, r.device, r.tok, **kw)
    runs = {"shift": {s: score(shift_by=s) for s in eval_shifts(args, raw.cfg)}, "redraw": {}}
    try:
        for k in eval_redraws(args, raw.cfg):
            raw.set_eval_draw(k)
            runs["redraw"][k] = score()
    finally:
        raw.set_eval_draw(0)
    for perturbation, by in runs.items():
        for split in (metrics if by else ()):
            per = {str(p): m[split] for p, m in by.items()}
            metrics[split][perturbation] = {"by": per, **summarise(per.values())}


# lower is better for these metrics (masked LM), higher for every other
LOWER_IS_BETTER = ("loss", "ppl")


def summarise(runs):
    """{"mean": {metric: mean}, "worst": {metric: worst}} over perturbed evaluations' metrics (counts skipped)."""
    runs = list(runs)
    names = [k for k, v in runs[0].items() if isinstance(v, float)]
    worst = lambda k, vs: max(vs) if k in LOWER_IS_BETTER else min(vs)
    return {"mean": {k: float(np.mean([m[k] for m in runs])) for k in names},
            "worst": {k: worst(k, [m[k] for m in runs]) for k in names}}


def save_last(r, meter):
    """ckpt_last.pt: everything --resume needs. Every process calls it (their RNG states are gathered)."""
    if not all_true(weights_finite(r.raw), r.device, r.world):
        stop_nonfinite(r, f"non-finite weights after step {r.state['step']}")
    r.state["wall"] = time.time() - meter["t0"]
    rngs = gather_rng_states(r.world)
    if is_main():
        save_checkpoint(r.paths["ckpt_last.pt"], r.raw, r.tok, r.optimizer,
                        {**r.state, "saved_step": r.state["step"]}, r.args, rngs)
    r.state["saved_step"] = r.state["step"]


def stop_nonfinite(r, what):
    s = r.state["saved_step"]
    good = f"{r.paths['ckpt_last.pt']} (step {s})" if s is not None else "none written yet"
    fail(f"{what}; last good checkpoint: {good}; lower --lr, or pass --skip-nonfinite to skip such batches", code=1)


# --- the report -----------------------------------------------------------------

def majority_baseline(task, task_name):
    """The task's main metric for always predicting the most common training label, on the first dev split
    (so a CoLA run compares its MCC with the majority class's MCC, 0, not with its accuracy)."""
    if task.is_regression or not task.label_names or not task.dev:     # regression, masked LM, QA spans: none
        return None
    counts = np.bincount([e.label for e in task.train], minlength=task.num_labels)
    labels = np.array([e.label for e in next(iter(task.dev.values()))])
    return data.compute_metrics(task_name, np.full_like(labels, int(counts.argmax())), labels)[task.metric_name]


def report(r):
    """final.json and the summary line: the last and the best dev score, beside the majority-class baseline."""
    args, task, state = r.args, r.task, r.state
    metrics, best = state["dev"], state["best"]
    final = {"task": args.task, "metric": task.metric_name, "dev": metrics,
             "best_dev": -best if best is not None and task.metric_name == "loss" else best,
             "best_step": state["best_step"], "steps": state["step"], "skipped_batches": state["skipped"],
             "wall_time_s": round(state["wall"], 2), "majority_baseline": majority_baseline(task, args.task),
             "config": asdict(r.raw.cfg), "args": public_args(args)}
    with open(r.paths["final.json"], "w") as f:
        json.dump(final, f, indent=1)
    line = f"done in {state['wall']:.0f}s, {state['step']} steps"
    name = task.metric_name
    show = lambda v: tasks.show_value(args.task, name, v)              # "34.8%", "0.5120" (mcc, loss)
    if metrics:
        split = next(iter(metrics))
        line += f": {split} {name} {show(metrics[split][name])} at the last step"
        if final["best_dev"] is not None:
            line += f", best {show(final['best_dev'])} at step {final['best_step']}"
    if final["majority_baseline"] is not None:
        line += f" (majority-class baseline: {name} {show(final['majority_baseline'])})"
    print(line + f"; results in {r.paths['final.json']}")


if __name__ == "__main__":
    main()
