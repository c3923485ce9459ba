"""
attendout.py: the attention-dropout methods of attnreg (methods.md §3): AttendOut, then the
baselines standard, none, scheduled and DropKey.

The idea (AttendOut, Wu et al. 2021): a small network per layer, the G-Net, reads the layer's input
and decides which (query, key) pairs of its attention to mask. The model wants the same answer with
and without the mask, the G-Net wants to change it, and a reward for every pair it keeps stops it
from masking everything. We follow the form the first author published in code
(gingasan/adversarialSA, "Adversarial Self-Attention", Wu et al. 2023), methods.md §3.1.
The kernels apply the mask (model.dense_attention, sparse._attend); train.py builds the loss.

Run the tests: python -m pytest -q tests/test_attendout.py
"""

import json
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# The one place naming the methods: --attn-dropout NAME -> how the run's opening line says it.
METHODS = {
    "standard": "attention dropout {p:g}",
    "none": "no attention dropout",
    "attendout": "AttendOut (G-Net masks)",
    "scheduled": "scheduled attention dropout ({cfg.schedule})",
    "dropkey": "DropKey {p:g}",
}

# GNET: the G-Net's submodule name (export_without_gnet drops every key with this component).
# MASKED: a masked pair's logit drops by this much, so it leaves the softmax (the author's -10000).
# The G-Net's projections start as BERT's linear layers do (std 0.02), from a generator of layer
# l's own, seeded (run seed + GNET_SEED (l + 1)).
GNET = "gnet"
MASKED = 10000.0
GNET_INIT_STD = 0.02
GNET_SEED = 1_000_033


# -----------------------------------------------------------------------------
# AttendOut (methods.md §3.1)
#
# The G-Net of layer l reads the layer's input X (detached: the G-Net cannot shape the backbone
# through its own input) and scores every (query, key) pair with its own query-key product, one
# score per pair for all heads (the author's shape; one per head scored no better, §3.1):
#     a = (X W_a + b_a) / sqrt(d),   c = X W_c + b_c,   G = a c^T          G: [B, 1, L, L]

class GNet(nn.Module):
    """The G-Net of one layer: fused projections [W_a | W_c], plain Parameters (not nn.Linear), so
    that the model-wide init of nn.Linear leaves the G-Net's own seeded init alone."""

    def __init__(self, hidden_size, seed=0):
        super().__init__()
        self.dim = hidden_size
        self.weight = nn.Parameter(torch.empty(2 * hidden_size, hidden_size))   # [W_a | W_c]
        self.bias = nn.Parameter(torch.zeros(2 * hidden_size))
        # Its own generator: the global random stream is left alone, so at one seed every
        # --attn-dropout method starts from the same backbone and head weights (paired runs,
        # methods.md §3.4).
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) * GNET_INIT_STD)

    # x [B, L, d] -> (a, c), each [B, 1, L, d] (one head: the heads share the mask), with
    # a_i . c_j = G_ij. Each kernel computes G from them in its own layout (pair_scores(a, c)).
    def features(self, x):
        g = F.linear(x.detach(), self.weight, self.bias)                 # [B, L, 2d]
        a, c = g[:, None].chunk(2, dim=-1)                               # [B, 1, L, d] each
        return a / math.sqrt(self.dim), c


# The mask, in the author's form: hard in the forward, straight-through in the backward, reversed.
#     forward:   M = [G > 0]                          keep (1) or mask (0) each pair
#     backward:  dL/dG = -(dL/dM) sigmoid'(G)          sigmoid(G)'s gradient, its sign flipped
# The flipped sign is a gradient-reversal layer: the G-Net climbs the loss that the model descends,
# so it learns to mask the pairs whose loss hurts most, and to keep pairs for the keep reward. (The
# author's code adds Gumbel noise g and subtracts it again, x + g - g: the mask has no noise.)

class KeepMask(torch.autograd.Function):
    """M = [G > 0], with the reversed straight-through gradient -sigmoid'(G) (methods.md §3.1)."""

    @staticmethod
    def forward(ctx, G):
        ctx.save_for_backward(G)
        return (G > 0).to(G.dtype)

    @staticmethod
    def backward(ctx, grad):
        (G,) = ctx.saved_tensors
        s = torch.sigmoid(G.float())
        return (-grad * s * (1 - s)).to(G.dtype)     # reversed: the G-Net ascends the loss


