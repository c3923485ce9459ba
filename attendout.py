"""
attendout.py: attention-dropout methods for attnreg (methods.md §3).

The idea (AttendOut, Wu et al. 2021): instead of dropping attention probabilities with a fixed rate, a
small per-layer G-Net looks at the layer input and predicts a drop probability for every (head, query, key).
How it is trained is our reconstruction (methods.md §3.1): adversarially (gradient reversal) under a mean
drop-rate budget, the mask applied in one of four forms (--gnet-mask).

Four methods, chosen by `--attn-dropout` (config.attn_dropout) and built by `make_attn_dropout(config, l)`:
  standard   fixed-rate Bernoulli dropout on the attention probabilities (rate attn_dropout_p)
  none       no attention dropout
  scheduled  Bernoulli dropout with rate p_l(t): "linear:P_LOW:P_HIGH" or replayed from a droprates.jsonl
  attendout  the G-Net (methods.md §3.1, reconstructed) applied through the kernel hook drop_fn(A, valid, pair_scores)

Where the G-Net mask is: `AttendOut.hook` (below) returns drop_fn; drop_fn computes the drop logits Z and
calls `apply_keep_mask`, which samples the keep mask k and applies it by the --gnet-mask form: by default
(capped) A * k / (1 - pi) with every pi <= 0.5, so a kept pair is rescaled at most 2x. The kernels call drop_fn on the
attention probabilities right after the softmax (model.dense_attention, sparse._attend).

The mean drop rate is a constraint, not a penalty: in every training forward the hook shifts each layer's
logits to its target rate, and after every optimizer step the trainer calls `hold_budget(model)`, which sets
the targets from one common shift of all layers so that the mean drop probability over layers, heads and
real (query, key) pairs is the budget rho (methods.md §3.1; --gnet-budget-scope layer: every layer at rho).
`drop_rates(model)` and `drop_tails(model)` give the per-layer rates, largest pi and largest row sum of the
last training forward (DropRateLogger writes them); `export_without_gnet(state_dict)` removes the G-Net
before exporting a fine-tuned model.

Run the tests: python -m pytest tests/test_attendout.py -q
"""

import bisect
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

METHODS = ("standard", "none", "attendout", "scheduled")
GNET = "gnet"        # name of the G-Net submodule: export_without_gnet drops keys with this component
P0_MIN = 1e-4        # attn_dropout_p = 0 would make beta = logit(0) = -inf; start from this rate instead
U_EPS = 1e-6         # u ~ U(0,1) is clamped to [U_EPS, 1 - U_EPS] so log u and log(1-u) are finite
KEEP_MIN = 1e-4      # 1 - pi is clamped to >= KEEP_MIN, so 1/(1-pi) <= 1e4 (finite, also in fp16)
PAIR_MAX = 8.0       # the G-Net's pair term is soft-bounded to +-PAIR_MAX logits (see GNet.logits)
Z_RANGE = 32.0       # the budget's histogram of drop logits Z covers [-Z_RANGE, Z_RANGE] (clamped beyond) ...
Z_BINS = 4096        # ... in this many bins (1/64 wide): the mean rate after a shift to within ~1e-3
SHIFT_MAX = 16.0     # the budget's shifts stay within +-SHIFT_MAX, so clamped logits stay saturated after them
GNET_SEED = 1_000_033  # the G-Net of layer l draws its init from torch.Generator seeded (run seed + GNET_SEED (l+1))
MASKS = ("logit", "rowscale", "capped", "inverted")  # --gnet-mask: how the keep mask k is applied (§3.1)


# -----------------------------------------------------------------------------
# gradient reversal (methods.md §3.1: G-Net maximises the task loss, one backward pass)

