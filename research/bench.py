"""research/bench.py: speed and memory of attnreg's encoder, side by side with HuggingFace
references, in one run.

What it is: one command that times *training steps* (forward + loss.backward(), no optimizer) and
prints a Markdown table per section, every figure as a ratio with its requirement beside it, and
writes the lot to JSON. The reference implementations come from `transformers` (imported here
only, never by the library).

The idea in three lines: a teaching codebase is only useful if it is not a slow toy. So we race our
dense encoder against RobertaModel with the same weights, our block-sparse encoder against
BigBirdModel, and our methods (HST, AttendOut, SAR / R-Drop) against their plain baselines, timing
the two sides alternately (ours, theirs, ours, theirs, ...) so that background load hits both
alike, and report medians.

Sections (--only takes names or numbers):
  1 dense      our dense encoder vs RobertaModel (eager and sdpa; the faster is the reference),
               MiniLM size
  2 bigbird    our sparse encoder vs BigBirdModel(attention_type="block_sparse"), n = 4096
  3 scaling    time and peak memory at n = 1k .. 16k for dense / sparse / HST, one fresh process
               each
  4 hst        HST vs block-sparse on the same topology, n = 4096
  5 attendout  AttendOut vs standard attention dropout: train step and inference, MiniLM size
  6 sar        SAR and R-Drop steps vs a plain cross-entropy step (sparse, n = 1024)
  7 throughput (CUDA only) tokens/s and MFU at 4k and 16k, bf16: sparse through FlexAttention and
               (with attention dropout) through the gather kernel, HST, against dense SDPA

How to run it (from the repository root):
    python research/bench.py             # everything, full sizes (tens of minutes on 2 busy cores)
    python research/bench.py --quick     # small sizes, under a minute: a smoke run
    python research/bench.py --only dense,hst --rounds 15 --threads 2 --json bench.json
    python research/bench.py --device cuda   # bf16 autocast, tokens/s and MFU vs --peak-tflops
    python research/bench.py --only hst --profile     # also torch.profiler's top ops of our side
Before / after a change, another checkout's model.py, sparse.py, attendout.py and sar.py side by
side with ours:
    python research/bench.py --only attendout,hst --base /tmp/base
This process's CPU time, less moved by other jobs on a busy machine (CPU only):
    python research/bench.py --only bigbird --threads 1 --clock cpu
With --base DIR, sections 1-6 build every model of ours twice, from this checkout and from DIR's
modules (imported afresh, side by side in this process), time them alternately with the rest, and
add the figures "X / X (base)" (after / before; section 3: peak memory at the longest n, each point
in its own process). No figure is ever asserted on: timings are noisy, the table is for people
(research/tests/test_bench.py is a smoke).
"""
import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the six files' folder
sys.path.insert(0, ROOT)
import attendout  # noqa: E402
import model  # noqa: E402
import sar  # noqa: E402
from data import ArgumentParser, fail, one_line_errors  # noqa: E402

SECTIONS = ("dense", "bigbird", "scaling", "hst", "attendout", "sar", "throughput")
MEMORY_LIMIT = 12 * 2**30      # skip a scaling point whose estimated peak exceeds this (bytes)
# --clock: wall time, or this process's CPU time.
CLOCKS = dict(wall=time.perf_counter, cpu=time.process_time)
# Our modules; with --base, load_checkout gives a second such namespace.
THIS = SimpleNamespace(model=model, attendout=attendout, sar=sar, root=None, tag="")


# -----------------------------------------------------------------------------
# --base DIR: another checkout's modules, side by side with ours in this process

def top_level_modules(folder):
    """Names in sys.modules of the modules whose file lies directly in folder (model, sparse,
    data, ...)."""
    return [k for k, m in list(sys.modules.items())
            if os.path.dirname(os.path.abspath(getattr(m, "__file__", None) or "/")) == folder]


def load_checkout(root):
    """DIR's model, attendout and sar (and what they import from DIR), imported afresh; then taken
    out of sys.modules again, so that ours stay what `import model` gives. Returns a namespace like
    THIS."""
    root = os.path.abspath(root)
    if not os.path.isfile(os.path.join(root, "model.py")):
        fail(f"--base {root}: no model.py there (give a checkout's root folder, e.g. /tmp/base)")
    ours = {k: sys.modules.pop(k) for k in top_level_modules(ROOT)}
    sys.path.insert(0, root)
    try:
        mods = {k: importlib.import_module(k) for k in ("model", "attendout", "sar")}
    finally:
        sys.path.remove(root)
        for k in top_level_modules(root):
            del sys.modules[k]
        sys.modules.update(ours)
    return SimpleNamespace(**mods, root=root, tag=" (base)")


def make_config(lib, **kw):
    """lib's Config; a base checkout's drops the fields it does not have (e.g. fields added
    since)."""
    names = {f.name for f in dataclasses.fields(lib.model.Config)}
    return lib.model.Config(**{k: v for k, v in kw.items() if lib is THIS or k in names})


def base_figures(t, names):
    """With --base: each named side of ours against the same side built from the base checkout."""
    expect = "after / before; < 1: faster"
    return [figure(f"{k} / {k} (base)", t[k], t[k + " (base)"], expect=expect)
            for k in names if k + " (base)" in t]


# -----------------------------------------------------------------------------
# Sizes. Full sizes are those of the task; --quick shrinks everything to run in under a minute.

