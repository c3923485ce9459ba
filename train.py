"""train.py: the training loop of attnreg, nanoGPT's train.py for encoders, on the CPU or the GPU.

Run:  python train.py                                     # the demo (DEMO), into out/demo
      python train.py --max-steps 100 --out out/demo-100    # the same demo cut to 100 steps
      python train.py --init roberta.pt --task sst2 --data glue/SST-2 --out out/sst2   # fine-tune
Each run writes its own --out folder; a second run into one needs --overwrite or --resume.
"""
import argparse
import itertools
import json
import math
import os
import signal
import sys
import time
from collections import namedtuple
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import attendout
import data
import sar
from data import ArgumentParser, fail, one_line_errors, show_metrics, show_value, warn
from model import (CheckpointError, Config, Model, apply_overrides, build_model, checkpoint_dict,
                   checkpoint_task, pick_device, read_checkpoint, save_atomic)

# -----------------------------------------------------------------------------------------------
# 1. Flags. DEMO, the parser's defaults, switches on the three methods that model.Config's plain
# RoBERTa leaves off (dense attention, blocks of 64, standard dropout; no SAR), for a small model
# from scratch on generated ListOps: `python train.py`, about 4 minutes on a CPU core (with
# --max-steps 100, the same demo cut to a minute).
DEMO = {"task": "listops", "init": "scratch",
        "layers": 2, "hidden": 128, "heads": 4, "ffn": 256,   # from scratch: 0.4M parameters
        "lr": 1e-3, "epochs": 10, "eval_every": 200,           # peak lr; evaluate every 200 steps
        "attention": "hst", "block_size": 8,                   # Config: dense, blocks of 64
        "attn_dropout": "attendout",                           # Config: standard
        "gnet_lr": 1e-5,                                       # Config: None (the backbone's lr)
        "sar": 1.0}                                            # SAR's alpha (0: off)
# The flags that are model.Config fields (None: Config's default, with --init the checkpoint's).
# With --init, FINETUNE replaces DEMO for the flags not given: the usual GLUE recipe, no SAR.
CONFIG_FLAGS = ("attention", "block_size", "window", "num_global", "num_random", "max_positions",
                "attn_dropout", "attn_dropout_p", "hidden_dropout_p", "gnet_tau", "gnet_lr",
                "schedule", "layerdrop", "attn_layerdrop")
FINETUNE = {"lr": 2e-5, "epochs": 3, "eval_every": 0, "sar": 0.0, **dict.fromkeys(CONFIG_FLAGS)}
# What fixes the model, the data stream and the schedule: a resumed run may not change these.
RESUME_FIXED = ("task", "data", "train_file", "dev_file", "text_col", "text_pair_col", "label_col",
                "vocab_size", "max_len", "batch_size", "grad_accum", "seed", "epochs", "max_steps",
                "warmup", "init", "layers", "hidden", "heads", "ffn", *CONFIG_FLAGS)
# Numbers that must be >= 1 (every other number: >= 0), and a method's own flags (by name).
POSITIVE = ("batch_size", "grad_accum", "log_every", "vocab_size", "layers", "hidden", "heads",
            "ffn", "block_size", "max_positions")
ONLY_WITH = {"gnet_": "attendout", "schedule": "scheduled"}
# A run whose length comes from --epochs, with fewer optimizer steps than this, is warned: 3
# epochs of 100 SST-2 lines at --batch-size 32 are 12 steps, after which MiniLM at --lr 2e-5
# scored 40.0% on 50 dev lines against a 48.0% majority class (docs/use.md).
FEW_STEPS = 50

def flag(name):                                          # block_size -> --block-size
    return "--" + name.replace("_", "-")

# The parser, each default DEMO's where it has one. defaults=False suppresses every default, so
# that parsing with it tells which flags were given (parse_args).
def make_parser(defaults=True):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = ap.add_argument
    # the task and its data
    add("--task", choices=list(data.TASKS), metavar="TASK", help=", ".join(data.TASKS))
    add("--data", help="the task's folder of train and dev files (mlm: or one text file; listops "
                       "and lab-*: generated if omitted)")
    add("--train-file", metavar="FILE",
        help="the training file, any path, in place of the task's usual one in --data (not LRA's)")
    add("--dev-file", nargs="+", metavar="FILE",
        help="the dev file, any path, in place of the task's usual one in --data (not LRA's); "
             "--task tsv scores several, each a dev split named by its file's stem (the first "
             "picks ckpt_best.pt)")
    add("--text-col", help="--task tsv: the text column (name or 0-based index)")
    add("--text-pair-col", help="--task tsv: an optional second text column")
    add("--label-col", help="--task tsv: the label column")
    add("--max-len", type=int, help="tokens per example (default: the task's, at most the model's)")
    add("--vocab-size", type=int, default=8000,
        help="from scratch on text: the SentencePiece vocabulary's size (a small training file "
             "allows fewer; the error says how many)")
    # the model: a checkpoint, or a new one of this size
    add("--init", help="an HF folder, a .pt (python model.py convert), or 'scratch'")
    add("--layers", type=int, help="from scratch: layers")
    add("--hidden", type=int, help="from scratch: hidden size d")
    add("--heads", type=int, help="from scratch: attention heads H")
    add("--ffn", type=int, help="from scratch: feed-forward size")
    # the schedule and the optimizer
    add("--epochs", type=float, help="passes over the training set (with --init: 3)")
    add("--max-steps", type=int, default=0, help="optimizer steps (0: from --epochs)")
    add("--batch-size", type=int, default=32, help="examples per step, all processes together")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--lr", type=float, help="peak learning rate (with --init: 2e-5)")
    add("--warmup", type=float, default=0.06, help="warmup: a fraction of the steps, or a count")
    add("--weight-decay", type=float, default=0.01, help="AdamW's decay of matrices, embeddings")
    add("--clip", type=float, default=1.0, help="the backbone's gradient-norm clip (0: off)")
    add("--seed", type=int, default=0, help="data order, initial weights, dropout")
    # the run folder, evaluation and logging
    add("--out", default="out/demo", help="run folder: log.jsonl, final.json, checkpoints")
    add("--eval-every", type=int, help="evaluate every N steps (0: each epoch's end)")
    add("--save-every", type=int, default=500, help="write ckpt_last.pt every N steps, at the end")
    add("--log-every", type=int, default=10, help="a log line every N steps")
    add("--eval-shift", type=shift_arg, default=0, help="also score shifted by N tokens, or 'all'")
    add("--resume", action="store_true", help="continue the run in --out from its ckpt_last.pt")
    add("--overwrite", action="store_true", help="replace a run already in --out")
    # the machine
    add("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--threads", type=int, default=0, help="CPU threads (0: 1 for a model under 20M, else all)")
    # model.Config fields (CONFIG_FLAGS)
    add("--attention", choices=["dense", "sparse", "hst"], help="the topology (sparse.py)")
    add("--block-size", type=int, help="b, tokens per block (Config: 64)")
    add("--window", type=int, help="w, neighbour blocks on each side (Config: 1)")
    add("--num-global", type=int, help="g, global tokens at the start (Config: 1)")
    add("--num-random", type=int, help="r, random key blocks per query block (Config: 0)")
    add("--max-positions", type=int, help="position-table rows (more than the checkpoint's)")
    add("--attn-dropout", choices=list(attendout.METHODS), help="attendout.METHODS")
    add("--attn-dropout-p", type=float, help="the rate of standard and dropkey (Config: 0.1)")
    add("--hidden-dropout-p", type=float, help="embedding and residual dropout (Config: 0.1)")
    add("--gnet-tau", type=float, help="AttendOut: the keep reward's weight is tau^2 (Config: 0.5)")
    add("--gnet-lr", type=float, help="the G-Nets' own peak learning rate (Config: --lr's)")
    add("--schedule", help="--attn-dropout scheduled: a droprates.jsonl or linear:P_LOW:P_HIGH")
    add("--layerdrop", type=float, help="LayerDrop: skip a whole layer with this probability")
    add("--attn-layerdrop", type=float, help="Attn.LayerDrop: skip only the attention sub-layer")
    # the losses of sar.py (methods.md §2.3)
    add("--sar", type=float, help="SAR's weight alpha (0: off; with --init: 0)")
    add("--sar-shift", type=int, default=1, help="SAR: padding tokens inserted after the first")
    add("--rdrop", type=float, default=0.0, help="R-Drop's weight alpha (0: off)")
    add("--views", type=int, choices=[1, 2],
        help="views per batch: 2 adds SAR's shifted view (R-Drop's copy), also at alpha 0 "
             "(default: 2 with --sar or --rdrop, else 1)")
    add("--ce", choices=["all", "original"],
        help="the cross-entropy on every clean view, or on the original view only (default: "
             "SAR's original, as its digest reads; R-Drop's all, as its paper has it)")
    if defaults:
        ap.set_defaults(**DEMO)
    else:
        for action in ap._actions:
            action.default = argparse.SUPPRESS           # absent unless given
    return ap

