"""Tests that catch implementations which look right but are not the methods (methods.md §2, §3).

Each test names the wrong implementation it is there to catch:
  - the backbone receiving AttendOut's reversed gradient through the mask (only the G-Net may);
  - any attention dropout, LayerDrop or G-Net running in eval;
  - LayerDrop, Attn.LayerDrop or scheduled dropout doing nothing when switched on by train.py's flags;
  - a sparse kernel that builds an n x n tensor by any route (matmul, @, einsum, fused attention);
  - SAR / R-Drop / AttendOut views sharing random blocks; representatives that average padding;
  - a ListOps generator with other distributions than LRA's; --clip ignored.
Run: python -m pytest tests/test_fidelity.py -q
"""
import collections
import json
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attendout
import data
import model as M
import sar
import sparse
import train
from helpers import train_args

# a tiny model from scratch, dense and without SAR (train.py's defaults are the demo's: HST, AttendOut, SAR)
TINY = ["--init", "scratch", "--layers", "2", "--hidden", "32", "--heads", "2", "--ffn", "64", "--attention", "dense",
        "--sar", "0", "--device", "cpu"]


def tiny_config(**kw):
    base = dict(vocab_size=60, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_positions=64,
                num_labels=3, pad_id=1, block_size=4, num_global=1)
    base.update(kw)
    return M.Config(**base)


def batch(B=3, L=14, seed=0, vocab=60):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, L), generator=g)
    mask = torch.ones_like(ids)
    mask[1, L - 5:] = 0
    ids[1, L - 5:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("listops"))
    data.write_listops(folder, 160, 16, 4, min_len=5, max_len=30, seed=0, max_depth=3, max_args=3)
    return folder


def run_train(argv):
    try:
        train.main(argv)
    except SystemExit as e:
        assert e.code in (0, None), f"train.py exited with {e.code}"


# -----------------------------------------------------------------------------
# AttendOut: the reversed gradient reaches the G-Net only

@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_backbone_gradient_is_the_true_gradient(attention):
    """AttendOut's loss (CE of the clean view + consistency with the masked view + tau^2 x kept pairs) with
    nothing random (hidden dropout 0, no random blocks) is a smooth function of the backbone weights between
    the hard mask's switches: autograd's gradient must equal a finite difference. A reversed straight-through
    gradient that also reached the backbone (e.g. a G-Net reading its input without detaching it) does not."""
    torch.manual_seed(0)
    net = M.Model(tiny_config(attn_dropout="attendout", hidden_dropout_p=0.0,
                              attention=attention)).double().train()
    ids, mask = batch()
    b = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2])}
    w = net.layers[0].attn.qkv.weight

    def loss():
        clean, masked = sar.stacked_views(net, b, masked=True)
        return (torch.nn.functional.cross_entropy(clean, b["labels"]) + sar.consistency(clean, masked)
                + net.cfg.gnet_tau ** 2 * attendout.keep_reward(net, ids.size(0)))

    loss().backward()
    assert 0 < attendout.mask_rates(net)[1].item() < 1       # layer 1's mask depends on w (through its input)
    direction = torch.randn_like(w)
    analytic = (w.grad * direction).sum().item()
    eps = 1e-6
    with torch.no_grad():
        w.add_(eps * direction)
        up = loss().item()
        w.sub_(2 * eps * direction)
        down = loss().item()
        w.add_(eps * direction)
    numeric = (up - down) / (2 * eps)
    assert abs(analytic) > 1e-6
    assert analytic == pytest.approx(numeric, rel=1e-4, abs=1e-9)
    # and the G-Net does get a gradient (the reversed one, tests/test_attendout.py)
    gnet = net.layers[1].attn.drop.gnet.weight
    assert gnet.grad is not None and gnet.grad.abs().sum().item() > 0


# -----------------------------------------------------------------------------
# Nothing random in eval

@pytest.mark.parametrize("method", [dict(attn_dropout="standard"), dict(attn_dropout="attendout"),
                                    dict(attn_dropout="scheduled", schedule="linear:0.3:0.6"),
                                    dict(layerdrop=0.5), dict(attn_layerdrop=0.5)])