def sizes(quick):
    if not quick:
        return dict(minilm_batch=(16, 128), minilm_layers=6,
                    bigbird=dict(n=4096, batch=2, block=64, num_global=128),
                    scaling_ns=[1024, 2048, 4096, 8192, 16384], scaling_steps=3, hst_n=4096,
                    sar_n=1024, sar_batch=2, throughput_ns=[4096, 16384])
    return dict(minilm_batch=(4, 64), minilm_layers=2,       # MiniLM's width, 2 of its 6 layers
                bigbird=dict(n=512, batch=1, block=32, num_global=64),
                scaling_ns=[512, 1024], scaling_steps=2, hst_n=512,
                sar_n=256, sar_batch=1, throughput_ns=[512, 1024])


def minilm_config(lib=THIS, **kw):
    """MiniLM-sized RoBERTa (6 x 384, 12 heads, FFN 1536, vocab 30522)."""
    base = dict(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12,
                intermediate_size=1536, max_positions=514, type_vocab_size=1, pad_id=1,
                layer_norm_eps=1e-5)
    return make_config(lib, **{**base, **kw})


def long_config(attention, n, lib=THIS, **kw):
    """The long-sequence model of sections 2-4, 6: 2 x 256, 4 heads, FFN 1024, BigBird's topology
    (block 64, one window block each side, 2 global blocks = 128 tokens, 3 random blocks)."""
    base = dict(vocab_size=30522, hidden_size=256, num_layers=2, num_heads=4,
                intermediate_size=1024, max_positions=n + 2, type_vocab_size=1, pad_id=1,
                attention=attention, block_size=64, window=1, num_global=128, num_random=3)
    return make_config(lib, **{**base, **kw})


# -----------------------------------------------------------------------------
# Timing

def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def autocast(device):
    """bf16 autocast on CUDA, a no-op context on CPU (fp32)."""
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")


def train_step(net, batch, loss_fn, device="cpu", lib=THIS):
    """One training step without optimizer: fresh grads, forward, loss, backward (and, for a base
    checkout whose attendout has hold_budget, the AttendOut budget its train.py held after each
    step)."""
    net.zero_grad(set_to_none=True)
    with autocast(device):
        loss = loss_fn(net, batch)
    loss.backward()
    method = getattr(getattr(net, "cfg", None), "attn_dropout", None)    # HF's models: no field
    is_attendout = method == "attendout"
    if is_attendout and hasattr(lib.attendout, "hold_budget"):
        lib.attendout.hold_budget(net)
    return loss


def time_alternately(fns, rounds, warmup=1, device="cpu", clock="wall"):
    """fns: {name: zero-argument callable}. Runs each `warmup` times, then `rounds` rounds of one
    call of each in turn (a, b, a, b, ...). Returns {name: [seconds per call]} of CLOCKS[clock]."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            t0 = CLOCKS[clock]()
            fn()
            sync(device)
            times[name].append(CLOCKS[clock]() - t0)
    return times


def med(ts):
    return statistics.median(ts)


def verdict(ratio, need=None, target=None, expect=None):
    """'ratio 0.82 (need <= 1.0, target 0.85): PASS'. Without a requirement: an info line."""
    if need is None:
        return f"ratio {ratio:.2f} ({expect}): info"
    # Three decimals where two would print the requirement itself: 1.004 is not "1.00: FAIL".
    shown = f"{ratio:.3f}" if f"{ratio:.2f}" == f"{need:.2f}" else f"{ratio:.2f}"
    aim = f", target {target:g}" if target is not None else ""
    s = f"ratio {shown} (need <= {need:g}{aim}): "
    s += "PASS" if ratio <= need else "FAIL"
    if target is not None and ratio <= need:
        s += "" if ratio <= target else " (target missed)"
    return s


def figure(name, ours, theirs, need=None, target=None, expect=None):
    """A ratio ours/theirs of median times, as a JSON-able dict with its printed line."""
    ratio = med(ours) / med(theirs)
    paired = med([a / b for a, b in zip(ours, theirs)])    # median of per-round ratios: noise check
    line = verdict(ratio, need, target, expect)
    status = "info" if need is None else ("PASS" if ratio <= need else "FAIL")
    return dict(name=name, ratio=ratio, paired_ratio=paired, need=need, target=target,
                status=status, line=f"{name}: {line}")


def table(headers, rows):
    """A Markdown table from a header list and rows of already formatted cells."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def ms(ts):
    return f"{1e3 * med(ts):.1f}"


# -----------------------------------------------------------------------------
# FLOPs (for tokens/s and model-FLOPs utilisation on CUDA)

def layer_params(model):
    """Parameters of the transformer layers (embeddings and heads excluded: they are not matmuls
    per token)."""
    layers = model.layers if hasattr(model, "layers") else model.encoder.layer
    return sum(p.numel() for p in layers.parameters())


def attention_context(cfg, n):
    """Keys each query sees: n (dense), or (2w + 1 + r) b + g (block-sparse; HST adds R_i)."""
    if cfg.attention == "dense":
        return n
    ctx = (2 * cfg.window + 1 + cfg.num_random) * cfg.block_size + cfg.num_global
    return ctx + 1 if cfg.attention == "hst" else ctx