def shift_arg(text):                                     # --eval-shift: N tokens, or 'all'
    if text != "all" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text}: give 'all' or a number of tokens >= 0")
    return text if text == "all" else int(text)

# The flags in force (DEMO's defaults, with --init FINETUNE's), and args.given, those given.
def parse_args(argv):
    args = make_parser().parse_args(argv)
    args.given = sorted(vars(make_parser(defaults=False).parse_args(argv)))
    if args.init != "scratch":
        for name, value in FINETUNE.items():
            if name not in args.given:
                setattr(args, name, value)
    if args.views is None:                               # a second view where an alpha asks for it
        args.views = 2 if args.sar > 0 or args.rdrop > 0 else 1
    if args.ce is None:                                  # each method's own form (methods.md §2.3)
        args.ce = "all" if args.rdrop > 0 else "original"
    return args

# Before anything is read or written, a value that means nothing is one `error:` line.
def check_args(args):
    for name, value in vars(args).items():               # NaN and infinity fail too
        least = 1 if name in POSITIVE else 0
        if type(value) in (int, float) and not (math.isfinite(value) and value >= least):
            fail(f"{flag(name)} {value}: must be >= {least}")
    paths = [("data", args.data), ("train_file", args.train_file)]
    paths += [("dev_file", path) for path in args.dev_file or []]
    for name, path in paths:
        if path and not os.path.exists(path):
            fail(f"{flag(name)} {path}: no such file or folder")
    if args.dev_file and len(args.dev_file) > 1 and args.task != "tsv":
        fail(f"--dev-file: {len(args.dev_file)} files; only --task tsv scores several dev files")
    # --data is a folder. Masked LM also reads one text file as --data, and a task given both
    # --train-file and --dev-file reads no file of --data (it holds the tokenizer's cache); LRA's
    # readers take neither flag. Any other file there is refused now, not by the reader's search.
    lra = args.task.startswith("lra-")
    if lra and (args.train_file or args.dev_file):
        fail(f"--train-file / --dev-file: --task {args.task} reads the release's own files in "
             "--data (docs/tasks.md)")
    both_files = args.train_file and args.dev_file and not lra
    if args.data and os.path.isfile(args.data) and args.task != "mlm" and not both_files:
        instead = "" if lra else ", or give --train-file FILE and --dev-file FILE"
        fail(f"--data {args.data} is a file: --task {args.task} reads a folder with "
             f"{folder_files(args.task)}{instead}")
    if args.max_steps == 0 and not args.epochs > 0:
        fail(f"--epochs {args.epochs}: must be > 0")
    if args.max_len is not None and args.max_len < 8:
        fail(f"--max-len {args.max_len}: must be >= 8")
    if args.sar > 0 and args.rdrop > 0:
        fail("--sar and --rdrop are alternatives; give one")
    if args.views == 1 and (args.sar > 0 or args.rdrop > 0):
        fail("--views 1: --sar / --rdrop compare two views (give --views 2, or alpha 0)")
    if args.sar_shift < 1:
        fail(f"--sar-shift {args.sar_shift}: SAR needs a shift of at least 1 token")
    s = args.schedule
    if s and not s.startswith("linear:") and not os.path.isfile(s):
        fail(f"--schedule {s}: no such file (or linear:P_LOW:P_HIGH)")

# What a task's --data folder holds, the names its reader looks for: the error that meets a file
# in its place says so.
def folder_files(task):
    if task in data.GLUE:
        names = [f"{split}.tsv" for split in ("train", *data.GLUE[task]["dev"])]
        return ", ".join(names[:-1]) + " and " + names[-1]
    if task.startswith("lab-"):
        return "train.tsv and dev.tsv (generated into an empty folder)"
    usual = {"tsv": "train.* and dev.* (.tsv, .csv or .jsonl)",
             "listops": "basic_train.tsv and basic_val.tsv",
             "squad": "train.json and dev.json"}
    return usual.get(task, "the files docs/tasks.md lists")

# -----------------------------------------------------------------------------------------------
# 2. The run. main checks the flags, builds the run (setup), trains (train) and writes final.json
# (report). A user error ends in one `error:` line (exit 2); Ctrl-C or SIGTERM finishes the step,
# saves ckpt_last.pt and exits 130 / 143.
def main(argv=None):
    with one_line_errors("interrupted; the last checkpoint, if any, is --out's ckpt_last.pt"):
        args = parse_args(sys.argv[1:] if argv is None else argv)
        check_args(args)
        try:
            r = setup(args)
            train(r)
            if r.state["step"] == r.total and is_main():  # not after a stop
                report(r)
            # torchrun: every rank reaches the end before the process group goes
            barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if r.stopped_by:
        sys.exit(128 + r.stopped_by)

# Run holds what setup builds: args, rank, world, device, paths, tok, task, loss_fn and evaluate,
# raw (the Model), model (compiled, under DDP), optimizer, total, warmup and state (ckpt_last.pt's).
class Run:
    stopped_by = None                                    # the signal that stopped it, if one did
    FILES = ("log.jsonl", "droprates.jsonl", "ckpt_last.pt", "final.json", "ckpt_best.pt")

