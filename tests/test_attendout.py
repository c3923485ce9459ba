"""
Tests for attendout.py (methods.md §3): the G-Net and its mask (hard forward, reversed straight-through
backward, on the logits), the keep reward, the masked pass in every kernel, scheduled dropout, and
AttendOut's loss through train.py.

Run: python -m pytest -q tests/test_attendout.py
"""

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attendout as ao  # noqa: E402
import model as M  # noqa: E402
import sparse  # noqa: E402
import train  # noqa: E402
from helpers import train_args  # noqa: E402
from test_train import TINY  # noqa: E402  (listops_dir: conftest.py)


def tiny_config(**kw):
    base = dict(vocab_size=60, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                max_positions=64, num_labels=3, pad_id=1, block_size=4, num_global=1,
                attn_dropout="attendout", hidden_dropout_p=0.0)
    base.update(kw)
    return M.Config(**base)


def batch(B=3, L=14, seed=0, vocab=60):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 9:] = 0                                      # padding in the second sequence
    ids[1, 9:] = 1
    return ids, mask


def strong(model, std=1.0):
    """G-Nets far from their init (std 1): their masks differ clearly from all-keep and all-mask."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in ao.attendout_modules(model):
            m.gnet.weight.normal_(std=std, generator=g)
    return model


# -----------------------------------------------------------------------------
# the mask (methods.md §3.1)

def test_keep_mask_is_hard_forward_and_reversed_straight_through_backward():
    G = torch.tensor([-2.0, -0.1, 0.0, 0.3, 4.0], requires_grad=True)
    M_ = ao.KeepMask.apply(G)
    assert M_.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]                      # M = [G > 0]
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    (M_ * w).sum().backward()
    s = torch.sigmoid(G.detach())
    assert torch.allclose(G.grad, -w * s * (1 - s))                     # -dL/dM sigmoid'(G)


def test_a_masked_pair_leaves_the_softmax_and_rows_renormalise():
    # dense_attention's masked pass = softmax over the kept real pairs only, computed by hand
    torch.manual_seed(0)
    B, H, L, e = 2, 2, 6, 3
    q, k, v = (torch.randn(B, H, L, 4) for _ in range(3))
    a, c = torch.randn(B, 1, L, e), torch.randn(B, 1, L, e)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    key_mask[1, 4:] = False
    out = M.dense_attention(q, k, v, key_mask, mask_fn=lambda S, valid, ps: S + (
        (ps(a, c) > 0).float() - 1) * ao.MASKED)
    keep = (a @ c.transpose(-1, -2) > 0) & key_mask[:, None, None, :]   # [B, 1, L, L]
    S = q @ k.transpose(-1, -2) / 2.0
    want = torch.zeros_like(out)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                kept = keep[b, 0, i]
                if kept.any():
                    p = torch.softmax(S[b, h, i][kept], dim=-1)
                    want[b, h, i] = p @ v[b, h][kept]
                else:                                   # every key masked: S - 10000 everywhere,
                    real = key_mask[b]                  # the softmax is shift-invariant
                    want[b, h, i] = torch.softmax(S[b, h, i][real], -1) @ v[b, h][real]
    assert torch.allclose(out, want, atol=1e-5)


def test_a_fully_masked_row_is_unchanged():
    # a G-Net that masks every pair (G = a.c < 0 everywhere): each real row is fully masked, every
    # logit drops by the same 10,000, and the softmax, which ignores a constant shift, is as it was
    torch.manual_seed(0)
    B, H, L, d = 2, 2, 6, 16
    mod = ao.make_attn_dropout(tiny_config(), 0)
    with torch.no_grad():
        mod.gnet.weight.zero_()
        mod.gnet.bias[:d].fill_(1.0)
        mod.gnet.bias[d:].fill_(-1.0)
    ao.begin_forward(torch.nn.ModuleList([mod]))
    q, k, v = (torch.randn(B, H, L, 4) for _ in range(3))
    key_mask = torch.ones(B, L, dtype=torch.bool)
    key_mask[1, 4:] = False
    out = M.dense_attention(q, k, v, key_mask, mask_fn=mod.hook(torch.randn(B, L, d)))
    assert mod.full_row_rate().item() == 1.0
    S = q @ k.transpose(-1, -2) / 2.0
    A = S.masked_fill(~key_mask[:, None, None, :], float("-inf")).softmax(-1)
    # float32 holds S - 10000 to about 1e-3: the shifted rows are equal up to that rounding
    assert torch.allclose(out, A @ v, atol=5e-3)


def test_full_rows_count_only_rows_with_every_real_key_masked():
    """A row with one real key kept is not fully masked; a row whose real keys are all masked is, whatever the
    G-Net says of the padding keys; padding query rows are not rows at all. And masked_by_key (dense): each key
    position's share of the masked real pairs."""
    B, L, d = 1, 5, 16
    mod = ao.make_attn_dropout(tiny_config(attention="dense"), 0)
    ao.begin_forward(torch.nn.ModuleList([mod]))
    mask_fn = mod.hook(torch.randn(B, L, d))
    real = torch.tensor([True, True, True, True, False])                 # key 4 is padding
    valid = (real[:, None] & real[None, :])[None, None]                  # [1, 1, L, L]
    G = -torch.ones(B, 1, L, L)                                          # mask every pair ...
    G[0, 0, 0, 3] = 1.0                                                  # ... but row 0 keeps real key 3
    G[0, 0, 1, 4] = 1.0                                                  # row 1 keeps only the padding key
    mask_fn(torch.zeros(B, 2, L, L), valid, lambda a, c: G)
    assert mod.full_row_rate().item() == pytest.approx(3 / 4)                   # rows 1, 2, 3 of the 4 real rows
    assert mod.mask_rate().item() == pytest.approx(15 / 16)
    shares = mod.masked_by_key().tolist()                                # 15 masked: key 3 has 3 of them
    assert shares == pytest.approx([4 / 15, 4 / 15, 4 / 15, 3 / 15, 0.0])
    sparse_mod = ao.make_attn_dropout(tiny_config(attention="sparse"), 0)
    assert sparse_mod.masked_by_key() is None                            # gathered blocks: no positions


