"""
research/bench_attendout.py: how much an AttendOut train step costs against a standard-dropout one.

MiniLM-sized dense encoder (6 layers, d 384, 12 heads, FFN 1536), a batch of 16 x 128 tokens, no padding.
One "step" is what train.py does per batch minus the optimizer: zero grads, forward, loss mean(h^2),
backward, and under AttendOut attendout.hold_budget(model) (train.py's after-step budget). The models share
their backbone weights and run in turn, one step each per round (a, b, a, b, ...), in one process, so a
busy machine slows them alike; each round gives a ratio AttendOut / standard, and the figure is the median
of those ratios (the bar: <= 1.15). Several --root folders (e.g. the code before a change and after it) are
loaded side by side in the same process and interleaved the same way.

Run (from the repository root):
    python research/bench_attendout.py                                  # this checkout
    python research/bench_attendout.py --root /tmp/base --root .        # before (another checkout) and after
    python research/bench_attendout.py --threads 1 --rounds 20
"""

import argparse
import importlib
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


def load(root, roots):
    """model and attendout as found in root, imported afresh (the modules of an earlier root stay alive)."""
    folders = {os.path.abspath(r) for r in (HERE, *roots)}
    for name in [n for n, m in sys.modules.items() if getattr(m, "__file__", None) and
                 os.path.dirname(os.path.abspath(m.__file__)) in folders]:
        del sys.modules[name]                             # a module of any root: import it again from this one
    sys.path.insert(0, os.path.abspath(root))
    try:
        model, attendout = importlib.import_module("model"), importlib.import_module("attendout")
        assert os.path.dirname(os.path.abspath(attendout.__file__)) == os.path.abspath(root), attendout.__file__
        return model, attendout
    finally:
        sys.path.pop(0)


def build(model, method, layers):
    """A MiniLM-sized RoBERTa (only Config fields every version of model.Config has), training mode."""
    torch.manual_seed(0)                                  # the same backbone weights for every method and root
    cfg = model.Config(vocab_size=30522, hidden_size=384, num_layers=layers, num_heads=12, intermediate_size=1536,
                       max_positions=514, type_vocab_size=1, pad_id=1, attn_dropout=method)
    return model.Model(cfg).train()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", action="append", help="folder holding model.py and attendout.py (repeatable; "
                    "default: this repository)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12, help="timed steps per model")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--len", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = {}                                             # (root, method) -> step function
    for root in args.root or [HERE]:
        model, attendout = load(root, args.root or [HERE])
        for method in ("standard", "attendout"):
            net = build(model, method, args.layers)

            def step(net=net, budget=getattr(attendout, "hold_budget", None) if method == "attendout" else None):
                net.zero_grad(set_to_none=True)
                net.encode(ids, mask).pow(2).mean().backward()
                if budget is not None:
                    budget(net)                           # the budget's after-step part (train.py runs it)
            runs[root, method] = step
    ids = torch.randint(3, 30522, (args.batch, args.len), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for step in runs.values():                            # warm-up
        step()
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, step in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)       # CPU seconds of this process: less moved by other jobs
    print(f"{args.threads} thread(s), {args.layers} x 384, 12 heads, FFN 1536, batch {args.batch} x {args.len}, "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.2f} at the end")
    for root in args.root or [HERE]:
        print(f"{os.path.abspath(root)}:")
        for name, t in (("wall", wall), ("cpu", cpu)):
            ao, std = t[root, "attendout"], t[root, "standard"]
            ratio = statistics.median(a / s for a, s in zip(ao, std))
            print(f"  {name}: standard {1000 * statistics.median(std):.0f} ms, attendout "
                  f"{1000 * statistics.median(ao):.0f} ms (medians); AttendOut / standard train step {ratio:.3f} "
                  f"(median of {args.rounds} rounds; bar <= 1.15: {'ok' if ratio <= 1.15 else 'MISSED'})")


if __name__ == "__main__":
    main()