# setup builds the run in the order each part needs the one before, and takes --out last, so a
# run that fails to start leaves the run in --out as it was.
def setup(args):
    r = Run()
    r.args = args
    r.rank, r.world, r.device = setup_distributed(args)
    r.paths = {name: os.path.join(args.out, name) for name in Run.FILES}
    taken = any(os.path.exists(path) for path in r.paths.values())
    if os.path.isfile(args.out) or (taken and not (args.resume or args.overwrite)):
        fail(f"--out {args.out} holds another run (or is a file); pass --resume to continue it "
             "or --overwrite")
    r.fallbacks = fall_back(args)                        # the demo's defaults a task cannot use
    start = read_start(args)                             # None: from scratch
    torch.manual_seed(args.seed)                         # the same initial weights for each method
    # The data: --data, or without it ListOps' demo set or a lab task's (data/TASK), generated once
    # (data.write_listops, data.load_lab); the tokenizer;
    # the examples, cut to --max-len tokens (by default the task's length, at most what the model's
    # position table holds; from scratch the table fits it).
    generated = args.task == "listops" or args.task.startswith("lab-")  # made here without --data
    if args.data is None and not generated:
        fail(f"--task {args.task} needs --data (a folder with its train / dev files)")
    default_folder = "listops-demo" if args.task == "listops" else args.task
    folder = args.data or os.path.join("data", default_folder)
    if args.task == "listops" and args.data is None and is_main() and \
            not os.path.exists(f"{folder}/basic_val.tsv"):
        print(f"generating a small ListOps set in {folder}", flush=True)
        data.write_listops(folder, 6000, 500, 500, min_len=10, max_len=60, seed=0, max_depth=3,
                           max_args=4)
    barrier()                                            # the others wait for rank 0's set
    r.tok = load_tokenizer(args, folder, start.tokenizer_files if start else None)
    limit = math.inf
    if start is not None:
        rows = args.max_positions or start.cfg.max_positions
        limit = apply_overrides(start.cfg, {"max_positions": rows}).max_len
    if args.max_len and args.max_len > limit:
        warn(f"--max-len {args.max_len} is longer than the model allows ({limit} tokens; "
             "--max-positions grows it)")
    args.max_len = min(args.max_len or data.TASKS[args.task].max_len, limit)
    r.task = reader(args.task).load_task(args.task, folder, r.tok, max_len=args.max_len,
                                         **columns(args))
    r.loss_fn, r.evaluate = objective(args.task)         # section 5
    # The model on its device: one CPU thread for a small model (its operations are too small to
    # split), the MLM head frozen beside a task head (unused there), torch.compile, and DDP.
    r.raw = make_model(args, r.tok, r.task, start)
    check_run(args, r.task, r.raw.cfg)
    if start is not None and not args.resume:
        check_classes(args.init, start.checkpoint, r.task)
    if args.threads or r.device.type == "cpu":
        every_core = len(os.sched_getaffinity(0))
        torch.set_num_threads(args.threads or (1 if r.raw.num_params() < 20e6 else every_core))
    r.raw.to(r.device)
    r.raw.mlm.requires_grad_(r.task.num_labels == 0)     # trained only for masked LM
    r.model = torch.compile(r.raw) if args.compile else r.raw
    if r.world > 1:
        skips = r.raw.cfg.layerdrop > 0 or r.raw.cfg.attn_layerdrop > 0     # unused parameters
        r.model = torch.nn.parallel.DistributedDataParallel(r.model, find_unused_parameters=skips)
    r.model.train()
    torch.manual_seed(args.seed + r.rank)                # nanoGPT: each process its own dropout
    # The schedule in optimizer steps (one per batch of --batch-size; the total: --max-steps or
    # --epochs of them; the warmup: a fraction or a count), AdamW and the loop's state (batch: the
    # epoch's batches used; masks_died: the step AttendOut's masks were found dead, if they were).
    if args.batch_size % (args.grad_accum * r.world):
        fail(f"--batch-size {args.batch_size} must be a multiple of --grad-accum x processes "
             f"({args.grad_accum} x {r.world})")
    r.per_epoch = len(epoch_batches(r, 0))
    if r.per_epoch == 0:
        fail(f"{len(r.task.train)} training examples make no step of --batch-size "
             f"{args.batch_size}")
    r.total = args.max_steps or max(1, int(args.epochs * r.per_epoch))
    if not args.max_steps and r.total < FEW_STEPS:
        warn(f"only {r.total} optimizer steps ({args.epochs:g} epochs of {r.per_epoch} batches "
             f"of --batch-size {args.batch_size}): too few for fine-tuning to learn much; raise "
             "--epochs or lower --batch-size (or give --max-steps)")
    r.warmup = int(args.warmup * r.total) if args.warmup < 1 else int(args.warmup)
    r.optimizer = make_optimizer(r.raw, args, r.device)
    r.state = {"step": 0, "epoch": 0, "batch": 0, "best": None, "best_step": None, "wall": 0.0,
               "dev": {}, "saved_step": None,        # saved_step: the step in ckpt_last.pt
               "mask_medians": [], "masks_died": None}
    # --out, once all that worked: one run at a time (data.lock_out), the old run's files removed
    # (not on --resume), and a killed save's temporary file.
    os.makedirs(args.out, exist_ok=True)
    r.lock = data.lock_out(args.out) if is_main() else None  # OUT/.lock, for the run's life
    for name in os.listdir(args.out):
        old = name in Run.FILES and not args.resume
        if is_main() and (old or name.startswith(("ckpt_last.pt.tmp", "ckpt_best.pt.tmp"))):
            os.remove(os.path.join(args.out, name))
    if args.resume:
        restore(r, start.checkpoint)
    if is_main():
        print(opening_line(r), flush=True)
    return r

# The demo's defaults that a task cannot use, when not given, fall back (the opening line says so):
# AttendOut compares two predictions of a class or a value, so masked LM and extractive QA train
# with standard attention dropout; masked LM has no prediction for SAR to compare either.
def fall_back(args):
    objective = data.TASKS[args.task].objective
    notes = []
    if objective in ("mlm", "span") and args.attn_dropout == "attendout" and \
            "attn_dropout" not in args.given:
        args.attn_dropout = "standard"
        notes.append(f"the default AttendOut falls back to standard attention dropout: it "
                     f"compares class or value predictions, not {args.task}'s")
    if objective == "mlm" and args.sar > 0 and "sar" not in args.given:
        args.sar = 0.0
        if "views" not in args.given:
            args.views = 1
        notes.append("the default SAR is off: it compares predictions, and masked LM has none")
    return notes

# Where a task's files and columns are. --task tsv takes the list of --dev-file's files; every
# other reader one file (check_args allows it no more).
def columns(args):
    names = ("train_file", "text_col", "text_pair_col", "label_col")
    found = {name: getattr(args, name) for name in names}
    dev_files = args.dev_file or [None]
    found["dev_file"] = args.dev_file if args.task == "tsv" else dev_files[0]
    return found

# The module that reads a task's files: data.py for GLUE, --task tsv and ListOps; for LRA's other
# tasks, SQuAD and masked LM one of readers/ (imported on first use), with its objective's loss.
def reader(task_name):
    if data.TASKS[task_name].load is not None:
        return data
    from readers import lra, mlm, qa                     # data.py imports no project module
    return {"squad": qa, "mlm": mlm}.get(task_name, lra)

# The tokenizer: the checkpoint's, the task's own (ListOps' symbols, LRA's bytes), or SentencePiece
# trained by rank 0 on the training texts, cached beside the data (read-only: data/spm-cache/).
def load_tokenizer(args, data_dir, stored_files):
    if stored_files:
        return data.tokenizer_from_files(data.tensors_to_files(stored_files))
    fixed = data.fixed_tokenizer(args.task)
    if fixed is not None:
        return fixed
    folder = data_dir if os.path.isdir(data_dir) else os.path.dirname(os.path.abspath(data_dir))
    if not os.access(folder, os.W_OK):
        name = os.path.abspath(folder).strip(os.sep).replace(os.sep, "_")
        folder = os.path.join("data", "spm-cache", name)
    if not is_main():
        barrier()                                        # wait for rank 0's model
    os.makedirs(folder, exist_ok=True)
    texts = reader(args.task).training_texts(args.task, data_dir, **columns(args))
    tok = data.train_sentencepiece(texts, f"{folder}/spm{args.vocab_size}", args.vocab_size)
    if is_main():
        barrier()                                        # rank 0's model is written
    return tok

