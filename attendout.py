"""
attendout.py: the attention-dropout methods of attnreg (methods.md §3): standard, none, scheduled, AttendOut.

The idea (AttendOut, Wu et al. 2021): instead of dropping attention probabilities at one fixed rate, a small
per-layer G-Net reads the layer's input and predicts a drop probability for every (head, query, key), trained
end to end; here adversarially (it maximises the task loss) under a budget on the mean drop rate (§3.1).

Where things are: `CappedMask` is THE G-Net mask (what a kernel's A goes through); `AttendOut.hook` builds it
from the G-Net (`GNet`); `shift_for_rate` and `hold_budget` hold the budget; `ScheduledDropout` replays a
drop-rate log. The kernels call the hook (model.dense_attention, sparse._attend).

Run the tests: python -m pytest -q tests/test_attendout.py      (used by: python train.py --attn-dropout ...)
"""

import json
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

# the one place naming the methods: --attn-dropout NAME -> how the run's opening line says it (train.py)
METHODS = {"standard": "attention dropout {p:g}", "none": "no attention dropout",
           "attendout": "AttendOut attention dropout", "scheduled": "scheduled attention dropout ({cfg.schedule})"}
GNET = "gnet"          # the G-Net's submodule name: export_without_gnet drops every key with this component
CAP = 0.5              # pi <= CAP: a kept pair is rescaled by at most 1 / (1 - CAP) = 2 (methods.md §3.1)
P0_MIN = 1e-4          # attn_dropout_p = 0 would make beta = logit(0) = -inf: start from this rate instead
U_EPS = 1e-6           # u ~ U(0,1) is clamped to [U_EPS, 1 - U_EPS], so log u and log(1 - u) stay finite
SAMPLE = 8192          # the budget's shift is solved on this many randomly drawn pairs of each kernel call
BISECT = 16            # ... in this many halvings of its bracket (the sample's range of logits / 65536)
GNET_SEED = 1_000_033  # layer l's G-Net init comes from a generator seeded (run seed + GNET_SEED (l + 1))


# -----------------------------------------------------------------------------
# standard and none (methods.md §3.3): the base every method shares

class AttnDropout(nn.Module):
    """Plain Bernoulli dropout on the attention probabilities at a fixed rate p; p = 0 is 'none'.
    A layer asks rate(step_frac) for the kernel's rate in training, and calls hook(x) when needs_hook."""

    def __init__(self, p=0.0):
        super().__init__()
        self.p = float(p)

    def rate(self, step_frac=0.0):
        return self.p

    @property
    def needs_hook(self):   # only AttendOut, in training, drops through a hook
        return False

    def extra_repr(self):
        return f"p={self.p}"


# -----------------------------------------------------------------------------
# scheduled Bernoulli dropout (methods.md §3.2): a rate per layer l and training fraction t, p_l(t)

def linear_schedule(spec, num_layers):
    """'linear:P_LOW:P_HIGH' -> one rate per layer, linear in depth, constant in time."""
    try:
        _, p_low, p_high = spec.split(":")
        p_low, p_high = float(p_low), float(p_high)
    except ValueError:
        raise ValueError(f"bad schedule {spec!r}: expected linear:P_LOW:P_HIGH, e.g. linear:0.1:0.5") from None
    if not (0.0 <= p_low < 1.0 and 0.0 <= p_high < 1.0):
        raise ValueError(f"bad schedule {spec!r}: rates must be in [0, 1)")
    steps = max(num_layers - 1, 1)
    return [p_low + (p_high - p_low) * l / steps for l in range(num_layers)]   # p_l = p_low + (p_high-p_low) l/(L-1)


