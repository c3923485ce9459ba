"""research/gpu_check.py: the parts of research/gpu_check.sh, one command each, so that a part that
hangs or crashes is killed or reported alone, and the rest still run.

What it is: the proof that the GPU path works, for the day a GPU is lent (docs/results.md, "The
GPU check"). Each part runs one thing the first GPU user would meet and prints ONE line, "ok PART:
its figures"; a failed check raises, and gpu_check.sh prints FAIL with the part's last lines. With
--device cpu every part runs as a rehearsal on the CPU (the suite runs it: research/tests), where
the GPU's own figures (bf16 speed, MFU, CUDA against CPU) are not there to measure.

Run:  python research/gpu_check.py PART --device cuda --work DIR     # PART: one of PARTS
      bash research/gpu_check.sh [--cpu] [REPORT.md]                  # every part, in order
"""
import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import attendout  # noqa: E402
import data  # noqa: E402
import sparse  # noqa: E402
from model import Config, Model  # noqa: E402

# Each part's sizes on the GPU and, in the CPU's rehearsal, the smallest that still exercise it.
DEMO_STEPS = {"cuda": 200, "cpu": 8}
COMPILED_STEPS = {"cuda": 20, "cpu": 0}        # the CPU rehearsal traces; compiling takes minutes
FLEX_LENGTHS = {"cuda": [256, 1024, 320, 2048, 512, 768, 4096, 384, 1536, 640],
                "cpu": [8, 40, 12, 64, 160, 20, 28, 24, 36, 16]}


def run(cmd, **kw):
    """A command of this repository, its output kept; a non-zero exit is a failed check."""
    p = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
        raise SystemExit(f"exit {p.returncode}: {' '.join(cmd)}")
    return p.stdout


# -----------------------------------------------------------------------------
# tests: the suite's CUDA-only tests (skipped without a GPU) and the CPU-side tests that guard the
# CUDA path. On the CPU the CUDA-only tests all skip, which the rehearsal accepts.

def part_tests(device, work):
    files = ["tests/test_cuda.py"]
    if device.type == "cuda":
        files += ["tests/test_flex.py", "tests/test_precision.py", "tests/test_devices.py",
                  "tests/test_gpu_rehearsal.py"]
    out = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *files])
    summary = out.strip().splitlines()[-1]
    if device.type == "cuda" and "skipped" in summary:
        raise SystemExit(f"CUDA tests skipped on a GPU: {summary}")
    return summary


# -----------------------------------------------------------------------------
# flex: sparse.compile_flex (what HST runs through on CUDA) against the gather kernel at 10
# lengths, with the number of compiles (at most 3 wanted: torch gives up compiling after 8). On the
# GPU the backend is inductor; on the CPU one that runs each graph as traced, counting alike.

def part_flex(device, work):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
    counter = CompileCounterWithBackend("inductor") if device.type == "cuda" else CompileCounter()
    torch._dynamo.reset()
    compiled = sparse.compile_flex(backend=counter)
    sparse.flex_functions = lambda dev: compiled        # in this process, on every device
    kw = dict(block_size=64 if device.type == "cuda" else 4, window=1, num_global=1, num_random=1)
    worst = 0.0
    t0 = time.time()
    for i, n in enumerate(FLEX_LENGTHS[device.type]):
        B = (1, 3, 2)[i % 3]
        L = n + n // kw["block_size"]
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(B, 4, L, 32, generator=g).to(device) for _ in range(3))
        am = torch.ones(B, n, dtype=torch.long, device=device)
        am[0, n - 3:] = 0
        outs = [sparse.hst_attention(q, k, v, am, generator=torch.Generator().manual_seed(i),
                                     flex=flex, **kw) for flex in (True, False)]
        worst = max(worst, (outs[0] - outs[1]).abs().max().item())
    lengths = len(FLEX_LENGTHS[device.type])
    figure = (f"{counter.frame_count} compiles over {lengths} lengths, max |flex - gather| "
              f"{worst:.1e}, {time.time() - t0:.1f} s")
    if counter.frame_count > 3 or worst > 2e-3:
        raise SystemExit(f"want <= 3 compiles and |flex - gather| <= 2e-3: {figure}")
    return figure


# -----------------------------------------------------------------------------
# bf16-row: a row whose every real key AttendOut masks keeps softmax(S) with bf16 logits, as in
# fp32 (methods.md §3.1): every masked logit drops by the same 10,000 only if the drop is exact.