# What a run starts from: --resume's OUT/ckpt_last.pt, --init's checkpoint, or None (scratch).
# A resumed run takes its own flags for those not given now; RESUME_FIXED's may not change.
Start = namedtuple("Start", ["cfg", "weights", "tokenizer_files", "checkpoint"])
def read_start(args):
    path = os.path.join(args.out, "ckpt_last.pt") if args.resume else args.init
    source = "--resume" if args.resume else "--init"
    if path == "scratch":
        return None
    if not os.path.exists(path):
        fail(f"--resume: {path} does not exist" if args.resume else
             f"--init {path}: neither a model folder nor a checkpoint file (nor 'scratch')")
    try:
        start = Start(*read_checkpoint(path))
    except CheckpointError as e:
        fail(f"{source}: {e}")
    if not start.tokenizer_files:                        # a pretrained model needs its tokenizer
        fail(f"{source} {path}: no tokenizer files in it (convert it again with "
             "python model.py convert)")
    if not args.resume:
        return start
    if not all(k in start.checkpoint for k in ("args", "train_state", "optimizer", "rng")):
        fail(f"--resume: {path} is not a training checkpoint (a converted or exported model? "
             "use it with --init)")
    saved = start.checkpoint["args"]
    for name in RESUME_FIXED:
        if name in args.given and getattr(args, name) != saved.get(name):
            fail(f"--resume: {flag(name)} {getattr(args, name)} differs from the run's "
                 f"{saved.get(name)}; a resumed run keeps its model, data and schedule (start a "
                 "new --out to change them)")
    for name, value in saved.items():                    # a flag that no longer exists is left out
        if name in vars(args) and name not in args.given and name not in ("resume", "device"):
            setattr(args, name, value)
    return start

# The model: the checkpoint's Config with the flags given, or from scratch --layers x --hidden,
# positions 0 .. L-1 in a table of --max-len + SAR's shift + 1 rows; the task's head.
def make_model(args, tok, task, start):
    overrides = {n: getattr(args, n) for n in CONFIG_FLAGS if getattr(args, n) is not None}
    overrides.update(num_labels=task.num_labels, head=task.head)
    if start is not None:
        return build_model(apply_overrides(start.cfg, overrides), start.weights, args.init)
    cfg = Config(vocab_size=tok.vocab_size, hidden_size=args.hidden, num_layers=args.layers,
                 num_heads=args.heads, intermediate_size=args.ffn, type_vocab_size=2,
                 max_positions=args.max_len + args.sar_shift + 1, pad_id=tok.pad_id,
                 layer_norm_eps=1e-12, position_style="bert")
    return Model(apply_overrides(cfg, overrides))

# Once data and model are known: what cannot run is an `error:`, what does nothing a `warning:`.
def check_run(args, task, cfg):
    sparse = cfg.attention != "dense"
    b = cfg.block_size
    if args.views == 2 and task.num_labels == 0:
        fail("--sar / --rdrop / --views 2 need a classification or regression task, not mlm")
    if cfg.attn_dropout == "attendout" and data.TASKS[args.task].objective in ("mlm", "span"):
        fail(f"--attn-dropout attendout needs a classification or regression task, not "
             f"{args.task}: its masked pass is compared with the clean pass's predictions "
             "(methods.md §3.1)")
    if sparse and args.eval_shift != "all" and args.eval_shift >= b:
        fail(f"--eval-shift {args.eval_shift}: give 'all' or a shift in 0 .. {b - 1} "
             f"(--block-size {b})")
    if task.skipped:
        warn(data.skipped_warning(task.skipped))
    if task.n_truncated:
        done = "were split into chunks" if task.num_labels == 0 else "were truncated"
        warn(f"{task.n_truncated} examples were longer than --max-len {args.max_len} and {done}")
    shifted = args.views == 2 and args.rdrop == 0        # SAR's second view: the shifted topology
    if shifted and not sparse:
        warn("--sar with dense attention has no effect: no block boundary moves")
    if shifted and sparse and args.sar_shift % b == 0:
        warn(f"--sar-shift {args.sar_shift} is a multiple of --block-size {b}: every boundary "
             "lands on a boundary, so the two views are the same and SAR's consistency is 0")
    if args.eval_shift and not sparse:
        warn("--eval-shift with dense attention: shifting moves no block boundary")
    if sparse and b > max(len(e.ids) for e in task.train):
        warn(f"--block-size {b} is larger than the longest sequence: sparse attention is dense "
             "here")
    useless = []                                         # flags given that do nothing here
    for start, method in ONLY_WITH.items():              # a method's flags without the method
        useless += [n for n in args.given if n.startswith(start) and cfg.attn_dropout != method]
    useless += [n for n in args.given if n.endswith("_col") and args.task != "tsv"]
    useless += [n for n in ("sar_shift",) if n in args.given and not shifted]
    if "ce" in args.given and args.views == 1:           # one view: the original is all there is
        useless.append("ce")
    if useless:
        warn(f"{', '.join(map(flag, useless))}: no effect with this method or task")

# A classifier given as --init keeps its head when the class count matches; where its classes had
# other names (an HF classifier's id2label, an earlier run's), its class i now stands for the data's
# label i, which a warning says.
def check_classes(init, checkpoint, task):
    before = checkpoint_task(checkpoint).get("labels")
    if before and len(before) == task.num_labels and before != task.label_names:
        warn(f"--init {init} classified {before}; its head is kept for this data's "
             f"{task.label_names}, so its class i now stands for the data's label i")

def opening_line(r):                                     # task | model | methods | steps, device
    args = r.args
    cfg = r.raw.cfg
    dev = " + ".join(f"{len(examples)} {split}" for split, examples in r.task.dev.items())
    origin = "from scratch" if args.init == "scratch" and not args.resume else f"from {args.init}"
    methods = [f"{cfg.attention} attention",
               attendout.METHODS[cfg.attn_dropout].format(p=cfg.attn_dropout_p, cfg=cfg)]
    if args.rdrop > 0:
        methods.append(f"R-Drop alpha {args.rdrop:g}")
    elif args.views == 2:
        methods.append(f"SAR alpha {args.sar:g} shift {args.sar_shift}")
    if args.views == 2:                                  # where the cross-entropy is taken (--ce)
        methods[-1] += " (CE on " + ("both views)" if args.ce == "all" else "the original view)")
    where = f"{r.total} steps on {r.device}"
    where += f" x {r.world} processes" if r.world > 1 else ""
    if r.device.type == "cpu":
        where += f", {torch.get_num_threads()} CPU thread(s) (--threads)"
    where += f"; resuming at step {r.state['step']}" if args.resume else ""
    return (f"task {args.task}: {len(r.task.train)} train / {dev or 'no dev'} examples | model "
            f"{r.raw.num_params() / 1e6:.2f}M parameters ({cfg.num_layers} layers, hidden "
            f"{cfg.hidden_size}, {origin}) | {', '.join(methods + r.fallbacks)} | {where}")

# -----------------------------------------------------------------------------------------------
# 3. The loop: steps until the last (r.total) or a stop (Ctrl-C, SIGTERM; under torchrun all stop
# together). After each step: its numbers kept on the device until the next log line (every
# --log-every steps, and before an evaluation or a save) reads them all (log_pending: the log
# lines, AttendOut's rates), an evaluation every --eval-every steps (0: each epoch's end),
# ckpt_last.pt every --save-every steps; both at the last step. A checkpoint holds all that was
# logged before it: a resumed run continues the logs exactly.
def train(r):
    args = r.args
    state = r.state
    r.rates_log = None                                   # AttendOut: OUT/droprates.jsonl
    if r.raw.cfg.attn_dropout == "attendout" and is_main():
        r.rates_log = attendout.DropRateLogger(r.paths["droprates.jsonl"], args.log_every,
                                               append=args.resume)
    r.pending = []                                       # the steps not yet read (section 6)
    meter = {"t0": time.time() - state["wall"], "seen": 0, "t_last": time.time()}
    epoch = None                                         # the epoch whose batches are at hand
    with StopFlag() as stop:
        while state["step"] < r.total and all_true(stop.signum is None, r.device, r.world):
            if epoch != state["epoch"]:
                epoch = state["epoch"]
                batches = epoch_batches(r, epoch)
            step = state["step"] + 1                     # the step being taken; logs count from 1
            numbers, epoch_done = train_step(r, batches, step, meter)   # on the device
            state["step"] = step
            r.pending.append((step, numbers))
            evaluate_now = step % args.eval_every == 0 if args.eval_every else epoch_done
            save_now = step == r.total or (args.save_every and step % args.save_every == 0)
            if step % args.log_every == 0 or step == r.total or evaluate_now or save_now:
                log_pending(r, meter)                    # one read of the steps since the last
            if evaluate_now or step == r.total:
                evaluate_and_keep_best(r, step)          # every process: its share (evaluate)
                barrier()
            if save_now:
                save_last(r, meter)
        if state["step"] < r.total:                      # stopped here, or in another process
            r.stopped_by = stop.signum or signal.SIGTERM  # another process's stop: SIGTERM
            if state["saved_step"] != state["step"]:
                save_last(r, meter)
            if is_main():
                print(f"stopped at step {state['step']}: saved {r.paths['ckpt_last.pt']}; "
                      f"continue with --resume --out {args.out}")