@pytest.mark.parametrize("attention", ["dense", "hst"])
def test_eval_runs_no_dropout_and_no_gnet(method, attention, monkeypatch):
    torch.manual_seed(0)
    net = M.Model(tiny_config(attention=attention, num_random=1, **method)).eval()
    plain = M.Model(tiny_config(attention=attention, num_random=1, attn_dropout="none", hidden_dropout_p=0.0))
    plain.load_state_dict(net.state_dict(), strict=False)
    plain.eval()
    ids, mask = batch()

    def no_gnet(*a, **k):
        raise AssertionError("the G-Net ran in eval")
    monkeypatch.setattr(attendout.GNet, "features", no_gnet)
    with torch.no_grad():
        out = net(ids, mask)
        torch.testing.assert_close(out, net(ids, mask), rtol=0, atol=0)         # deterministic
        torch.testing.assert_close(out, plain(ids, mask), rtol=0, atol=0)       # = the model without any dropout
        two = (torch.cat([ids, ids]), torch.cat([mask, mask]))                  # asked for a masked view: none
        torch.testing.assert_close(net(*two, views=2, masked=True), plain(*two), rtol=0, atol=0)


# -----------------------------------------------------------------------------
# The dropout baselines do something when train.py switches them on

def count_calls(monkeypatch, cls, name="forward"):
    """Count the training-mode calls of cls.name."""
    counter = collections.Counter()
    original = getattr(cls, name)

    def wrapped(self, *a, **k):
        counter["train" if self.training else "eval"] += 1
        return original(self, *a, **k)
    monkeypatch.setattr(cls, name, wrapped)
    return counter


@pytest.mark.parametrize("flag,attn_frac,ffn_frac", [("--layerdrop", 0.5, 0.5), ("--attn-layerdrop", 0.5, 1.0)])
def test_layerdrop_flags_skip_layers(flag, attn_frac, ffn_frac, listops_dir, tmp_path, monkeypatch):
    attn_calls = count_calls(monkeypatch, M.Attention)
    ffn_calls = count_calls(monkeypatch, M.FeedForward)
    steps = 40
    run_train(["--task", "listops", "--data", listops_dir, "--out", str(tmp_path / "run"), "--max-steps",
               str(steps), "--batch-size", "8", "--eval-every", "1000", flag, "0.5", "--attn-dropout", "standard",
               *TINY])
    nominal = steps * 2                              # 2 layers, one attention and one FFN call per layer and step
    assert abs(attn_calls["train"] / nominal - attn_frac) < 0.2
    assert abs(ffn_calls["train"] / nominal - ffn_frac) < 0.2


def test_scheduled_dropout_follows_training_progress(listops_dir, tmp_path, monkeypatch):
    sched = tmp_path / "droprates.jsonl"
    sched.write_text('{"step": 0, "step_frac": 0.0, "drop_rate": [0.0, 0.0]}\n'
                     '{"step": 9, "step_frac": 1.0, "drop_rate": [0.9, 0.45]}\n')
    seen = []
    original = M.dense_attention

    def record(q, k, v, key_mask=None, dropout_p=0.0, mask_fn=None):
        if torch.is_grad_enabled():                  # training forwards only
            seen.append(dropout_p)
        return original(q, k, v, key_mask, dropout_p, mask_fn)
    monkeypatch.setattr(M, "dense_attention", record)
    steps = 10
    run_train(["--task", "listops", "--data", listops_dir, "--out", str(tmp_path / "run"), "--max-steps",
               str(steps), "--batch-size", "8", "--eval-every", "1000", "--attn-dropout", "scheduled",
               "--schedule", str(sched), *TINY])
    per_step = [seen[2 * i:2 * i + 2] for i in range(steps)]     # [layer 0, layer 1] of each step
    # step s (0-based) runs at progress s / steps: layer 0 at 0.9 * s/steps (clamped), layer 1 at half of it
    for s, (p0, p1) in enumerate(per_step):
        assert p0 == pytest.approx(0.9 * s / steps) and p1 == pytest.approx(0.45 * s / steps)


# -----------------------------------------------------------------------------
# AttendOut's log of masking rates