def read_droprates(path, num_layers):
    """A DropRateLogger file -> (fracs [T] increasing, rates [T][L]). A line without step_frac is placed at
    step / (the last step logged)."""
    points = []                                                  # (step_frac or None, step, rates)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rates = [float(r) for r in rec["drop_rate"]]
                points.append((rec.get("step_frac"), float(rec.get("step", 0)), rates))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}, line {lineno}: cannot read drop rates ({e!r}); expected "
                                 '{"step": S, "step_frac": F, "drop_rate": [p_1, ..., p_L]}') from None
            if len(rates) != num_layers:
                raise ValueError(f"{path}, line {lineno}: {len(rates)} drop rates, the model has {num_layers} layers")
    if not points:
        raise ValueError(f"{path}: no drop-rate lines")
    last = max(step for _, step, _ in points) or 1.0
    points = [(step / last if frac is None else float(frac), r) for frac, step, r in points]   # t = step_frac
    points.sort(key=lambda p: p[0])                               # stable: equal fractions keep the file's order
    return [t for t, _ in points], [r for _, r in points]


class ScheduledDropout(AttnDropout):
    """Bernoulli dropout at p_l(t), t = step_frac in [0, 1]: linear between the points, constant outside."""

    def __init__(self, fracs, rates):
        super().__init__(rates[0])
        self.fracs, self.rates = list(fracs), list(rates)        # [T], [T] for this layer

    def rate(self, step_frac=0.0):   # p_l(t) = p(t_k) + (t - t_k) / (t_k+1 - t_k) (p(t_k+1) - p(t_k))
        return float(np.interp(step_frac, self.fracs, self.rates))


def make_scheduled(schedule, num_layers, layer_idx):
    if not schedule:
        raise ValueError("attn_dropout 'scheduled' needs --schedule FILE or --schedule linear:P_LOW:P_HIGH")
    if schedule.startswith("linear:"):
        return ScheduledDropout([0.0], [linear_schedule(schedule, num_layers)[layer_idx]])
    fracs, rates = read_droprates(schedule, num_layers)          # replay an AttendOut run's droprates.jsonl
    return ScheduledDropout(fracs, [r[layer_idx] for r in rates])


# -----------------------------------------------------------------------------
# AttendOut (methods.md §3.1, reconstructed): the G-Net, its mask, its budget

class GNet(nn.Module):
    """Layer l's drop-logit generator (methods.md §3.1), per head: Z = beta + P, P = gq gk^T / sqrt(d_g), with the
    features gq = X W_q, gk = X W_k of the detached input. W_q, W_k are one fused weight (rows [0, H d_g)
    and [H d_g, 2 H d_g)), plain Parameters, not an nn.Linear, so a model-wide BERT init of nn.Linear (std 0.02)
    leaves the small G-Net init alone."""

    def __init__(self, hidden_size, num_heads, gnet_dim, p0, rho, seed=0):
        super().__init__()
        self.num_heads, self.gnet_dim = num_heads, gnet_dim
        self.weight = nn.Parameter(torch.empty(2 * num_heads * gnet_dim, hidden_size))   # [W_q | W_k]
        self.bias = nn.Parameter(torch.zeros(2 * num_heads * gnet_dim))
        self.beta = nn.Parameter(torch.tensor(math.log(p0 / (1 - p0))))                 # logit(p0): pi ~ p0 at start
        self.register_buffer("target", torch.tensor(float(rho)))   # t_l, set by hold_budget (checkpoints keep it)
        # its own generator (std 0.002, methods.md §3.1): the global random stream is left alone, so at one seed
        # every --attn-dropout method starts from the same backbone and head weights (a paired comparison, §3.4)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) * 0.002)

    def features(self, x):
        """x [B, L, d] -> (a, c), each [B, H, L, d_g], with a_i . c_j = P_ij, the pair term, which each kernel's
        pair_scores(a, c) computes in its own layout. No bound: a soft bound on the features (|P| <= 8) cost the
        demo 2-5 points on two of three seeds (docs/results.md); unbounded, some logits saturate (the cap holds)."""
        B, L, _ = x.shape
        g = F.linear(x.detach(), self.weight, self.bias)         # gq | gk = X W + b, X DETACHED: the G-Net cannot
        g = g.view(B, L, 2, self.num_heads, self.gnet_dim).permute(2, 0, 3, 1, 4)   # shape the backbone through it
        return g[0] / math.sqrt(self.gnet_dim), g[1]              # a = gq / sqrt(d_g), c = gk: [B, H, L, d_g] each


