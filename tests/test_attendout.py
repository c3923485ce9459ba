"""
Tests for attendout.py (methods.md §3): AttendOut's G-Net hook, gradient reversal, budget, scheduled dropout.

Uses a small self-contained dense attention (below), not model.py, so it runs on its own.
Run: python -m pytest tests/test_attendout.py -q
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


def make_config(**kw):
    cfg = dict(attn_dropout="attendout", attn_dropout_p=0.1, num_heads=H, hidden_size=D, gnet_dim=4,
               gnet_tau=0.5, gnet_budget=None, schedule="", num_layers=3, gnet_mask="inverted",
               gnet_max_pi=0.5, gnet_reverse=True, gnet_budget_scope="mean")
    cfg.update(kw)
    return types.SimpleNamespace(**cfg)


def attn(q, k, v, mask, mod, x, training, t=0.0):
    """Dense reference kernel using the contract's hook. q,k,v [B, H, L, d_h]; mask [B, L] (1 = real)."""
    valid = mask.bool()[:, None, None, :]                                  # [B, 1, 1, L]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])                   # [B, H, L, L]
    s = s.masked_fill(~valid, torch.finfo(s.dtype).min)
    A = s.softmax(-1)
    if training and mod.needs_hook:
        real_pairs = mask.bool()[:, None, :, None] & valid                 # [B, 1, L, L] real query and key
        mod.reset_stats()                                                  # the model does this per forward
        A = mod.hook(x)(A, real_pairs, lambda a, c: a @ c.transpose(-1, -2))
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


def test_eval_equals_plain_attention():
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(), 0).eval()
    assert not mod.needs_hook
    plain = attn(q, k, v, mask, ao.AttnDropout(0.0), x, training=False)
    assert torch.equal(attn(q, k, v, mask, mod, x, training=False), plain)
    # standard dropout modules: also identity in eval
    assert torch.equal(attn(q, k, v, mask, ao.make_attn_dropout(make_config(attn_dropout="standard"), 0),
                            x, training=False), plain)


def test_training_forwards_differ():
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(attn_dropout_p=0.3), 0).train()
    assert mod.needs_hook and mod.rate(0.5) == 0.0
    assert not torch.equal(attn(q, k, v, mask, mod, x, True), attn(q, k, v, mask, mod, x, True))


def test_mask_binary_and_padding_zero():
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(attn_dropout_p=0.3), 0).train()
    valid = mask.bool()[:, None, None, :]
    s = (q @ k.transpose(-1, -2) / math.sqrt(DH)).masked_fill(~valid, torch.finfo(q.dtype).min)
    A = s.softmax(-1)
    a, c = mod.gnet.features(x)
    pi = torch.sigmoid(mod.gnet.logits(a @ c.transpose(-1, -2)))
    A2 = mod.hook(x)(A, valid, lambda a, c: a @ c.transpose(-1, -2))
    validx = valid.expand_as(A)
    kmask = (A2 / A * (1 - pi))[validx]
    assert torch.all((kmask.abs() < 1e-6) | ((kmask - 1).abs() < 1e-6))
    assert 0 < (kmask > 0.5).float().mean() < 1           # some kept, some dropped
    assert torch.all(A2[~validx] == 0)                      # padding keys stay exactly 0
    assert torch.isfinite(A2).all()


def test_fused_drop_matches_plain_formula():
    # RelaxedDrop must equal methods.md §3.1 written with plain autograd ops, forward and gradients, same u
    torch.manual_seed(0)
    A = torch.rand(2, 3, 5, 5).softmax(-1).requires_grad_()
    Z = torch.randn(2, 3, 5, 5).requires_grad_()
    g = torch.randn(2, 3, 5, 5)
    tau = 0.5
    torch.manual_seed(1)
    out = ao.RelaxedDrop.apply(A, Z, torch.sigmoid(Z).detach(), tau)
    dA, dZ = torch.autograd.grad((out * g).sum(), (A, Z))
    torch.manual_seed(1)
    u = torch.rand_like(Z).clamp(ao.U_EPS, 1 - ao.U_EPS)
    k_soft = torch.sigmoid((-Z + torch.log(u) - torch.log(1 - u)) / tau)
    k_hard = (k_soft > 0.5).float()
    kk = k_hard + k_soft - k_soft.detach()
    ref = A * kk / (1 - torch.sigmoid(Z)).detach()
    rA, rZ = torch.autograd.grad((ref * g).sum(), (A, Z))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dA, rA)
    torch.testing.assert_close(dZ, rZ)