def test_gnet_reads_its_input_detached():
    mod = ao.make_attn_dropout(tiny_config(), 0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    a, c = mod.gnet.features(x)
    (a.sum() + c.sum()).backward()
    assert x.grad is None and mod.gnet.weight.grad is not None


def test_gnet_pair_term_is_the_scaled_product_of_its_projections():
    mod = ao.make_attn_dropout(tiny_config(), 0)
    x = torch.randn(2, 5, 16)
    a, c = mod.gnet.features(x)
    W_a, W_c = mod.gnet.weight.chunk(2)
    b_a, b_c = mod.gnet.bias.chunk(2)
    want = (x @ W_a.T + b_a) @ (x @ W_c.T + b_c).transpose(-1, -2) / math.sqrt(16)
    assert a.shape == (2, 1, 5, 16)                     # one head: the heads share the mask
    assert torch.allclose(a @ c.transpose(-1, -2), want[:, None], atol=1e-5)


def test_gnet_init_leaves_the_global_random_stream_alone():
    torch.manual_seed(3)
    ao.make_attn_dropout(tiny_config(), 0)
    after_gnet = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(3), after_gnet)
    torch.manual_seed(3)
    w3 = ao.make_attn_dropout(tiny_config(), 1).gnet.weight.clone()
    torch.manual_seed(4)
    assert not torch.equal(ao.make_attn_dropout(tiny_config(), 1).gnet.weight, w3)   # the run's seed
    torch.manual_seed(3)
    assert not torch.equal(ao.make_attn_dropout(tiny_config(), 0).gnet.weight, w3)   # and the layer
    assert ao.make_attn_dropout(tiny_config(), 0).gnet.weight.std().item() == pytest.approx(0.02, rel=0.2)


# -----------------------------------------------------------------------------
# the masked pass in the model: only the last view, only in training; eval is the plain model

@pytest.mark.parametrize("attention", ["dense", "sparse", "hst"])
def test_eval_is_the_plain_model_bit_for_bit(attention):
    torch.manual_seed(0)
    ao_model = strong(M.Model(tiny_config(attention=attention))).eval()
    plain = M.Model(tiny_config(attention=attention, attn_dropout="standard")).eval()
    plain.load_state_dict(ao.export_without_gnet(ao_model.state_dict()))
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(ao_model(ids, mask), plain(ids, mask))
        assert torch.equal(ao_model(ids, mask, masked=True), plain(ids, mask))   # eval: no mask


