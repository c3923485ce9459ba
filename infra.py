"""infra.py: the plumbing of train.py that a reader of the training loop need not read first.

What it is: warnings (the one-line errors are cli.py's), torchrun / DDP setup, seeding and RNG capture (for
exact resume), the run folder (its lock, refusing to overwrite, trimming logs on resume), atomic checkpoint
writing, and the Ctrl-C / SIGTERM flag. Nothing here knows about attention, AttendOut or SAR: train.py is where the ideas are.

How to run it: it is not run on its own; `python train.py` uses it.
"""
import fcntl
import io
import json
import os
import random
import signal
import sys
from contextlib import contextmanager, nullcontext, suppress

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import data
from cli import fail
from model import checkpoint_dict, save_atomic


# -----------------------------------------------------------------------------
# Messages: one clear line, never a traceback.

def warn(msg):
    if is_main():
        tqdm.write(f"warning: {msg}", file=sys.stderr)


# -----------------------------------------------------------------------------
# Devices and processes (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK).

def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        fail(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {name}: CUDA is not available here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        fail(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        fail(f"--device {name}: only cpu and cuda are supported")
    return device


def autocast(device):
    """Forward passes in bf16 autocast on CUDA, fp32 (no autocast) on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


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


def is_main():
    return not dist.is_initialized() or dist.get_rank() == 0


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


def all_reduce_sum(t):
    """Sum a tensor over processes, in place (nothing to do in a single process)."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def check_replicas(raw, device, world):
    """End of a torchrun run: DDP keeps the replicas in step, so every process must hold rank 0's weights.
    Compared through a per-tensor checksum (sum and sum of squares, float64), broadcast from rank 0."""
    mine = torch.stack([s for p in raw.parameters() for s in (p.detach().double().sum(), p.detach().double().square().sum())])
    ref = mine.clone()
    dist.broadcast(ref, 0)
    if not all_true(torch.equal(mine, ref), device, world):
        fail(f"process {dist.get_rank()}: the replicas' weights differ after training (DDP out of step)", code=1)


# -----------------------------------------------------------------------------
# Seeds and RNG state (every RNG the run draws from, saved in ckpt_last.pt so a resumed run is bit-identical).

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


def gather_rng_states(world):
    """Every process's rng_state(), by rank (tensors travel as torch.save bytes: all_gather_object pickles)."""
    rngs = [rng_state()]
    if world > 1:
        buf, blobs = io.BytesIO(), [None] * world
        torch.save(rngs[0], buf)
        dist.all_gather_object(blobs, buf.getvalue())
        rngs = [torch.load(io.BytesIO(blob), weights_only=True) for blob in blobs]
    return rngs


# -----------------------------------------------------------------------------
# The run folder and checkpoints.

RUN_FILES = ("log.jsonl", "droprates.jsonl", "final.json", "ckpt_last.pt", "ckpt_best.pt")
LOCK_FILE = "run.lock"         # held (flock) while a run writes to --out; the kernel lets go if the run dies


@contextmanager
def lock_out(out):
    """--out belongs to one run at a time: a second run into it (a --resume while the first still runs) is
    refused in one line. Rank 0 holds the lock; other torchrun processes write nothing there."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    if os.path.exists(out) and not os.path.isdir(out):
        fail(f"--out {out}: is a file, not a folder")
    path = os.path.join(out, LOCK_FILE)
    try:
        os.makedirs(out, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        fail(f"--out {out}: cannot write there ({e.strerror})")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        fail(f"--out {out}: another run is writing to it ({path} is held); wait for it or choose another --out")
    try:
        yield
    finally:
        with suppress(FileNotFoundError):
            os.remove(path)
        os.close(fd)


def run_in_progress(folder):
    """True while a run holds `folder`'s lock (lock_out): its files are still being written. A lock file left by
    a run that died is not held, so it does not count."""
    path = os.path.join(folder, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def check_out(args):
    """--out holding another run is refused unless --resume or --overwrite (checked first; cleared by clear_out
    only once the new run has read its data and built its model)."""
    taken = any(os.path.exists(os.path.join(args.out, f)) for f in ("log.jsonl", "ckpt_last.pt", "final.json"))
    if taken and not args.resume and not args.overwrite:
        fail(f"--out {args.out} holds another run (log.jsonl / checkpoints); pass --resume to continue it or "
             "--overwrite to replace it")


def clear_out(args):
    """Just before the first step: drop a killed save's temp files, and (--overwrite) the old run's files."""
    if not is_main():
        return
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.out):                     # a run killed while saving leaves a half-written temp file
        if f.startswith(("ckpt_last.pt.tmp", "ckpt_best.pt.tmp")):
            os.remove(os.path.join(args.out, f))
    if not args.resume:                                # run() has read its ckpt_last.pt already
        for f in RUN_FILES:
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


def public_args(args):
    return {k: v for k, v in vars(args).items() if k != "given"}


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


def append_jsonl(path, rec):
    """One JSON line (rank 0 only)."""
    if is_main():
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


# -----------------------------------------------------------------------------
# Stopping cleanly.

class StopFlag:
    """Ctrl-C / SIGTERM: finish the current step, save ckpt_last.pt, exit cleanly. A second Ctrl-C aborts.
    Under torchrun every process stops at the same step (requested() agrees across processes)."""

    def __init__(self, device, world):
        self.stop, self.device, self.world = False, device, world
        self.signum = None              # the signal that asked for the stop (the exit code is 128 + it)

    def __enter__(self):
        self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)

    def handle(self, signum, frame):
        if self.stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop, self.signum = True, signum

    def requested(self):
        return not all_true(not self.stop, self.device, self.world)