# One layer's AttendOut (methods.md §3.1). Of the views of a training forward, only the masked
# one (the last) is given a mask_fn: logits_fn(x, masked=True) calls hook(x); every other view
# (the clean pass) and evaluation are the plain model. The hook returns mask_fn, the function a
# kernel applies to its logits S:
#     S' = S - 10000 (1 - M),   M = KeepMask(G)
# in the kernel's own layout (the dense [B, H, L, L], or the block-sparse layout of sparse.py),
# with G computed there by pair_scores(a, c). It also counts, for the keep reward and the step
# line, the real pairs kept. A forward may call mask_fn several times (the pieces of a sparse
# layout, HST's two stages): the counts add up over the calls, and begin_forward clears them for
# the next forward.

class AttendOut(nn.Module):
    """AttendOut for one layer: its G-Net, and the counts of its last masked pass."""

    def __init__(self, cfg, layer_idx=0):
        super().__init__()
        # the run's seed, per layer (methods.md §3.4)
        seed = (torch.initial_seed() + GNET_SEED * (layer_idx + 1)) % 2 ** 63
        self.gnet = GNet(cfg.hidden_size, seed)
        # differentiable: the real pairs kept in this forward's masked pass, over its kernel calls
        self.kept = None
        # the real pairs of the same (no gradient); 1 - kept / pairs is the masking rate
        self.pairs = None
        # the real query rows, and those whose every real key is masked (no gradient): their
        # logits all drop by the same 10,000, so their softmax, and their output, stay unchanged
        self.rows = None
        self.full_rows = None
        # dense attention, whose layout's last axis is the key's position: the masked real pairs
        # by key position [L] (no gradient), which shows WHERE the G-Net masks
        self.dense = cfg.attention == "dense"
        self.masked_keys = None

    # no Bernoulli dropout in either pass (the author's RoBERTa code)
    def rate(self, step_frac=0.0):
        return 0.0

    # the G-Net's mask on the masked view only (the switch's contract, below)
    def logits_fn(self, x, masked=False):
        return self.hook(x) if masked else None

    def hook(self, x):
        """x [B, L, d]: the layer input of the masked pass. Returns mask_fn(S, valid, pair_scores)
        -> S', the kernels' contract: S the attention logits in the kernel's layout, valid (bool,
        broadcastable to S) the real (query, key) pairs, pair_scores(a, c) G in S's layout."""
        # the G-Net's features, once per forward: [B, heads, L, e] each
        a, c = self.gnet.features(x)

        def mask_fn(S, valid, pair_scores):
            # the scores and the mask in S's layout: [B, 1, ...], broadcast over the H heads of S;
            # [B, H, ...] in a sparse layout with random blocks, whose keys differ by head
            G = pair_scores(a, c).float()
            M = KeepMask.apply(G)
            # the real pairs kept, counted once per pair: averaged over the mask's heads
            if valid.dim() == M.dim() and valid.shape[1] > M.shape[1]:
                valid = valid[:, : M.shape[1]]
            valid = valid.expand_as(M)
            heads = M.shape[1]
            kept = (M * valid).sum() / heads
            pairs = valid.sum() / heads
            # the fully masked rows: a real query row (one valid key or more) with no key kept
            with torch.no_grad():
                real_row = valid.any(dim=-1)                                  # [B, heads, ..]
                none_kept = (M * valid).sum(dim=-1) == 0
                rows = real_row.sum() / heads
                full_rows = (real_row & none_kept).sum() / heads
                if self.dense:                                               # [L]
                    self.masked_keys = ((1 - M) * valid).sum(dim=(0, 1, 2)) / heads
            if self.kept is None:
                self.kept = kept
                self.pairs = pairs
                self.rows = rows
                self.full_rows = full_rows
            else:
                self.kept = self.kept + kept
                self.pairs = self.pairs + pairs
                self.rows = self.rows + rows
                self.full_rows = self.full_rows + full_rows
            # S' = S - 10000 (1 - M): a masked pair leaves the softmax. In fp32 at least (fp64
            # stays): in bf16 (8 significant bits) S - 10000 would round every logit of a fully
            # masked row to one value, making the row uniform instead of leaving it unchanged.
            S = S.to(torch.promote_types(S.dtype, torch.float32))
            return S + (M - 1) * MASKED

        return mask_fn

    # The rates of the last masked pass, 0-d tensors left on the device, so that a training step
    # reads nothing off it (train.py reads them once per logged step); nan where none ran (a
    # layer LayerDrop skipped, a forward without the masked pass).
    def share(self, part, whole):
        if whole is None:
            return torch.tensor(math.nan, device=self.gnet.weight.device)
        return torch.where(whole > 0, part / whole, math.nan)

    # this layer's share of real pairs masked in the last masked pass
    def mask_rate(self):
        kept = None if self.kept is None else self.kept.detach()
        return 1 - self.share(kept, self.pairs)

    # this layer's share of real query rows whose every real key is masked
    def full_row_rate(self):
        return self.share(self.full_rows, self.rows)

    # this layer's masked real pairs by key position, each position's share of them [L] (dense only)
    def masked_by_key(self):
        if self.masked_keys is None:
            return None
        return self.masked_keys / self.masked_keys.sum().clamp(min=1.0)

    def extra_repr(self):
        return f"dim={self.gnet.dim}"


