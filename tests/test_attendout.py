"""
Tests for attendout.py (methods.md §3): the G-Net's capped mask, its gradient, the budget, scheduled dropout.

Most use a small self-contained dense attention (below), not model.py; a few run model.py or train.py.
Run: python -m pytest -q tests/test_attendout.py
"""

import json
import math
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attendout as ao  # noqa: E402

B, L, H, DH = 2, 8, 2, 4
D = H * DH
SCORES = staticmethod(lambda a, c: a @ c.transpose(-1, -2))   # the dense kernel's pair_scores


def make_config(**kw):
    cfg = dict(attn_dropout="attendout", attn_dropout_p=0.1, num_heads=H, hidden_size=D, gnet_dim=4,
               gnet_tau=0.5, gnet_budget=None, schedule="", num_layers=3)
    cfg.update(kw)
    return types.SimpleNamespace(**cfg)


def attn(q, k, v, mask, mod, x, training, t=0.0):
    """Dense reference kernel using the hook's contract. q,k,v [B, H, L, d_h]; mask [B, L] (1 = real)."""
    valid = mask.bool()[:, None, None, :]                                  # [B, 1, 1, L]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])                   # [B, H, L, L]
    A = s.masked_fill(~valid, torch.finfo(s.dtype).min).softmax(-1)
    if training and mod.needs_hook:
        real_pairs = mask.bool()[:, None, :, None] & valid                 # [B, 1, L, L] real query and key
        ao.begin_forward([mod])                                            # the model does this per forward
        A = mod.hook(x)(A, real_pairs, SCORES.__func__)
    elif training:
        A = F.dropout(A, mod.rate(t))
    return A @ v


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, generator=g)
    q, k, v = (torch.randn(B, H, L, DH, generator=g) for _ in range(3))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 5:] = 0  # padding in the second sequence
    return x, q, k, v, mask


def probabilities(q, k, mask):
    valid = mask.bool()[:, None, None, :]
    return (q @ k.transpose(-1, -2) / math.sqrt(DH)).masked_fill(~valid, -1e9).softmax(-1), valid


def strong(**kw):
    """An adversarially strong G-Net: projections 500x the init (std 1) and beta 0, so its logits spread far
    beyond the cap (pi would reach 0.9997 without it)."""
    m = ao.make_attn_dropout(make_config(**kw), 0).train()
    with torch.no_grad():
        m.gnet.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(0))
        m.gnet.beta.zero_()
    return m


# -----------------------------------------------------------------------------
# the mask (methods.md §3.1)

def test_eval_equals_plain_attention():
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(), 0).eval()
    assert not mod.needs_hook
    plain = attn(q, k, v, mask, ao.AttnDropout(0.0), x, training=False)
    assert torch.equal(attn(q, k, v, mask, mod, x, training=False), plain)
    standard = ao.make_attn_dropout(make_config(attn_dropout="standard"), 0).eval()
    assert torch.equal(attn(q, k, v, mask, standard, x, training=False), plain)


def test_training_forwards_differ():
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(attn_dropout_p=0.3), 0).train()
    assert mod.needs_hook and mod.rate(0.5) == 0.0
    assert not torch.equal(attn(q, k, v, mask, mod, x, True), attn(q, k, v, mask, mod, x, True))


def test_mask_is_binary_and_padding_stays_zero():
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(attn_dropout_p=0.3), 0).train()
    A, valid = probabilities(q, k, mask)
    A2 = mod.hook(x)(A, valid, SCORES.__func__)
    ratio = (A2 / A)[valid.expand_as(A)]                    # 0 (dropped) or 1 / (1 - pi) in [1, 2] (kept)
    assert torch.all((ratio == 0) | ((ratio >= 1) & (ratio <= 2)))
    assert 0 < (ratio > 0).float().mean() < 1               # some kept, some dropped
    assert torch.all(A2[~valid.expand_as(A)] == 0) and torch.isfinite(A2).all()   # padding keys stay exactly 0