def train_flops(cfg, params, batch, n):
    """6 * params * tokens (matmuls, forward + backward) + 12 * layers * n * context * d (QK^T and
    AV)."""
    tokens = batch * (n + (n // cfg.block_size if cfg.attention == "hst" else 0))
    attn = 12 * cfg.num_layers * tokens * attention_context(cfg, n) * cfg.hidden_size
    return 6 * params * tokens + attn


def rate_cells(flops, tokens, seconds, args):
    """[tokens/s, MFU or achieved TFLOP/s] cells."""
    tflops = flops / seconds / 1e12
    if args.device == "cuda":
        mfu = f"{100 * tflops / args.peak_tflops:.1f}%"
    else:
        mfu = f"{tflops:.3f} TF/s"
    return [f"{tokens / seconds:,.0f}", mfu]


# -----------------------------------------------------------------------------
# Inputs and losses

def random_batch(batch, n, vocab, device, num_labels=0, seed=0):
    """Token ids drawn away from the special ids 0..2 (no padding), all-ones mask, zero token
    types."""
    g = torch.Generator().manual_seed(seed)
    b = dict(input_ids=torch.randint(3, vocab, (batch, n), generator=g),
             attention_mask=torch.ones(batch, n, dtype=torch.long),
             token_type_ids=torch.zeros(batch, n, dtype=torch.long))
    if num_labels:
        b["labels"] = torch.randint(0, num_labels, (batch,), generator=g)
    return {k: v.to(device) for k, v in b.items()}


def ours_hidden_loss(model, batch):
    """mean(h^2) of the last hidden states."""
    h = model.encode(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    return h.float().pow(2).mean()


def hf_hidden_loss(model, batch):
    h = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              token_type_ids=batch["token_type_ids"]).last_hidden_state
    return h.float().pow(2).mean()


def views_loss(lib, net, b, second=None, masked=False):
    """train.py's classification loss, written against lib's sar.stacked_views (this checkout's
    API): CE of the clean views + consistency (SAR / R-Drop) + AttendOut's consistency and keep
    reward."""
    z = lib.sar.stacked_views(net, b, second, masked)
    clean = z[:-1] if masked else z
    ces = [torch.nn.functional.cross_entropy(zi.float(), b["labels"]) for zi in clean]
    loss = sum(ces) / len(clean)
    if second is not None:
        loss = loss + lib.sar.consistency(z[0], z[1])
    if masked:
        keep = lib.attendout.keep_reward(net, z[0].size(0))
        loss = loss + lib.sar.consistency(z[0], z[-1]) + net.cfg.gnet_tau ** 2 * keep
    return loss


def sar_losses(lib=THIS):
    """The losses of sections 5-6 from lib: plain cross-entropy, SAR (shift 1, alpha 1), R-Drop
    (alpha 1), AttendOut (its masked pass; a base checkout without sar.stacked_views: one pass under
    its budget)."""
    def ce(net, b):
        logits = net(b["input_ids"], b["attention_mask"], b["token_type_ids"])
        return torch.nn.functional.cross_entropy(logits.float(), b["labels"])
    # An older base checkout's API: sar_loss and rdrop_loss in place of stacked_views.
    if not hasattr(lib.sar, "stacked_views"):
        return {"plain CE": ce,
                "SAR (shift 1)": lambda net, b: lib.sar.sar_loss(net, b, 1.0, 1)[0],
                "R-Drop": lambda net, b: lib.sar.rdrop_loss(net, b, 1.0)[0],
                "AttendOut": ce}
    return {"plain CE": ce,
            "SAR (shift 1)": lambda net, b: views_loss(lib, net, b, second=1),
            "R-Drop": lambda net, b: views_loss(lib, net, b, second=0),
            "AttendOut": lambda net, b: views_loss(lib, net, b, masked=True)}


def step_fn(net, batch, loss_fn, device, lib=THIS):
    return lambda: train_step(net, batch, loss_fn, device, lib)


def seed_all(seed=0):
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# -----------------------------------------------------------------------------
# Profiling (--profile): where our side spends its time

def profile_step(fn, label, top=15):
    """Run fn twice (one warm-up) under torch.profiler; print the top ops by self time."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    print(f"\n<details><summary>profile: {label}</summary>\n\n```")
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top))
    print("```\n</details>\n")


# -----------------------------------------------------------------------------
# Section 1: dense encoder vs transformers.RobertaModel, the same weights

def print_race(title, t, figs, ours, B, n, args, ours_fn):
    """The table of a race against a reference: ms/step, tokens/s and MFU (CUDA) per side, then the
    ratios."""
    flops = train_flops(ours.cfg, layer_params(ours), B, n)
    rows = [[k, ms(v), *rate_cells(flops, B * n, med(v), args)] for k, v in t.items()]
    rate = "MFU" if args.device == "cuda" else "achieved"
    print(title + "\n")
    print(table(["model", "ms/step (median)", "tokens/s", rate], rows))
    print("\n" + "\n".join(f["line"] for f in figs) + "\n")
    if args.profile:
        profile_step(ours_fn, "ours: " + title)


def bench_dense(S, args):
    from transformers import RobertaConfig, RobertaModel
    from transformers.utils.logging import disable_progress_bar
    B, n = S["minilm_batch"]
    dev = args.device
    seed_all()
    theirs = {}
    for impl in ("eager", "sdpa"):         # one config object each: the model keeps a reference
        hf_cfg = RobertaConfig(vocab_size=30522, hidden_size=384,
                               num_hidden_layers=S["minilm_layers"], num_attention_heads=12,
                               intermediate_size=1536, max_position_embeddings=514,
                               type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5,
                               hidden_act="gelu", hidden_dropout_prob=0.1,
                               attention_probs_dropout_prob=0.1)
        hf_cfg._attn_implementation = impl
        seed_all()
        theirs[impl] = RobertaModel(hf_cfg, add_pooling_layer=False)
    theirs["sdpa"].load_state_dict(theirs["eager"].state_dict())
    # Ours from theirs, through the real checkpoint path.
    with tempfile.TemporaryDirectory() as tmp:
        disable_progress_bar()
        theirs["eager"].save_pretrained(tmp)
        mine = {"ours" + lib.tag: lib.model.load_pretrained(tmp, attention="dense",
                                                             attn_dropout="standard",
                                                             attn_dropout_p=0.1,
                                                             hidden_dropout_p=0.1)
                for lib in args.libs}
    ours = mine["ours"]
    batch = random_batch(B, n, 30522, dev)
    models = {**mine, **{f"hf {k}": m for k, m in theirs.items()}}
    for m in models.values():
        m.to(dev).eval()
    # The same weights give the same outputs in eval: the largest difference from either of theirs.
    hf_models = [m for k, m in models.items() if k.startswith("hf")]
    with torch.no_grad():
        h0 = ours.encode(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        diff = max((h0 - m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                    .last_hidden_state).abs().max().item() for m in hf_models)
    for m in models.values():
        m.train()
    fns = {k: step_fn(m, batch, ours_hidden_loss, dev, lib)
           for lib, (k, m) in zip(args.libs, mine.items())}
    fns.update({k: step_fn(m, batch, hf_hidden_loss, dev)
                for k, m in models.items() if k.startswith("hf")})
    t = time_alternately(fns, args.rounds, args.warmup, dev, args.clock)
    ref = min(("hf eager", "hf sdpa"), key=lambda k: med(t[k]))
    figs = [figure(f"dense train step ours / {ref}", t["ours"], t[ref], need=1.0, target=0.85),
            *base_figures(t, ["ours"])]
    title = (f"## 1. Dense train step vs RobertaModel (MiniLM {S['minilm_layers']}x384, {B} x {n}, "
             f"dropout 0.1, same weights; eval max |diff| {diff:.1e})")
    print_race(title, t, figs, ours, B, n, args, fns["ours"])
    return dict(times=t, reference=ref, max_abs_diff_eval=diff, figures=figs)


# -----------------------------------------------------------------------------
# Section 2: block-sparse encoder vs transformers.BigBirdModel(attention_type="block_sparse")

def bench_bigbird(S, args):
    from transformers import BigBirdConfig, BigBirdModel
    bb = S["bigbird"]
    n, B, b, dev = bb["n"], bb["batch"], bb["block"], args.device
    seed_all()
    hf_cfg = BigBirdConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=1024,
                           max_position_embeddings=n, attention_type="block_sparse",
                           block_size=b, num_random_blocks=3, hidden_act="gelu",
                           hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    theirs = BigBirdModel(hf_cfg, add_pooling_layer=False)
    # ours: same sizes and weights; BigBird is BERT-style (positions 0..n-1, two token types, eps
    # 1e-12), and its weights carry BERT's names (family "bert"). Its globals are the first and last
    # block; ours are the first 2 blocks (same count, g = 2b).
    batch = random_batch(B, n, 30522, dev, seed=1)
    fns = {}
    for lib in args.libs:                              # ours (and with --base, the base's)
        cfg = long_config("sparse", n, lib, max_positions=n, type_vocab_size=2, pad_id=0,
                          layer_norm_eps=1e-12, position_style="bert", block_size=b,
                          num_global=bb["num_global"], attn_dropout="none", hidden_dropout_p=0.1,
                          family="bert")
        state = lib.model.convert_hf_state(theirs.state_dict(), cfg, "bigbird")
        net = lib.model.build_model(cfg, state, "bigbird")
        if not lib.tag:                                # the FLOPs and the profile: this checkout's
            ours = net
        fns["ours sparse" + lib.tag] = step_fn(net.to(dev).train(), batch, ours_hidden_loss, dev,
                                               lib)
    theirs.to(dev).train()
    fns["hf bigbird"] = step_fn(theirs, batch, hf_hidden_loss, dev)
    t = time_alternately(fns, args.rounds, args.warmup, dev, args.clock)
    figs = [figure("sparse train step ours / BigBird", t["ours sparse"], t["hf bigbird"], need=0.7),
            *base_figures(t, ["ours sparse"])]
    title = (f"## 2. Block-sparse train step vs BigBird (2x256, 4 heads, n {n}, batch {B}, "
             f"block {b}, 3 random, {bb['num_global']} global, no attention dropout)")
    print_race(title, t, figs, ours, B, n, args, fns["ours sparse"])
    return dict(times=t, figures=figs)


# -----------------------------------------------------------------------------
# Section 3: scaling. Each (topology, n) runs in a fresh process so that its peak memory is its
# own.

def estimate_bytes(kind, n, batch=1, d=256, heads=4, layers=2, ffn=1024, ctx=512):
    """Rough peak of one train step in fp32 (what autograd keeps): ~(10 d + 3 ffn) floats per token
    and layer, plus the sparse kernel's B H n ctx scores x4 (scores, probs, masks, grads). Dense
    through fused SDPA (no dropout, no mask) keeps no n x n matrix."""
    per_token = layers * (10 * d + 3 * ffn) * 4
    attn = 0 if kind == "dense" else layers * batch * heads * n * ctx * 4 * 4
    return batch * n * per_token + attn


def peak_tensor_bytes(fn):
    """CPU: the peak of live tensor bytes while fn() runs, over its baseline, from the profiler's
    allocation records (each op's own allocations and every free, in time order). Unlike the
    process's peak RSS this does not depend on the allocator or the machine: the same code gives the
    same figure on any machine."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def long_step(spec, n):
    """(Config, model, train-step function) of a scaling point: long_config of spec["kind"] at
    length n, no attention dropout, hidden dropout 0.1, a random batch of spec["batch"].
    "sparse-dropout": standard attention dropout 0.1, so the sparse kernel runs its gather path
    (FlexAttention has nothing to drop with). spec["root"]: build it from that checkout's modules
    (--base), else from ours."""
    seed_all()
    lib = load_checkout(spec["root"]) if spec.get("root") else THIS
    attention, _, dropout = spec["kind"].partition("-")
    method = "standard" if dropout else "none"
    cfg = long_config(attention, n, lib, attn_dropout=method, hidden_dropout_p=0.1)
    net = lib.model.Model(cfg).to(spec["device"]).train()
    batch = random_batch(spec["batch"], n, cfg.vocab_size, spec["device"])
    return cfg, net, step_fn(net, batch, ours_hidden_loss, spec["device"], lib)


def child_measure(spec):
    """In the child: build, warm-up + timed steps, the peak of live tensors over a step. Returns a
    dict. CPU: peak_tensor_bytes of one more step; CUDA: torch.cuda.max_memory_allocated over the
    steps, less what was allocated after the build."""
    dev = spec["device"]
    cfg, model, fn = long_step(spec, spec["n"])
    if dev == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    steps = spec["steps"] if spec["n"] <= 8192 else 1    # 16k: one warm-up, one timed (long on CPU)
    t = time_alternately({"step": fn}, steps, 1, dev, spec["clock"])["step"]
    if dev == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_tensor_bytes(fn)
    flops = train_flops(cfg, layer_params(model), spec["batch"], spec["n"])
    return dict(spec, times=t, peak_bytes=peak, flops=flops)


def child_alternate(spec):
    """In the child: one model per length in spec["ns"] (same kind), train steps timed
    alternately (2k, 8k, 2k, 8k, ...), so that both lengths see the same machine. Returns
    {"times": {n: [s]}}."""
    fns = {str(n): long_step(spec, n)[2] for n in spec["ns"]}
    times = time_alternately(fns, spec["steps"], 1, spec["device"], spec["clock"])
    return dict(spec, times=times)


def run_child(spec):
    """Run `python research/bench.py --_child SPEC` in a fresh process; returns its dict (or one
    with "error": the last line of its stderr)."""
    here = os.path.abspath(__file__)
    cmd = [sys.executable, here, "--_child", json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(here))
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines() or ["exit %d" % r.returncode]
        return dict(spec, error=lines[-1])
    return json.loads(r.stdout.strip().splitlines()[-1])


def peak_memory_child(kind, n, args, batch=1, steps=2, lib=THIS):
    """One scaling point (time and peak memory) in a fresh process; returns its dict."""
    return run_child(dict(kind=kind, n=n, batch=batch, steps=steps, device=args.device,
                          threads=args.threads, clock=args.clock, root=lib.root))


def scaling_points(kinds, ns, args, steps):
    """{kind: {n: result}} (with --base also "kind (base)"); points whose estimated peak exceeds
    MEMORY_LIMIT are skipped (CPU)."""
    res = {}
    for kind in kinds:
        for lib in args.libs:
            for n in ns:
                est, at = estimate_bytes(kind, n), res.setdefault(kind + lib.tag, {})
                if args.device == "cpu" and est > MEMORY_LIMIT:
                    at[n] = dict(kind=kind, n=n, skipped="memory", estimate_bytes=est)
                    continue
                at[n] = peak_memory_child(kind, n, args, steps=steps, lib=lib)
                print(f"  measured {kind}{lib.tag} n={n}", file=sys.stderr, flush=True)
    return res


def scaling_rows(res, args):
    rows = []
    for kind, by_n in res.items():
        for n, r in by_n.items():
            if "skipped" in r:
                estimate = f"est. {r['estimate_bytes'] / 2**20:,.0f}"
                rows.append([kind, n, "skipped (memory)", estimate, "", ""])
            elif "error" in r:
                rows.append([kind, n, "error", r["error"][:60], "", ""])
            else:
                rows.append([kind, n, ms(r["times"]), f"{r['peak_bytes'] / 2**20:,.1f}",
                             *rate_cells(r["flops"], n * r["batch"], med(r["times"]), args)])
    return rows


def bench_scaling(S, args):
    ns = S["scaling_ns"]
    res = scaling_points(("dense", "sparse", "hst"), ns, args, S["scaling_steps"])
    print("## 3. Scaling: train step and peak memory (2x256, 4 heads, block 64, w 1, g 128, r 3, "
          "batch 1, attention dropout none, hidden dropout 0.1; one fresh process per point)\n")
    rate = "MFU" if args.device == "cuda" else "achieved"
    print(table(["attention", "n", "ms/step (median)", "peak of live tensors, MiB", "tokens/s",
                 rate], scaling_rows(res, args)))
    figs = []
    # Memory at the longest n: the sparse kernel against dense fused attention, both O(n): fused
    # SDPA keeps no scores, the gather kernel keeps n x ctx of them (ctx = 448 keys here); with
    # --base, each kind's memory after / before the change.
    top = ns[-1]
    pairs = [("sparse", "dense", "both O(n); sparse keeps its n x ctx scores for the backward")]
    pairs += [(k, k + " (base)", "after / before; < 1: less memory")
              for k in ("dense", "sparse", "hst") if k + " (base)" in res]
    for a, b, expect in pairs:
        pts = [res[k].get(top, {}) for k in (a, b)]
        if all("peak_bytes" in p for p in pts):
            ratio = pts[0]["peak_bytes"] / pts[1]["peak_bytes"]
            name = f"{a} / {b} peak of live tensors at n={top}"
            figs.append(dict(name=name, ratio=ratio, need=None, status="info",
                             line=f"{name}: ratio {ratio:.4f} ({expect}): info"))
            mib = [p["peak_bytes"] / 2**20 for p in pts]
            print(f"\n{figs[-1]['line']} ({mib[0]:,.1f} vs {mib[1]:,.1f} MiB)")
    # The linearity figure: the two lengths timed alternately in one fresh process (args.rounds
    # each), as every other CPU figure here; the table's per-process medians above are for reading,
    # not for the ratio.
    lo, hi = (2048, 8192) if 8192 in ns else (ns[0], ns[-1])
    alt = run_child(dict(kind="sparse", ns=[lo, hi], batch=1, steps=args.rounds,
                         device=args.device, threads=args.threads, clock=args.clock, root=None))
    if "error" in alt:
        print(f"\nsparse time({hi}) / time({lo}): error: {alt['error']}\n")
    else:
        need = round(1.15 * hi / lo, 2)          # linear in n, with 15% slack (8k / 2k: 4.6)
        t_lo, t_hi = alt["times"][str(lo)], alt["times"][str(hi)]
        figs.append(figure(f"sparse time({hi}) / time({lo}), alternated", t_hi, t_lo, need=need))
        print(f"\nsparse n={lo} vs n={hi}, alternated in one process: {ms(t_lo)} vs {ms(t_hi)} "
              f"ms/step")
        print(figs[-1]["line"] + "\n")
    if args.plot:
        plot_scaling(res, args.plot, args.device)
    points = {k: {str(n): r for n, r in v.items()} for k, v in res.items()}
    return dict(points=points, alternated=alt, figures=figs)


def plot_scaling(res, path, device):
    """Time and peak memory against sequence length, dense / sparse / HST, log-log (optional
    matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, by_n in res.items():
        ns = [n for n, r in by_n.items() if "times" in r]
        ax_t.plot(ns, [med(by_n[n]["times"]) for n in ns], marker="o", label=kind)
        ax_m.plot(ns, [by_n[n]["peak_bytes"] / 2**20 for n in ns], marker="o", label=kind)
    memory = "peak of live tensors (MiB)" if device == "cpu" else "peak memory allocated (MiB)"
    for ax, label in ((ax_t, "train step (s)"), (ax_m, memory)):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"2 layers x 256, 4 heads, block 64, batch 1, {device} "
                 f"(python research/bench.py --only scaling)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# -----------------------------------------------------------------------------
# Section 4: HST vs block-sparse on the same topology

def bench_hst(S, args):
    n, dev = S["hst_n"], args.device
    batch = random_batch(1, n, 30522, dev, seed=2)
    fns = {}
    for lib in args.libs:
        models = {}
        for kind in ("hst", "sparse"):                 # attention dropout 0.1 (Config's)
            seed_all()
            models[kind] = lib.model.Model(long_config(kind, n, lib)).to(dev).train()
        # HST: the sparse model's weights, + its rep_embedding
        models["hst"].load_state_dict(models["sparse"].state_dict(), strict=False)
        fns.update({k + lib.tag: step_fn(m, batch, ours_hidden_loss, dev, lib)
                    for k, m in models.items()})
    t = time_alternately(fns, args.rounds, args.warmup, dev, args.clock)
    figs = [figure("HST / sparse train step", t["hst"], t["sparse"], need=1.1),
            *base_figures(t, ["hst", "sparse"])]
    print(f"## 4. HST vs block-sparse train step (2x256, 4 heads, n {n}, batch 1, block 64, w 1, "
          f"g 128, r 3, attention dropout 0.1)\n")
    print(table(["attention", "ms/step (median)"], [[k, ms(v)] for k, v in t.items()]))
    print("\n" + "\n".join(f["line"] for f in figs) + "\n")
    if args.profile:
        profile_step(fns["hst"], "HST train step")
    return dict(times=t, figures=figs)


# -----------------------------------------------------------------------------
# Section 5: AttendOut vs standard dropout

def bench_attendout(S, args):
    """AttendOut's step (a clean and a masked pass, one stacked batch) against R-Drop's (two passes
    with standard dropout) and a plain step; inference (the plain model) against standard
    dropout's."""
    B, n = S["minilm_batch"]
    dev = args.device
    batch = random_batch(B, n, 30522, dev, num_labels=2, seed=3)
    models, train = {}, {}
    # Ours, and with --base the base's, with the same backbone weights.
    for lib in args.libs:
        losses = sar_losses(lib)
        for method in ("attendout", "standard"):
            seed_all()
            cfg = minilm_config(lib, attn_dropout=method, num_layers=S["minilm_layers"],
                                num_labels=2)
            models[method + lib.tag] = lib.model.Model(cfg).to(dev).train()
        # AttendOut: the standard model's weights, + the G-Nets
        models["attendout" + lib.tag].load_state_dict(models["standard" + lib.tag].state_dict(),
                                                      strict=False)
        std, ao = models["standard" + lib.tag], models["attendout" + lib.tag]
        train["standard" + lib.tag] = step_fn(std, batch, losses["plain CE"], dev, lib)
        train["R-Drop" + lib.tag] = step_fn(std, batch, losses["R-Drop"], dev, lib)
        train["attendout" + lib.tag] = step_fn(ao, batch, losses["AttendOut"], dev, lib)
    t_train = time_alternately(train, args.rounds, args.warmup, dev, args.clock)

    def infer(m):
        def run():
            with torch.no_grad(), autocast(dev):
                m.encode(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        return run
    for m in models.values():
        m.eval()
    # a forward is ~5x shorter than a train step and as noisy in absolute terms: 4x the rounds
    infers = {k: infer(m) for k, m in models.items()}
    t_inf = time_alternately(infers, 4 * args.rounds, args.warmup, dev, args.clock)
    figs = [figure("AttendOut / R-Drop train step", t_train["attendout"], t_train["R-Drop"],
                   need=1.15),
            figure("AttendOut / standard train step", t_train["attendout"], t_train["standard"],
                   expect="expect ~2: two passes"),
            figure("AttendOut / standard inference", t_inf["attendout"], t_inf["standard"],
                   need=1.1)]
    if args.base:                                        # after / before
        figs += base_figures(t_train, ["attendout", "standard", "R-Drop"])
    print(f"## 5. AttendOut vs R-Drop and standard dropout (MiniLM {S['minilm_layers']}x384, "
          f"dense, {B} x {n})\n")
    print(table(["step", "train ms/step"], [[k, ms(v)] for k, v in t_train.items()]))
    print()
    print(table(["model", "inference ms/forward"], [[k, ms(v)] for k, v in t_inf.items()]))
    print("\n" + "\n".join(f["line"] for f in figs) + "\n")
    if args.profile:
        models["attendout"].train()
        profile_step(train["attendout"], "AttendOut train step")
    return dict(train_times=t_train, inference_times=t_inf, figures=figs)


# -----------------------------------------------------------------------------
# Section 6: SAR and R-Drop vs a plain cross-entropy step

def bench_sar(S, args):
    n, B, dev = S["sar_n"], S["sar_batch"], args.device
    batch = random_batch(B, n, 30522, dev, num_labels=2, seed=4)
    fns = {}
    for lib in args.libs:
        seed_all()
        cfg = long_config("sparse", n + 64, lib, num_labels=2)     # + 64: room for the shift
        net = lib.model.Model(cfg).to(dev).train()
        fns.update({k + lib.tag: step_fn(net, batch, loss, dev, lib)
                    for k, loss in sar_losses(lib).items() if k != "AttendOut"})
    t = time_alternately(fns, args.rounds, args.warmup, dev, args.clock)
    figs = [figure("SAR / plain step", t["SAR (shift 1)"], t["plain CE"],
                   expect="expect ~2: two views"),
            figure("R-Drop / plain step", t["R-Drop"], t["plain CE"],
                   expect="expect ~2: two passes"),
            *base_figures(t, ["plain CE", "SAR (shift 1)", "R-Drop"])]
    print(f"## 6. SAR and R-Drop step cost (sparse 2x256, n {n}, batch {B}, block 64, w 1, g 128, "
          f"r 3)\n")
    print(table(["loss", "ms/step (median)"], [[k, ms(v)] for k, v in t.items()]))
    print("\n" + "\n".join(f["line"] for f in figs) + "\n")
    return dict(times=t, figures=figs)


# -----------------------------------------------------------------------------
# Section 7 (CUDA): tokens/s, sparse vs dense SDPA, bf16

def bench_throughput(S, args, scaling=None):
    if args.device != "cuda":
        print("## 7. Throughput: CUDA only (run with --device cuda); skipped\n")
        return dict(skipped="cpu")
    ns = S["throughput_ns"]
    have = (scaling or {}).get("points", {})
    res = {}
    # on CUDA "sparse" and "hst" run through FlexAttention (nothing to drop), "sparse-dropout"
    # through the gather kernel (sparse.py's reference, the path every run with attention dropout
    # takes)
    for kind in ("dense", "sparse", "sparse-dropout", "hst"):
        for n in ns:                         # reuse section 3's points when it ran in this process
            r = have.get(kind, {}).get(str(n))
            if not r:
                r = peak_memory_child(kind, n, args, steps=S["scaling_steps"])
            res.setdefault(kind, {})[n] = r
    print(f"## 7. Throughput, bf16 autocast: sparse (FlexAttention and gather kernel) and HST vs "
          f"dense SDPA (peak {args.peak_tflops:g} TFLOP/s)\n")
    print(table(["attention", "n", "ms/step (median)", "peak MiB", "tokens/s", "MFU"],
                scaling_rows(res, args)))
    figs = []
    for n in ns:
        for kind in ("sparse", "sparse-dropout", "hst"):
            if "times" in res["dense"][n] and "times" in res[kind][n]:
                figs.append(figure(f"dense / {kind} time at n={n} (speed-up)",
                                   res["dense"][n]["times"], res[kind][n]["times"],
                                   expect="> 1: faster than dense"))
    print("\n" + "\n".join(f["line"] for f in figs) + "\n")
    points = {k: {str(n): r for n, r in v.items()} for k, v in res.items()}
    return dict(points=points, figures=figs)


# -----------------------------------------------------------------------------
# Driver

def parse_only(s):
    if not s:
        return list(SECTIONS)
    out = []
    for item in s.split(","):
        item = item.strip()
        numbered = item.isdigit() and 1 <= int(item) <= len(SECTIONS)
        name = SECTIONS[int(item) - 1] if numbered else item
        if name not in SECTIONS:
            fail(f"--only: unknown section {item!r}: choose from {', '.join(SECTIONS)} or "
                 f"1-{len(SECTIONS)}")
        out.append(name)
    return out


def main(argv=None):
    p = ArgumentParser(
        description="Time attnreg against HuggingFace references (see the docstring).")
    p.add_argument("--quick", action="store_true",
                   help="small sizes, few rounds: under a minute on 2 CPU cores")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--only", default="",
                   help=f"comma list of sections: {','.join(SECTIONS)} (or 1-7)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per side (default 5; --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="device peak for MFU (989: H200 bf16 dense)")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler top ops of our side")
    p.add_argument("--json", default="bench.json", help="where to write the results")
    p.add_argument("--plot", default="", help="also draw the scaling section to this PNG "
                   "(e.g. docs/results/scaling.png)")
    p.add_argument("--base", default="", help="another checkout's root (e.g. /tmp/base): its "
                   "models side by side with ours in sections 1-6, with after / before ratios")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="wall time, or cpu: this process's CPU time (CPU only; with --threads 1 "
                   "less moved by other jobs)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)  # internal: one scaling point
    args = p.parse_args(argv)
    check_args(args)
    if args._child:
        spec = json.loads(args._child)
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        print(json.dumps(child_alternate(spec) if "ns" in spec else child_measure(spec)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else 1
    # Whose models each section builds: ours, and with --base the base checkout's.
    args.libs = [THIS] + ([load_checkout(args.base)] if args.base else [])
    S = sizes(args.quick)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    meta = dict(device=args.device, torch=torch.__version__,
                transformers=importlib.metadata.version("transformers"),
                threads=torch.get_num_threads(), cpu_count=os.cpu_count(), quick=args.quick,
                rounds=args.rounds, warmup=args.warmup, peak_tflops=args.peak_tflops,
                python=platform.python_version(), gpu=gpu, clock=args.clock,
                base=args.libs[-1].root, loadavg=os.getloadavg()[0],
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    head = f"# attnreg bench ({'quick' if args.quick else 'full'}; {args.device}"
    if args.device == "cuda":
        head += f", {meta['gpu']}, peak {args.peak_tflops:g} TFLOP/s bf16"
    head += (f"; torch {meta['torch']}, transformers {meta['transformers']}; "
             f"{meta['threads']} threads; {args.rounds} rounds after {args.warmup} warm-up, "
             f"medians of {args.clock} time")
    if args.base:
        head += f"; base {meta['base']}"
    print(head + ")\n")
    fns = dict(dense=bench_dense, bigbird=bench_bigbird, scaling=bench_scaling, hst=bench_hst,
               attendout=bench_attendout, sar=bench_sar)
    results, t0 = {}, time.perf_counter()
    with one_line_errors():
        for name in parse_only(args.only):
            if name == "throughput":
                results[name] = bench_throughput(S, args, results.get("scaling"))
            else:
                results[name] = fns[name](S, args)
        figs = [f for r in results.values() for f in r.get("figures", [])]
        print("## Summary\n")
        print("\n".join(f"- {f['line']}" for f in figs))
        print(f"\n(total {time.perf_counter() - t0:.0f} s, load average "
              f"{os.getloadavg()[0]:.2f} at the end)")
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, sizes=S, results=results), f, indent=1, default=str)
        print(f"wrote {args.json}")


def check_args(args):
    """Flags that mean nothing, and outputs that could not be written after a long run: refused up
    front."""
    for name, low in (("rounds", 1), ("warmup", 0), ("threads", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            fail(f"--{name} {getattr(args, name)}: must be >= {low}")
    if not args.peak_tflops > 0:
        fail(f"--peak-tflops {args.peak_tflops}: must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device visible to torch")
    if args.device == "cuda" and args.clock == "cpu":
        fail("--clock cpu: CPU time misses the GPU's work; use --clock wall with --device cuda")
    parse_only(args.only)
    for name in ("json", "plot"):
        path = getattr(args, name)
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        writable = os.path.isdir(folder) and os.access(folder, os.W_OK)
        if os.path.isdir(path) or not writable:
            fail(f"--{name} {path}: cannot write there (a folder, or no writable folder {folder})")


if __name__ == "__main__":
    main()