@pytest.mark.parametrize("attention", ["dense", "sparse", "hst"])
def test_the_clean_view_is_untouched_and_the_masked_view_differs(attention):
    torch.manual_seed(0)
    model = strong(M.Model(tiny_config(attention=attention))).train()
    ids, mask = batch()
    two = (torch.cat([ids, ids]), torch.cat([mask, mask]))
    clean, masked = model.encode(*two, views=2, masked=True).chunk(2)     # hidden states [B, L, d]
    rates = ao.mask_rates(model).tolist()
    assert len(rates) == 2 and all(0.05 < r < 0.95 for r in rates)
    alone = model.encode(ids, mask)                        # hidden dropout 0: deterministic
    assert torch.allclose(clean, alone, atol=1e-6)
    assert not torch.allclose(masked, alone, atol=1e-3)
    assert all(math.isnan(r) for r in ao.mask_rates(model).tolist())   # a forward without the masked pass


def dense_reference(q, k, v, allowed):
    """softmax over the allowed keys, [B, H, L, L] bool; a row with none gives 0."""
    S = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    return torch.nan_to_num(S.softmax(-1)) @ v


@pytest.mark.parametrize("hst", [False, True])
@pytest.mark.parametrize("num_random", [0, 1])
def test_sparse_kernels_mask_the_same_pairs_as_dense(hst, num_random):
    # the G-Net's scores in each kernel's layout: the block kernel with the mask = dense attention under
    # (layout mask) & [G > 0], with G = a c^T computed densely; and the same kept-pair counts
    torch.manual_seed(1)
    B, H, n, d, b = 2, 2, 16, 4, 4
    L = n + n // b if hst else n
    q, k, v = (torch.randn(B, H, L, d) for _ in range(3))
    att = torch.ones(B, n, dtype=torch.long)
    att[1, 11:] = 0
    a, c = torch.randn(B, 1, L, 3), torch.randn(B, 1, L, 3)     # one mask for the H heads
    cfg = tiny_config(num_heads=H, hidden_size=8)
    mod = ao.make_attn_dropout(cfg, 0)
    mod.gnet.features = lambda x: (a, c)                  # the G-Net's features, fixed
    pattern = dict(block_size=b, window=1, num_global=1, num_random=num_random)
    kernel = sparse.hst_attention if hst else sparse.block_sparse_attention
    dense_mask = sparse.hst_dense_mask if hst else sparse.dense_mask
    ao.begin_forward(torch.nn.ModuleList([mod]))
    out = kernel(q, k, v, att, generator=torch.Generator().manual_seed(5),
                 mask_fn=mod.hook(None), **pattern)
    allowed = dense_mask(n, att, generator=torch.Generator().manual_seed(5), num_heads=H,
                         batch_size=B, **pattern)         # [B, H, L, L]
    keep = (a @ c.transpose(-1, -2)) > 0                  # [B, heads, L, L]
    want = dense_reference(q, k, v, allowed & keep)
    none_kept = ~(allowed & keep).any(-1, keepdim=True)   # every allowed key masked: the row renormalises
    want = torch.where(none_kept, dense_reference(q, k, v, allowed), want)
    real_rows = sparse.real_keys(att, n, b, hst, B)[:, None, :, None]
    assert torch.allclose(out * real_rows, want * real_rows, atol=1e-5)
    kept, pairs = mod.kept.item(), mod.pairs.item()
    real_pairs = (allowed & real_rows).expand(B, H, L, L)
    assert pairs == pytest.approx(real_pairs.sum().item() / H)       # per head
    assert kept == pytest.approx((real_pairs & keep).sum().item() / H)


def test_padding_keys_stay_masked_even_where_the_gnet_keeps_them():
    torch.manual_seed(0)
    model = M.Model(tiny_config()).train()
    for m in ao.attendout_modules(model):
        with torch.no_grad():
            m.gnet.weight.zero_()
            m.gnet.bias.fill_(1.0)                        # G > 0 everywhere: every pair kept
    ids, mask = batch()
    clean, masked = model(torch.cat([ids, ids]), torch.cat([mask, mask]), views=2, masked=True).chunk(2)
    assert torch.allclose(clean, masked, atol=1e-6)       # nothing masked, and padding still out
    assert ao.mask_rates(model).tolist() == [0.0, 0.0]