def test_drop_rate_log_ends_at_the_last_step(listops_dir, tmp_path):
    """droprates.jsonl has a line every --log-every steps and one at the run's last step, so that a schedule
    replayed from it (--attn-dropout scheduled) ends at the rates the AttendOut run ended with."""
    out = tmp_path / "run"
    run_train(["--task", "listops", "--data", listops_dir, "--out", str(out), "--max-steps", "7",
               "--batch-size", "8", "--eval-every", "1000", "--log-every", "5", "--attn-dropout", "attendout", *TINY])
    recs = [json.loads(line) for line in open(out / "droprates.jsonl")]
    assert [(r["step"], r["step_frac"]) for r in recs] == [(5, 5 / 7), (7, 1.0)]


# -----------------------------------------------------------------------------
# No n x n tensor, by any route

class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements any operation produced, and for fused attention the size of the
    score matrix it implies (batch x Q x K), whatever Python operator led to it."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if "scaled_dot_product" in str(func) or "flash_attention" in str(func):
            q, k = args[0], args[1]
            sizes.append(q.numel() // q.shape[-1] * k.shape[-2])
        if sizes and max(sizes) > self.largest:
            self.largest, self.op = max(sizes), str(func)
        return out


@pytest.mark.parametrize("kernel", ["sparse", "hst"])
@pytest.mark.parametrize("drop", [dict(), dict(dropout_p=0.2), "gnet"])
def test_no_kernel_builds_an_n_by_n_tensor(kernel, drop):
    # "gnet": AttendOut's masked pass, the G-Net's scores G = a c^T in the kernel's layout
    B, H, n, d, b = 1, 2, 1024, 8, 16
    m = n // b
    L = n + m if kernel == "hst" else n
    q, k, v = (torch.randn(B, H, L, d, requires_grad=True) for _ in range(3))
    kw = dict(block_size=b, window=1, num_global=2, num_random=1)
    if drop == "gnet":
        gate = attendout.AttendOut(tiny_config(hidden_size=16, num_heads=H)).train()
        kw["mask_fn"] = gate.hook(torch.randn(B, L, 16))
    else:
        kw.update(drop)
    fn = sparse.hst_attention if kernel == "hst" else sparse.block_sparse_attention
    with LargestTensor() as rec:
        out = fn(q, k, v, torch.ones(B, n, dtype=torch.long), **kw)
        out.sum().backward()
    # the largest legitimate pieces: the block layout [B, H, m, b + 1, K] with K = (2w + 1 + r) b + g + 1,
    # or the g global rows [B, H, g, L]; an n x n score matrix would be B * H * n * n
    assert rec.largest < B * H * n * n / 4, (rec.largest, rec.op)


# -----------------------------------------------------------------------------
# SAR / R-Drop: each view draws its own random blocks; the shift moves the blocks

VIEWS = {"sar": dict(second=1), "rdrop": dict(second=0), "attendout": dict(masked=True),
         "sar+attendout": dict(second=1, masked=True)}     # sar.stacked_views' views of each method


@pytest.mark.parametrize("loss", list(VIEWS))
def test_views_draw_their_own_random_blocks(loss, monkeypatch):
    method = "attendout" if VIEWS[loss].get("masked") else "none"
    net = M.Model(tiny_config(attention="sparse", num_random=1, num_global=1, attn_dropout=method,
                              hidden_dropout_p=0.0)).train()
    draws = []
    original = sparse.random_blocks

    def record(*a, **k):
        idx, ok = original(*a, **k)
        draws.append(idx.clone())
        return idx, ok
    monkeypatch.setattr(sparse, "random_blocks", record)
    ids, mask = batch(B=2, L=40)
    b = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}
    torch.manual_seed(0)
    views = len(sar.stacked_views(net, b, **VIEWS[loss]))
    assert views == 1 + ("second" in VIEWS[loss]) + ("masked" in VIEWS[loss])
    assert len(draws) == views * net.cfg.num_layers   # one draw per view and layer
    for layer in range(net.cfg.num_layers):
        mine = draws[views * layer:views * (layer + 1)]
        for i in range(views):                       # (same shapes: all views have the same length)
            assert not any(torch.equal(mine[i], mine[j]) for j in range(i))


