"""train.py: the one training loop (fine-tuning a checkpoint, or training from scratch), for the CPU and the GPU.

What it is: nanoGPT's train.py for encoders: AdamW, warmup then linear decay, clipping, gradient accumulation,
bf16 autocast on CUDA, each task's official dev metric, atomic checkpoints, exact resume, torchrun. The ideas,
each a flag (and a model.Config field): --attention sparse|hst (ERNIE-Sparse, sparse.py), --sar / --rdrop
(Self-Attention Regularization and its control R-Drop, sar.py), --attn-dropout attendout (AttendOut, attendout.py).

How to run it:
  python train.py                                   # the demo: generated ListOps, HST + SAR + AttendOut
  python train.py --max-steps 100                   # the same demo, 100 steps (every default is the demo's)
  python train.py --init roberta.pt --task sst2 --data glue/SST-2      # fine-tune a converted checkpoint
  torchrun --nproc_per_node 4 train.py --init roberta.pt --task mnli --data glue/MNLI
  python train.py --resume --out out/demo           # continue a stopped or killed run
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import attendout
import data
import sar
from data import ArgumentParser, fail, one_line_errors, warn
from model import CheckpointError, Config, Model, apply_overrides, build_model, checkpoint_dict, read_checkpoint, \
    save_atomic

# --- 1. Flags. Every default is the demo's: `python train.py --max-steps 100` is the demo, 100 steps long.
#    With --init CKPT, FINETUNE's defaults apply instead and the model keeps the checkpoint's own Config.

def make_parser():
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = ap.add_argument
    add("--task", default="listops", choices=list(data.TASKS), metavar="TASK", help=", ".join(data.TASKS))
    add("--data", help="the task's folder or file (listops: generated into data/listops-demo if omitted)")
    add("--train-file", help="the training file inside --data, if not the task's usual name")
    add("--dev-file", help="the dev file inside --data, if not the task's usual name")
    add("--text-col", help="--task tsv: the text column (name or 0-based index)")
    add("--text-pair-col", help="--task tsv: an optional second text column")
    add("--label-col", help="--task tsv: the label column")
    add("--max-len", type=int, help="tokens per example (default: the task's, at most the model's)")
    add("--vocab-size", type=int, default=8000, help="from scratch on text: the SentencePiece vocabulary")
    add("--init", default="scratch", help="an HF folder, a .pt (python model.py convert), or 'scratch'")
    add("--layers", type=int, default=2, help="from scratch: layers")
    add("--hidden", type=int, default=128, help="from scratch: hidden size d")
    add("--heads", type=int, default=4, help="from scratch: attention heads H")
    add("--ffn", type=int, default=256, help="from scratch: feed-forward size")
    add("--epochs", type=float, default=10, help="passes over the training set (with --init: 3)")
    add("--max-steps", type=int, default=0, help="optimizer steps (0: from --epochs)")
    add("--batch-size", type=int, default=32, help="examples per optimizer step, all processes together")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--lr", type=float, default=1e-3, help="peak learning rate (with --init: 2e-5)")
    add("--warmup", type=float, default=0.06, help="warmup: a fraction of the steps (< 1) or a step count")
    add("--weight-decay", type=float, default=0.01, help="AdamW's decay of weight matrices and embeddings")
    add("--clip", type=float, default=1.0, help="gradient-norm clip, backbone and G-Nets apart (0: off)")
    add("--seed", type=int, default=0, help="data order, initial weights, dropout: the same for every method")
    add("--out", default="out/demo", help="run folder: log.jsonl, final.json, ckpt_best.pt, ckpt_last.pt")
    add("--eval-every", type=int, default=200, help="evaluate every N steps (0: each epoch's end; with --init: 0)")
    add("--save-every", type=int, default=500, help="write ckpt_last.pt every N steps (and at the end)")
    add("--log-every", type=int, default=10, help="a log line every N steps")
    add("--eval-shift", type=shift_arg, default=0, help="also score the topology shifted by N tokens, or 'all'")
    add("--resume", action="store_true", help="continue the run in --out from its ckpt_last.pt")
    add("--overwrite", action="store_true", help="replace a run already in --out")
    add("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--threads", type=int, default=0, help="CPU threads (0: 1 for a model under 20M parameters, else all)")
    # model.Config fields (methods.md §2, §3); None: Config's default (or, with --init, the checkpoint's)
    add("--attention", choices=["dense", "sparse", "hst"], default="hst", help="the topology (sparse.py)")
    add("--block-size", type=int, default=8, help="b, tokens per block")
    add("--window", type=int, help="w, neighbour blocks on each side (Config: 1)")
    add("--num-global", type=int, help="g, global tokens at the start (Config: 1)")
    add("--num-random", type=int, help="r, random key blocks per query block (Config: 0)")
    add("--max-positions", type=int, help="position-table rows; more than the checkpoint's copies the table")
    add("--attn-dropout", choices=list(attendout.METHODS), default="attendout", help="attendout.METHODS")
    add("--attn-dropout-p", type=float, help="the standard attention-dropout rate (Config: 0.1)")
    add("--hidden-dropout-p", type=float, help="dropout on embeddings and residual branches (Config: 0.1)")
    add("--gnet-tau", type=float, help="AttendOut: the keep reward's weight is tau^2 (Config: 0.5)")
    add("--gnet-shape", choices=["shared", "per-head"], help="AttendOut: one G-Net mask for all heads, or one each")
    add("--gnet-lr", type=float, help="the G-Nets' own peak learning rate (Config: None, --lr's)")
    add("--schedule", help="--attn-dropout scheduled: a droprates.jsonl or linear:P_LOW:P_HIGH")
    add("--layerdrop", type=float, help="LayerDrop: skip a whole layer with this probability")
    add("--attn-layerdrop", type=float, help="Attn.LayerDrop: skip only the attention sub-layer")
    add("--sar", type=float, default=1.0, help="SAR's weight alpha (0: off; with --init: 0)")
    add("--sar-shift", type=int, default=1, help="SAR: padding tokens inserted after the first token")
    add("--rdrop", type=float, default=0.0, help="R-Drop's weight alpha (0: off)")
    return ap

CONFIG_FLAGS = ("attention", "block_size", "window", "num_global", "num_random", "max_positions", "attn_dropout",
                "attn_dropout_p", "hidden_dropout_p", "gnet_tau", "gnet_shape", "gnet_lr", "schedule", "layerdrop",
                "attn_layerdrop")                                # the flags that are model.Config fields
FINETUNE = {"lr": 2e-5, "epochs": 3, "eval_every": 0, "sar": 0.0, **{f: None for f in CONFIG_FLAGS}}
RESUME_FIXED = ("task", "data", "train_file", "dev_file", "text_col", "text_pair_col", "label_col", "vocab_size",
                "max_len", "batch_size", "grad_accum", "seed", "epochs", "max_steps", "warmup", "init", "layers",
                "hidden", "heads", "ffn", *CONFIG_FLAGS)  # what fixes the model, the data stream, the schedule
POSITIVE = ("batch_size", "grad_accum", "log_every", "vocab_size", "layers", "hidden", "heads", "ffn", "block_size",
            "max_positions")                             # must be >= 1; every other number must be >= 0
ONLY_WITH = {"gnet_": "attendout", "schedule": "scheduled"}     # method flags, useless without their method

def shift_arg(s):                                        # --eval-shift: a number of tokens, or 'all' (1 .. b-1)
    if s != "all" and not s.isdigit():
        raise argparse.ArgumentTypeError(f"{s}: give 'all' or a number of tokens >= 0")
    return s if s == "all" else int(s)

def parse_args(argv):
    args = make_parser().parse_args(argv)                # the demo's defaults (FINETUNE's with --init)
    quiet = make_parser()                                # the same flags without defaults: which were given
    for a in quiet._actions:
        a.default = argparse.SUPPRESS
    args.given = sorted(vars(quiet.parse_args(argv)))
    for k, v in FINETUNE.items() if args.init != "scratch" else ():
        if k not in args.given:                          # with --init: the fine-tuning defaults
            setattr(args, k, v)
    return args

def check_args(args):                                    # before anything is read or written: one line each
    for name, v in vars(args).items():                   # every number >= 0 (>= 1 for the POSITIVE); NaN fails
        if type(v) in (int, float) and not (math.isfinite(v) and v >= (name in POSITIVE)):
            fail(f"--{name.replace('_', '-')} {v}: must be >= {int(name in POSITIVE)}")
    for f in ("data", "train_file", "dev_file"):
        if getattr(args, f) and not os.path.exists(getattr(args, f)):
            fail(f"--{f.replace('_', '-')} {getattr(args, f)}: no such file or folder")
    for wrong, what in [(args.max_steps == 0 and not args.epochs > 0, f"--epochs {args.epochs}: must be > 0"),
                        (args.max_len is not None and args.max_len < 8, f"--max-len {args.max_len}: must be >= 8"),
                        (args.sar > 0 and args.rdrop > 0, "--sar and --rdrop are alternatives; give one"),
                        (args.sar_shift < 1, f"--sar-shift {args.sar_shift}: SAR needs a shift of at least 1 token"),
                        (args.schedule and not args.schedule.startswith("linear:") and not os.path.isfile(
                            args.schedule), f"--schedule {args.schedule}: no such file (or linear:P_LOW:P_HIGH)")]:
        if wrong:
            fail(what)

# --- 2. Data, tokenizer and model.

def columns(args):                                       # where a task's files and columns are, by flag
    return {k: getattr(args, k) for k in ("train_file", "dev_file", "text_col", "text_pair_col", "label_col")}

def task_data_dir(args):                                 # --data, or for ListOps the demo's set, made once
    if args.data is not None or args.task != "listops":
        return args.data or fail(f"--task {args.task} needs --data (a folder with its train / dev files)")
    folder = os.path.join("data", "listops-demo")        # 6,000 / 500 / 500 expressions, 10-60 tokens
    if is_main() and not os.path.exists(os.path.join(folder, "basic_val.tsv")):
        print(f"generating a small ListOps set in {folder}", flush=True)
        data.write_listops(folder, 6000, 500, 500, min_len=10, max_len=60, seed=0, max_depth=3, max_args=4)
    barrier()
    return folder

# The module that reads a task's files: data.py for GLUE, --task tsv and ListOps; for LRA's other
# four tasks, SQuAD and masked LM, a module of readers/, imported here on first use (data.py imports
# no other module of the project). Each has load_task and training_texts; readers/qa.py and
# readers/mlm.py also the loss and evaluate of their objective (section 3).
def reader(task_name):
    if data.TASKS[task_name].load is not None:
        return data
    from readers import lra, mlm, qa
    return {"squad": qa, "mlm": mlm}.get(task_name, lra)

def load_tokenizer(args, data_dir, stored_files):
    """The checkpoint's own, the task's fixed one (ListOps symbols, LRA bytes), or SentencePiece trained here."""
    if stored_files:
        return data.tokenizer_from_files(data.tensors_to_files(stored_files))
    if (fixed := data.fixed_tokenizer(args.task)) is not None:     # built once
        return fixed
    folder = data_dir if os.path.isdir(data_dir) else os.path.dirname(os.path.abspath(data_dir))
    if not os.access(folder, os.W_OK):                   # read-only data: the cache goes under data/spm-cache/
        folder = os.path.join("data", "spm-cache", os.path.abspath(folder).strip(os.sep).replace(os.sep, "_"))
    if not is_main():
        barrier()                                        # rank 0 trains it first; the others then read its cache
    os.makedirs(folder, exist_ok=True)
    texts = reader(args.task).training_texts(args.task, data_dir, **columns(args))
    tok = data.train_sentencepiece(texts, os.path.join(folder, f"spm{args.vocab_size}"), args.vocab_size)
    if is_main():
        barrier()
    return tok

def read_start(args):
    """(Config, weights, tokenizer files, the whole dict) to start from: --resume's OUT/ckpt_last.pt (its flags fill
    in every flag not given now; RESUME_FIXED's may not change), --init's checkpoint, or None (from scratch)."""
    path, flag = (os.path.join(args.out, "ckpt_last.pt"), "--resume") if args.resume else (args.init, "--init")
    if path == "scratch":
        return None
    if not os.path.exists(path):
        fail(f"--resume: {path} does not exist" if args.resume else
             f"--init {path}: neither a model folder nor a checkpoint file (nor 'scratch')")
    try:
        cfg, state, tok_files, ckpt = read_checkpoint(path)
    except CheckpointError as e:
        fail(f"{flag}: {e}")
    if not tok_files:                                    # a pretrained model reads text through its own tokenizer
        fail(f"{flag} {path}: no tokenizer files in it (convert it again with python model.py convert)")
    if args.resume and not all(k in ckpt for k in ("args", "train_state", "optimizer", "rng")):
        fail(f"--resume: {path} is not a training checkpoint (a converted or exported model? use it with --init)")
    for k in RESUME_FIXED if args.resume else ():
        if k in args.given and getattr(args, k) != ckpt["args"].get(k):
            fail(f"--resume: --{k.replace('_', '-')} {getattr(args, k)} differs from the run's {ckpt['args'].get(k)}"
                 "; a resumed run keeps its model, data and schedule (start a new --out to change them)")
    for k, v in ckpt["args"].items() if args.resume else ():
        if k not in args.given and k not in ("resume", "device"):
            setattr(args, k, v)                          # the run's own flags
    return cfg, state, tok_files, ckpt

def make_model(args, tok, task, start):                  # the checkpoint's Config and the flags given, or scratch
    overrides = {f: getattr(args, f) for f in CONFIG_FLAGS if getattr(args, f) is not None}
    overrides.update(num_labels=task.num_labels, head=task.head)  # the task fixes the head
    if start is not None:
        return build_model(apply_overrides(start[0], overrides), start[1], args.init)
    cfg = Config(vocab_size=tok.vocab_size, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                 intermediate_size=args.ffn, max_positions=args.max_len + args.sar_shift + 1, type_vocab_size=2,
                 pad_id=tok.pad_id, layer_norm_eps=1e-12, position_style="bert")   # BERT-style positions 0..L-1
    return Model(apply_overrides(cfg, overrides))

def check_run(args, task, cfg, data_dir):
    """What fails (one `error:` line) or does nothing (one `warning:` line) once data and model are known."""
    sparse, b = cfg.attention != "dense", cfg.block_size
    if (args.sar > 0 or args.rdrop > 0) and task.num_labels == 0:
        fail("--sar / --rdrop need a classification or regression task, not mlm")
    if cfg.attn_dropout == "attendout" and data.TASKS[args.task].objective != "classify":
        fail(f"--attn-dropout attendout needs a classification or regression task, not {args.task}: its masked "
             "pass is compared with the clean pass's predictions (methods.md §3.1)")
    if sparse and args.eval_shift != "all" and args.eval_shift >= b:
        fail(f"--eval-shift {args.eval_shift}: give 'all' or a shift in 0 .. {b - 1} (--block-size {b})")
    useless = [f for f in args.given for k, m in ONLY_WITH.items() if f.startswith(k) and cfg.attn_dropout != m]
    useless += [f for f in args.given if f.endswith("_col") and args.task != "tsv"]     # --task tsv's columns
    for happens, line in [(task.skipped, task.skipped and data.skipped_warning(task.skipped)),
            (task.n_truncated, f"{task.n_truncated} examples were longer than --max-len {args.max_len} and were "
                               + ("split into chunks" if task.num_labels == 0 else "truncated")),
            (args.sar > 0 and not sparse, "--sar with dense attention has no effect: no block boundary moves"),
            (args.eval_shift and not sparse, "--eval-shift with dense attention: shifting moves no block boundary"),
            (sparse and b > max(len(e.ids) for e in task.train), f"--block-size {b} is larger than the longest "
                                                                 "sequence: sparse attention is dense here"),
            (useless, f"--{', --'.join(useless).replace('_', '-')}: no effect with this method or task")]:
        if happens:
            warn(line)

# --- 3. Losses and evaluation, by the task's objective (data.TASKS); extractive QA's live in readers/qa.py.

def task_loss(logits, labels, regression=False):
    """Cross-entropy, or MSE for a 1-output regression head (methods.md §1)."""
    if regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())         # logits: [B, 1]
    return F.cross_entropy(logits.float(), labels)                            # logits: [B, C]

def classify_loss(model, batch, args, task, tok):
    """The loss a classification / regression step optimises, all its terms here (methods.md §1, §2.3, §3.1):
        L = mean over the clean views of CE                         the task loss
          + alpha x consistency(original, second view)             SAR (shifted topology) or R-Drop (a copy)
          + consistency(original, masked) + tau^2 x kept pairs     AttendOut: the masked pass, the keep reward
    Every view runs in one stacked batch (sar.stacked_views)."""
    if task.head == "pair":                              # LRA Retrieval: [B, 2, L] -> [2B, L], rows 2i, 2i + 1
        batch = data.flatten_pairs(batch)
    raw = getattr(model, "module", model)
    second = args.sar_shift if args.sar > 0 else 0 if args.rdrop > 0 else None   # SAR / R-Drop / neither
    masked = raw.cfg.attn_dropout == "attendout"
    z = sar.stacked_views(model, batch, second, masked)  # [B, C] per view: original, (second), (masked)
    clean = z[:-1] if masked else z
    ce = sum(task_loss(zi, batch["labels"], task.is_regression) for zi in clean) / len(clean)
    loss, parts = ce, {}
    if second is not None:                               # SAR / R-Drop (methods.md §2.3)
        cons = sar.consistency(z[0], z[1], task.is_regression)
        loss = loss + (args.sar if args.sar > 0 else args.rdrop) * cons
        parts.update(ce=ce.item(), consistency=cons.item())
    if masked:                                           # AttendOut (methods.md §3.1)
        kl = sar.consistency(z[0], z[-1], task.is_regression)       # clean against masked
        keep = attendout.keep_reward(raw, z[0].size(0))             # kept pairs per example, all layers
        loss = loss + kl + raw.cfg.gnet_tau ** 2 * keep
        parts.update(ce=ce.item(), mask_consistency=kl.item(), kept=keep.item())
    return loss, parts

@torch.no_grad()
def evaluate(raw, task, args, device, tok, shift_by=0):
    """{split: the task's metrics}: one pass, on the original topology or shifted by shift_by (sar.shift)."""
    raw.eval()                                           # no dropout; eval random blocks are fixed
    out = {}
    for split, examples in task.dev.items():
        preds, labels = [], []
        for batch in data.make_batches(data.longest_first(examples), args.batch_size, pad_id=tok.pad_id, seed=0,
                                       epoch=0, shuffle=False):       # longest first, each padded to its own
            batch = {k: v.to(device) for k, v in batch.items()}
            batch = data.flatten_pairs(batch) if task.head == "pair" else batch   # LRA Retrieval's pairs
            ids, mask, pos, types = batch["input_ids"], batch["attention_mask"], None, batch["token_type_ids"]
            if shift_by:                                 # the content keeps its positions; the blocks move
                ids, mask, pos, types = sar.shift(ids, mask, shift_by, raw.cfg.pad_id, raw.position_ids(ids), types)
            with data.autocast(device):                  # bf16 on CUDA
                logits = raw(ids, mask, types, pos).float()                       # [B, C]
            preds.append(logits.squeeze(-1) if task.is_regression else logits.argmax(-1))
            labels.append(batch["labels"])
        out[split] = data.compute_metrics(args.task, torch.cat(preds).cpu().numpy(), torch.cat(labels).cpu().numpy())
    raw.train()
    return out

def objective(task_name):                                # (loss, evaluate) of the task: classify (LRA pairs too) ...
    if data.TASKS[task_name].objective in ("mlm", "span"):  # ... or masked LM / QA: readers/, loaded on first use
        return reader(task_name).loss, reader(task_name).evaluate
    return classify_loss, evaluate

# --- 4. The optimizer (nanoGPT's recipe). The G-Nets learn at their own rate and are clipped apart.

def make_optimizer(model, args, device):
    """AdamW: matrices (decayed), biases and LayerNorms (not), the G-Nets (their own peak lr, by default
    --lr as in the author's code; no decay)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gnet = lambda n: attendout.GNET in n.split(".")      # attendout.GNET: the G-Nets' submodules
    groups = [dict(params=[p for n, p in params if not gnet(n) and p.dim() >= 2], weight_decay=args.weight_decay),
              dict(params=[p for n, p in params if not gnet(n) and p.dim() < 2], weight_decay=0.0),
              dict(params=[p for n, p in params if gnet(n)], weight_decay=0.0,
                   base_lr=args.lr if model.cfg.gnet_lr is None else model.cfg.gnet_lr)]
    groups = [{"base_lr": args.lr, **g} for g in groups if g["params"]]             # base_lr: the group's peak
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6, fused=device.type == "cuda")

def clip_gradients(optimizer, max_norm):                 # the backbone's; the G-Nets' reversed gradient (x 10000
    groups = [g["params"] for g in optimizer.param_groups]  # through the mask) is not clipped, as in the author's
    clip = lambda params, m: float(torch.nn.utils.clip_grad_norm_(params, m or math.inf))   # the norm before
    gnet = {"gnet_grad_norm": clip(groups[2], math.inf)} if groups[2:] else {}
    return {"grad_norm": clip(groups[0] + groups[1], max_norm), **gnet}

# --- 5. Plumbing: processes, RNG states (exact resume), checkpoints, Ctrl-C.

def resolve_device(name):                                # auto, cpu, cuda or cuda:N, if this machine has it
    gpus, kind, _, index = torch.cuda.device_count(), *name.partition(":")
    if name == "auto":
        return torch.device("cuda" if gpus else "cpu")
    if not (name == "cpu" or kind == "cuda" and (index or "0").isdigit() and int(index or 0) < gpus):
        fail(f"--device {name}: not available here (auto, cpu, cuda or cuda:N; this machine has {gpus} GPUs)")
    return torch.device(name)

def setup_distributed(args):                             # (rank, world size, device); torchrun sets RANK
    device = resolve_device(args.device)
    if "RANK" not in os.environ:
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

def all_true(flag, device, world):                       # True only where it is True on every process
    if world == 1:
        return bool(flag)
    t = torch.tensor([float(bool(flag))], device=device)  # 1.0 where True
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())

def rng_state():    # the RNGs a step draws from (dropout, G-Net noise, random blocks, masks): torch's alone
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available()
            else []}

def trim_log(path, step):                                # resume: a killed run may have logged past its checkpoint
    if os.path.exists(path):
        with open(path) as f:
            keep = [line for line in f if line.endswith("\n") and json.loads(line).get("step", 0) <= step]
        with open(path, "w") as f:
            f.writelines(keep)

def append_jsonl(path, rec):
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")

def save_checkpoint(r, path, rngs):                      # atomic (model.save_atomic): a temporary file, a rename
    args = {k: v for k, v in vars(r.args).items() if k != "given"}  # the flags, to resume with
    save_atomic(checkpoint_dict(r.raw, data.files_to_tensors(r.tok.files), train_state=r.state, args=args,
                                optimizer=r.optimizer.state_dict(), rng=rngs), path)

class StopFlag:                                          # Ctrl-C / SIGTERM: finish the step, save, exit 128 + it
    def __enter__(self):
        self.signum, self.old = None, {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)

    def handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt                      # a second Ctrl-C aborts
        self.signum = signum

# --- 6. The run, top to bottom: setup(), then train() (step, log, evaluate, save), then report().

def main(argv=None):
    """A user error ends in one `error:` line (exit 2); Ctrl-C or SIGTERM saves, then exits 130 / 143."""
    with one_line_errors("interrupted; the last checkpoint, if any, is --out's ckpt_last.pt"):
        args = parse_args(sys.argv[1:] if argv is None else argv)
        check_args(args)
        try:
            r = setup(args)              # data, tokenizer, model, optimizer, schedule (or a resumed run's)
            train(r)                     # the loop: returns at the last step, or when a stop was asked for
            if r.state["step"] == r.total and is_main():
                report(r)                # final.json and the last line
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if r.stopped_by:
        sys.exit(128 + r.stopped_by)

class Run:                               # what one run holds; `state` is the part ckpt_last.pt saves
    stopped_by = None
    FILES = ("log.jsonl", "droprates.jsonl", "ckpt_last.pt", "final.json", "ckpt_best.pt")   # in --out

def setup(args):
    r = Run()
    r.args, (r.rank, r.world, r.device) = args, setup_distributed(args)
    r.paths = {name: os.path.join(args.out, name) for name in Run.FILES}
    if os.path.isfile(args.out) or not (args.resume or args.overwrite) and any(map(os.path.exists, r.paths.values())):
        fail(f"--out {args.out} holds another run (or is a file); pass --resume to continue it or --overwrite")
    start = read_start(args)             # --resume's or --init's checkpoint, or None (from scratch)
    torch.manual_seed(args.seed)         # one seed, one set of initial weights for every method (paired runs)
    # --- data: the tokenizer (the checkpoint's, the task's, or trained here), then the task's examples
    data_dir = task_data_dir(args)                       # --data, or the demo's ListOps
    r.tok = load_tokenizer(args, data_dir, start and start[2])
    limit = apply_overrides(start[0], {"max_positions": args.max_positions or start[0].max_positions}).max_len \
        if start else math.inf                           # from scratch the model is sized to --max-len
    if args.max_len and args.max_len > limit:
        warn(f"--max-len {args.max_len} is longer than the model allows ({limit} tokens; --max-positions grows it)")
    args.max_len = min(args.max_len or data.TASKS[args.task].max_len, limit)
    r.task = reader(args.task).load_task(args.task, data_dir, r.tok, max_len=args.max_len,
                                         **columns(args))
    r.loss_fn, r.evaluate = objective(args.task)         # section 3
    # --- the model: the checkpoint's (converted weights + the flags given) or from scratch
    r.raw = make_model(args, r.tok, r.task, start)
    check_run(args, r.task, r.raw.cfg, data_dir)
    if args.threads or r.device.type == "cpu":           # a small model's operations are too small to split
        torch.set_num_threads(args.threads or (1 if r.raw.num_params() < 20e6 else len(os.sched_getaffinity(0))))
    r.raw.to(r.device)                                   # the device the run trains on
    (r.raw.mlm if r.task.num_labels > 0 else r.raw.cls or r.raw.mlm).requires_grad_(r.task.num_labels == 0)
    r.model = torch.compile(r.raw) if args.compile else r.raw          # what runs the forward
    if r.world > 1:                                      # LayerDrop leaves a skipped layer without gradients
        r.model = torch.nn.parallel.DistributedDataParallel(
            r.model, find_unused_parameters=r.raw.cfg.layerdrop > 0 or r.raw.cfg.attn_layerdrop > 0)
    r.model.train()
    torch.manual_seed(args.seed + r.rank)                # nanoGPT: every process draws its own dropout masks
    # --- the schedule: steps per epoch from the batch plan, total steps, warmup
    if args.batch_size // args.grad_accum < r.world or args.batch_size % (args.grad_accum * r.world):
        fail(f"--batch-size {args.batch_size} must be a multiple of --grad-accum x processes "
             f"({args.grad_accum} x {r.world})")
    r.per_epoch = len(epoch_batches(r, 0)) // args.grad_accum  # full steps in an epoch
    if r.per_epoch == 0:
        fail(f"{len(r.task.train)} training examples make no full step of --batch-size {args.batch_size}")
    r.total = args.max_steps or max(1, int(args.epochs * r.per_epoch))
    r.warmup = int(args.warmup * r.total) if args.warmup < 1 else int(args.warmup)
    r.optimizer = make_optimizer(r.raw, args, r.device)
    r.state = {"step": 0, "epoch": 0, "micro": 0, "best": None, "best_step": None, "wall": 0.0, "dev": {},
               "saved_step": None}               # micro: the epoch's batches used; saved_step: in ckpt_last.pt
    os.makedirs(args.out, exist_ok=True)
    r.lock = data.lock_out(args.out) if is_main() else None   # one run at a time in --out (OUT/.lock)
    for path in r.paths.values() if is_main() and not args.resume else ():
        if os.path.exists(path):                         # the old run's files go only now, once all is ready
            os.remove(path)
    for f in os.listdir(args.out) if is_main() else ():  # a save killed mid-write leaves its temporary file
        if f.startswith(("ckpt_last.pt.tmp", "ckpt_best.pt.tmp")):
            os.remove(os.path.join(args.out, f))
    if args.resume:
        restore(r, start[3])
    start = None                                         # free the checkpoint's weights
    if is_main():
        print(opening_line(r), flush=True)
    return r

def opening_line(r):                                     # task and data | model | method | steps, device, threads
    args, t, c = r.args, r.task, r.raw.cfg
    dev = " + ".join(f"{len(v)} {k}" for k, v in t.dev.items()) or "no dev"
    origin = "from scratch" if args.init == "scratch" and not args.resume else f"from {args.init}"
    method = [f"{c.attention} attention", attendout.METHODS[c.attn_dropout].format(p=c.attn_dropout_p, cfg=c)]
    method += [f"SAR alpha {args.sar:g} shift {args.sar_shift}"] if args.sar else [f"R-Drop alpha {args.rdrop:g}"] * (
        args.rdrop > 0)
    where = f"{r.total} steps on {r.device}" + (f" x {r.world} processes" if r.world > 1 else "")
    where += f", {torch.get_num_threads()} CPU thread(s) (--threads)" if r.device.type == "cpu" else ""
    return (f"task {args.task}: {len(t.train)} train / {dev} examples | model {r.raw.num_params() / 1e6:.2f}M "
            f"parameters ({c.num_layers} layers, hidden {c.hidden_size}, {origin}) | {', '.join(method)} | {where}"
            + (f"; resuming at step {r.state['step']}" if args.resume else ""))

def restore(r, ckpt):                                    # AdamW, the loop state, this process's RNGs, the logs
    r.optimizer.load_state_dict(ckpt["optimizer"])       # AdamW's moments and step
    r.state.update(ckpt["train_state"])                  # step, epoch, micro, best, ...
    if len(ckpt["rng"]) != r.world:
        warn(f"--resume: the run had {len(ckpt['rng'])} processes, now {r.world}: the RNG streams change")
    rng = ckpt["rng"][r.rank % len(ckpt["rng"])]         # the data order is a function of (seed, epoch)
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    for name in ("log.jsonl", "droprates.jsonl") if is_main() else ():
        trim_log(r.paths[name], r.state["step"])         # a killed run may have logged past its checkpoint

def epoch_batches(r, epoch):                             # a function of (seed, epoch): resuming needs only "micro"
    plan = data.batch_plan([len(e.ids) for e in r.task.train], r.args.batch_size // r.args.grad_accum,
                           seed=r.args.seed, epoch=epoch)
    return [b for b in plan if len(b) >= r.world]

def train(r):      # steps until r.total or a stop; each: log, evaluate, save (a checkpoint holds all logged before)
    args, state = r.args, r.state
    gnet_log = (attendout.DropRateLogger(r.paths["droprates.jsonl"], args.log_every, append=args.resume)
                if r.raw.cfg.attn_dropout == "attendout" and is_main() else None)
    meter = {"t0": time.time() - state["wall"], "seen": 0, "t_last": time.time()}
    epoch, batches = None, None
    with StopFlag() as stop:
        while state["step"] < r.total and all_true(stop.signum is None, r.device, r.world):
            if epoch != state["epoch"]:
                epoch, batches = state["epoch"], epoch_batches(r, state["epoch"])
            step = state["step"] + 1                     # the step being taken; the logs count from 1
            numbers, epoch_done = train_step(r, batches, step, meter)
            state["step"] = step                         # the step is done
            log_step(r, step, numbers, meter)
            if gnet_log is not None:                     # AttendOut: each layer's mean drop rate (methods.md §3.1)
                gnet_log.log(step, step / r.total, numbers["mask"], last=step == r.total)
            if step == r.total or (step % args.eval_every == 0 if args.eval_every else epoch_done):
                if is_main():
                    evaluate_and_keep_best(r, step)
                barrier()
            if step == r.total or (args.save_every and step % args.save_every == 0):
                save_last(r, meter)
        if state["step"] < r.total:                      # Ctrl-C / SIGTERM (under torchrun: maybe another's)
            r.stopped_by = stop.signum or signal.SIGTERM
            if state["saved_step"] != state["step"]:
                save_last(r, meter)
            if is_main():
                print(f"stopped at step {state['step']}: saved {r.paths['ckpt_last.pt']}; "
                      f"continue with --resume --out {args.out}")

def train_step(r, batches, step, meter):
    """One optimizer step: forward and backward over --grad-accum micro-batches, clip, AdamW."""
    args, state = r.args, r.state
    t = step - 1                                         # linear warmup to 1, then linear decay to 0:
    factor = (t + 1) / r.warmup if t < r.warmup else max(0.0, (r.total - t) / max(1, r.total - r.warmup))
    for group in r.optimizer.param_groups:               # every group at factor x its own peak rate
        group["lr"] = group["base_lr"] * factor
    r.raw.set_progress((step - 1) / r.total)             # scheduled dropout follows training progress
    loss_sum, parts = 0.0, {}                            # the step's loss, its logged parts
    for i in range(args.grad_accum):                     # gradients add up over the micro-batches
        # padded to the longest example; under torchrun each process takes every world-th example
        batch = data.collate([r.task.train[j] for j in batches[state["micro"] + i]], r.tok.pad_id)
        batch = {k: v[r.rank::r.world].to(r.device, non_blocking=True) for k, v in batch.items()}
        meter["seen"] += batch["input_ids"].size(0) * r.world
        sync = i == args.grad_accum - 1 or r.world == 1  # DDP averages the gradients at the last micro-batch
        with (nullcontext() if sync else r.model.no_sync()), data.autocast(r.device):
            loss, parts = r.loss_fn(r.model, batch, args, r.task, r.tok)       # the task's objective, section 3
        (loss / args.grad_accum).backward()              # mean over the micro-batches
        loss_sum += loss.item() / args.grad_accum
    state["micro"] += args.grad_accum                    # the epoch ends when no full step is left in it
    epoch_done = state["micro"] + args.grad_accum > len(batches)
    if epoch_done:
        state["epoch"], state["micro"] = state["epoch"] + 1, 0
    norms = clip_gradients(r.optimizer, args.clip)       # the norms before clipping
    what = "loss" if not math.isfinite(loss_sum) else "gradient" if not all(map(math.isfinite, norms.values())) else ""
    if not all_true(not what, r.device, r.world):        # stop at once: nothing non-finite is ever saved
        saved = state["saved_step"]
        fail(f"non-finite {what or 'loss'} at step {step} (lr {factor * args.lr:.3g}); last good checkpoint: "
             + (f"{r.paths['ckpt_last.pt']} (step {saved})" if saved else "none written yet") + "; lower --lr", 1)
    r.optimizer.step()                                   # AdamW: backbone, heads, G-Nets (reversed gradients)
    r.optimizer.zero_grad(set_to_none=True)              # set_to_none: no zero tensors kept
    numbers = {"loss": loss_sum, "lr": factor * args.lr, **norms, **parts}
    if r.raw.cfg.attn_dropout == "attendout":            # AttendOut: each layer's masking rate (methods.md §3.1)
        numbers["mask"] = attendout.mask_rates(r.raw)
    return numbers, epoch_done

def log_step(r, step, numbers, meter):                   # every --log-every steps: log.jsonl and the console
    if step % r.args.log_every and step != r.total or not is_main():
        return
    now = time.time()
    rate, meter["seen"], meter["t_last"] = meter["seen"] / max(now - meter["t_last"], 1e-9), 0, now
    append_jsonl(r.paths["log.jsonl"], {"step": step, **numbers, "examples_per_s": rate})
    shown = [f"loss {numbers['loss']:.4f}"]
    terms = [f"ce {numbers['ce']:.4f}"] if "ce" in numbers else []
    if "consistency" in numbers:                         # SAR / R-Drop: + alpha x consistency
        name, alpha = ("SAR", r.args.sar) if r.args.sar > 0 else ("R-Drop", r.args.rdrop)
        terms.append(f"{alpha:g} x {name} consistency {numbers['consistency']:.4f}")
    if "mask_consistency" in numbers:                    # AttendOut: + consistency + tau^2 x kept pairs
        tau = r.raw.cfg.gnet_tau
        terms.append(f"AttendOut consistency {numbers['mask_consistency']:.4f}")
        terms.append(f"{tau ** 2:g} x kept {numbers['kept']:.0f}")
    if terms:
        shown[0] += " = " + " + ".join(terms)
    if "mask" in numbers:                                # AttendOut: each layer's masking rate
        shown.append("mask rates " + " ".join(f"{m:.2f}" for m in numbers["mask"]))
    print(f"step {step}/{r.total}: {', '.join(shown)}, lr {numbers['lr']:.2e}, {rate:.0f} examples/s", flush=True)

def evaluate_and_keep_best(r, step):                     # dev metrics (and --eval-shift's); the best: ckpt_best.pt
    args, task, state = r.args, r.task, r.state
    if not task.dev:
        return
    metrics = r.evaluate(r.raw, task, args, r.device, r.tok)  # {split: metrics}, section 3
    shifts = sar.eval_shifts(args.eval_shift, r.raw.cfg.attention != "dense", r.raw.cfg.block_size)
    sar.add_shifted(metrics, {s: r.evaluate(r.raw, task, args, r.device, r.tok, shift_by=s) for s in shifts},
                    lower_is_better=task.metric_name == "loss")            # --eval-shift, methods.md §2.3
    append_jsonl(r.paths["log.jsonl"], {"step": step, "dev": metrics})
    state["dev"] = metrics
    v = metrics[next(iter(metrics))][task.metric_name]   # the main metric, on the first dev split
    score = -v if task.metric_name == "loss" else v      # higher is better (the LM's loss: lower)
    if state["best"] is None or score > state["best"]:
        state["best"], state["best_step"] = score, step
        save_checkpoint(r, r.paths["ckpt_best.pt"], [rng_state()])  # [rng_state()]: rank 0's
    print(f"step {step}: " + "; ".join(f"{split} {show_metrics(args.task, m)}" for split, m in metrics.items()))

def show_value(task_name, metric, v):                    # "83.4%" for the task's percent metrics, else "0.5120"
    t = data.TASKS[task_name]
    return f"{v * t.scale:.1f}%" if metric in t.percent else f"{v}" if isinstance(v, int) else f"{v:.4f}"

def show_metrics(task_name, metrics):                    # "acc 83.4%, f1 80.2% | shifted mean acc 82.9% worst .."
    plain = lambda ms: ", ".join(f"{m} {show_value(task_name, m, v)}" for m, v in ms.items() if m != "shift")
    shifted = metrics.get("shift")
    return plain(metrics) + (f" | shifted mean {plain(shifted['mean'])} worst {plain(shifted['worst'])}"
                             if shifted else "")

def save_last(r, meter):                                 # every process calls it: their RNG states are gathered
    r.state["wall"], r.state["saved_step"] = time.time() - meter["t0"], r.state["step"]
    rngs = [rng_state()] * r.world                       # every process's RNG states, by rank
    if r.world > 1:
        dist.all_gather_object(rngs, rngs[0])
    if is_main():
        save_checkpoint(r, r.paths["ckpt_last.pt"], rngs)

def report(r):                                           # final.json and the last line, beside the majority class
    args, task, state, name = r.args, r.task, r.state, r.task.metric_name
    majority = None                                      # the majority class's main metric
    if task.label_names and not task.is_regression and task.dev:     # always the commonest training label
        labels = np.array([e.label for e in next(iter(task.dev.values()))])
        common = np.bincount([e.label for e in task.train], minlength=task.num_labels).argmax()
        majority = data.compute_metrics(args.task, np.full_like(labels, common), labels)[name]
    best = None if state["best"] is None else -state["best"] if name == "loss" else state["best"]
    final = {"task": args.task, "metric": name, "dev": state["dev"], "best_dev": best, "best_step": state["best_step"],
             "steps": state["step"], "wall_time_s": round(state["wall"], 2), "majority_baseline": majority,
             "config": asdict(r.raw.cfg), "args": {k: v for k, v in vars(args).items() if k != "given"}}
    with open(r.paths["final.json"], "w") as f:
        json.dump(final, f, indent=1)                    # the run's record (README figures)
    show, line = lambda v: show_value(args.task, name, v), f"done in {state['wall']:.0f}s, {state['step']} steps"
    if state["dev"]:
        split = next(iter(state["dev"]))
        line += f": {split} {name} {show(state['dev'][split][name])} at the last step"
        line += f", best {show(best)} at step {state['best_step']}" if best is not None else ""
    line += f" (majority-class baseline: {name} {show(majority)})" if majority is not None else ""
    print(line + f"; results in {r.paths['final.json']}")

if __name__ == "__main__":
    main()