class CappedMask(torch.autograd.Function):
    """THE G-Net mask (methods.md §3.1). With Zc = min(Z, 0) (the cap), pi = sigmoid(Zc) <= 0.5, u ~ U(0, 1):
        k_soft = sigmoid((-Zc + log u - log(1 - u)) / tau)    relaxed Bernoulli keep mask (tau = 0.5)
        k_hard = [k_soft > 0.5]                                keep (1) or drop (0): P(drop) = pi
        k      = k_hard + k_soft - k_soft.detach()             straight-through: value k_hard, gradient of k_soft
        A'     = A k / (1 - pi)                                1 / (1 - pi) <= 2 a constant: a row sums to <= 2
    and the G-Net's gradient reversed: it receives -dL/dZ (it maximises the task loss); a capped pair gets none.
    Written out as one Function because autograd through those lines keeps about ten [B, H, L, L] tensors per
    layer, this two (tests/test_attendout.py checks that it equals those lines). apply(A, Z, tau) -> (A', pi)."""

    @staticmethod
    def forward(ctx, A, Z, tau):
        Zc = Z.clamp_max(0.0)                                    # the cap: pi = sigmoid(Zc) <= sigmoid(0) = 0.5
        scale = torch.exp(Zc).add_(1.0)                          # 1 / (1 - pi) = 1 + exp(Zc) <= 2
        x = torch.rand_like(Zc).logit_(U_EPS).sub_(Zc).div_(tau)  # (-Zc + log u - log(1 - u)) / tau, u ~ U(0, 1)
        k_hard = x.sign().clamp_min_(0.0)                        # [k_soft > 0.5] = [x > 0], as 1.0 / 0.0
        k_soft = x.sigmoid_()                                    # k_soft = sigmoid(x), from here on in place:
        # tau dA'/dZ = -A / (1 - pi) k_soft (1 - k_soft) where Z < 0, and 0 where Z is capped (sign(Zc): -1 or 0)
        dz = k_soft.addcmul_(k_soft, k_soft, value=-1.0).mul_(scale).mul_(A).mul_(Zc.sign())
        scale.mul_(k_hard)                                       # k_hard / (1 - pi)
        pi = Zc.sigmoid_()                                       # drop probability [B, H, L, L] (or the layout's)
        ctx.save_for_backward(scale, dz)
        ctx.mark_non_differentiable(pi)
        ctx.tau = tau
        return (A * scale).to(A.dtype), pi                       # A' = A k_hard / (1 - pi)

    @staticmethod
    def backward(ctx, g, _):
        scale, dz = ctx.saved_tensors                            # (in place: they become the gradients)
        # dL/dA = g k_hard / (1 - pi); the G-Net gets the reversed -dL/dZ = -g dA'/dZ = -g dz / tau
        return scale.mul_(g).to(g.dtype), dz.mul_(g).mul_(-1.0 / ctx.tau), None


# The budget (methods.md §3.1): the mean drop rate over layers and real (query, key) pairs is rho. One equation,
#     c:  mean_l mean_pairs sigmoid(min(Z_l + c, 0)) = rho                        (shift_for_rate, a bisection)
# solved after each step (hold_budget) on the logits Z_l that each layer drew in the step's forward; the rate it
# gives layer l is the layer's target t_l. In every training forward each kernel call then shifts its logits by
# the constant eps that puts its mean rate on t_l (the same equation, for one layer): the layers average rho in
# every forward, and each keeps the rate its G-Net asks for relative to the others, which it learns from the
# reversed task gradient (its logits rise where dropping hurts the task most).

def rates(z, w):
    """Each row's w-weighted mean of sigmoid(min(z, 0)): the drop rate of logits z after the cap. z, w [R, S] -> [R]"""
    return (torch.sigmoid(z.clamp_max(0.0)) * w).sum(-1) / w.sum(-1).clamp_min(1e-30)


def shift_for_rate(z, w, target):
    """The shift e with mean(rates(z + e, w)) = target, by bisection: the rate only grows with e, and is at most
    the target at e = logit(target) - max z, at least it at logit(target) - min z. z, w [R, S]; target 0-dim."""
    lo, hi = torch.logit(target) - z.amax(), torch.logit(target) - z.amin()
    for _ in range(BISECT):
        e = (lo + hi) / 2
        low = rates(z + e, w).mean() < target                     # too few drops: the shift lies above e
        lo, hi = torch.where(low, e, lo), torch.where(low, hi, e)  # tensors throughout: no GPU sync
    return (lo + hi) / 2