# AttendOut's masks can die: when the G-Nets learn too fast (at --lr 1e-4 on MiniLM, their default
# rate, the backbone's), most layers stop masking within some steps, and the run is close to plain
# fine-tuning at twice the cost. Each step's masking rates give their median over the layers (the
# mean would hide dead layers behind layer 1, which keeps masking 20% there); when that median has
# averaged under MASKS_DEAD_RATE over the last MASKS_DEAD_STEPS steps, one warning names
# --gnet-lr, and final.json records the step ("masks_died"). 2% over 50 steps: a dead run's median
# falls under 1%, a living one's stays over 6% (docs/results.md, issue 44); 50 steps keep one
# quiet stretch of batches from deciding it. docs/methods.md §3.1.
MASKS_DEAD_RATE = 0.02
MASKS_DEAD_STEPS = 50

def watch_masks(r, step, rates):
    ran = [x for x in rates if not math.isnan(x)]       # LayerDrop may skip a layer: nan
    recent = r.state["mask_medians"]
    recent.append(float(np.median(ran)) if ran else math.nan)
    del recent[:-MASKS_DEAD_STEPS]                       # the last MASKS_DEAD_STEPS steps
    average = sum(recent) / len(recent)
    dead = len(recent) == MASKS_DEAD_STEPS and average < MASKS_DEAD_RATE
    if dead and r.state["masks_died"] is None:
        r.state["masks_died"] = step
        warn(f"AttendOut's masks have died: over steps {step - MASKS_DEAD_STEPS + 1}-{step} the "
             f"median layer masked {100 * average:.1f}% of its pairs (under "
             f"{100 * MASKS_DEAD_RATE:g}%), so this is close to plain fine-tuning at twice the "
             f"cost; a lower --gnet-lr (now {gnet_peak_lr(r.raw.cfg, r.args):g}) keeps them alive")

# An epoch's batches of example indices, one per step: --batch-size examples of similar lengths
# (the epoch's last may be short), shuffled by (seed, epoch) alone (data.batch_plan), so resuming
# needs only the count used ("batch"), and the same seed trains the same examples at any
# --grad-accum: a step cuts its batch into micro-batches (micro_batches).
def epoch_batches(r, epoch):
    lengths = [len(e.ids) for e in r.task.train]
    plan = data.batch_plan(lengths, r.args.batch_size, seed=r.args.seed, epoch=epoch)
    return [batch for batch in plan if len(batch) >= r.world]