def reference_mask(A, Z, tau):
    """methods.md §3.1 as plain autograd, line by line: the cap, the straight-through relaxed Bernoulli k, the
    gradient reversal on Z, A' = A k / (1 - pi). CappedMask must compute exactly this."""
    class Reverse(torch.autograd.Function):
        forward = staticmethod(lambda ctx, z: z.view_as(z))
        backward = staticmethod(lambda ctx, g: -g)
    Z = Reverse.apply(Z).clamp_max(0.0)                                   # pi <= 0.5; capped pairs: no gradient
    pi = torch.sigmoid(Z).detach()
    u = torch.rand_like(Z).clamp(ao.U_EPS, 1 - ao.U_EPS)                  # u ~ U(0, 1)
    k_soft = torch.sigmoid((-Z + torch.log(u) - torch.log(1 - u)) / tau)
    k_hard = (k_soft > 0.5).float()
    k = k_hard + k_soft - k_soft.detach()
    return A * k / (1 - pi), pi


def test_capped_mask_is_the_straight_through_formula():
    torch.manual_seed(0)
    A = torch.rand(2, 3, 6, 6).softmax(-1).requires_grad_()
    Z = (torch.randn(2, 3, 6, 6) * 2).requires_grad_()                   # a third of the pairs above the cap
    g = torch.randn(2, 3, 6, 6)
    results = []
    for fn in (ao.CappedMask.apply, reference_mask):
        torch.manual_seed(1)                                              # the same u
        out, pi = fn(A, Z, 0.5)
        results.append((out, pi, *torch.autograd.grad((out * g).sum(), (A, Z))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    dZ = results[0][3]
    assert (dZ[Z >= 0] == 0).all() and (dZ[Z < 0] != 0).any()             # the cap: no gradient above it


def test_cap_bounds_pi_and_every_row_sum_by_construction():
    # pi <= 0.5 and a kept pair x (1 / (1 - pi)) <= 2, so a row of A' sums to <= 2 whatever the G-Net does:
    # directly on logits far beyond the cap, and through the hook against an adversarially strong G-Net
    torch.manual_seed(0)
    A = torch.rand(4, 3, 16, 16).softmax(-1)
    out, pi = ao.CappedMask.apply(A, torch.randn(4, 3, 16, 16) * 50, 0.5)
    assert pi.max() == 0.5 and out.sum(-1).max() <= 2 + 1e-6
    x, q, k, v, mask = inputs()
    A, valid = probabilities(q, k, mask)
    worst = 0.0
    for seed in range(20):
        m = strong(attn_dropout_p=0.1)
        torch.manual_seed(seed)
        out = m.hook(x)(A, valid, SCORES.__func__)
        assert (out / A).nan_to_num().max() <= 2 + 1e-6                 # pi <= 0.5 on every pair
        worst = max(worst, out.sum(-1).max().item())
    assert 1.2 < worst <= 2 + 1e-6                                        # rows do go above 1, never above 2


def test_gnet_reads_its_input_detached():
    # methods.md §3.1: the adversary must not shape the backbone through its input. The layer input reaches the
    # output here only through the G-Net: it must get no gradient, while the G-Net does (straight-through).
    x, q, k, v, mask = inputs()
    x.requires_grad_()
    mod = ao.make_attn_dropout(make_config(attn_dropout_p=0.3), 0).train()
    A, valid = probabilities(q, k, mask)
    out = mod.hook(x)(A, valid, SCORES.__func__)
    (out * torch.randn_like(out)).sum().backward()
    assert x.grad is None
    assert mod.gnet.weight.grad.abs().sum() > 0 and mod.gnet.beta.grad != 0


def test_gnet_pair_term_is_the_scaled_product_of_its_features():
    # the pair term each kernel computes from (a, c) is (X W_q + b_q)(X W_k + b_k)^T / sqrt(d_g), per head
    x = inputs()[0]
    m = ao.make_attn_dropout(make_config(), 0)
    with torch.no_grad():
        m.gnet.weight.normal_(std=1.0)
    a, c = m.gnet.features(x)
    g = F.linear(x, m.gnet.weight, m.gnet.bias).view(B, L, 2, H, 4).permute(2, 0, 3, 1, 4)
    torch.testing.assert_close(a @ c.transpose(-1, -2), g[0] @ g[1].transpose(-1, -2) / 2, rtol=1e-4, atol=1e-6)


def test_stats_accumulate_over_layout_pieces():
    # a kernel may call drop_fn once per layout piece: the statistics add up over the calls of one forward
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(), 0).train()
    valid = mask.bool()[:, None, None, :]
    A = torch.rand(B, H, L, L) * valid
    mod.hook(x)(A, valid, SCORES.__func__)
    full_sum, full_count = mod.stats.tolist()
    assert ao.drop_rates([mod]) == [pytest.approx(full_sum / full_count)]
    assert not mod.stats.requires_grad                     # plain numbers: no graph outlives the step
    ao.begin_forward([mod])                                # what the model does at each training forward
    assert mod.stats is None and mod.drawn == [] and math.isnan(ao.drop_rates([mod])[0])
    fn = mod.hook(x)
    half = lambda rows: (lambda a, c: a[:, :, rows] @ c.transpose(-1, -2))
    torch.manual_seed(0)
    fn(A[:, :, :3], valid, half(slice(0, 3)))
    fn(A[:, :, 3:], valid, half(slice(3, None)))
    assert mod.stats[1].item() == full_count and len(mod.drawn) == 2
    assert mod.stats[0].item() == pytest.approx(full_sum, abs=0.02 * full_count)   # each piece at the target
    mod.hook(x[:, :4])(A[:, :, :4, :4], valid[..., :4], SCORES.__func__)   # e.g. HST stage 2: 2nd hook, same forward
    assert mod.stats[1].item() == full_count + H * 4 * (4 + 4)


# -----------------------------------------------------------------------------
# the budget (methods.md §3.1)

def test_shift_for_rate_solves_the_equation():
    torch.manual_seed(0)
    z = torch.randn(3, 500) * torch.tensor([[1.0], [4.0], [0.1]]) + torch.tensor([[-3.0], [2.0], [0.0]])
    w = (torch.rand(3, 500) > 0.3).float() * torch.tensor([[1.0], [2.0], [7.0]])   # per-row weights, zeros
    for target in (0.01, 0.1, 0.3, 0.49):
        e = ao.shift_for_rate(z, w, torch.tensor(target))
        assert ao.rates(z + e, w).mean().item() == pytest.approx(target, abs=1e-4)
    assert ao.rates(z + 100, w).tolist() == pytest.approx([0.5] * 3)            # the cap: at most 0.5 anywhere


def test_budget_init_counts_real_pairs_only():
    torch.manual_seed(0)
    x, q, k, v, mask = inputs()
    cfg = make_config(attn_dropout_p=0.1)
    mods = [ao.make_attn_dropout(cfg, l).train() for l in range(cfg.num_layers)]
    for m in mods:
        attn(q, k, v, mask, m, x, True)
    rates = ao.drop_rates(mods)
    # a model-wide BERT re-init of nn.Linear (as model.py does) must not touch the G-Net
    before = mods[0].gnet.weight.clone()
    torch.nn.ModuleList(mods).apply(lambda mod: isinstance(mod, torch.nn.Linear) and mod.weight.data.normal_())
    assert torch.equal(mods[0].gnet.weight, before)
    assert len(rates) == 3 and all(abs(r - 0.1) < 0.005 for r in rates)   # pi ~ p0 at init
    # the statistics count exactly the real (query, key) pairs: H * (8 * 8 + 5 * 5), padding rows count nothing
    assert mods[0].stats[1].item() == H * (8 * 8 + 5 * 5)


def test_budget_holds_against_the_reversed_task_gradient():
    # The G-Nets are pushed to drop more (they maximise the task loss); the budget must keep the mean at rho
    # while the layers stay free to differ.
    torch.manual_seed(0)
    x, q, k, v, mask = inputs()
    cfg = make_config(attn_dropout_p=0.1, gnet_budget=0.3)
    mods = [ao.make_attn_dropout(cfg, l).train() for l in range(cfg.num_layers)]
    opt = torch.optim.Adam([p for m in mods for p in m.parameters()], lr=0.05)
    target = torch.randn(B, H, L, DH)
    means = []
    for step in range(60):
        # layer l's output matters l + 1 times as much: a task that wants layers treated differently
        loss = sum((l + 1) * ((attn(q, k, v, mask, m, x, True) - target) ** 2).mean() for l, m in enumerate(mods))
        means.append(ao.mean_drop_rate(mods))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ao.hold_budget(mods)
        assert sum(m.gnet.target.item() for m in mods) / 3 == pytest.approx(0.3, abs=1e-4)
    rates = ao.drop_rates(mods)
    assert max(abs(m - 0.3) for m in means) < 0.02          # the mean is held in every forward ...
    assert max(rates) - min(rates) > 0.02                   # ... the layers are not (sample noise: ~0.003)


def test_next_forward_lands_on_the_targets():
    # hold_budget sets targets whose mean is rho; the next forward puts every layer on its target, even after a
    # large jump of the G-Nets' projections (AdamW can move them that much in one step)
    torch.manual_seed(0)
    x, q, k, v, mask = inputs()
    cfg = make_config(attn_dropout_p=0.1, gnet_budget=0.4)
    mods = [ao.make_attn_dropout(cfg, l).train() for l in range(cfg.num_layers)]
    with torch.no_grad():
        for i, m in enumerate(mods):          # spread the logits: many pi near 0 or the cap, layers apart
            m.gnet.weight.normal_(std=0.5)
            m.gnet.beta.fill_(-3.0 + i)
    for m in mods:
        attn(q, k, v, mask, m, x, True)
    assert ao.mean_drop_rate(mods) == pytest.approx(0.4, abs=0.01)         # at start every target is rho
    ao.hold_budget(mods)
    targets = [m.gnet.target.item() for m in mods]
    assert sum(targets) / 3 == pytest.approx(0.4, abs=1e-4) and targets == sorted(targets)   # the betas' order
    assert max(targets) - min(targets) > 0.05
    with torch.no_grad():
        for m in mods:
            m.gnet.weight.mul_(2.0)
    for m in mods:
        attn(q, k, v, mask, m, x, True)
    assert ao.drop_rates(mods) == pytest.approx(targets, abs=0.01)


def test_a_layer_that_did_not_run_keeps_its_target():
    x, q, k, v, mask = inputs()
    mods = [strong(gnet_budget=0.2) for _ in range(3)]
    with torch.no_grad():
        mods[0].gnet.beta.fill_(-4.0)
    for m in mods[:2]:                                      # layer 2 skipped (LayerDrop)
        attn(q, k, v, mask, m, x, True)
    ao.begin_forward(mods[2:])
    ao.hold_budget(mods)
    assert mods[2].gnet.target.item() == pytest.approx(0.2)
    assert (mods[0].gnet.target.item() + mods[1].gnet.target.item()) / 2 == pytest.approx(0.2, abs=1e-4)


def test_no_state_outlives_a_forward():
    # encode().backward() steps, with and without the budget: nothing leaks, the statistics describe one forward
    import model as M
    cfg = M.Config(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_positions=40,
                   num_labels=2, attn_dropout="attendout", gnet_dim=4)
    net = M.Model(cfg).train()
    ids = torch.randint(3, 50, (2, 12))
    for _ in range(3):
        net.encode(ids).sum().backward()
    ao.hold_budget(net)
    assert all(math.isfinite(r) for r in ao.drop_rates(net))
    count = [m.stats[1].item() for m in ao.attendout_modules(net)]
    net.encode(ids)                                          # a second forward replaces them, it does not add
    assert [m.stats[1].item() for m in ao.attendout_modules(net)] == count


def test_zero_p0_is_guarded():
    m = ao.make_attn_dropout(make_config(attn_dropout_p=0.0), 0)
    assert math.isfinite(m.gnet.beta.item())
    assert abs(torch.sigmoid(m.gnet.beta).item() - ao.P0_MIN) < 1e-6
    with pytest.raises(ValueError, match="--gnet-budget"):
        ao.make_attn_dropout(make_config(gnet_budget=0.5), 0)                # the cap: rho < 0.5


@pytest.mark.parametrize("attention", ["dense", "sparse", "hst"])
def test_padding_counts_for_nothing(attention):
    # the same real tokens, once without and once with a block of padding after them: the drop statistics
    # (budget and log) must count exactly the same pairs, whatever the kernel
    import model as M
    cfg = M.Config(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_positions=40,
                   num_labels=2, attn_dropout="attendout", gnet_dim=4, attention=attention, block_size=4,
                   num_global=1, num_random=1, pad_id=1)
    net = M.Model(cfg).train()
    ids = torch.randint(3, 50, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ids[1, 6:] = 1

    def counts(i, m):
        net.encode(i, m)
        return [mod.stats[1].item() for mod in ao.attendout_modules(net)]

    plain = counts(ids, mask)
    padded = counts(torch.cat([ids, torch.ones(2, 4, dtype=torch.long)], 1),
                    torch.cat([mask, torch.zeros(2, 4, dtype=torch.long)], 1))
    assert plain == padded
    if attention == "dense":   # every real pair: H * (8 * 8 + 6 * 6) per layer
        assert plain == [2 * (64 + 36)] * 2


def test_gnet_init_leaves_the_global_random_stream_alone():
    torch.manual_seed(3)
    ao.make_attn_dropout(make_config(), 0)
    after_gnet = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(3), after_gnet)
    torch.manual_seed(3)
    w3 = ao.make_attn_dropout(make_config(), 1).gnet.weight.clone()
    torch.manual_seed(4)
    assert not torch.equal(ao.make_attn_dropout(make_config(), 1).gnet.weight, w3)   # the run's seed counts
    torch.manual_seed(3)
    assert not torch.equal(ao.make_attn_dropout(make_config(), 0).gnet.weight, w3)   # and the layer


# -----------------------------------------------------------------------------
# scheduled dropout (methods.md §3.2), the log, export, the method list

def test_scheduled_linear():
    cfg = make_config(attn_dropout="scheduled", schedule="linear:0.1:0.5", num_layers=5)
    mods = [ao.make_attn_dropout(cfg, l) for l in range(5)]
    assert mods[0].rate(0.0) == pytest.approx(0.1) and mods[-1].rate(0.7) == pytest.approx(0.5)
    assert mods[2].rate(0.3) == pytest.approx(0.3)
    assert not mods[0].needs_hook
    one = ao.make_attn_dropout(make_config(attn_dropout="scheduled", schedule="linear:0.1:0.5", num_layers=1), 0)
    assert one.rate(0.5) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="linear:P_LOW:P_HIGH"):
        ao.make_attn_dropout(make_config(attn_dropout="scheduled", schedule="linear:0.1"), 0)