def test_shift_moves_every_block_boundary(capsys):
    ids, mask = batch(B=2, L=12)
    s_ids, s_mask, _, _ = sar.shift(ids, mask, 3, pad_id=1)
    # token i >= 1 of the original sits at i + 3: block of 4 boundaries fall elsewhere for every content token
    assert torch.equal(s_ids[:, 4:], ids[:, 1:]) and torch.equal(s_ids[:, 0], ids[:, 0])
    assert (s_mask[:, 1:4] == 0).all()
    # a shift of 0 moves nothing: train.py refuses it for SAR (stacked_views' second=0 is R-Drop's copy)
    with pytest.raises(SystemExit) as e:
        train.check_args(train_args("--sar", "1.0", "--sar-shift", "0"))
    assert e.value.code == 2 and "--sar-shift 0" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# HST representatives: the mean of the block's real tokens only

def test_representatives_average_real_tokens_only():
    net = M.Model(tiny_config(attention="hst", block_size=4))
    with torch.no_grad():
        net.rep_embedding.copy_(torch.arange(16.0))
    x = torch.randn(2, 12, 16)
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[1, 6:] = False                          # block 1 half padding, block 2 all padding
    xr, rep_ok = net.add_representatives(x, key_mask)
    R = xr[:, 12:]
    torch.testing.assert_close(R[1, 1], x[1, 4:6].mean(0) + torch.arange(16.0))
    torch.testing.assert_close(R[0, 2], x[0, 8:12].mean(0) + torch.arange(16.0))
    assert rep_ok.tolist() == [[True, True, True], [True, True, False]]


# -----------------------------------------------------------------------------
# ListOps: LRA's distributions

def test_listops_tree_has_lras_distributions():
    """LRA's generator: a node is an operator with probability 0.25 (always a leaf at max depth), then 2 ..
    max_args arguments uniformly, then one of the four operators uniformly; values 0-9 uniformly."""
    rng = random.Random(0)
    n, max_args = 20000, 5
    ops, nargs, values, leaves = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for _ in range(n):
        source, length, value = data.listops_tree(rng, 1, 2, max_args)
        toks = [t for t in source.split() if t not in "()"]
        if len(toks) == 1:
            leaves += 1
            values[int(toks[0])] += 1
            continue
        ops[toks[0]] += 1
        assert toks[-1] == "]" and all(t.isdigit() for t in toks[1:-1])     # depth 2 = max: only leaves below
        nargs[len(toks) - 2] += 1
    assert abs(leaves / n - 0.75) < 0.015
    n_ops = n - leaves
    assert set(nargs) == set(range(2, max_args + 1))
    assert all(abs(c / n_ops - 1 / (max_args - 1)) < 0.03 for c in nargs.values())
    assert set(ops) == {"[MIN", "[MAX", "[MED", "[SM"} and all(abs(c / n_ops - 0.25) < 0.03 for c in ops.values())
    assert all(abs(c / leaves - 0.1) < 0.015 for c in values.values()) and len(values) == 10


# -----------------------------------------------------------------------------
# --clip reaches the optimizer

def test_clip_flag_is_applied(listops_dir, tmp_path):
    """With AdamW the first step moves every weight by about lr whatever the gradient's size, unless the gradient
    is clipped far below eps (1e-6): then the step is ~0. So a tiny --clip must freeze the weights."""
    def weight_change(clip):
        out = tmp_path / f"clip{clip}"
        run_train(["--task", "listops", "--data", listops_dir, "--out", str(out), "--max-steps", "1",
                   "--batch-size", "8", "--lr", "1e-2", "--warmup", "0", "--weight-decay", "0", "--clip", clip,
                   "--eval-every", "1000", "--seed", "0", "--attn-dropout", "standard", *TINY])
        return torch.load(out / "ckpt_last.pt", weights_only=True)["model"]["layers.0.ffn.up.weight"]
    # both runs start from the same seeded init, so their difference is the difference of their steps:
    # about lr for the unclipped one, ~0 for the clipped one
    free, clipped = weight_change("0"), weight_change("1e-12")
    assert (free - clipped).abs().median() > 1e-3