def task_grad_wq(reverse):
    torch.manual_seed(0)
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(attn_dropout_p=0.3), 0).train()
    mod.reverse = reverse
    torch.manual_seed(123)  # same u in both runs
    out = attn(q, k, v, mask, mod, x, True)
    (out ** 2).sum().backward()
    hd = H * mod.gnet.gnet_dim
    return mod.gnet.weight.grad[:hd].clone(), mod  # rows [0, H*d_g) are W_q


def test_stats_accumulate_over_layout_pieces():
    # a kernel may call drop_fn once per layout piece: statistics add up over the calls of one forward
    x, q, k, v, mask = inputs()
    mod = ao.make_attn_dropout(make_config(), 0).train()
    valid = mask.bool()[:, None, None, :]
    A = torch.rand(B, H, L, L) * valid
    scores = lambda a, c: a @ c.transpose(-1, -2)
    mod.hook(x)(A, valid, scores)
    full_sum, full_count = mod.pi_sum.item(), mod.pi_count.item()
    assert ao.drop_rates([mod]) == [pytest.approx(full_sum / full_count)]
    assert not mod.pi_sum.requires_grad                    # plain numbers: no graph outlives the step
    mod.reset_stats()                                      # what the model does at each training forward
    assert mod.pi_sum is None and math.isnan(ao.drop_rates([mod])[0])
    fn = mod.hook(x)
    half = lambda rows: (lambda a, c: a[:, :, rows] @ c.transpose(-1, -2))
    fn(A[:, :, :3], valid, half(slice(0, 3)))
    fn(A[:, :, 3:], valid, half(slice(3, None)))
    assert mod.pi_count.item() == full_count
    assert mod.pi_sum.item() == pytest.approx(full_sum, rel=1e-5)
    mod.hook(x[:, :4])(A[:, :, :4, :4], valid[..., :4], scores)  # e.g. HST stage 2: 2nd hook, same forward
    assert mod.pi_count.item() == full_count + H * 4 * (4 + 4)


def test_gradient_reversal_and_straight_through():
    g_rev, mod = task_grad_wq(True)
    g_fwd, _ = task_grad_wq(False)
    assert g_rev.abs().sum() > 0                          # straight-through: G-Net receives a gradient
    assert mod.gnet.beta.grad is not None and mod.gnet.beta.grad != 0
    torch.testing.assert_close(g_rev, -g_fwd)


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
    assert len(rates) == 3 and all(abs(r - 0.1) < 0.02 for r in rates)   # pi ~ p0 at init
    # the statistics count exactly the real (query, key) pairs: H * (8 * 8 + 5 * 5), padding rows count nothing
    assert mods[0].pi_count.item() == H * (8 * 8 + 5 * 5)