def test_scheduled_replay(tmp_path):
    path = str(tmp_path / "droprates.jsonl")
    log = ao.DropRateLogger(path, log_interval=10)
    fake = {0: [0.1, 0.2, 0.3], 10: [0.5, 0.4, 0.3], 20: [0.9, 0.0, 0.3]}
    for step in range(21):
        log.log(step, step / 20, fake.get(step, [7.0, 7.0, 7.0]))  # only steps 0, 10, 20 are written
    lines = [json.loads(s) for s in open(path)]
    assert [r["step"] for r in lines] == [0, 10, 20] and lines[1]["step_frac"] == 0.5
    cfg = make_config(attn_dropout="scheduled", schedule=path, num_layers=3)
    mods = [ao.make_attn_dropout(cfg, l) for l in range(3)]
    for step, rates in fake.items():
        assert [m.rate(step / 20) for m in mods] == pytest.approx(rates)
    assert mods[0].rate(0.25) == pytest.approx(0.3)    # halfway between 0.1 and 0.5
    assert mods[1].rate(0.75) == pytest.approx(0.2)
    assert mods[0].rate(-1.0) == pytest.approx(0.1) and mods[0].rate(2.0) == pytest.approx(0.9)  # clamped
    # without step_frac: step / last step
    path2 = tmp_path / "nofrac.jsonl"
    path2.write_text('{"step": 0, "drop_rate": [0.0]}\n{"step": 100, "drop_rate": [1.0]}\n')
    m = ao.make_attn_dropout(make_config(attn_dropout="scheduled", schedule=str(path2), num_layers=1), 0)
    assert m.rate(0.25) == pytest.approx(0.25)