# -----------------------------------------------------------------------------
# the keep reward (methods.md §3.1)

def test_keep_reward_counts_kept_real_pairs_per_example_over_layers():
    torch.manual_seed(0)
    model = strong(M.Model(tiny_config())).train()
    ids, mask = batch()
    model(torch.cat([ids, ids]), torch.cat([mask, mask]), views=2, masked=True)
    reward = ao.keep_reward(model, ids.size(0))
    real = mask.sum(1) ** 2                               # real (query, key) pairs per example
    rates = ao.mask_rates(model).tolist()
    want = sum((1 - r) * real.sum().item() for r in rates) / ids.size(0)
    assert reward.item() == pytest.approx(want, rel=1e-5)


def test_the_keep_reward_makes_the_gnet_keep_more_pairs():
    # descending tau^2 x kept through the reversed mask raises the G-Net's scores: more pairs kept
    torch.manual_seed(0)
    model = strong(M.Model(tiny_config()), std=0.3).train()
    ids, mask = batch()
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if ao.GNET in n.split(".")], lr=0.05)
    kept = []
    for _ in range(5):
        model(torch.cat([ids, ids]), torch.cat([mask, mask]), views=2, masked=True)
        reward = ao.keep_reward(model, ids.size(0))
        kept.append(reward.item())
        opt.zero_grad()
        reward.backward()
        opt.step()
    assert kept[-1] > kept[0]


def test_the_gnets_gradient_comes_only_through_the_mask():
    # flipping KeepMask's backward flips the G-Net's whole gradient: it has no other path to the loss
    torch.manual_seed(0)
    model = strong(M.Model(tiny_config()), std=0.3).train()
    ids, mask = batch()
    z = model(torch.cat([ids, ids]), torch.cat([mask, mask]), views=2, masked=True)
    gnet = ao.attendout_modules(model)[0].gnet
    z[3:].sum().backward()
    reversed_grad = gnet.weight.grad.clone()
    model.zero_grad()
    original = ao.KeepMask.backward

    def not_reversed(ctx, grad):
        return -original(ctx, grad)
    ao.KeepMask.backward = staticmethod(not_reversed)
    try:
        z = model(torch.cat([ids, ids]), torch.cat([mask, mask]), views=2, masked=True)
        z[3:].sum().backward()
    finally:
        ao.KeepMask.backward = staticmethod(original)
    assert torch.allclose(gnet.weight.grad, -reversed_grad, atol=1e-6)
    assert reversed_grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# AttendOut's loss through train.py

def test_the_loss_is_ce_plus_consistency_plus_tau_squared_kept(listops_dir, tmp_path):
    args = train_args("--data", listops_dir, "--out", str(tmp_path), *TINY, "--attn-dropout", "attendout",
                      "--hidden-dropout-p", "0")
    r = train.setup(args)
    strong(r.raw)
    b = next(iter(train.data.make_batches(r.task.train[:8], 8, pad_id=r.tok.pad_id, seed=0, epoch=0)))
    losses = {}
    for tau in (0.5, 1.0):
        r.raw.cfg.gnet_tau = tau
        loss, parts = train.classify_loss(r.model, b, args, r.task, r.tok)
        losses[tau] = (loss.item(), parts)
    parts = losses[0.5][1]
    assert parts["mask_consistency"] > 0 and parts["kept"] > 0
    assert losses[0.5][0] == pytest.approx((parts["ce"] + parts["mask_consistency"] + 0.25 * parts["kept"]).item(),
                                           rel=1e-5)
    assert losses[1.0][0] - losses[0.5][0] == pytest.approx(0.75 * parts["kept"].item(), rel=1e-4)  # tau reaches


def test_a_run_logs_consistency_and_one_rate_per_layer(listops_dir, tmp_path):
    out = tmp_path / "run"
    train.main(["--task", "listops", "--data", listops_dir, "--out", str(out), *TINY, "--layers", "2",
                "--attn-dropout", "attendout", "--max-steps", "4", "--log-every", "1", "--batch-size", "8"])
    log = [json.loads(line) for line in open(out / "log.jsonl") if '"loss"' in line]
    assert all(rec["mask_consistency"] >= 0 and len(rec["mask"]) == 2 for rec in log)
    rates = [json.loads(line) for line in open(out / "droprates.jsonl")]
    assert [rec["step"] for rec in rates] == [1, 2, 3, 4]
    assert all(0 <= p <= 1 for rec in rates for p in rec["drop_rate"])
    assert rates[0]["drop_rate"] == log[0]["mask"]