def part_bf16_row(device, work):
    cfg = Config(hidden_size=16, num_heads=2, attn_dropout="attendout")
    layer = attendout.AttendOut(cfg).to(device)
    with torch.no_grad():                                 # G = a c^T < 0 for every pair: all masked
        layer.gnet.weight.zero_()
        layer.gnet.bias.copy_(torch.cat([torch.ones(16), -torch.ones(16)]))
    torch.manual_seed(0)
    x = torch.randn(1, 6, 16, device=device)
    S = (torch.randn(1, 2, 6, 6, device=device) * 3).to(torch.bfloat16)
    mask_fn = layer.logits_fn(x, masked=True)
    valid = torch.ones(1, 1, 6, 6, dtype=torch.bool, device=device)
    S_masked = mask_fn(S, valid, lambda a, c: a @ c.transpose(-1, -2))
    gap = (S_masked.float().softmax(-1) - S.float().softmax(-1)).abs().max().item()
    if layer.full_row_rate().item() != 1.0 or gap > 1e-2:
        raise SystemExit(f"a fully masked bf16 row moved by {gap:.3f} (want <= 1e-2)")
    return f"every row masked, softmax(S') - softmax(S) at most {gap:.1e} in bf16"


# -----------------------------------------------------------------------------
# demo: `python train.py` (ListOps, HST + SAR + AttendOut), cut to DEMO_STEPS, in this process so
# that the peak memory is read after it: examples/s, the median over its step lines. Every step is
# logged and ckpt_last.pt saved every 2 steps, as the resume part's run of the same flags needs.

def demo_flags(out, device):
    return ["--out", out, "--overwrite", "--max-steps", str(DEMO_STEPS[device.type]),
            "--device", str(device), "--log-every", "1", "--save-every", "2"]


def part_demo(device, work):
    import train
    out = os.path.join(work, "demo")
    steps = DEMO_STEPS[device.type]
    train.main(demo_flags(out, device))
    with open(os.path.join(out, "log.jsonl")) as f:
        rates = sorted(r["examples_per_s"] for r in map(json.loads, f) if "examples_per_s" in r)
    with open(os.path.join(out, "final.json")) as f:
        final = json.load(f)
    if device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated() / 2 ** 20:.0f} MiB peak GPU memory"
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB peak RSS"
    rate = f"{rates[len(rates) // 2]:.0f} examples/s" if rates else "examples/s not logged"
    return (f"{steps} steps, {rate}, {peak}, dev acc {100 * final['best_dev']:.1f}%, "
            f"{final['wall_time_s']:.0f} s")


# -----------------------------------------------------------------------------
# compile: a training forward of a compiled HST model is one graph, flex inside it (no break per
# flex call), then `train.py --compile` with HST for COMPILED_STEPS (the GPU only: compiling for the
# CPU takes minutes). The CPU rehearsal forces the CUDA branch of sparse.flex_functions.

def part_compile(device, work):
    import torch._dynamo

    import model as model_py
    real_hst = model_py.hst_attention
    if device.type == "cpu":
        on_cuda = sparse.flex_functions
        sparse.flex_functions = lambda dev: on_cuda(torch.device("cuda"))
        model_py.hst_attention = lambda *a, **kw: real_hst(*a, **{**kw, "flex": True})
    cfg = Config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                 pad_id=1, attention="hst", block_size=8, num_random=1, attn_dropout="none",
                 num_labels=2)
    torch.manual_seed(0)
    net = Model(cfg).to(device).train()
    ids = torch.randint(4, 64, (2, 64), device=device)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(net)(ids, torch.ones_like(ids))
    model_py.hst_attention = real_hst
    figure = f"compiled HST forward: {explained.graph_count} graph(s), " \
             f"{explained.graph_break_count} graph break(s)"
    if explained.graph_break_count or explained.graph_count != 1:
        raise SystemExit(f"{figure}, want 1 and 0: {explained.break_reasons}")
    steps = COMPILED_STEPS[device.type]
    if steps:
        out = os.path.join(work, "compiled")
        t0 = time.time()
        run(["train.py", "--out", out, "--overwrite", "--compile", "--max-steps", str(steps),
             "--device", str(device), "--log-every", "5"])
        with open(os.path.join(out, "final.json")) as f:
            final = json.load(f)
        figure += f"; train.py --compile: {steps} steps in {time.time() - t0:.0f} s " \
                  f"(compile included), dev acc {100 * final['best_dev']:.1f}%"
    return figure


# -----------------------------------------------------------------------------
# resume: the demo's run again, stopped by Ctrl-C halfway and resumed, against the demo's own
# uninterrupted run. On the CPU the weights are bit-identical (tests/test_reliability.py); on CUDA
# kernels that add in a varying order (index_select's backward, atomics) make them differ by
# rounding, so there the check is the step reached and the weights' largest relative difference.