def test_scheduled_parse_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "drop_rate": [0.1, 0.2, 0.3]}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2"):
        ao.make_attn_dropout(make_config(attn_dropout="scheduled", schedule=str(bad)), 0)
    short = tmp_path / "short.jsonl"
    short.write_text('{"step": 0, "drop_rate": [0.1]}\n')
    with pytest.raises(ValueError, match=r"short\.jsonl, line 1.*3 layers"):
        ao.make_attn_dropout(make_config(attn_dropout="scheduled", schedule=str(short)), 0)
    with pytest.raises(ValueError, match="--schedule"):
        ao.make_attn_dropout(make_config(attn_dropout="scheduled", schedule=""), 0)


def test_logger_reads_modules(tmp_path):
    x, q, k, v, mask = inputs()
    mods = [ao.make_attn_dropout(make_config(), l).train() for l in range(3)]
    for m in mods:
        attn(q, k, v, mask, m, x, True)
    path = str(tmp_path / "droprates.jsonl")
    ao.DropRateLogger(path, 1).log(5, 0.5, mods)
    rec = json.loads(open(path).read())
    assert rec["step"] == 5 and rec["drop_rate"] == pytest.approx(ao.drop_rates(mods))
    assert rec["mean"] == pytest.approx(ao.mean_drop_rate(mods))
    ao.DropRateLogger(path, 1, append=True).log(6, 0.6, [0.1, 0.2, 0.3])   # resume: keeps the old lines
    assert [json.loads(s)["step"] for s in open(path)] == [5, 6]
    ao.DropRateLogger(path, 1)                                             # fresh run: starts afresh
    assert open(path).read() == ""