def test_attendout_needs_a_task_with_predictions_to_compare(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--task", "mlm", "--data", str(tmp_path), "--out", str(tmp_path / "o"), *TINY,
                    "--attn-dropout", "attendout"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "attendout" in err[0]


# -----------------------------------------------------------------------------
# scheduled dropout (methods.md §3.2), the log, export, the method list

def test_scheduled_linear():
    cfg = tiny_config(attn_dropout="scheduled", schedule="linear:0.1:0.5", num_layers=5)
    mods = [ao.make_attn_dropout(cfg, l) for l in range(5)]
    assert mods[0].rate(0.0) == pytest.approx(0.1) and mods[-1].rate(0.7) == pytest.approx(0.5)
    assert mods[2].rate(0.3) == pytest.approx(0.3)
    one = ao.make_attn_dropout(tiny_config(attn_dropout="scheduled", schedule="linear:0.1:0.5",
                                           num_layers=1), 0)
    assert one.rate(0.5) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="linear:P_LOW:P_HIGH"):
        ao.make_attn_dropout(tiny_config(attn_dropout="scheduled", schedule="linear:0.1"), 0)


def test_scheduled_replay(tmp_path):
    path = str(tmp_path / "droprates.jsonl")
    log = ao.DropRateLogger(path, log_interval=10)
    fake = {0: [0.1, 0.2, 0.3], 10: [0.5, 0.4, 0.3], 20: [0.9, 0.0, 0.3]}
    for step in range(21):
        log.log(step, step / 20, fake.get(step, [7.0, 7.0, 7.0]))  # only steps 0, 10, 20 are written
    lines = [json.loads(s) for s in open(path)]
    assert [r["step"] for r in lines] == [0, 10, 20] and lines[1]["step_frac"] == 0.5
    cfg = tiny_config(attn_dropout="scheduled", schedule=path, num_layers=3)
    mods = [ao.make_attn_dropout(cfg, l) for l in range(3)]
    for step, rates in fake.items():
        assert [m.rate(step / 20) for m in mods] == pytest.approx(rates)
    assert mods[0].rate(0.25) == pytest.approx(0.3)    # halfway between 0.1 and 0.5
    assert mods[1].rate(0.75) == pytest.approx(0.2)
    assert mods[0].rate(-1.0) == pytest.approx(0.1) and mods[0].rate(2.0) == pytest.approx(0.9)
    path2 = tmp_path / "nofrac.jsonl"                  # without step_frac: step / last step
    path2.write_text('{"step": 0, "drop_rate": [0.0]}\n{"step": 100, "drop_rate": [1.0]}\n')
    m = ao.make_attn_dropout(tiny_config(attn_dropout="scheduled", schedule=str(path2), num_layers=1), 0)
    assert m.rate(0.25) == pytest.approx(0.25)


def test_scheduled_parse_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "drop_rate": [0.1, 0.2, 0.3]}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2"):
        ao.make_attn_dropout(tiny_config(attn_dropout="scheduled", schedule=str(bad), num_layers=3), 0)
    short = tmp_path / "short.jsonl"
    short.write_text('{"step": 0, "drop_rate": [0.1]}\n')
    with pytest.raises(ValueError, match=r"short\.jsonl, line 1.*3 layers"):
        ao.make_attn_dropout(tiny_config(attn_dropout="scheduled", schedule=str(short), num_layers=3), 0)
    with pytest.raises(ValueError, match="--schedule"):
        ao.make_attn_dropout(tiny_config(attn_dropout="scheduled", schedule=""), 0)


def test_logger_appends_on_resume(tmp_path):
    path = str(tmp_path / "droprates.jsonl")
    ao.DropRateLogger(path, 1).log(5, 0.5, [0.1, float("nan"), 0.3])
    rec = json.loads(open(path).read())
    assert rec["step"] == 5 and rec["mean"] == pytest.approx(0.2)      # the mean over the layers that ran
    ao.DropRateLogger(path, 1, append=True).log(6, 0.6, [0.1, 0.2, 0.3])   # resume: keeps the old lines
    assert [json.loads(s)["step"] for s in open(path)] == [5, 6]
    ao.DropRateLogger(path, 1)                                             # fresh run: starts afresh
    assert open(path).read() == ""