def test_budget_holds_against_the_reversed_task_gradient():
    # The G-Net is pushed to drop more (it maximises the task loss); hold_budget must keep the mean at rho
    # while the layers stay free to differ.
    torch.manual_seed(0)
    x, q, k, v, mask = inputs()
    cfg = make_config(attn_dropout_p=0.1, gnet_budget=0.3)
    mods = [ao.make_attn_dropout(cfg, l).train() for l in range(cfg.num_layers)]
    opt = torch.optim.Adam([p for m in mods for p in m.parameters()], lr=0.05)
    target = torch.randn(B, H, L, DH)
    for step in range(60):
        # layer l's output matters l + 1 times as much: a task that wants layers treated differently
        loss = sum((l + 1) * ((attn(q, k, v, mask, m, x, True) - target) ** 2).mean() for l, m in enumerate(mods))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean, shift = ao.hold_budget(mods)
        if step == 0:
            assert shift > 0                                # measured 0.1 < rho = 0.3: every beta moves up
    for m in mods:
        attn(q, k, v, mask, m, x, True)
    rates = ao.drop_rates(mods)
    assert abs(sum(rates) / 3 - 0.3) < 0.02                 # the mean is held ...
    assert max(rates) - min(rates) > 0.05                   # ... the layers are not


def test_budget_step_lands_on_rho():
    # one hold_budget on fixed inputs: the next forward's mean must land on rho far more closely than before
    torch.manual_seed(0)
    x, q, k, v, mask = inputs()
    cfg = make_config(attn_dropout_p=0.1, gnet_budget=0.4)
    mods = [ao.make_attn_dropout(cfg, l).train() for l in range(cfg.num_layers)]
    with torch.no_grad():
        for i, m in enumerate(mods):          # spread the logits: many pi near 0 or 1, layers apart
            m.gnet.weight.normal_(std=0.5)
            m.gnet.beta.fill_(-3.0 + i)
    def mean_rate():
        for m in mods:
            attn(q, k, v, mask, m, x, True)
        return sum(ao.drop_rates(mods)) / 3
    before = mean_rate()
    got, delta = ao.hold_budget(mods)
    assert got == pytest.approx(before)
    after = mean_rate()
    assert abs(before - 0.4) > 0.1 and abs(after - 0.4) < 0.005
    # the budget holds in the forward itself, not one step late: a large jump of the G-Nets' projections after
    # hold_budget (AdamW can move them that much in one step) leaves every layer at its target, the mean at rho
    targets = [m.gnet.target.item() for m in mods]
    assert sum(targets) / 3 == pytest.approx(0.4, abs=1e-5) and max(targets) - min(targets) > 0.05
    with torch.no_grad():
        for m in mods:
            m.gnet.weight.mul_(2.0)
    for m in mods:
        attn(q, k, v, mask, m, x, True)
    assert ao.drop_rates(mods) == pytest.approx(targets, abs=2e-3)
    # the histogram counts the real pairs by their logit
    m = mods[0]
    a, c = m.gnet.features(x)
    Z = m.gnet.logits(a @ c.transpose(-1, -2))
    real = (mask.bool()[:, None, :, None] & mask.bool()[:, None, None, :]).expand_as(Z)
    assert m.z_hist.sum().item() == real.sum().item()
    width = 2 * ao.Z_RANGE / ao.Z_BINS
    inside = ((Z >= -1.0) & (Z < -1.0 + width) & real).sum().item()
    assert m.z_hist[int((-1.0 + ao.Z_RANGE) / width)].item() == inside