def part_resume(device, work):
    steps = DEMO_STEPS[device.type]
    ref = os.path.join(work, "demo")
    out = os.path.join(work, "resume")
    p = subprocess.Popen([sys.executable, "train.py", *demo_flags(out, device)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = os.path.join(out, "log.jsonl")
    while p.poll() is None:                               # Ctrl-C once half the steps are logged
        logged = open(log).read().count('"step"') if os.path.exists(log) else 0
        if logged >= steps // 2:
            p.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    p.wait()
    stopped = torch.load(os.path.join(out, "ckpt_last.pt"), weights_only=True)
    stopped = stopped["train_state"]["step"]
    if p.returncode != 130 or stopped >= steps:
        raise SystemExit(f"Ctrl-C did not stop the run halfway: exit {p.returncode}, "
                         f"step {stopped}")
    run(["train.py", "--resume", "--out", out])
    a, b = (torch.load(os.path.join(d, "ckpt_last.pt"), weights_only=True) for d in (ref, out))
    if a["train_state"]["step"] != b["train_state"]["step"]:
        raise SystemExit("the resumed run ended at another step")
    wa, wb = a["model"], b["model"]
    diff = max(((wa[k].float() - wb[k].float()).norm() / wa[k].float().norm().clamp(min=1e-12))
               .item() for k in wa)
    if device.type == "cpu" and diff != 0.0:
        raise SystemExit(f"resume on the CPU is not bit-identical: relative difference {diff:.1e}")
    if diff > 1e-2:
        raise SystemExit(f"the resumed weights differ by {diff:.1e} (relative) from the run's")
    return (f"Ctrl-C at step {stopped} of {steps}, resumed to the end: weights' largest "
            f"relative difference from the uninterrupted run {diff:.1e}")


# -----------------------------------------------------------------------------
# predict: the demo's best checkpoint on its dev file. Its accuracy must be the one evaluation gave
# that checkpoint (final.json's best_dev: the same batches, the same device); on a GPU, its labels
# and probabilities are also compared with the CPU's (bf16 there, fp32 here).

def predict_file(ckpt, dev, where, work):
    out = os.path.join(work, f"predict_{where.replace(':', '_')}.jsonl")
    printed = run(["model.py", "predict", ckpt, dev, "--out", out, "--device", where])
    acc = float(re.search(r"acc ([0-9.]+)%", printed).group(1))
    with open(out) as f:
        return acc, [json.loads(line) for line in f]


def part_predict(device, work):
    ckpt = os.path.join(work, "demo", "ckpt_best.pt")
    dev = os.path.join(ROOT, "data", "listops-demo", "basic_val.tsv")    # the demo's dev file
    with open(os.path.join(work, "demo", "final.json")) as f:
        best = 100 * json.load(f)["best_dev"]
    acc, here = predict_file(ckpt, dev, str(device), work)
    figure = f"{len(here)} dev lines on {device}: acc {acc:.1f}%, evaluation's {best:.1f}%"
    if abs(acc - best) > (0.05 if device.type == "cpu" else 0.5):
        raise SystemExit(f"predict does not score as evaluation did: {figure}")
    if device.type == "cpu":
        return figure
    _, cpu = predict_file(ckpt, dev, "cpu", work)
    agree = sum(a["label"] == b["label"] for a, b in zip(here, cpu)) / len(cpu)
    gap = max(abs(a["probs"][name] - p)
              for a, b in zip(here, cpu) for name, p in b["probs"].items())
    figure += f"; against the CPU: {agree:.1%} of labels agree, probabilities within {gap:.1e}"
    if agree < 0.95 or gap > 0.1:
        raise SystemExit(f"{device} and the CPU disagree: {figure}")
    return figure


# -----------------------------------------------------------------------------
# bench: research/bench.py's throughput section in bf16 (tokens/s, MFU; dense SDPA, sparse and HST
# at 4k and 16k), its JSON in the work folder. The CPU has none of these figures to give.

def part_bench(device, work):
    if device.type != "cuda":
        return "the GPU's own figures (MFU, sparse against dense at 16k): not measured on a CPU"
    path = os.path.join(work, "bench_cuda.json")
    out = run(["research/bench.py", "--device", "cuda", "--only", "throughput", "--json", path])
    lines = [line for line in out.splitlines() if re.search(r"MFU|16k|16,384|16384", line)]
    return " | ".join(line.strip() for line in lines[:6]) or f"see {path}"


PARTS = {"tests": part_tests, "flex": part_flex, "bf16-row": part_bf16_row, "demo": part_demo,
         "compile": part_compile, "resume": part_resume, "predict": part_predict,
         "bench": part_bench}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=PARTS)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--work", required=True,
                   help="a folder for the parts' runs (the demo's, which predict reads)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        data.fail("--device cuda: no CUDA device here (rehearse with --device cpu)")
    os.makedirs(a.work, exist_ok=True)
    print(f"ok {a.part}: {PARTS[a.part](torch.device(a.device), a.work)}", flush=True)


if __name__ == "__main__":
    main()