def test_export_without_gnet():
    model = M.Model(tiny_config())
    sd = model.state_dict()
    out = ao.export_without_gnet(sd)
    gnet_keys = {k for k in sd if ".gnet." in k}
    assert gnet_keys == {f"layers.{i}.attn.drop.gnet.{p}" for i in range(2) for p in ("weight", "bias")}
    assert set(out) == set(sd) - gnet_keys
    assert all(out[k] is sd[k] for k in out)


def test_standard_none_rates():
    assert ao.make_attn_dropout(tiny_config(attn_dropout="standard", attn_dropout_p=0.2), 0).rate(0.3) == 0.2
    assert ao.make_attn_dropout(tiny_config(attn_dropout="none"), 0).rate(0.3) == 0.0
    assert ao.make_attn_dropout(tiny_config(), 0).rate(0.3) == 0.0     # AttendOut: no Bernoulli dropout


def test_methods_is_the_one_list():
    assert list(ao.METHODS) == ["standard", "none", "attendout", "scheduled", "dropkey"]
    for name, says in ao.METHODS.items():                   # every one builds, and names itself
        cfg = tiny_config(attn_dropout=name, schedule="linear:0.1:0.3")
        assert ao.make_attn_dropout(cfg, 0) is not None and says.format(p=0.1, cfg=cfg)
    with pytest.raises(ValueError, match="--attn-dropout.*standard.*none.*attendout.*scheduled"):
        ao.make_attn_dropout(tiny_config(attn_dropout="gaussian"), 0)


def test_every_method_starts_from_the_same_weights(listops_dir, tmp_path):
    # at one seed, every method builds identical backbone and head weights (the G-Nets draw from their own
    # generator), so the methods' comparison is paired
    states = {}
    for method in ao.METHODS:
        extra = ["--schedule", "linear:0.1:0.3"] if method == "scheduled" else []
        args = train.parse_args(["--task", "listops", "--data", listops_dir, "--out", str(tmp_path / method),
                                 *TINY, "--attn-dropout", method, "--seed", "7", *extra])
        full = train.setup(args).raw.state_dict()
        assert any(ao.GNET in k for k in full) == (method == "attendout")
        states[method] = {k: v for k, v in full.items() if ao.GNET not in k.split(".")}
    for method, st in states.items():
        assert st.keys() == states["standard"].keys()
        for k, v in st.items():
            assert torch.equal(v, states["standard"][k]), f"{method}: {k} differs from standard's"


def test_gnet_lr_none_is_the_backbone_lr(listops_dir, tmp_path):
    # Config.gnet_lr None, the default (the author's code: one learning rate): the G-Nets learn at --lr
    args = train_args("--data", listops_dir, "--out", str(tmp_path), *TINY, "--attn-dropout", "attendout",
                      "--lr", "3e-4")
    r = train.setup(args)
    r.raw.cfg.gnet_lr = None
    groups = train.make_optimizer(r.raw, args, r.device).param_groups
    assert [(g["name"], g["base_lr"]) for g in groups] == [("decay", 3e-4), ("no_decay", 3e-4), ("gnet", 3e-4)]
    assert M.Config().gnet_lr is None
    args = train_args("--data", listops_dir, "--out", str(tmp_path / "b"), *TINY, "--attn-dropout",
                      "attendout", "--lr", "3e-4", "--gnet-lr", "2e-5")
    gnet = [g for g in train.setup(args).optimizer.param_groups if g["name"] == "gnet"]
    assert [g["base_lr"] for g in gnet] == [2e-5]
    args = train_args("--data", listops_dir, "--out", str(tmp_path / "c"), *TINY, "--attn-dropout",
                      "attendout", "--lr", "3e-4")                  # the demo's own setting: DEMO's 1e-5
    gnet = [g for g in train.setup(args).optimizer.param_groups if g["name"] == "gnet"]
    assert [g["base_lr"] for g in gnet] == [train.DEMO["gnet_lr"]] == [1e-5]


# -----------------------------------------------------------------------------
# DropKey (methods.md §3.3): a method on the logits that lives in attendout.py alone