def test_budget_shift_solves_the_mean_of_a_histogram():
    hist = torch.zeros(2, ao.Z_BINS, dtype=torch.float64)
    k1, k2, k3 = (ao.Z_BINS * k // 512 for k in (10, 200, 128))  # logits -31.4, -19.5, -24.0 at any bin count
    hist[0, k1], hist[0, k2], hist[1, k3] = 5, 5, 1          # a spread layer and a flat one
    delta = ao.shift_for_rate(hist, 0.2).item()
    width = 2 * ao.Z_RANGE / ao.Z_BINS
    c = lambda k: -ao.Z_RANGE + width * (k + 0.5)
    sig = lambda z: 1 / (1 + math.exp(-z))
    got = (0.5 * (sig(c(k1) + delta) + sig(c(k2) + delta)) + sig(c(k3) + delta)) / 2
    assert got == pytest.approx(0.2, abs=1e-5)                   # the grid search's precision: 32 / 64^3


def test_no_state_outlives_a_forward():
    # encode().backward() steps without any budget call: nothing leaks, nothing breaks
    import model as M
    cfg = M.Config(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_positions=40,
                   num_labels=2, attn_dropout="attendout", gnet_dim=4)
    net = M.Model(cfg).train()
    ids = torch.randint(3, 50, (2, 12))
    for _ in range(3):
        net.encode(ids).sum().backward()
    first = ao.drop_rates(net)
    net.encode(ids).sum().backward()
    assert ao.hold_budget(net) is not None and all(math.isfinite(r) for r in first)
    # the statistics describe one forward: a second forward replaces them, it does not add to them
    count = [m.pi_count.item() for m in ao.attendout_modules(net)]
    net.encode(ids)
    assert [m.pi_count.item() for m in ao.attendout_modules(net)] == count


def test_zero_p0_is_guarded():
    m = ao.make_attn_dropout(make_config(attn_dropout_p=0.0), 0)
    assert math.isfinite(m.gnet.beta.item())
    assert abs(torch.sigmoid(m.gnet.beta).item() - ao.P0_MIN) < 1e-6


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


def test_unknown_method():
    with pytest.raises(ValueError, match="--attn-dropout.*standard.*none.*attendout.*scheduled"):
        ao.make_attn_dropout(make_config(attn_dropout="gaussian"), 0)


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
        return [mod.pi_count.item() for mod in ao.attendout_modules(net)]

    plain = counts(ids, mask)
    padded = counts(torch.cat([ids, torch.ones(2, 4, dtype=torch.long)], 1), torch.cat([mask, torch.zeros(2, 4, dtype=torch.long)], 1))
    assert plain == padded
    if attention == "dense":   # every real pair: H * (8 * 8 + 6 * 6) per layer
        assert plain == [2 * (64 + 36)] * 2


def test_gnet_logits_stay_within_the_bound_of_beta():
    # however large the G-Net's projections grow, every logit stays within PAIR_MAX of the layer's beta, so the
    # mask never becomes deterministic and the budget's shift of beta always moves the rate
    x, q, k, v, mask = inputs()
    m = ao.make_attn_dropout(make_config(), 0)
    with torch.no_grad():
        m.gnet.weight.normal_(std=100.0)
    a, c = m.gnet.features(x)
    pair = a @ c.transpose(-1, -2)
    Z = m.gnet.logits(pair)
    beta = m.gnet.beta.item()
    assert pair.abs().max() > 1e3 and (Z - beta).abs().max() <= ao.PAIR_MAX
    small = m.gnet.logits(torch.tensor(0.01))                 # near 0 it is the plain pair term
    assert (small - beta).item() == pytest.approx(0.01, rel=1e-4)


# -----------------------------------------------------------------------------
# the mask forms (--gnet-mask, methods.md §3.1): what a row of A looks like after dropping

def adversarial_module(form, **kw):
    """An adversarially strong G-Net: projections scaled up 500x (std 1), beta at 0, so pi spreads over (0, 1)
    with some pairs near sigmoid(PAIR_MAX) = 0.9997 and many in between (a kept pair at pi = 0.9 is rescaled
    10x by the inverted form)."""
    m = ao.make_attn_dropout(make_config(gnet_mask=form, attn_dropout_p=0.1, **kw), 0).train()
    with torch.no_grad():
        m.gnet.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(0))
        m.gnet.beta.zero_()
    return m


def row_sums_after_drop(m, seed=0):
    x, q, k, v, mask = inputs(seed)
    valid = mask.bool()[:, None, None, :]
    A = (q @ k.transpose(-1, -2)).masked_fill(~valid, -1e9).softmax(-1)
    m.reset_stats()
    out = m.hook(x)(A, valid, lambda a, c: a @ c.transpose(-1, -2))
    return out.sum(-1), m