class AttendOut(AttnDropout):
    """AttendOut for one layer (methods.md §3.1, reconstructed). The layer calls hook(x) in training only."""

    def __init__(self, cfg, layer_idx=0):
        super().__init__(0.0)                                     # no plain Bernoulli dropout: the hook drops
        p0 = cfg.attn_dropout_p
        self.rho = cfg.gnet_budget if cfg.gnet_budget is not None else p0
        if not (0.0 <= p0 < 1.0 and 0.0 <= self.rho < CAP):
            raise ValueError(f"attendout needs attn_dropout_p in [0, 1) and its budget (--gnet-budget) in [0, {CAP}),"
                             f" got {p0} and {self.rho}")
        self.rho = max(self.rho, P0_MIN)                          # a rate of exactly 0 has no finite logit
        seed = (torch.initial_seed() + GNET_SEED * (layer_idx + 1)) % 2 ** 63   # the run's seed, per layer
        self.gnet = GNet(cfg.hidden_size, cfg.num_heads, cfg.gnet_dim, max(p0, P0_MIN), self.rho, seed)  # GNET
        self.tau = float(cfg.gnet_tau)
        self.stats, self.drawn = None, []                         # of the last training forward (begin_forward)

    @property
    def needs_hook(self):
        return self.training

    def hook(self, x):
        """x [B, L, d]: the layer input. Returns drop_fn(A, valid, pair_scores) -> A' (the kernels' contract):
        A the attention probabilities in the kernel's layout (rows along the last dim), valid (bool, broadcastable
        to A) the real (query, key) pairs, pair_scores(a, c) the pair term in A's layout (a fresh tensor: Z is
        built in it, in place)."""
        a, c = self.gnet.features(x)                              # [B, H, L, d_g] each, once per forward

        def drop_fn(A, valid, pair_scores):
            P = pair_scores(a, c).float()                         # the pair term gq gk^T / sqrt(d_g), A's layout
            with torch.no_grad():                                 # the budget's shift: a constant (no gradient)
                i = torch.unravel_index(torch.randint(P.numel(), (SAMPLE,), device=P.device), P.shape)
                z = P[i] + self.gnet.beta                         # [SAMPLE] logits Z of randomly drawn pairs, each
                w = valid.expand_as(P)[i] * (P.numel() / SAMPLE)  # standing for this many pairs (0: not a real one)
                eps = shift_for_rate(z[None], w[None], self.gnet.target)   # mean_pairs sigmoid(min(Z + eps, 0)) = t_l
                self.drawn.append((z, w))                         # for hold_budget, after the step
            Z = P.add_(self.gnet.beta + eps)                      # Z = P + beta, shifted by eps (in place: P is fresh)
            out, pi = CappedMask.apply(A, Z, self.tau)            # THE mask
            with torch.no_grad():
                new = masked_sum(pi, valid)                       # [sum of pi, count] over the real pairs
                self.stats = new if self.stats is None else self.stats + new   # summed over the forward's calls
            return out

        return drop_fn

    def mean_pi(self):
        """This layer's mean drop probability over the real pairs of the last training forward (nan: did not run)."""
        return math.nan if self.stats is None or self.stats[1] == 0 else float(self.stats[0] / self.stats[1])

    def extra_repr(self):
        return f"rho={self.rho}, tau={self.tau}, cap={CAP}"


def masked_sum(pi, valid):
    """[sum of pi over the pairs where valid, their number]; valid (bool) broadcastable to pi: summed over the
    dimensions valid broadcasts along first, so no pi-sized mask is built."""
    v = valid.reshape((1,) * (pi.dim() - valid.dim()) + valid.shape)
    dims = [d for d in range(pi.dim()) if v.shape[d] == 1 < pi.shape[d]]
    s = pi.sum(dims, keepdim=True) if dims else pi
    return torch.stack([(s * v).sum(), v.sum() * (pi.numel() / v.numel())])