def weights_and_drops(kernel, p, seed=0):
    """One training call of `kernel` ("dense", "sparse", "hst") with DropKey at rate p, V the identity, so the
    output is the attention weights A [B, H, L, L] over the real tokens (and R under HST); with the pairs the
    pattern allows (bool [B, H, L, L]), the real query rows [B, 1, L, 1] and the number of pairs DropKey set."""
    torch.manual_seed(seed)
    B, H, n, b = 2, 2, 16, 4
    L = n + n // b if kernel == "hst" else n
    q, k = torch.randn(B, H, L, L), torch.randn(B, H, L, L)     # d_h = L: the kernels' V has q's width
    v = torch.eye(L).expand(B, H, L, L)
    att = torch.ones(B, n, dtype=torch.long)
    att[1, 11:] = 0
    drop = ao.DropKey(p)
    dropped = []

    def record(S, valid, pair_scores):
        S2 = drop.logits_fn(None)(S, valid, pair_scores)
        dropped.append(int(((S2 != S) & valid).sum()))
        return S2

    pattern = dict(block_size=b, window=1, num_global=1, num_random=1)
    real = sparse.real_keys(att, n, b, kernel == "hst", B)                  # [B, L]
    if kernel == "dense":
        out = M.dense_attention(q, k, v, real, mask_fn=record)
        allowed = real[:, None, None, :].expand(B, H, L, L)
        plain = M.dense_attention(q, k, v, real)
    else:
        attend = sparse.hst_attention if kernel == "hst" else sparse.block_sparse_attention
        dense_mask = sparse.hst_dense_mask if kernel == "hst" else sparse.dense_mask
        out = attend(q, k, v, att, generator=torch.Generator().manual_seed(5), mask_fn=record, **pattern)
        plain = attend(q, k, v, att, generator=torch.Generator().manual_seed(5), **pattern)
        allowed = dense_mask(n, att, generator=torch.Generator().manual_seed(5), num_heads=H, batch_size=B,
                             **pattern)
    return out, plain, allowed, real[:, None, :, None], sum(dropped)


@pytest.mark.parametrize("kernel", ["dense", "sparse", "hst"])
def test_dropkey_rows_sum_to_one_and_dropped_pairs_get_weight_zero(kernel):
    A, plain, allowed, real_rows, dropped = weights_and_drops(kernel, 0.3)
    real_pairs = allowed & real_rows
    assert torch.allclose(A.sum(-1)[real_rows[..., 0].expand_as(A[..., 0])], torch.tensor(1.0), atol=1e-6)
    # the only zero weights among the real pairs are the dropped ones (softmax leaves every other > 0)
    zeros = int(((A == 0) & real_pairs).sum())
    assert zeros == dropped and 0.2 < dropped / int(real_pairs.sum()) < 0.4
    assert not torch.allclose(A, plain)


@pytest.mark.parametrize("kernel", ["dense", "sparse", "hst"])
def test_dropkey_keeps_every_key_of_a_row_whose_keys_were_all_drawn(kernel):
    # at p = 1 every real key of every row is drawn: each row keeps them all, over its whole softmax (sparse.py
    # gives mask_fn the layout's rows and the global rows apart; each holds whole rows), so A is the plain one
    A, plain, allowed, real_rows, dropped = weights_and_drops(kernel, 1.0)
    assert dropped == 0
    assert torch.allclose(A * real_rows, plain * real_rows, atol=1e-6)


@pytest.mark.parametrize("attention", ["dense", "sparse", "hst"])
def test_dropkey_acts_in_every_training_view_and_evaluation_is_the_plain_model(attention):
    models = {}
    for method in ("dropkey", "none"):
        torch.manual_seed(0)
        models[method] = M.Model(tiny_config(attention=attention, attn_dropout=method, attn_dropout_p=0.3,
                                             num_random=1))
    ids, mask = batch()
    with torch.no_grad():
        for model in models.values():
            model.eval()
        assert torch.equal(models["dropkey"](ids, mask), models["none"](ids, mask))
        assert torch.equal(models["dropkey"](ids, mask, masked=True), models["none"](ids, mask))
        # one view; SAR's or R-Drop's two; those and AttendOut's masked copy
        for n_views, masked in ((1, False), (2, False), (3, True)):
            stacked = (torch.cat([ids] * n_views), torch.cat([mask] * n_views))
            views = {}
            for method, model in models.items():
                torch.manual_seed(1)                      # the same random blocks in both
                h = model.train().encode(*stacked, views=n_views, masked=masked)
                views[method] = h.chunk(n_views)
            for view, plain in zip(views["dropkey"], views["none"]):
                assert not torch.allclose(view, plain, atol=1e-3)
            if n_views > 1:                               # drawn afresh per view
                assert not torch.allclose(views["dropkey"][0], views["dropkey"][1], atol=1e-3)