@pytest.mark.parametrize("form, bound", [("logit", 1.0), ("rowscale", 1.0), ("capped", 2.0)])
def test_bounded_forms_keep_every_row_sum_under_their_bound(form, bound):
    # the default form (capped) and the other bounded ones, against the strongest G-Net the bound allows, over
    # many draws of the mask; the unbounded inverted form, in the same setting, goes far above (next test)
    import model
    assert model.Config().gnet_mask == "capped"                # the default's bound: 1 / (1 - 0.5) = 2
    worst, top_pi = 0.0, 0.0
    for seed in range(20):
        sums, m = row_sums_after_drop(adversarial_module(form), seed)
        worst, top_pi = max(worst, sums.max().item()), max(top_pi, m.pi_max.item())
        assert m.row_max.item() == pytest.approx(sums.max().item(), rel=1e-6)   # what droprates.jsonl logs
    assert worst <= bound + 1e-5
    if form == "capped":
        assert top_pi <= 0.5 + 1e-6                            # --gnet-max-pi's default
    else:
        assert top_pi > 0.99                                   # the G-Net really is adversarially strong


def test_inverted_form_rows_can_sum_far_above_one():
    worst = max(row_sums_after_drop(adversarial_module("inverted"), seed)[0].max().item() for seed in range(20))
    assert worst > 20.0                                       # 135 with this generator


def test_logit_form_is_the_softmax_over_the_kept_keys():
    # forward: dropping by the keep mask then renormalising = setting the dropped pairs' logits to -inf before
    # the softmax (same u). Gradient: "logit" differentiates the row sum, "rowscale" treats it as a constant.
    torch.manual_seed(0)
    s = torch.randn(2, 3, 6, 6)
    Z = torch.randn(2, 3, 6, 6)
    g = torch.randn(2, 3, 6, 6)
    results = {}
    for form in ("logit", "rowscale"):
        sr = s.clone().requires_grad_()
        torch.manual_seed(1)
        out = ao.apply_keep_mask(form, sr.softmax(-1), Z, torch.sigmoid(Z), 0.5)
        results[form] = (out, torch.autograd.grad((out * g).sum(), sr)[0])
    torch.manual_seed(1)
    u = torch.rand_like(Z)
    k_hard = torch.sigmoid((u.logit(ao.U_EPS) - Z) / 0.5) > 0.5
    sr = s.clone().requires_grad_()
    ref = sr.masked_fill(~k_hard, float("-inf")).softmax(-1).nan_to_num(0.0)   # a row with no kept key: 0
    ref_grad = torch.autograd.grad((ref * g).sum(), sr)[0]
    torch.testing.assert_close(results["logit"][0], ref)
    torch.testing.assert_close(results["rowscale"][0], ref)
    torch.testing.assert_close(results["logit"][1], ref_grad)                  # the exact gradient
    assert not torch.allclose(results["rowscale"][1], ref_grad)                # the constant-sum estimator


def test_capped_budget_lands_on_rho_and_per_layer_scope_holds_every_layer():
    torch.manual_seed(0)
    x, q, k, v, mask = inputs()
    for form, scope in (("capped", "mean"), ("logit", "layer")):
        mods = [adversarial_module(form, gnet_budget_scope=scope) for _ in range(3)]
        with torch.no_grad():
            mods[0].gnet.beta.fill_(-3.0)                     # layers at different levels
            mods[2].gnet.beta.fill_(2.0)
        for _ in range(2):                                    # 1st forward: no target yet; then held
            for m in mods:
                row_sums_after_drop(m)
            mean, _ = ao.hold_budget(mods)
        rates = ao.drop_rates(mods)
        assert sum(rates) / 3 == pytest.approx(0.1, abs=2e-3)
        if scope == "layer":
            assert rates == [pytest.approx(0.1, abs=2e-3)] * 3
        else:
            assert max(rates) - min(rates) > 0.05             # the mean scope keeps the layers' spread
            assert max(m.pi_max.item() for m in mods) <= 0.5 + 1e-6


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
# through train.py: the flags, the paired seeds and the drop-rate log