def test_export_without_gnet():
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(D, D)
    model.layers = torch.nn.ModuleList(ao.make_attn_dropout(make_config(), l) for l in range(2))
    sd = model.state_dict()
    out = ao.export_without_gnet(sd)
    gnet_keys = {k for k in sd if ".gnet." in k}
    assert gnet_keys == {f"layers.{i}.gnet.{p}" for i in range(2) for p in ("weight", "bias", "beta", "target")}
    assert set(out) == set(sd) - gnet_keys
    assert all(out[k] is sd[k] for k in out)


def test_standard_none_rates():
    assert ao.make_attn_dropout(make_config(attn_dropout="standard", attn_dropout_p=0.2), 0).rate(0.3) == 0.2
    m = ao.make_attn_dropout(make_config(attn_dropout="none"), 0)
    assert m.rate(0.3) == 0.0 and not m.needs_hook


def test_methods_is_the_one_list():
    assert list(ao.METHODS) == ["standard", "none", "attendout", "scheduled"]
    for name, says in ao.METHODS.items():                   # every one builds, and names itself
        cfg = make_config(attn_dropout=name, schedule="linear:0.1:0.3")
        assert ao.make_attn_dropout(cfg, 0) is not None and says.format(p=0.1, cfg=cfg)
    with pytest.raises(ValueError, match="--attn-dropout.*standard.*none.*attendout.*scheduled"):
        ao.make_attn_dropout(make_config(attn_dropout="gaussian"), 0)