# A batch cut into --grad-accum micro-batches of (nearly) equal size, each with a row for every
# process (torchrun): a short batch may make fewer.
def micro_batches(batch, grad_accum, world):
    count = min(grad_accum, len(batch) // world)
    size, extra = divmod(len(batch), count)
    pieces = []
    start = 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        pieces.append(batch[start:end])
        start = end
    return pieces

# -----------------------------------------------------------------------------------------------
# 4. The step (methods.md §1). The learning rate rises linearly over the warmup, then falls
# linearly to 0 (t = step - 1), each parameter group at that factor of its own peak:
#     lr(t) = peak x (t + 1) / warmup  (t < warmup),   peak x (total - t) / (total - warmup)  after
# Then each micro-batch's loss (section 5) backward at its share of the batch's examples, so every
# example weighs the same and the gradients add up to the whole batch's; clipping, a check (a
# non-finite loss or gradient stops the run: nothing non-finite is saved), AdamW's step. The
# numbers logged are the micro-batches' means at the same weights, so the step line adds up. The
# step returns them as they are, on the device (Step): the check is the one read off the device a
# step needs, and section 6 reads the rest once per logged line (numbers gives them on the host).
Step = namedtuple("Step", ["logged", "weights", "lr", "norms"])

def train_step(r, batches, step, meter):
    args = r.args
    state = r.state
    t = step - 1
    if t < r.warmup:
        factor = (t + 1) / r.warmup
    else:
        factor = max(0.0, (r.total - t) / max(1, r.total - r.warmup))
    for group in r.optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
    r.raw.set_progress(t / r.total)                      # scheduled dropout follows the progress
    batch_ids = batches[state["batch"]]
    pieces = micro_batches(batch_ids, args.grad_accum, r.world)
    weights = []
    logged = []
    for i, piece in enumerate(pieces):
        # the micro-batch, padded to its longest; each process (torchrun) takes every world-th row
        rows = data.collate([r.task.train[j] for j in piece], r.tok.pad_id)
        batch = {k: v[r.rank::r.world].to(r.device, non_blocking=True) for k, v in rows.items()}
        meter["seen"] += len(piece)
        weight = len(piece) / len(batch_ids)             # its share of the batch's examples
        sync = i == len(pieces) - 1 or r.world == 1      # DDP averages at the last micro-batch
        with nullcontext() if sync else r.model.no_sync(), data.autocast(r.device):
            loss, parts = r.loss_fn(r.model, batch, args, r.task, r.tok)     # section 5
        (loss * weight).backward()                       # the gradients add up
        weights.append(weight)
        logged.append({"loss": loss.detach(), **parts})  # "loss": the backbone's, where it differs
    state["batch"] += 1
    epoch_done = state["batch"] == len(batches)
    if epoch_done:
        state["epoch"] += 1
        state["batch"] = 0
    norms = clip_gradients(r.optimizer, args.clip)       # the norms before clipping
    losses = [numbers["loss"] for numbers in logged]
    stop_if_not_finite(r, step, losses, norms, factor * args.lr)
    r.optimizer.step()                                   # AdamW: backbone, heads, G-Nets
    r.optimizer.zero_grad(set_to_none=True)
    return Step(logged, weights, factor * args.lr, norms), epoch_done

# A step's numbers on the host, {name: value}: every tensor of the steps given read off the device
# at once (read_numbers), the micro-batches' numbers averaged (weighted_mean), lr, the norms.
def numbers(steps):
    read_numbers([d for s in steps for d in (*s.logged, s.norms)])
    return [{**weighted_mean(s.logged, s.weights), "lr": s.lr, **s.norms} for s in steps]

# Each tensor value of these dicts replaced by its value on the host (a 0-dim tensor: a float; a
# vector: a list; [layers, L]: a list of lists), in ONE copy off the device: float64 holds every
# float32 exactly, so the numbers are those .item() and .tolist() give.
def read_numbers(dicts):
    found = [(d, name) for d in dicts for name, value in d.items() if torch.is_tensor(value)]
    if not found:
        return
    flat = torch.cat([d[name].detach().double().flatten() for d, name in found]).cpu()
    at = 0
    for d, name in found:
        size = d[name].numel()
        d[name] = flat[at:at + size].view(d[name].shape).tolist()
        at += size

# The micro-batches' logged numbers {name: value}, each averaged at the micro-batches' weights. A
# list (one number per layer, or per key position) is averaged entry by entry, a missing entry
# counting 0 (a shorter micro-batch has no pairs at that key) and a nan (a layer LayerDrop skipped)
# left out; a plain number keeps its nan (a non-finite loss must stop the run).
def weighted_mean(logged, weights):
    def mean(values, in_list):
        if isinstance(values[0], list):
            columns = itertools.zip_longest(*values, fillvalue=0.0)
            return [mean(list(column), True) for column in columns]
        pairs = [(v, w) for v, w in zip(values, weights) if not (in_list and math.isnan(v))]
        if not pairs:
            return math.nan
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    return {name: mean([numbers[name] for numbers in logged], False) for name in logged[0]}

# -----------------------------------------------------------------------------------------------
# 5. The loss (methods.md §1, §2.3, §3.1): all that a classification or regression step optimises:
#     L = CE(z_original, y)                            the task (task_loss; MSE for STS-B); with
#                                                      --ce all, the mean over the clean views
#       + alpha x consistency(z_original, z_second)    SAR (--sar alpha): the topology shifted,
#                                                      or R-Drop (--rdrop alpha): a 2nd dropout
#                                                      (--views 2 runs the second view at alpha 0)
#       + consistency(z_original, z_masked)            AttendOut: the G-Nets' masked pass
#     keep = tau^2 x kept                              AttendOut's keep reward (--gnet-tau): the
#                                                      pairs kept per example, all layers
# consistency: the symmetric KL of two predictions (a regression's squared difference). The views
# run as one stacked batch [original; second; masked] (sar.stacked_views). One backward runs
# through L + keep: the backbone descends L (keep does not depend on it). The keep reward is the
# G-Nets' objective alone: they climb it, so it pulls them towards keeping pairs, against
# AttendOut's consistency, which pulls them towards masking (their reversed mask climbs both).
# parts: the terms for the log, "loss" being L, the backbone's loss, and "keep" the reward.
def classify_loss(model, batch, args, task, tok):
    batch = as_rows(batch)
    raw = getattr(model, "module", model)                # the Model itself, also under DDP
    second, alpha = sar.second_view(args)                # None, R-Drop's copy (0) or SAR's shift
    masked = raw.cfg.attn_dropout == "attendout"
    z = sar.stacked_views(model, batch, second, masked)  # [B, C] per view
    clean = z[:-1] if masked else z                      # the views the labels are asked of
    if args.ce == "original":
        clean = z[:1]
    ce = sum(task_loss(zi, batch["labels"], task.is_regression) for zi in clean) / len(clean)
    loss = ce
    parts = {"ce": ce.detach()} if second is not None or masked else {}
    if second is not None:                               # SAR / R-Drop (methods.md §2.3)
        consistency = sar.consistency(z[0], z[1], task.is_regression)
        loss = loss + alpha * consistency
        parts["consistency"] = consistency.detach()
    if not masked:
        parts["loss"] = loss.detach()
        return loss, parts
    # AttendOut (methods.md §3.1): its consistency is the backbone's; the keep reward the G-Nets'
    mask_consistency = sar.consistency(z[0], z[-1], task.is_regression)
    loss = loss + mask_consistency
    kept = attendout.keep_reward(raw, z[0].size(0))
    keep = raw.cfg.gnet_tau ** 2 * kept
    parts["mask_consistency"] = mask_consistency.detach()
    parts["loss"] = loss.detach()
    parts["kept"] = kept.detach()
    parts["keep"] = keep.detach()
    parts.update(attendout_rates(raw))                   # "mask", "full_rows", "masked_by_key"
    return loss + keep, parts

# AttendOut's numbers of this forward for the log, left on the device (section 6 reads them):
# each layer's share of real pairs masked ("mask") and of real query rows with every key masked
# ("full_rows"), nan for a layer whose masked pass did not run (LayerDrop); under dense attention
# each layer's masked pairs by key position ("masked_by_key", [layers, L]).
def attendout_rates(raw):
    rates = {"mask": attendout.mask_rates(raw), "full_rows": attendout.full_row_rates(raw)}
    by_key = attendout.masked_by_key(raw)
    if by_key is not None:
        rates["masked_by_key"] = by_key
    return rates

def task_loss(logits, labels, regression=False):         # methods.md §1
    if regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())    # logits: [B, 1]
    return F.cross_entropy(logits.float(), labels)                       # logits: [B, C]

# The model reads rows of tokens [rows, L]: LRA Retrieval's pairs [B, 2, L] become [2B, L], pair i
# in rows 2i, 2i + 1 (model.PairHead re-pairs them); neither loss nor evaluation asks which task.
def as_rows(batch):
    rows = {name: t.flatten(0, -2) for name, t in batch.items() if name != "labels"}  # [rows, L]
    rows["labels"] = batch["labels"]                                               # [B]
    return rows

# The task's loss and evaluation, by its objective in the task table (data.TASKS): "classify" and
# "pair" (LRA Retrieval) here, "mlm" and "span" (extractive QA) from its module of readers/.
def objective(task_name):
    if data.TASKS[task_name].objective in ("classify", "pair"):
        return classify_loss, evaluate
    return reader(task_name).loss, reader(task_name).evaluate

# -----------------------------------------------------------------------------------------------
# 6. The step line, evaluation and final.json. Every --log-every steps (and the last) log.jsonl
# gets the step's numbers and the step line the loss's terms. The demo's first (--max-steps 4):
#     step 1/4: loss 2.2962 = ce 2.2948 + 1 x SAR consistency 0.0007 + AttendOut consistency
#     0.0007 | G-Nets: keep reward 57.07 = 0.25 x kept pairs 228.3, mask rates 0.41 0.29, lr
#     1.00e-03, 97 examples/s
# loss: what the backbone descends, its terms adding up to it; after the bar the G-Nets' part: the
# keep reward (tau^2 x the (query, key) pairs kept per example, all layers), and each layer's
# share of the real pairs masked in this step, layer 1 first (log.jsonl: "loss" and "keep").
#
# A step leaves its numbers on the device (r.pending). They are read off it together, in one copy,
# at a logged step (and before an evaluation or a save): a GPU then waits for the host once per
# --log-every steps, not at every step. Each step read then gets, in step order, its log line,
# its droprates.jsonl line (attendout.DropRateLogger writes every --log-every steps) and its check
# of AttendOut's masks (watch_masks, whose warning comes at that read).
def log_pending(r, meter):
    for (step, _), values in zip(r.pending, numbers([s for _, s in r.pending])):
        log_step(r, step, values, meter)
        if r.rates_log is not None:                      # each layer's masking rate (§3.1)
            r.rates_log.log(step, step / r.total, values["mask"], values["full_rows"],
                            values.get("masked_by_key"), last=step == r.total)
        if "mask" in values:
            watch_masks(r, step, values["mask"])
    r.pending = []

def log_step(r, step, numbers, meter):
    if not is_main() or (step % r.args.log_every and step != r.total):
        return
    now = time.time()
    rate = meter["seen"] / max(now - meter["t_last"], 1e-9)              # examples per second
    meter["seen"] = 0
    meter["t_last"] = now
    logged = {k: v for k, v in numbers.items() if k != "masked_by_key"}   # droprates.jsonl's
    append_jsonl(r.paths["log.jsonl"], {"step": step, **logged, "examples_per_s": rate})
    terms = [f"ce {numbers['ce']:.4f}"] if "ce" in numbers else []
    if "consistency" in numbers:                         # + alpha x consistency
        name = "R-Drop" if r.args.rdrop > 0 else "SAR"
        alpha = r.args.rdrop if r.args.rdrop > 0 else r.args.sar
        terms.append(f"{alpha:g} x {name} consistency {numbers['consistency']:.4f}")
    if "mask_consistency" in numbers:                    # + AttendOut's consistency
        terms.append(f"AttendOut consistency {numbers['mask_consistency']:.4f}")
    shown = f"loss {numbers['loss']:.4f}"
    if terms:
        shown += " = " + " + ".join(terms)
    if "keep" in numbers:                                # the G-Nets' part: keep reward, rates
        shown += (f" | G-Nets: keep reward {numbers['keep']:.2f} = {r.raw.cfg.gnet_tau ** 2:g} x "
                  f"kept pairs {numbers['kept']:.1f}, mask rates ")
        shown += " ".join(f"{m:.2f}" for m in numbers["mask"])
    print(f"step {step}/{r.total}: {shown}, lr {numbers['lr']:.2e}, {rate:.0f} examples/s",
          flush=True)