class GradReverse(torch.autograd.Function):
    """Identity in the forward pass, negated gradient in the backward pass."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


def grad_reverse(x):
    return GradReverse.apply(x)


# -----------------------------------------------------------------------------
# baselines: standard / none (methods.md §3.3) and the base behaviour every method shares

class AttnDropout(nn.Module):
    """Plain Bernoulli attention dropout with a fixed rate p; p = 0 is the 'none' method.

    The layer asks `rate(step_frac)` for the rate to pass to the kernel in training (0.0 in eval) and
    calls `hook(x)` only when `needs_hook` is True (AttendOut in training).
    """

    def __init__(self, p=0.0):
        super().__init__()
        self.p = float(p)

    def rate(self, step_frac=0.0):
        return self.p

    @property
    def needs_hook(self):
        return False

    def hook(self, x):
        raise RuntimeError(f"{type(self).__name__} applies plain dropout, it has no drop_fn hook")

    def extra_repr(self):
        return f"p={self.p}"


# -----------------------------------------------------------------------------
# scheduled Bernoulli dropout (methods.md §3.2)

def linear_schedule(spec, num_layers):
    """'linear:P_LOW:P_HIGH' -> per layer rate, linear in depth, constant in time. -> list[L] of float"""
    parts = spec.split(":")
    try:
        assert len(parts) == 3
        p_low, p_high = float(parts[1]), float(parts[2])
    except (AssertionError, ValueError):
        raise ValueError(f"bad schedule {spec!r}: expected linear:P_LOW:P_HIGH, e.g. linear:0.1:0.5") from None
    for p in (p_low, p_high):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"bad schedule {spec!r}: rates must be in [0, 1)")
    if num_layers == 1:
        return [p_low]
    # methods.md §3.2: p_l = p_low + (p_high - p_low) * l / (L - 1), l = 0 .. L-1
    return [p_low + (p_high - p_low) * l / (num_layers - 1) for l in range(num_layers)]


def read_droprates(path, num_layers):
    """Read an AttendOut drop-rate log (DropRateLogger's JSON lines).

    Returns (fracs [T] increasing, rates [T][L]). The time axis is the logged step_frac; a line without
    step_frac uses step / (last logged step).
    """
    entries = []  # (lineno, step, step_frac or None, rates)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rates = [float(r) for r in rec["drop_rate"]]
                step = float(rec["step"]) if "step" in rec else None
                frac = float(rec["step_frac"]) if rec.get("step_frac") is not None else None
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}, line {lineno}: cannot parse drop-rate entry ({e!r}); expected "
                                 '{"step": S, "step_frac": F, "drop_rate": [p_1, ..., p_L]}') from None
            if len(rates) != num_layers:
                raise ValueError(f"{path}, line {lineno}: {len(rates)} drop rates but the model has "
                                 f"{num_layers} layers")
            if frac is None and step is None:
                raise ValueError(f"{path}, line {lineno}: entry has neither step_frac nor step")
            entries.append((lineno, step, frac, rates))
    if not entries:
        raise ValueError(f"{path}: no drop-rate entries")
    last_step = max((e[1] for e in entries if e[1] is not None), default=None)
    points = []
    for lineno, step, frac, rates in entries:
        if frac is None:
            if not last_step:
                raise ValueError(f"{path}, line {lineno}: no step_frac and no positive last step to scale by")
            frac = step / last_step
        points.append((frac, rates))
    points.sort(key=lambda p: p[0])  # stable: equal fractions keep file order
    return [p[0] for p in points], [p[1] for p in points]


def interpolate(fracs, values, t):
    """Piecewise-linear value at t through the points (fracs[i], values[i]), clamped outside."""
    if t <= fracs[0]:
        return values[0]
    if t >= fracs[-1]:
        return values[-1]
    i = bisect.bisect_right(fracs, t)  # fracs[i-1] <= t < fracs[i]
    f0, f1 = fracs[i - 1], fracs[i]
    w = (t - f0) / (f1 - f0)
    return values[i - 1] + w * (values[i] - values[i - 1])


class ScheduledDropout(AttnDropout):
    """Bernoulli dropout with rate p_l(t) (methods.md §3.2), t = step_frac in [0, 1] (fraction of training)."""

    def __init__(self, fracs, rates):
        super().__init__(rates[0])
        self.fracs, self.rates = list(fracs), list(rates)  # [T], [T] for this layer

    def rate(self, step_frac=0.0):
        return interpolate(self.fracs, self.rates, float(step_frac))

    def extra_repr(self):
        return f"points={len(self.fracs)}, p(0)={self.rates[0]:.3f}, p(1)={self.rates[-1]:.3f}"


def make_scheduled(schedule, num_layers, layer_idx):
    if not schedule:
        raise ValueError("attn_dropout 'scheduled' needs --schedule FILE or --schedule linear:P_LOW:P_HIGH")
    if schedule.startswith("linear:"):
        return ScheduledDropout([0.0], [linear_schedule(schedule, num_layers)[layer_idx]])
    fracs, rates = read_droprates(schedule, num_layers)
    return ScheduledDropout(fracs, [r[layer_idx] for r in rates])


# -----------------------------------------------------------------------------
# AttendOut: the G-Net (methods.md §3.1, reconstructed from a short summary of the paper)

class GNet(nn.Module):
    """Per-layer drop-logit generator: Z = (X W_q)(X W_k)^T / sqrt(d_g) + beta, per head.

    W_q and W_k are fused in one linear map (weight, bias): rows [0, H*d_g) are W_q, rows [H*d_g, 2*H*d_g)
    are W_k. They are plain Parameters, not an nn.Linear, so a model-wide `apply(init nn.Linear)` (BERT init,
    std 0.02) does not overwrite the small G-Net init.
    """

    def __init__(self, hidden_size, num_heads, gnet_dim, p0, seed=0):
        super().__init__()
        self.num_heads, self.gnet_dim = num_heads, gnet_dim
        self.weight = nn.Parameter(torch.empty(2 * num_heads * gnet_dim, hidden_size))  # [W_q | W_k]
        self.bias = nn.Parameter(torch.empty(2 * num_heads * gnet_dim))
        self.beta = nn.Parameter(torch.zeros(()))
        # this layer's drop rate in the next training forward, set by hold_budget (NaN: none yet); a buffer, so
        # checkpoints keep it and `export_without_gnet` drops it with the rest of the G-Net
        self.register_buffer("target", torch.tensor(float("nan")))
        self.p0 = max(float(p0), P0_MIN)
        self.seed = int(seed)
        self.reset_parameters()

    def reset_parameters(self):
        # methods.md §3.1: projections small (std 0.002, zero bias) and beta = logit(p0), so that pi ~ p0 at start.
        # Drawn from the G-Net's own generator, not the global one: building a model with G-Nets then leaves the
        # global random stream untouched, so at one seed every --attn-dropout method starts from identical
        # backbone and head weights (a paired comparison, methods.md §3.4).
        g = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) * 0.002)
        nn.init.zeros_(self.bias)
        with torch.no_grad():
            self.beta.fill_(math.log(self.p0 / (1.0 - self.p0)))

    def features(self, x):
        """x [B, L, d] -> (a, c), each [B, H, L, d_g], such that a_i . c_j = gq_i . gk_j / sqrt(d_g).
        The scale is folded into a, so the kernel's pair_scores(a, c) gives the pair term directly."""
        B, L, _ = x.shape
        H, dg = self.num_heads, self.gnet_dim
        g = F.linear(x.detach(), self.weight, self.bias)         # [B, L, 2*H*d_g]  X is detached (methods.md §3.1)
        g = g.view(B, L, 2, H, dg).permute(2, 0, 3, 1, 4)        # [2, B, H, L, d_g]
        return g[0] * (1.0 / math.sqrt(dg)), g[1]                # a = gq / sqrt(d_g), c = gk: [B, H, L, d_g]

    def logits(self, pair):
        """Z = beta + PAIR_MAX tanh(pair / PAIR_MAX), pair = gq gk^T / sqrt(d_g) in any layout (methods.md §3.1).
        (reconstructed) The soft bound keeps every pair within +-PAIR_MAX logits of the layer's beta: the
        adversarial G-Net cannot push its logits to +-infinity (a deterministic mask), and the budget can always
        move a layer's rate by shifting beta. Near 0 it is the plain pair term."""
        return self.beta + PAIR_MAX * torch.tanh(pair * (1.0 / PAIR_MAX))


# --- the keep mask and the four ways to apply it (--gnet-mask, methods.md §3.1) -----------------------------
#
# Every form draws the same keep mask k from the drop logits Z (a relaxed Bernoulli, straight-through):
#     u ~ U(0,1),  k_soft = sigmoid((log u - log(1-u) - Z) / tau),  k_hard = [k_soft > 0.5]   (P(k_hard = 0) = pi)
#     k = k_hard + k_soft - k_soft.detach()       forward value k_hard, gradient dk_soft/dZ
# and differs in what it does to a row of A after dropping, and so in what the G-Net's gradient says:
#   logit     A'_ij = A_ij k_ij / sum_j A_ij k_ij        = softmax over the kept keys, i.e. the dropped pairs'
#             logits set to -inf before the softmax. Rows sum to 1 (0 if every key is dropped). The gradient
#             flows through the row sum: dropping pair j moves its mass to the row's other kept pairs.
#   rowscale  the same forward, with the row sum treated as a constant in the backward (the straight-through
#             estimator of the original form: the G-Net sees dropping as removing A_ij's mass).
#   capped    A'_ij = A_ij k_ij / (1 - pi_ij), pi_ij <= pi_max (--gnet-max-pi): inverted dropout, each pair
#             rescaled by at most 1 / (1 - pi_max), so a row sums to at most 1 / (1 - pi_max).
#   inverted  the same without the cap (the first reconstruction): unbiased per pair, E[A'] = A, but a pair
#             with pi near 1 is rescaled by up to 1 / KEEP_MIN and a row can sum far above 1. 1 / (1 - pi)
#             is a constant in the backward.

def keep_mask(Z, tau):
    """Straight-through relaxed Bernoulli keep mask k (float32, shape of Z): forward k_hard, gradient dk_soft/dZ."""
    u = torch.rand_like(Z)                                                       # u ~ U(0,1)
    k_soft = torch.sigmoid((u.logit(U_EPS) - Z) * (1.0 / tau))                   # sigmoid((log u - log(1-u) - Z) / tau)
    k_hard = (k_soft > 0.5).to(k_soft.dtype)
    return k_hard + k_soft - k_soft.detach()


def renormalized_drop(A, Z, tau, constant_sum):
    """--gnet-mask logit (constant_sum False) and rowscale (True): A' = A k / sum_j A k, per row (last dim).

    A row whose keys are all dropped (or a padding row, all A = 0) gives A' = 0: its sum is replaced by 1, so
    no gradient is divided by 0."""
    kept = A * keep_mask(Z, tau)                     # A k, [.., Q, K], at least float32 (k is; float64 stays)
    mass = kept.sum(-1, keepdim=True)                                            # sum_j A_ij k_ij, [.., Q, 1]
    mass = torch.where(mass.detach() > 0, mass, torch.ones_like(mass))
    if constant_sum:
        mass = mass.detach()
    return (kept / mass).to(A.dtype)


class RelaxedDrop(torch.autograd.Function):
    """--gnet-mask inverted and capped: A' = A * k / (1 - pi), pi a constant in the backward (methods.md §3.1).

    The same keep mask as keep_mask(Z, tau), fused into one Function so the [B, H, L, L] passes are few. The
    forward returns A * k_hard / (1 - pi) and keeps two tensors for the backward:
        scale = k_hard / (1 - pi)                              dA = g * scale
        w     = A / (1 - pi) * dk_soft/dZ                      dZ = g * w
              = -A / (1 - pi) * k_soft (1 - k_soft) / tau
    Z is passed through grad_reverse by the caller; the budget moves pi's level (hold_budget), so pi needs no
    gradient of its own here.
    """

    @staticmethod
    def forward(ctx, A, Z, pi, tau):
        # A [..]: attention probabilities in the kernel's layout; Z, pi: same shape (float32)
        u = torch.rand_like(Z)                                   # u ~ U(0,1)
        k_soft = u.logit_(U_EPS).sub_(Z).mul_(1.0 / tau).sigmoid_()  # sigmoid((log u - log(1-u) - Z) / tau)
        inv = torch.rsub(pi, 1.0).clamp_min_(KEEP_MIN).reciprocal_()  # 1 / (1 - pi), finite
        a_inv = A * inv                                          # A / (1 - pi)
        # k_hard = [k_soft > 0.5] as a float: round() maps [0, 0.5] -> 0 (half to even) and (0.5, 1] -> 1
        scale = torch.round(k_soft).mul_(inv)                    # k_hard / (1 - pi)
        out = A * scale                                          # A' = A * k_hard / (1 - pi)
        w = (k_soft - 1.0).mul_(k_soft).mul_(a_inv).mul_(1.0 / tau)  # -A/(1-pi) * k_soft (1 - k_soft) / tau
        ctx.save_for_backward(scale, w)
        return out.to(A.dtype)

    @staticmethod
    def backward(ctx, g):
        scale, w = ctx.saved_tensors
        dA = (g * scale).to(g.dtype) if ctx.needs_input_grad[0] else None
        dZ = g * w if ctx.needs_input_grad[1] else None
        return dA, dZ, None, None


def apply_keep_mask(form, A, Z, pi, tau):
    """THE G-Net mask (methods.md §3.1): A' from A, the drop logits Z (gradient-reversed by the caller) and
    pi = sigmoid(Z) (detached), by the --gnet-mask form. Every form keeps invalid pairs (A = 0) at exactly 0."""
    if form in ("logit", "rowscale"):
        return renormalized_drop(A, Z, tau, constant_sum=form == "rowscale")
    return RelaxedDrop.apply(A, Z, pi, tau)                      # inverted, capped (pi already capped)


def masked_sum(pi, valid):
    """Sum of pi over the valid pairs and their count, without expanding valid to pi's shape.

    pi [..] float, valid bool broadcastable to pi (or None = all valid). Returns two 0-dim float32 tensors.
    """
    if valid is None:
        return pi.sum(dtype=torch.float32), pi.new_tensor(float(pi.numel()), dtype=torch.float32)
    v = valid.reshape((1,) * (pi.dim() - valid.dim()) + tuple(valid.shape))
    dims = tuple(i for i in range(pi.dim()) if v.shape[i] == 1 and pi.shape[i] != 1)
    s = pi.sum(dims, keepdim=True, dtype=torch.float32) if dims else pi.float()  # reduce where v broadcasts
    count = v.sum(dtype=torch.float32) * (pi.numel() // v.numel())
    return (s * v).sum(), count


def bin_centers(device):
    width = 2 * Z_RANGE / Z_BINS
    return -Z_RANGE + width * (torch.arange(Z_BINS, device=device, dtype=torch.float64) + 0.5)   # [Z_BINS]


def rates_after_shift(hists, shifts, z_max=math.inf):
    """Each histogram's mean sigmoid(min(Z + shift, z_max)), for every shift. hists [L, Z_BINS] (pair counts per
    bin), shifts [S] -> [L, S]. z_max: the capped form's logit(pi_max) (inf: no cap)."""
    p = hists.double() / hists.double().sum(-1, keepdim=True).clamp_min(1.0)           # [L, Z_BINS]
    centers = bin_centers(hists.device)[:, None]                                        # [Z_BINS, 1]
    return torch.einsum("lz,zs->ls", p, torch.sigmoid((centers + shifts.double()).clamp_max(z_max)))  # [L, S]


def shift_for_rate(hists, target, z_max=math.inf):
    """The logit shift eps with mean_l (mean sigmoid(min(Z + eps, z_max)) over hists[l]) = target. hists
    [L, Z_BINS] or [Z_BINS]. The mean is increasing in eps: three rounds of a 64-step grid search, each in the
    bracket the last one found (precision 2 SHIFT_MAX / 64^3); a few vectorised ops that stay on hists' device
    (no sync)."""
    hists = hists.reshape(-1, Z_BINS)
    dev = hists.device
    steps = torch.arange(65, device=dev, dtype=torch.float64) / 64                      # [65]
    lo = torch.full((1,), -SHIFT_MAX, dtype=torch.float64, device=dev)
    hi = torch.full((1,), SHIFT_MAX, dtype=torch.float64, device=dev)
    want = torch.as_tensor(target, dtype=torch.float64, device=dev).reshape(1)
    for _ in range(3):
        grid = lo + (hi - lo) * steps                                                   # [65] candidate shifts
        rates = rates_after_shift(hists, grid, z_max).mean(0)                           # [65], non-decreasing
        i = torch.searchsorted(rates, want).clamp(1, 64)                                # first rate >= target
        lo, hi = grid[i - 1], grid[i]
    return (0.5 * (lo + hi)).float().reshape(())


def logit_histogram(Z, valid):
    """How many real pairs have their drop logit Z in each of Z_BINS bins over [-Z_RANGE, Z_RANGE]. -> [Z_BINS]
    Z [..] float, valid bool broadcastable to Z. Lets hold_budget predict the mean rate after any shift of Z."""
    width = 2 * Z_RANGE / Z_BINS
    idx = ((Z.clamp(-Z_RANGE, Z_RANGE - 1e-3) + Z_RANGE) / width).long()               # bin of every pair
    w = (valid.expand_as(Z) if valid is not None else torch.ones_like(Z, dtype=torch.bool)).to(Z.dtype)
    # scatter_add, not bincount or idx[w]: no output size to read off the device (no sync on a GPU)
    return Z.new_zeros(Z_BINS).scatter_add_(0, idx.flatten(), w.flatten())              # [Z_BINS]


class AttendOut(AttnDropout):
    """AttendOut for one layer (methods.md §3.1, reconstructed). The layer calls hook(x) in training only."""

    def __init__(self, config, layer_idx=0):
        super().__init__(0.0)  # no plain Bernoulli dropout: the hook does the dropping
        p0 = config.attn_dropout_p
        if not 0.0 <= p0 < 1.0:
            raise ValueError(f"attendout needs 0 <= attn_dropout_p < 1, got {p0}")
        seed = (torch.initial_seed() + GNET_SEED * (layer_idx + 1)) % 2 ** 63   # the run's seed, per layer
        self.gnet = GNet(config.hidden_size, config.num_heads, config.gnet_dim, p0, seed)  # name == GNET
        self.tau = float(config.gnet_tau)
        rho = float(config.gnet_budget if config.gnet_budget is not None else p0)
        if not 0.0 <= rho < 1.0:
            raise ValueError(f"the G-Net budget must be in [0, 1), got {rho} (--gnet-budget)")
        self.rho = max(rho, P0_MIN)   # as for p0: a budget of exactly 0 has no finite logit to hold
        self.form = config.gnet_mask
        if self.form not in MASKS:
            raise ValueError(f"unknown gnet_mask {self.form!r} (--gnet-mask): choose one of {', '.join(MASKS)}")
        self.z_max = math.inf         # the capped form: pi <= pi_max, i.e. Z <= logit(pi_max)
        if self.form == "capped":
            pi_max = float(config.gnet_max_pi)
            if not self.rho < pi_max < 1.0:
                raise ValueError(f"--gnet-max-pi {pi_max} must be above the budget {self.rho} and below 1")
            self.z_max = math.log(pi_max / (1.0 - pi_max))
        self.reverse = bool(config.gnet_reverse)   # gradient reversal on the mask path (False: cooperative G-Net)
        self.scope = config.gnet_budget_scope      # "mean": the mean over layers is rho; "layer": every layer is
        if self.scope not in ("mean", "layer"):
            raise ValueError(f"unknown gnet_budget_scope {self.scope!r} (--gnet-budget-scope): mean or layer")
        self.reset_stats()

    @property
    def needs_hook(self):
        return self.training

    def reset_stats(self):
        """Forget the drop statistics. The model calls this at the start of every training forward, so they
        always describe exactly one forward: all layout pieces, both HST stages, both SAR / R-Drop views."""
        # over the real (query, key) pairs: the sum of pi, their count, and a histogram of their logits Z;
        # the tail (logged in droprates.jsonl): the largest pi and the largest row sum of A' after dropping
        self.pi_sum, self.pi_count, self.z_hist = None, None, None
        self.pi_max, self.row_max = None, None

    def hook(self, x):
        """x [B, L, d]: the layer input. Returns drop_fn(A, valid, pair_scores) -> A' (contract)."""
        a, c = self.gnet.features(x)  # [B, H, L, d_g] each, computed once per forward

        def drop_fn(A, valid, pair_scores):
            # A [B, H, Lq, Lk] (dense) or the kernel's own layout, rows along the last dim; valid: bool,
            # broadcastable to A, True for the real (query, key) pairs the pattern allows
            Z = self.gnet.logits(pair_scores(a, c).float())  # methods.md §3.1: Z = beta + bounded gq gk^T, A's layout
            with torch.no_grad():
                h = logit_histogram(Z, valid)    # the G-Net's own logits, before the budget's shift
                target = self.gnet.target        # the budget (methods.md §3.1): shift the logits so that their
                eps = torch.where(torch.isnan(target), 0.0,          # mean rate = target (NaN: none yet, no shift)
                                  shift_for_rate(h, target, self.z_max))
            Z = Z + eps                          # eps is a constant: the G-Net's gradient is that of its own logits
            if self.z_max < math.inf:            # capped: Z <= logit(pi_max), so pi <= pi_max
                Z = Z.clamp_max(self.z_max)
            pi = torch.sigmoid(Z)                # drop probability pi (capped form: <= pi_max)
            Zr = grad_reverse(Z) if self.reverse else Z  # mask path: the G-Net receives -dL_task/dZ
            out = apply_keep_mask(self.form, A, Zr, pi.detach(), self.tau)   # THE mask: A' (same layout as A)
            with torch.no_grad():                # statistics for the budget and the log: plain numbers,
                s, n = masked_sum(pi, valid)     # no graph, so nothing is kept alive after the step
                top = (pi if valid is None else pi.masked_fill(~valid, 0.0)).max()
                rows = out.sum(-1, dtype=torch.float32).max()
                first = self.pi_sum is None
                self.pi_sum = s if first else self.pi_sum + s
                self.pi_count = n if first else self.pi_count + n
                self.z_hist = h if first else self.z_hist + h
                self.pi_max = top if first else torch.maximum(self.pi_max, top)
                self.row_max = rows if first else torch.maximum(self.row_max, rows)
            return out

        return drop_fn

    def mean_pi(self):
        """Mean drop probability over the real pairs of the last training forward (a 0-dim tensor), or None."""
        if self.pi_sum is None:
            return None
        return self.pi_sum / self.pi_count.clamp_min(1.0)

    def extra_repr(self):
        return (f"mask={self.form}, tau={self.tau}, rho={self.rho}, reverse={self.reverse}, budget={self.scope}"
                + (f", pi_max={1 / (1 + math.exp(-self.z_max)):.3g}" if self.z_max < math.inf else ""))

def attendout_modules(modules):
    """AttendOut modules, in order, from a model (nn.Module) or an iterable of modules."""
    if isinstance(modules, nn.Module):
        modules = modules.modules()
    return [m for m in modules if isinstance(m, AttendOut)]


@torch.no_grad()
def hold_budget(modules, all_reduce=None):
    """methods.md §3.1 budget (reconstructed): the mean drop rate is rho in every training forward.

    After every optimizer step, from the histograms of each layer's own logits Z in the step's forward
    (--gnet-budget-scope mean, the default: over the mean of layers):
        delta : mean_l E_l[sigmoid(Z + delta)] = rho        one common shift for all layers (shift_for_rate)
        t_l   = E_l[sigmoid(Z + delta)]                      layer l's target rate; mean_l t_l = rho
        beta_l <- beta_l + delta                             the G-Nets' own level follows
    (--gnet-budget-scope layer: every layer its own delta_l with E_l[sigmoid(Z + delta_l)] = rho, so t_l = rho.)
    In the next training forward, layer l shifts its logits by the eps_l that makes its mean rate over the real
    pairs exactly t_l (AttendOut.hook, shift_for_rate), so the mean over layers is rho by construction, not
    one step late: the G-Net's projections can move its logits a lot in one step. The capped form's cap
    (Z <= logit(pi_max)) is part of every rate computed here.

    What the G-Net learns (which layers, heads and pairs drop more, by the reversed task gradient) is kept:
    with scope "mean" every layer moves by the same delta, so the targets keep the layers' order and spread.
    (A penalty lambda (m - rho)^2 could not hold the level against the reversed task gradient, which keeps
    pushing every rate up.) Call it after optimizer.step(). all_reduce: sums a tensor over processes (DDP), so
    every replica sets the same targets. Returns (m, delta): the mean rate of the step's forward and the (mean)
    shift; or None when no AttendOut layer ran."""
    mods = attendout_modules(modules)
    if not mods:
        return None
    dev = mods[0].gnet.beta.device
    stats = torch.stack([torch.cat([torch.stack([m.pi_sum, m.pi_count]), m.z_hist]) if m.pi_sum is not None
                         else torch.zeros(2 + Z_BINS, device=dev) for m in mods])       # [L, 2 + Z_BINS]
    if all_reduce is not None:
        all_reduce(stats)
    stats = stats.double().cpu()
    ran = stats[:, 1] > 0                                                             # layers that ran (LayerDrop)
    if not bool(ran.any()):
        return None
    mean = (stats[ran, 0] / stats[ran, 1]).mean().item()                              # m, as applied
    rho, z_max = mods[0].rho, mods[0].z_max
    hists = stats[ran, 2:]                                                            # [L_ran, Z_BINS]
    ran_mods = [m for m, r in zip(mods, ran.tolist()) if r]
    if mods[0].scope == "layer":
        deltas = [shift_for_rate(h, rho, z_max).item() for h in hists]                # delta_l, one per layer
        targets = [rho] * len(deltas)                                                 # t_l = rho
        for m, d in zip(ran_mods, deltas):
            m.gnet.beta.add_(d)
        shift = sum(deltas) / len(deltas)
    else:
        shift = shift_for_rate(hists, rho, z_max).item()                              # one shift for all
        targets = rates_after_shift(hists, torch.tensor([shift]), z_max)[:, 0].tolist()   # t_l, mean rho
        for m in mods:                                                                # layers that did not run
            m.gnet.beta.add_(shift)                                                   # follow the common level
    for m, t in zip(ran_mods, targets):
        m.gnet.target.fill_(t)
    return mean, shift


def float_or_nan(t):
    """A 0-dim statistic as a float; nan when the layer did not run (None)."""
    return float("nan") if t is None else float(t)


def drop_rates(modules):
    """Mean drop probability per AttendOut layer in the last training forward, as floats (nan: did not run)."""
    return [float_or_nan(m.mean_pi()) for m in attendout_modules(modules)]


def drop_tails(modules):
    """Per AttendOut layer in the last training forward: (largest pi over real pairs, largest row sum of A' after
    dropping), as two lists of floats (nan: did not run). The mask's tail, logged beside the mean rates."""
    mods = attendout_modules(modules)
    return [float_or_nan(m.pi_max) for m in mods], [float_or_nan(m.row_max) for m in mods]


class DropRateLogger:
    """Writes {"step": s, "step_frac": f, "drop_rate": [p_1, ..., p_L], "max_pi": [..], "max_row_sum": [..]}
    JSON lines every log_interval steps (methods.md §3.1 logging) to path (e.g. OUT/droprates.jsonl): per layer
    the mean drop probability, the largest single pi and the largest attention-row sum after dropping. The
    file is started afresh on construction."""

    def __init__(self, path, log_interval, append=False):
        self.path, self.log_interval = path, max(int(log_interval), 1)
        if not append:                      # a resumed run (append=True) keeps its earlier lines
            open(self.path, "w").close()

    def log(self, step, step_frac, rates, last=False, **extra):
        """rates: a model / list of modules (-> drop_rates and drop_tails) or a list of floats; extra: more
        numbers for the line (the trainer adds "mean" and the budget's "shift"); last=True: the run's final
        step, always written (a schedule replayed from this file then ends at the rates the run ended with).
        Returns True if written."""
        if step % self.log_interval != 0 and not last:
            return False
        tails = {}
        if isinstance(rates, nn.Module) or any(isinstance(r, nn.Module) for r in rates):
            tails = dict(zip(("max_pi", "max_row_sum"), drop_tails(rates)))
            rates = drop_rates(rates)
        rec = {"step": int(step), "step_frac": float(step_frac), "drop_rate": [float(r) for r in rates], **tails,
               **{k: float(v) for k, v in extra.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return True


def export_without_gnet(state_dict):
    """Copy of state_dict without the G-Net parameters (keys with a 'gnet' component)."""
    return type(state_dict)((k, v) for k, v in state_dict.items() if GNET not in k.split("."))


# -----------------------------------------------------------------------------

def make_attn_dropout(config, layer_idx):
    """The attention-dropout module of layer layer_idx for config.attn_dropout (the --attn-dropout flag)."""
    method = config.attn_dropout
    if method == "standard":
        return AttnDropout(config.attn_dropout_p)
    if method == "none":
        return AttnDropout(0.0)
    if method == "scheduled":
        return make_scheduled(config.schedule, config.num_layers, layer_idx)
    if method == "attendout":
        return AttendOut(config, layer_idx)
    raise ValueError(f"unknown attn_dropout {method!r}: --attn-dropout must be one of {', '.join(METHODS)}")