# -----------------------------------------------------------------------------
# through train.py: the paired seeds, the two clips

import train  # noqa: E402
from test_train import TINY  # noqa: E402  (listops_dir: conftest.py)


def test_every_method_starts_from_the_same_weights(listops_dir, tmp_path):
    # at one seed, standard / none / scheduled / attendout build identical backbone and head weights (the
    # G-Nets draw from their own generator), so the methods' comparison is paired
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


def test_gnet_gradient_does_not_shrink_the_backbone_step(listops_dir, tmp_path):
    # the G-Nets' reversed gradient can be 1e5 times the backbone's; clipped together it would scale the
    # backbone's step down to nothing. train.clip_gradients clips the two apart.
    args = train.parse_args(["--task", "listops", "--data", listops_dir, "--out", str(tmp_path), *TINY,
                             "--attn-dropout", "attendout"])
    r = train.setup(args)
    for n, p in r.raw.named_parameters():
        p.grad = torch.full_like(p, 1e4 if ao.GNET in n.split(".") else 1e-4)
    before = {n: p.grad.clone() for n, p in r.raw.named_parameters()}
    norms = train.clip_gradients(r.optimizer, 1.0)
    assert norms["gnet_grad_norm"] > 1e4 and norms["grad_norm"] < 1.0
    for n, p in r.raw.named_parameters():
        if ao.GNET in n.split("."):
            assert p.grad.abs().max() < 1.0                            # the G-Nets are clipped on their own
        else:
            assert torch.equal(p.grad, before[n])                      # the backbone's gradient is untouched