# The classifier's evaluation, {split: metrics}: one pass over each dev split in eval mode (no
# dropout, no G-Net), on the original topology or with shift_by padding tokens after the first
# (sar.shift, methods.md §2.3). Longest first, each batch padded to its own longest: little
# padding, and a batch too large for the device fails at once. Under torchrun each process scores
# every world-th batch and the predictions are gathered back into batch order (gather_batches):
# the metrics are a single process's, and no process waits on another's whole evaluation.
@torch.no_grad()
def evaluate(raw, task, args, device, tok, shift_by=0):
    raw.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = {}
    for split, examples in task.dev.items():
        preds = []
        labels = []
        batches = data.make_batches(data.longest_first(examples), args.batch_size,
                                    pad_id=tok.pad_id, seed=0, epoch=0, shuffle=False)
        for batch in itertools.islice(batches, rank, None, world):      # this process's share
            batch = as_rows({k: v.to(device) for k, v in batch.items()})
            ids = batch["input_ids"]                     # [rows, L]
            mask = batch["attention_mask"]
            types = batch["token_type_ids"]
            positions = None                             # None: the model's own
            if shift_by:                                 # [rows, L + shift_by]
                ids, mask, positions, types = sar.shift(ids, mask, shift_by, raw.cfg.pad_id,
                                                        raw.position_ids(ids), types)
            with data.autocast(device):                  # bf16 on CUDA
                logits = raw(ids, mask, types, positions).float()        # [B, C]
            preds.append(logits.squeeze(-1) if task.is_regression else logits.argmax(-1))
            labels.append(batch["labels"])
        preds = gather_batches(preds, world)
        out[split] = data.compute_metrics(args.task, preds, gather_batches(labels, world))
    raw.train()
    return out

# Each process's batches of results (process p holds batches p, p + world, ...), as one numpy
# array in batch order in every process: all_gather_object, then interleaved back.
def gather_batches(mine, world):
    sizes = [len(t) for t in mine]
    mine = torch.cat(mine).cpu().numpy() if mine else np.zeros(0)       # one copy off the device
    if world == 1:
        return mine
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, sizes))
    pieces = [np.split(values, np.cumsum(counts)[:-1]) if counts else []
              for values, counts in everyone]            # by process, its batches
    rows = itertools.zip_longest(*pieces)                # batch i of each process, i = 0, 1, ..
    return np.concatenate([piece for row in rows for piece in row if piece is not None])

# Each evaluation: the dev metrics (--eval-shift: also those under shifted topologies, with their
# mean and worst, sar.add_shifted) into log.jsonl as {"step": s, "dev": {split: metrics}} and the
# console. The main metric on the first split picks ckpt_best.pt (the masked LM's loss: lowest).
# Under torchrun every process evaluates (train.evaluate its share of the batches; the readers'
# evaluation all of them), so none waits past the collective timeout; rank 0 writes.
def evaluate_and_keep_best(r, step):
    if not r.task.dev:
        return
    metrics = r.evaluate(r.raw, r.task, r.args, r.device, r.tok)
    cfg = r.raw.cfg
    shifts = sar.eval_shifts(r.args.eval_shift, cfg.attention != "dense", cfg.block_size)
    shifted = {s: r.evaluate(r.raw, r.task, r.args, r.device, r.tok, shift_by=s) for s in shifts}
    if not is_main():                                    # torchrun: rank 0 logs and keeps the best
        return
    lower_is_better = r.task.metric_name == "loss"
    sar.add_shifted(metrics, shifted, lower_is_better=lower_is_better)
    append_jsonl(r.paths["log.jsonl"], {"step": step, "dev": metrics})
    r.state["dev"] = metrics
    value = metrics[next(iter(metrics))][r.task.metric_name]
    score = -value if lower_is_better else value         # higher is better
    if r.state["best"] is None or score > r.state["best"]:
        r.state["best"] = score
        r.state["best_step"] = step
        save_checkpoint(r, r.paths["ckpt_best.pt"], [rng_state()])       # rank 0's RNG state
    print(f"step {step}: " + "; ".join(f"{split} {show_metrics(r.args.task, m)}"
                                       for split, m in metrics.items()))

# final.json, the run's record, flat:
#     "task", "metric"          the task and its main metric (e.g. "acc")
#     "label_names"             the classes' names in class-index order (None: a regression)
#     "acc", "f1", ...          the last evaluation's metrics on the first dev split (and "shift")
#     "dev_split"               its name ("dev"; MNLI: "dev_matched"); it picks ckpt_best.pt
#     "dev_splits"              every split's metrics, {split: metrics}, as log.jsonl's last "dev"
#     "best_dev", "best_step"   the best main metric, and its step
#     "majority_baseline"       the main metric of always answering the commonest training label
#     "config"                  every model.Config field in force (gnet_lr: the G-Nets' peak rate)
#     "args"                    every flag in force (a Config flag not given: the model's value)
def report(r):
    args = r.args
    task = r.task
    name = task.metric_name
    majority = None
    if task.label_names and not task.is_regression and task.dev:
        labels = np.array([e.label for e in next(iter(task.dev.values()))])
        commonest = np.bincount([e.label for e in task.train], minlength=task.num_labels).argmax()
        majority = data.compute_metrics(args.task, np.full_like(labels, commonest), labels)[name]
    best = r.state["best"]
    if best is not None and name == "loss":
        best = -best                                     # kept negated: higher is better
    config = {**asdict(r.raw.cfg), "gnet_lr": gnet_peak_lr(r.raw.cfg, args)}
    flags = {k: v for k, v in vars(args).items() if k != "given"}
    flags.update({field: config[field] for field in CONFIG_FLAGS})
    split = next(iter(r.state["dev"]), None)
    first = r.state["dev"][split] if split is not None else {}
    labels = task_record(r)["labels"]
    final = {"task": args.task, "label_names": labels, "metric": name, **first, "dev_split": split,
             "dev_splits": r.state["dev"], "best_dev": best, "best_step": r.state["best_step"],
             "majority_baseline": majority, "steps": r.state["step"],
             "masks_died": r.state["masks_died"],
             "wall_time_s": round(r.state["wall"], 2), "config": config, "args": flags}
    with open(r.paths["final.json"], "w") as f:
        json.dump(final, f, indent=1)
    line = f"done in {r.state['wall']:.0f}s, {r.state['step']} steps"
    if split is not None:
        line += f": {split} {name} {show_value(args.task, name, first[name])} at the last step"
        line += f", best {show_value(args.task, name, best)} at step {r.state['best_step']}"
    if majority is not None:
        line += f" (majority-class baseline: {name} {show_value(args.task, name, majority)})"
    print(line + f"; results in {r.paths['final.json']}")