def test_model_py_never_names_dropkey():
    # a method on the logits lives in attendout.py alone: model.py never names it
    source = open(M.__file__).read().lower()
    assert "dropkey" not in source


@pytest.mark.parametrize("attention", ["dense", "sparse", "hst"])
def test_dropkey_trains_through_train_py(attention, listops_dir, tmp_path, capsys):
    out = tmp_path / attention
    argv = ["--task", "listops", "--data", listops_dir, "--out", str(out), *TINY, "--attention", attention,
            "--block-size", "8", "--attn-dropout", "dropkey", "--attn-dropout-p", "0.3", "--max-steps", "2",
            "--batch-size", "4", "--log-every", "1"]
    if attention != "dense":
        argv += ["--sar", "1", "--views", "2", "--num-random", "1"]
    args = train.parse_args(argv)
    assert args.attn_dropout == "dropkey" and args.attn_dropout_p == 0.3
    train.main(argv)
    assert "DropKey 0.3" in capsys.readouterr().out
    log = [json.loads(line) for line in open(out / "log.jsonl") if '"loss"' in line]
    assert len(log) == 2 and all(math.isfinite(rec["loss"]) for rec in log)


# -----------------------------------------------------------------------------
# AttendOut under bf16 (issue 55): the mask is applied in fp32

def test_a_fully_masked_row_is_unchanged_under_bf16_too():
    torch.manual_seed(0)
    B, H, L = 1, 2, 6
    S = (torch.randn(B, H, L, L) * 3).bfloat16()
    G = torch.randn(1, 1, L, L)
    G[:, :, 0] = -1.0                                    # row 0: every key masked
    G[:, :, 1] = 1.0                                     # row 1: every key kept
    mod = ao.AttendOut(tiny_config(hidden_size=8))
    mod.gnet.features = lambda x: (None, None)
    valid = torch.ones(1, 1, L, L, dtype=torch.bool)
    S2 = mod.hook(None)(S, valid, lambda a, c: G)
    A, plain = S2.float().softmax(-1), S.float().softmax(-1)
    assert torch.allclose(A[:, :, :2], plain[:, :, :2], atol=1e-2)
    assert A[:, :, 0].std(-1).min() > 0.05                # not uniform
    # in fp32 S' = S - 10000 (1 - M) exactly, as before
    S32 = S.float()
    M_ = (G > 0).float()
    assert torch.equal(mod.hook(None)(S32, valid, lambda a, c: G), S32 + ((M_ - 1) * ao.MASKED).to(S32.dtype))


@pytest.mark.parametrize("kernel", ["dense", "sparse", "hst"])
def test_the_kernels_take_the_fp32_masked_logits_of_bf16_inputs(kernel):
    # bf16 q, k, v (no autocast): the fp32 S' meets V in V's dtype, and a fully masked row is the plain row
    torch.manual_seed(0)
    B, H, n, b = 1, 2, 8, 4
    L = n + n // b if kernel == "hst" else n
    q, k, v = (torch.randn(B, H, L, 4).bfloat16() for _ in range(3))
    mod = ao.AttendOut(tiny_config(hidden_size=8))
    ao.begin_forward(torch.nn.ModuleList([mod]))
    mod.gnet.features = lambda x: (-torch.ones(B, 1, L, 1), torch.ones(B, 1, L, 1))   # G < 0: every pair masked
    if kernel == "dense":
        out, plain = M.dense_attention(q, k, v, mask_fn=mod.hook(None)), M.dense_attention(q, k, v)
    else:
        attend = sparse.hst_attention if kernel == "hst" else sparse.block_sparse_attention
        kw = dict(block_size=b, window=1, num_global=1, num_random=0)
        out, plain = attend(q, k, v, mask_fn=mod.hook(None), **kw), attend(q, k, v, **kw)
    assert out.dtype == torch.bfloat16 and mod.full_row_rate().item() == 1.0
    assert torch.allclose(out.float(), plain.float(), atol=2e-2)
