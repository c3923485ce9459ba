"""research/bench_sparse.py: the speed and memory of sparse.py's kernels, side by side in one run, as ratios.

Idea: a train step (forward + loss.backward(), no optimizer) of the long-sequence model (2 x 256, 4 heads, FFN
1024, block 64, w 1, g 128, r 3) is timed alternately against transformers' BigBirdModel(block_sparse) and
between HST and sparse, so background load hits every side alike (medians of CPU time); --base OLD/sparse.py
also runs the model with another sparse.py swapped in (before / after in one run). Memory: the peak of live
tensors over a train step (torch.profiler's allocation records: deterministic, unlike RSS) at 8k and 16k tokens.

Run:  python research/bench_sparse.py --base /tmp/base/sparse.py        # all three sections, 1 thread
      python research/bench_sparse.py --only bigbird --rounds 3
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the six files' folder
import model  # noqa: E402
import sparse  # noqa: E402


def load_kernels(path):
    """{name: module with block_sparse_attention, hst_attention}: ours, and `path`'s as "base"."""
    kernels = {"new": sparse}
    if path:
        spec = importlib.util.spec_from_file_location("sparse_base", path)
        kernels["base"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kernels["base"])
    return kernels


def long_config(attention, n, **kw):
    """The long-sequence model of bench.py's sections 2-4 (BigBird's topology: 2 global blocks, 3 random)."""
    base = dict(vocab_size=30522, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=1024,
                max_positions=n + 2, type_vocab_size=1, pad_id=1, attention=attention, block_size=64, window=1,
                num_global=128, num_random=3, hidden_dropout_p=0.1)
    return model.Config(**{**base, **kw})


def batch(B, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 30522, (B, n), generator=g), torch.ones(B, n, dtype=torch.long)   # no padding


def step(net, ids, mask, kernel=None, hf=False):
    """A zero-argument train step: mean(h^2) of the last hidden states, backward. kernel: the sparse module the
    model calls (swapped into model.py's namespace for this step)."""
    def run():
        if kernel is not None:
            model.block_sparse_attention, model.hst_attention = kernel.block_sparse_attention, kernel.hst_attention
        net.zero_grad(set_to_none=True)
        h = net(input_ids=ids, attention_mask=mask).last_hidden_state if hf else net.encode(ids, mask)
        h.float().pow(2).mean().backward()
    return run


def time_alternately(fns, rounds, warmup, clock):
    """{name: [seconds]}: each fn `warmup` times, then `rounds` rounds of one call of each in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return times


def report(title, times, ratios):
    """Print the medians, then each ratio (a, b): median a / median b, and min a / min b."""
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"## {title}\n\n| side | ms/step (median) | every round |\n|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {1000 * med[k]:.1f} | {' '.join(f'{1000 * t:.0f}' for t in v)} |")
    for a, b in ratios:                                       # minima: the rounds least hit by other jobs
        print(f"{a} / {b}: ratio {med[a] / med[b]:.3f} (of the minima {min(times[a]) / min(times[b]):.3f})")
    print()


def bench_bigbird(kernels, args):
    from transformers import BigBirdConfig, BigBirdModel
    n, B = 4096, 2
    torch.manual_seed(0)
    hf_cfg = BigBirdConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=1024, max_position_embeddings=n, attention_type="block_sparse",
                           block_size=64, num_random_blocks=3, hidden_act="gelu", hidden_dropout_prob=0.1)
    theirs = BigBirdModel(hf_cfg, add_pooling_layer=False).train()
    ours = model.Model(long_config("sparse", n, attn_dropout="none")).train()
    ids, mask = batch(B, n, seed=1)
    fns = {f"ours sparse ({k})": step(ours, ids, mask, kern) for k, kern in kernels.items()}
    fns["hf bigbird"] = step(theirs, ids, mask, hf=True)
    t = time_alternately(fns, args.rounds, args.warmup, args.clock)
    report(f"sparse train step vs BigBirdModel (n {n}, batch {B}, no attention dropout)", t,
           [(k, "hf bigbird") for k in fns if k != "hf bigbird"] +
           ([("ours sparse (new)", "ours sparse (base)")] if "base" in kernels else []))


def bench_hst(kernels, args):
    n = 4096
    for method in ("standard", "none"):                       # attention dropout 0.1 (as bench.py), and none
        nets = {}
        for kind in ("hst", "sparse"):
            torch.manual_seed(0)
            nets[kind] = model.Model(long_config(kind, n, attn_dropout=method)).train()
        ids, mask = batch(1, n, seed=2)
        fns = {f"{kind} ({k})": step(net, ids, mask, kern)
               for k, kern in kernels.items() for kind, net in nets.items()}
        t = time_alternately(fns, args.rounds, args.warmup, args.clock)
        report(f"HST vs sparse train step (n {n}, batch 1, attention dropout {method})", t,
               [(f"hst ({k})", f"sparse ({k})") for k in kernels])


def peak_tensor_bytes(fn):
    """The peak of live tensor bytes while fn() runs, over its start, from the profiler's allocation records."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def bench_memory(kernels, args):
    print("## peak of live tensors over one train step (batch 1, no attention dropout), MiB\n")
    print("| kernel | 8192 | 16384 | 16k / 8k |\n|---|---|---|---|")
    for kind in ("sparse", "hst"):
        for k, kern in kernels.items():
            peaks = []
            for n in (8192, 16384):
                torch.manual_seed(0)
                net = model.Model(long_config(kind, n, attn_dropout="none")).train()
                fn = step(net, *batch(1, n), kern)
                fn()                                          # warm-up: the first step's one-off buffers
                peaks.append(peak_tensor_bytes(fn) / 2**20)
            print(f"| {kind} ({k}) | {peaks[0]:,.1f} | {peaks[1]:,.1f} | {peaks[1] / peaks[0]:.2f} |", flush=True)
    print()


def main():
    p = argparse.ArgumentParser(description="sparse.py's kernels against BigBird, HST against sparse, memory.")
    p.add_argument("--base", default="", help="another sparse.py to run side by side (e.g. the old one)")
    p.add_argument("--only", default="bigbird,hst,memory", help="sections, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: this process's CPU time (with 1 thread, robust to other jobs on the machine)")
    args = p.parse_args()
    args.clock_name, args.clock = args.clock, time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    kernels = load_kernels(args.base)
    print(f"# bench_sparse: torch {torch.__version__}, {args.threads} thread(s), {args.clock_name} time, "
          f"{args.rounds} rounds after {args.warmup} warm-up, kernels {', '.join(kernels)}\n", flush=True)
    sections = {"bigbird": bench_bigbird, "hst": bench_hst, "memory": bench_memory}
    for name in args.only.split(","):
        sections[name](kernels, args)


if __name__ == "__main__":
    main()