import train  # noqa: E402
from test_train import TINY, run_main  # noqa: E402  (listops_dir: conftest.py)


def test_every_method_starts_from_the_same_weights(listops_dir, tmp_path):
    # at one seed, standard / none / scheduled / attendout build identical backbone and head weights (the
    # G-Nets draw from their own generator), so the methods' comparison is paired
    states = {}
    for method in ("standard", "none", "attendout", "scheduled"):
        extra = ["--schedule", "linear:0.1:0.3"] if method == "scheduled" else []
        args = train.parse_args(["--task", "listops", "--data", listops_dir, "--out", str(tmp_path / method),
                                 "--attn-dropout", method, "--seed", "7", *extra, *TINY])
        full = train.setup(args).raw.state_dict()
        assert any(ao.GNET in k for k in full) == (method == "attendout")
        states[method] = {k: v for k, v in full.items() if ao.GNET not in k.split(".")}
    for method, st in states.items():
        assert st.keys() == states["standard"].keys()
        for k, v in st.items():
            assert torch.equal(v, states["standard"][k]), f"{method}: {k} differs from standard's"


def test_mask_flags_reach_the_model_and_the_log(listops_dir, tmp_path, capfd):
    out = tmp_path / "capped"
    code, _, err = run_main(["--task", "listops", "--data", listops_dir, "--out", str(out), "--max-steps", "3",
                             "--batch-size", "8", "--log-every", "1", "--attn-dropout", "attendout",
                             "--gnet-mask", "capped", "--gnet-max-pi", "0.3", "--gnet-cooperative",
                             "--gnet-budget-scope", "layer", *TINY], capfd)
    assert code == 0, err
    ckpt = torch.load(out / "ckpt_last.pt", weights_only=True)
    cfg = ckpt["config"]
    assert (cfg["gnet_mask"], cfg["gnet_max_pi"], cfg["gnet_reverse"], cfg["gnet_budget_scope"]) == \
        ("capped", 0.3, False, "layer")
    lines = [json.loads(line) for line in open(out / "droprates.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all(0 < p <= 0.3 + 1e-6 for r in lines for p in r["max_pi"])
    assert all(1.0 - 1e-3 < s <= 1 / (1 - 0.3) + 1e-5 for r in lines for s in r["max_row_sum"])
    out = tmp_path / "default"
    code, _, err = run_main(["--task", "listops", "--data", listops_dir, "--out", str(out), "--max-steps", "2",
                             "--batch-size", "8", "--log-every", "1", "--attn-dropout", "attendout", *TINY], capfd)
    assert code == 0, err
    assert torch.load(out / "ckpt_last.pt", weights_only=True)["config"]["gnet_mask"] == "capped"
    lines = [json.loads(line) for line in open(out / "droprates.jsonl")]
    assert all(s <= 2.0 + 1e-5 and p <= 0.5 + 1e-6 for r in lines for s, p in zip(r["max_row_sum"], r["max_pi"]))


def test_gnet_gradient_does_not_shrink_the_backbone_step(listops_dir, tmp_path):
    # the G-Nets' reversed gradient can be 1e5 times the backbone's; clipped together it would scale the
    # backbone's step down to nothing. train.clip_gradients clips the two apart.
    args = train.parse_args(["--task", "listops", "--data", listops_dir, "--out", str(tmp_path),
                             "--attn-dropout", "attendout", *TINY])
    model = train.setup(args).raw
    for n, p in model.named_parameters():
        p.grad = torch.full_like(p, 1e4 if ao.GNET in n.split(".") else 1e-4)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    norms = train.clip_gradients(model, 1.0)
    assert norms["gnet_grad_norm"] > 1e4 and norms["grad_norm"] < 1.0
    for n, p in model.named_parameters():
        if ao.GNET in n.split("."):
            assert p.grad.abs().max() < 1.0                            # the G-Nets are clipped on their own
        else:
            assert torch.equal(p.grad, before[n])                      # the backbone's gradient is untouched