# The model's AttendOut layers, and the start of every training forward.

def attendout_modules(model):
    return [m for m in model.modules() if isinstance(m, AttendOut)]


def begin_forward(model):
    """The model calls it at the start of every training forward: each layer's counts start afresh,
    so they describe exactly one forward (all its kernel calls: layout pieces, HST's two stages).
    """
    for m in attendout_modules(model):
        m.kept = None
        m.pairs = None
        m.rows = None
        m.full_rows = None
        m.masked_keys = None


# The keep reward (methods.md §3.1): tau^2 x (pairs kept per example, summed over layers). The keep
# reward is the G-Nets' objective alone: they climb it, so it pulls them towards keeping pairs,
# against AttendOut's consistency, which pulls them towards masking. The backbone cannot change it.
# Without it the G-Net's best move would be to mask everything.

def keep_reward(model, batch_size):
    """sum_l (pairs kept in layer l) / batch_size: differentiable, reaches the G-Nets only."""
    kept = [m.kept for m in attendout_modules(model) if m.kept is not None]
    if not kept:
        raise RuntimeError("keep_reward: no masked pass ran in this forward")
    return torch.stack(kept).sum() / batch_size


# The model's rates, one per layer, on the device: [layers] each.
def mask_rates(model):
    return torch.stack([m.mask_rate() for m in attendout_modules(model)])


def full_row_rates(model):
    return torch.stack([m.full_row_rate() for m in attendout_modules(model)])


# Where the masks fall (dense attention): per layer, each key position's share of the masked real
# pairs, [layers, L] on the device; None for a sparse or HST layout, whose key axis holds gathered
# blocks, not positions.
def masked_by_key(model):
    shares = [m.masked_by_key() for m in attendout_modules(model)]
    if any(share is None for share in shares):
        return None
    return torch.stack(shares)


# A copy of state_dict without the G-Nets (every key with a 'gnet' component): export drops them.
def export_without_gnet(state_dict):
    return type(state_dict)((k, v) for k, v in state_dict.items() if GNET not in k.split("."))


# What a student sees: every --log-every steps (and at the last step) one JSON line per step in
# OUT/droprates.jsonl with each layer's masking rate, the same numbers the step line shows. A plot
# of them is the learned per-layer pattern; scheduled dropout (§3.2) replays them as Bernoulli
# rates.

class DropRateLogger:
    """{"step": s, "step_frac": f, "drop_rate": [p_1, ..., p_L], "mean": m, "full_rows": [..],
    "masked_by_key": [[share of key 0, key 1, ..] per layer] (dense attention only)} lines."""

    def __init__(self, path, log_interval, append=False):
        self.path = path
        self.log_interval = max(int(log_interval), 1)
        # a fresh run starts the file afresh; a resumed run keeps its earlier lines
        if not append:
            open(self.path, "w").close()

    def log(self, step, step_frac, rates, full_rows=None, masked_by_key=None, last=False):
        """rates: one float per layer; full_rows: each layer's share of real query rows with every
        real key masked; masked_by_key: each layer's masked pairs by key position (masked_by_key);
        last: the final step, always written (a replay then ends at the run's final rates).
        Returns True if a line was written."""
        if step % self.log_interval and not last:
            return False
        # the mean over the layers that ran (LayerDrop may skip some: nan)
        ran = [float(r) for r in rates if not math.isnan(r)]
        rec = {
            "step": int(step),
            "step_frac": float(step_frac),
            "drop_rate": [float(r) for r in rates],
            "mean": sum(ran) / max(len(ran), 1),
        }
        if full_rows is not None:
            rec["full_rows"] = [float(r) for r in full_rows]
        if masked_by_key is not None:
            rec["masked_by_key"] = [[round(x, 5) for x in layer] for layer in masked_by_key]
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return True