# -----------------------------------------------------------------------------------------------
# 7. The optimizer (nanoGPT's recipe): AdamW (betas 0.9, 0.98, eps 1e-6, RoBERTa's) in groups
# found by their "name": "decay" (weight matrices and embeddings), "no_decay" (biases and
# LayerNorms) and "gnet" (the G-Nets: not decayed, at their peak rate --gnet-lr, by default --lr's,
# as in the author's code; methods.md §3.1); "base_lr": a group's peak. The backbone's gradient
# (every group but "gnet") is clipped to norm --clip; the G-Nets' reversed gradient (10,000 times
# a logit's, through the mask) is not, as in the author's code. A new group (layer-wise decay, say)
# needs only a name of its own: it is clipped with the backbone.
GNET_GROUP = "gnet"                                      # the G-Nets' parameter group

def make_optimizer(model, args, device):
    gnet_lr = gnet_peak_lr(model.cfg, args)
    groups = {"decay": {"params": [], "weight_decay": args.weight_decay, "base_lr": args.lr},
              "no_decay": {"params": [], "weight_decay": 0.0, "base_lr": args.lr},
              GNET_GROUP: {"params": [], "weight_decay": 0.0, "base_lr": gnet_lr}}
    for name, p in model.named_parameters():
        which = "decay" if p.dim() >= 2 else "no_decay"  # matrices, embeddings: decayed
        which = GNET_GROUP if attendout.GNET in name.split(".") else which
        if p.requires_grad:                              # not the frozen MLM head
            groups[which]["params"].append(p)
    groups = [{"name": name, **g} for name, g in groups.items() if g["params"]]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
                             fused=device.type == "cuda")

def gnet_peak_lr(cfg, args):                     # --gnet-lr (None: --lr's, the author's rule)
    return args.lr if cfg.gnet_lr is None else cfg.gnet_lr

def clip_gradients(optimizer, max_norm):                 # both norms before clipping (tensors)
    backbone = [p for g in optimizer.param_groups if g["name"] != GNET_GROUP for p in g["params"]]
    gnets = [p for g in optimizer.param_groups if g["name"] == GNET_GROUP for p in g["params"]]
    clip = torch.nn.utils.clip_grad_norm_
    norms = {"grad_norm": clip(backbone, max_norm or math.inf)}
    if gnets:
        norms["gnet_grad_norm"] = clip(gnets, math.inf)                 # measured, not clipped
    return norms

# A non-finite loss (a micro-batch's) or gradient norm stops the run at once, in every process,
# before AdamW's step: one read off the device of which are finite (under torchrun, in all
# processes: the minimum over them), the one read a step makes.
def stop_if_not_finite(r, step, losses, norms, lr):
    losses = torch.stack(losses).float()
    finite = torch.stack([torch.isfinite(losses).all(), *map(torch.isfinite, norms.values())])
    finite = finite.float()                              # [1 + norms]: 1 where finite
    if r.world > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    loss_ok, *norms_ok = finite.tolist()
    what = "gradient" if not all(norms_ok) else ""
    what = "loss" if not loss_ok else what
    if not what:
        return
    saved = r.state["saved_step"]
    last = f"{r.paths['ckpt_last.pt']} (step {saved})" if saved else "none written yet"
    fail(f"non-finite {what or 'loss'} at step {step} (lr {lr:.3g}); last good checkpoint: {last}"
         "; lower --lr", 1)

# -----------------------------------------------------------------------------------------------
# 8. Plumbing: processes, RNG states (exact resume: --resume --out OUT), checkpoints, Ctrl-C.
# The device (auto: CUDA when there is one), then under `torchrun --nproc_per_node N train.py ...`
# the processes: RANK, WORLD_SIZE and LOCAL_RANK in the environment, each process on its own GPU,
# talking over NCCL (GPUs) or gloo.
def setup_distributed(args):
    device = pick_device(args.device)                    # one error line for a GPU not here
    if "RANK" not in os.environ:                         # not under torchrun
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device

def is_main():
    return not dist.is_initialized() or dist.get_rank() == 0

def barrier():
    if dist.is_initialized():
        dist.barrier()

def all_true(value, device, world):                      # True only where True in every process
    if world == 1:
        return bool(value)
    t = torch.tensor([float(bool(value))], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())

# The random streams a step draws from (dropout, random blocks, masked-LM masks) are torch's
# alone, so a checkpoint that holds them continues a run bit for bit.
def rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda}

def append_jsonl(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")

# A resumed run: AdamW's moments, the loop's state, this process's RNG states, and the logs cut
# back to the checkpoint's step (a killed run may have logged past it).
def restore(r, ckpt):
    r.optimizer.load_state_dict(ckpt["optimizer"])
    r.state.update(ckpt["train_state"])
    if "micro" in r.state:                               # a checkpoint from before batch plans
        r.state["batch"] = r.state.pop("micro") // r.args.grad_accum
    # The RNG states: this process's (rank's), its CUDA generators those of the GPUs this machine
    # has (a checkpoint holds one per GPU the run's machine had). What cannot be restored as it
    # was, another number of processes or of GPUs, is one warning: the random streams change.
    rng = ckpt["rng"][r.rank % len(ckpt["rng"])]
    torch.set_rng_state(rng["torch"])
    gpus = torch.cuda.device_count()
    for i, state in enumerate(rng["cuda"][:gpus]):
        torch.cuda.set_rng_state(state, i)
    changed = []
    if len(ckpt["rng"]) != r.world:
        changed.append(f"the run had {len(ckpt['rng'])} processes, now {r.world}")
    if len(rng["cuda"]) != gpus and (len(rng["cuda"]) > gpus or r.device.type == "cuda"):
        changed.append(f"the run saved the random state of {len(rng['cuda'])} GPUs, this machine "
                       f"has {gpus} (restored: {min(len(rng['cuda']), gpus)})")
    if changed:
        warn(f"--resume: {'; '.join(changed)}: the random streams (dropout, random blocks) "
             "change from here")
    for path in (r.paths["log.jsonl"], r.paths["droprates.jsonl"]):
        if is_main() and os.path.exists(path):
            with open(path) as f:
                lines = [line for line in f if line.endswith("\n")]      # a killed write: no \n
            with open(path, "w") as f:
                f.writelines(x for x in lines if json.loads(x).get("step", 0) <= r.state["step"])

# ckpt_last.pt: every process calls save_last (it gathers their RNG states); rank 0 writes. A
# checkpoint holds the model, its tokenizer and what resuming needs; it is atomic (save_atomic).
def save_last(r, meter):
    log_pending(r, meter)                                # the steps it holds are all read
    r.state["wall"] = time.time() - meter["t0"]
    r.state["saved_step"] = r.state["step"]
    rngs = [rng_state()] * r.world                       # by rank
    if r.world > 1:
        dist.all_gather_object(rngs, rngs[0])
    if is_main():
        save_checkpoint(r, r.paths["ckpt_last.pt"], rngs)

def save_checkpoint(r, path, rngs):
    flags = {k: v for k, v in vars(r.args).items() if k != "given"}
    save_atomic(checkpoint_dict(r.raw, data.files_to_tensors(r.tok.files), task=task_record(r),
                                train_state=r.state, args=flags,
                                optimizer=r.optimizer.state_dict(), rng=rngs), path)

# What a prediction needs besides the weights (python model.py predict): the task, its label names
# in class-index order (None for a regression), the columns it read, --max-len and --batch-size
# (predict batches a file as evaluation batched the dev set).
def task_record(r):
    labels = list(r.task.label_names) if r.task.num_labels > 1 else None
    names = ("text_col", "text_pair_col", "label_col", "max_len", "batch_size")
    return {"name": r.args.task, "labels": labels, **{n: getattr(r.args, n) for n in names}}

# Ctrl-C or SIGTERM: the loop finishes its step and saves, then main exits 128 + the signal. A
# second Ctrl-C aborts at once.
class StopFlag:
    def __enter__(self):
        self.signum = None
        self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

if __name__ == "__main__":
    main()