def attendout_modules(modules):
    """The AttendOut modules, in order, of a model (nn.Module) or of an iterable of modules."""
    if isinstance(modules, nn.Module):
        modules = modules.modules()
    return [m for m in modules if isinstance(m, AttendOut)]


def begin_forward(modules):
    """The model calls it at the start of every training forward: each layer's statistics and draws start afresh,
    so they describe exactly one forward (every kernel call: layout pieces, HST stages, SAR / R-Drop views)."""
    for m in attendout_modules(modules):
        m.stats, m.drawn = None, []


@torch.no_grad()
def hold_budget(modules):
    """After each training step (train.py): set every layer's target t_l from the logits it drew in the step's
    forward, Z_l, moved by the one shift c that puts their mean rate on rho (methods.md §3.1):
        c: mean_l mean_pairs sigmoid(min(Z_l + c, 0)) = rho,    t_l = mean_pairs sigmoid(min(Z_l + c, 0))."""
    mods = [m for m in attendout_modules(modules) if m.drawn]   # the layers that ran (LayerDrop skips some)
    if not mods:
        return
    z, w = (pad_sequence([torch.cat([d[k] for d in m.drawn]) for m in mods], batch_first=True) for k in (0, 1))
    c = shift_for_rate(z, w, mods[0].gnet.target.new_tensor(mods[0].rho))   # [L, draws] -> one shift
    for m, t in zip(mods, rates(z + c, w)):
        m.gnet.target.copy_(t.clamp(P0_MIN, CAP))               # t_l (a layer with no real pair drawn: P0_MIN)


def drop_rates(modules):
    """Each AttendOut layer's mean drop probability in the last training forward (nan: did not run)."""
    return [m.mean_pi() for m in attendout_modules(modules)]


def mean_drop_rate(modules):
    """The mean over layers of drop_rates (the figure the budget holds at rho), or nan."""
    ran = [r for r in drop_rates(modules) if not math.isnan(r)]
    return sum(ran) / len(ran) if ran else math.nan


class DropRateLogger:
    """Every log_interval steps a JSON line {"step": s, "step_frac": f, "drop_rate": [p_1, ..., p_L], "mean": m}
    to path (OUT/droprates.jsonl, methods.md §3.1): the learned per-layer pattern, to plot or replay (§3.2)."""

    def __init__(self, path, log_interval, append=False):
        self.path, self.log_interval = path, max(int(log_interval), 1)
        if not append:                                            # a resumed run keeps its earlier lines
            open(self.path, "w").close()

    def log(self, step, step_frac, rates, last=False, **extra):
        """rates: a model or modules (-> drop_rates) or floats; last: the final step, always written (a replay
        then ends at the run's final rates); extra: more numbers for the line. Returns True if written."""
        if step % self.log_interval and not last:
            return False
        if isinstance(rates, nn.Module) or any(isinstance(r, nn.Module) for r in rates):
            rates = drop_rates(rates)
        ran = [float(r) for r in rates if not math.isnan(r)]      # the mean over the layers that ran: ~rho
        rec = {"step": int(step), "step_frac": float(step_frac), "drop_rate": [float(r) for r in rates],
               "mean": sum(ran) / max(len(ran), 1), **{k: float(v) for k, v in extra.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return True


def export_without_gnet(state_dict):
    """A copy of state_dict without the G-Net (every key with a 'gnet' component): AttendOut costs nothing after."""
    return type(state_dict)((k, v) for k, v in state_dict.items() if GNET not in k.split("."))


def make_attn_dropout(cfg, layer_idx):
    """Layer layer_idx's attention-dropout module for cfg.attn_dropout (--attn-dropout, one of METHODS)."""
    method = cfg.attn_dropout
    if method == "standard":
        return AttnDropout(cfg.attn_dropout_p)
    if method == "none":
        return AttnDropout(0.0)
    if method == "scheduled":
        return make_scheduled(cfg.schedule, cfg.num_layers, layer_idx)
    if method == "attendout":
        return AttendOut(cfg, layer_idx)
    raise ValueError(f"unknown attn_dropout {method!r}: --attn-dropout must be one of {', '.join(METHODS)}")