# -----------------------------------------------------------------------------
# standard and none (methods.md §3.3): a layer asks rate(step_frac) for the Bernoulli rate its
# kernel drops the attention probabilities with in training, A' = A k / (1 - p), k ~ Bernoulli(1-p)
# per pair (torch's inverted dropout); p = 0 is 'none'.

class AttnDropout(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.p = float(p)

    def rate(self, step_frac=0.0):
        return self.p

    # nothing on the logits: dense attention stays PyTorch's fused kernel
    def logits_fn(self, x, masked=False):
        return None

    def extra_repr(self):
        return f"p={self.p}"


# -----------------------------------------------------------------------------
# scheduled dropout (methods.md §3.2): Bernoulli dropout at a rate p_l(t) per layer l and training
# fraction t, replayed from an AttendOut run's droprates.jsonl, or linear in depth and constant in
# time, 'linear:P_LOW:P_HIGH':
#     p_l = p_low + (p_high - p_low) l / (L - 1),   l = 0 .. L-1

def linear_schedule(spec, num_layers):
    try:
        _, p_low, p_high = spec.split(":")
        p_low = float(p_low)
        p_high = float(p_high)
    except ValueError:
        raise ValueError(f"bad schedule {spec!r}: expected linear:P_LOW:P_HIGH, "
                         "e.g. linear:0.1:0.5") from None
    if not (0.0 <= p_low < 1.0 and 0.0 <= p_high < 1.0):
        raise ValueError(f"bad schedule {spec!r}: rates must be in [0, 1)")
    steps = max(num_layers - 1, 1)
    return [p_low + (p_high - p_low) * l / steps for l in range(num_layers)]


# A replayed schedule: an AttendOut run's droprates.jsonl, one point (t, [p_1 .. p_L]) per line, t
# the fraction of training done, so a run of another length can replay it. A line that cannot be
# read is one error naming the file and the line.

def read_droprates(path, num_layers):
    """A DropRateLogger file -> (fracs [T] increasing, rates [T][L])."""
    # (step_frac or None, step, rates) per line
    points = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rates = [float(r) for r in rec["drop_rate"]]
                points.append((rec.get("step_frac"), float(rec.get("step", 0)), rates))
            except (ValueError, KeyError, TypeError) as e:
                expected = '{"step": S, "step_frac": F, "drop_rate": [p_1, ..., p_L]}'
                raise ValueError(f"{path}, line {lineno}: cannot read drop rates ({e!r}); "
                                 f"expected {expected}") from None
            if len(rates) != num_layers:
                raise ValueError(f"{path}, line {lineno}: {len(rates)} drop rates, "
                                 f"the model has {num_layers} layers")
    if not points:
        raise ValueError(f"{path}: no drop-rate lines")
    # a line without step_frac is placed at step / (the last step logged)
    last = max(step for _, step, _ in points) or 1.0
    points = [(step / last if frac is None else float(frac), r) for frac, step, r in points]
    # a stable sort: equal fractions keep the file's order
    points.sort(key=lambda p: p[0])
    return [t for t, _ in points], [r for _, r in points]


# Between the points the rate is interpolated linearly, outside them held constant:
#     p_l(t) = p_l(t_k) + (t - t_k) / (t_k+1 - t_k) (p_l(t_k+1) - p_l(t_k)),   t_k <= t < t_k+1

class ScheduledDropout(AttnDropout):
    """Bernoulli dropout at p_l(t), t = step_frac in [0, 1]: linear between the points, constant
    outside them."""

    def __init__(self, fracs, rates):
        super().__init__(rates[0])
        self.fracs = list(fracs)                         # [T]
        self.rates = list(rates)                         # [T], this layer's

    def rate(self, step_frac=0.0):
        return float(np.interp(step_frac, self.fracs, self.rates))


# One layer's scheduled dropout, from --schedule: linear:P_LOW:P_HIGH, or a droprates.jsonl.

def make_scheduled(schedule, num_layers, layer_idx):
    if not schedule:
        raise ValueError("attn_dropout 'scheduled' needs --schedule FILE or "
                         "--schedule linear:P_LOW:P_HIGH")
    if schedule.startswith("linear:"):
        return ScheduledDropout([0.0], [linear_schedule(schedule, num_layers)[layer_idx]])
    fracs, rates = read_droprates(schedule, num_layers)  # an AttendOut run's droprates.jsonl
    return ScheduledDropout(fracs, [r[layer_idx] for r in rates])


# -----------------------------------------------------------------------------
# DropKey (Xie et al., CVPR 2023, methods.md §3.3): in training every view's real (query, key)
# logits are dropped at random before the softmax, each with probability p (--attn-dropout-p),
# with no rescaling: the row's softmax renormalises over the keys left.
#     S'_ij = min of S's dtype   if k_ij = 1,  k_ij ~ Bernoulli(p)  (so A_ij = 0 exactly)
#     S'_ij = S_ij               otherwise
# No row is left with no key: a real query row whose every real key was drawn keeps them all
# (S' = S on that row). A kernel hands mask_fn whole softmax rows (model.dense_attention all of
# them; sparse.py the layout's rows, then the global rows; HST's stage 2 is a softmax of its own),
# so the rule holds over each row's whole softmax. The draws come from torch's global random
# stream. Off in evaluation, like every method.

class DropKey(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = float(p)

    # no Bernoulli dropout on the weights after the softmax
    def rate(self, step_frac=0.0):
        return 0.0

    # every view: DropKey acts on each forward, clean or masked (p = 0: nothing, the fused kernel)
    def logits_fn(self, x, masked=False):
        return self.drop_keys if self.p > 0 else None

    def drop_keys(self, S, valid, pair_scores):
        """S' from S (any layout), valid: bool, broadcastable to S, the real pairs."""
        drawn = (torch.rand(S.shape, device=S.device) < self.p) & valid
        # a real row with no real key left keeps them all
        emptied = ~(valid & ~drawn).any(dim=-1, keepdim=True)
        dropped = drawn & ~emptied
        return S.masked_fill(dropped, torch.finfo(S.dtype).min)

    def extra_repr(self):
        return f"p={self.p}"


# -----------------------------------------------------------------------------
# The one switch: each layer's model.Attention builds its attention-dropout module here, by
# cfg.attn_dropout (--attn-dropout). A new method is a class above, a line here and an entry of
# METHODS; model.py names none of them. Every module answers two questions, in training only:
#     rate(t) -> p               the Bernoulli rate on the weights after the softmax (0: none),
#                                t the fraction of training done
#     logits_fn(x, masked) -> None or mask_fn, for one view of the stacked batch: x [B, L, d]
#                                its layer input, masked True for AttendOut's masked copy (the
#                                last view); mask_fn(S, valid, pair_scores) -> S' is applied by the
#                                kernel to that view's logits before the softmax, in every
#                                topology (see AttendOut.hook for its arguments)
# Dense attention stays PyTorch's fused kernel while no view has a mask_fn (standard, none,
# scheduled). A method on the logits (AttendOut, DropKey) therefore acts in every view it asks
# for: SAR's and R-Drop's, AttendOut's clean and masked passes, and HST's two stages.

def make_attn_dropout(cfg, layer_idx):
    """Layer layer_idx's attention-dropout module for cfg.attn_dropout (one of METHODS)."""
    method = cfg.attn_dropout
    if method == "standard":
        return AttnDropout(cfg.attn_dropout_p)
    if method == "none":
        return AttnDropout(0.0)
    if method == "scheduled":
        return make_scheduled(cfg.schedule, cfg.num_layers, layer_idx)
    if method == "attendout":
        return AttendOut(cfg, layer_idx)
    if method == "dropkey":
        return DropKey(cfg.attn_dropout_p)
    raise ValueError(f"unknown attn_dropout {method!r}: --attn-dropout must be one of "
                     f"{', '.join(METHODS)}")
