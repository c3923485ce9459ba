"""
sparse.py: block-sparse attention and the HST stage-1 kernel of attnreg, in plain PyTorch (no n x n
matrix, ever), to be read beside docs/methods.md §2.1 and §2.2.

The idea: BigBird-style attention cuts the sequence into blocks of b tokens; query block i reads
only key blocks i-w .. i+w, r random blocks and the first g (global) tokens, so a layer is O(n).
ERNIE-Sparse's HST (Liu et al. 2022) adds one representative R_j per block: its stage 1 is here,
its stage 2 in model.Layer.

Run:  python train.py --attention sparse   (or hst)  # model.Attention calls the two entry points
      python -m pytest -q tests/test_sparse.py        # kernels = dense attention under dense_mask
      python research/patterns.py                     # draws docs/results/attention_*.png
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# The pattern (methods.md §2.1). The sequence, padded to a multiple of the block size b, is cut
# into m = n / b blocks; a query in block i may attend to
#     the window:  key blocks i-w .. i+w that exist
#     random:      r further key blocks, drawn among the blocks outside its window
#     global:      the first g tokens, which also attend to every token themselves
# so every query sees (2w + 1 + r) b + g keys: a layer is O(n). The knobs are the model.Config
# fields of the same names (pattern_of); a new pattern (docs/exercises.md) adds a field to both.
class Pattern(NamedTuple):
    block_size: int = 64      # b, tokens per block
    window: int = 1           # w, window blocks on each side
    num_global: int = 1       # g, global tokens at the start
    num_random: int = 0       # r, random key blocks per query block

    # Query block i's window as offsets from i, -w .. w; 0 (its own block) must be one of them.
    def window_offsets(self):
        return list(range(-self.window, self.window + 1))

def pattern_of(cfg):
    return {f: getattr(cfg, f) for f in Pattern._fields}

# window_matrix[i, j], bool [m, m]: key block j is in query block i's window.
def window_matrix(m, p, device=None):
    blk = torch.arange(m, device=device)
    offsets = torch.tensor(p.window_offsets(), device=device)
    diff = blk[None, :] - blk[:, None]                                          # [m, m]: j - i
    return (diff[..., None] == offsets).any(-1)


# -----------------------------------------------------------------------------
# Random blocks (methods.md §2.1): per (head, query block), r key blocks drawn uniformly outside
# its window: the r smallest of uniform numbers, the window's set to 2. One draw serves the batch
# (BigBird); surplus slots (short sequences) hold window blocks, ok False; r = 0 draws nothing.
# The draw is always made on the CPU, then moved to `device`: at one seed every device (CPU, GPU,
# `look`, `predict`) gets the same blocks. The move does not wait for the device (non_blocking).
def random_blocks(num_blocks, *, num_heads=1, generator=None, device=None, **pattern):
    """(idx, ok), long and bool [H, m, r] on device; generator: a CPU one, None: torch's global
    CPU stream."""
    p = Pattern(**pattern)
    m = num_blocks
    H = num_heads
    offsets = p.window_offsets()
    # At most the blocks left outside the smallest window (the window is clipped at the ends).
    in_range = [sum(1 for o in offsets if 0 <= i + o < m) for i in range(m)]   # window blocks of i
    r = min(p.num_random, m - min(in_range, default=0))
    if r == 0:
        idx = torch.zeros(H, m, 0, dtype=torch.long, device=device)
        return idx, idx.bool()
    in_window = window_matrix(m, p)
    u = torch.rand(H, m, m, generator=generator)                                # [H, m, m]
    u = u.masked_fill(in_window, 2.0)
    idx = u.argsort(dim=-1)[..., :r].contiguous()                               # [H, m, r]
    ok = ~in_window.expand(H, m, m).gather(-1, idx)
    return idx.to(device, non_blocking=True), ok.to(device, non_blocking=True)


# -----------------------------------------------------------------------------
# The key layout: THE one place that says which keys query block i reads, as token indices
# (methods.md §2.1). Every query block gathers its K keys once, in a fixed order of columns:
#     [ window blocks i-w .. i+w | r random blocks | g global tokens | R_i (HST only) ]
#            (2w + 1) b                 r b               g              1
# Scores and probabilities live in it, [B, H, m, b, K]; the kernel, flex and dense masks read it.
class Layout(NamedTuple):
    kidx: torch.Tensor       # long [H, m, K]: token index of every key column ([X] or [X; R])
    kin: torch.Tensor        # bool [H, m, K]: the pattern allows the column (padding aside)
    blocks: torch.Tensor     # long [H, m, nw + r]: the key block of each window / random slot
    blocks_ok: torch.Tensor  # bool [H, m, nw + r]: the slot is a real, allowed block
    window: slice            # columns of the window blocks
    own: slice               # columns of query block i itself (inside the window)
    random: slice            # columns of the random blocks
    glob: slice              # columns of the g global tokens
    rep: slice               # the column of R_i (HST; empty otherwise)
    rep_row: torch.Tensor    # bool [K]: the columns R_i's own query row reads (HST)

# key_layout builds it (nw = 2w + 1). To equal the dense pattern, a window block off either end is
# clamped onto block 0 or m-1 and masked, and a global token inside a block is masked there: it is
# read once, through its global column (twice would double its softmax share). Under HST R_i, at
# n + i of [X; R], is the last column; R_i's own row reads block i, the globals and R_i (rep_row).
def key_layout(n, p, rand_idx, rand_ok, with_reps=False):
    b = p.block_size
    m = n // b
    g = min(p.num_global, n)
    H = rand_idx.shape[0]
    r = rand_idx.shape[-1]
    dev = rand_idx.device
    offsets = p.window_offsets()
    nw = len(offsets)

    # The key blocks of each slot: the window (clamped; off the ends not ok), then the random ones.
    i = torch.arange(m, device=dev)
    win = i[:, None] + torch.tensor(offsets, device=dev)                        # [m, nw]
    win_ok = (win >= 0) & (win < m)
    blocks = torch.cat([win.clamp(0, m - 1).expand(H, m, nw), rand_idx], dim=-1)   # [H, m, nw + r]
    blocks_ok = torch.cat([win_ok.expand(H, m, nw), rand_ok], dim=-1)

    # Their tokens, then the g global tokens (and R_i under HST).
    tok = blocks[..., None] * b + torch.arange(b, device=dev)                   # [H, m, nw + r, b]
    kidx = [tok.flatten(2), torch.arange(g, device=dev).expand(H, m, g)]
    block_in = (blocks_ok[..., None] & (tok >= g)).flatten(2)                   # [H, m, (nw + r) b]
    kin = [block_in, torch.ones(H, m, g, dtype=torch.bool, device=dev)]
    if with_reps:
        kidx.append((n + i).view(1, m, 1).expand(H, m, 1))
        kin.append(torch.ones(H, m, 1, dtype=torch.bool, device=dev))
    kidx = torch.cat(kidx, dim=-1)                                              # [H, m, K]
    kin = torch.cat(kin, dim=-1)

    c_win = nw * b
    c_rand = (nw + r) * b
    own_start = offsets.index(0) * b
    window = slice(0, c_win)
    own = slice(own_start, own_start + b)
    random = slice(c_win, c_rand)
    glob = slice(c_rand, c_rand + g)
    rep = slice(c_rand + g, kidx.shape[-1])
    rep_row = torch.zeros(kidx.shape[-1], dtype=torch.bool, device=dev)
    if with_reps:
        for cols in (own, glob, rep):
            rep_row[cols] = True
    return Layout(kidx, kin, blocks, blocks_ok, window, own, random, glob, rep, rep_row)

# Which keys are real (not padding), bool [B, L]: attention_mask, or every token without one.
# Under HST (L = n + m) R_j is real iff block j holds a real token.
def real_keys(attention_mask, n, block_size, with_reps, batch_size=1, device=None):
    if attention_mask is None:
        real = torch.ones(batch_size, n, dtype=torch.bool, device=device)
    else:
        real = attention_mask.to(device=device).bool()
    if with_reps:
        reps_real = real.view(real.shape[0], -1, block_size).any(-1)            # [B, m]
        real = torch.cat([real, reps_real], dim=1)                              # [B, n + m]
    return real


# -----------------------------------------------------------------------------
# The gather kernel (methods.md §2.1): each query block gathers its K keys by index, with ONE
# index_select (backward: one index_add_), and does one small attention: O(n K), never n x n. A
# one-head c (the shared G-Net, methods.md §3.1) is read through every head's kidx.
def gather_keys(c, kidx, m):
    """c [B, Hc, L, e] -> [B, H, m, K, e]: row kidx[h, i, j] of head h (of head 0 when Hc = 1)."""
    B, Hc, L, e = c.shape
    H = kidx.shape[0]
    heads = torch.arange(H, device=kidx.device)[:, None, None] if Hc > 1 else 0
    flat = (kidx + heads * L).reshape(-1)                                       # [H m K]: h L + l
    return c.reshape(B, Hc * L, e).index_select(1, flat).view(B, H, m, -1, e)

# One small attention over any leading layout (methods.md §1):
#     S = q k^T / sqrt(d_h),   A = softmax(S masked by valid),   out = A V
# A method on the logits turns S into S' = mask_fn(S, ..) (methods.md §3: AttendOut's masked pass,
# S - 10000 (1 - M), in fp32 under bf16). A masked score gets the dtype's minimum in place, outside
# autograd (gradient 0); a row with no valid key gives 0. A meets V in V's dtype.
def _attend(q, k, v, valid, dropout_p, mask_fn, pair_scores, real_rows):
    """q [.., Q, d], k, v [.., K, d], valid bool [.., Q, K], real_rows [.., Q, 1] -> [.., Q, d]."""
    invalid = ~valid
    a = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))  # S: [.., Q, K]
    if mask_fn is not None:
        a = mask_fn(a, valid & real_rows, pair_scores)                          # S'
    with torch.no_grad():
        a.masked_fill_(invalid, torch.finfo(a.dtype).min)
    a = a.softmax(dim=-1)                                                       # A: [.., Q, K]
    if dropout_p > 0:
        a = F.dropout(a, dropout_p, training=True)
    out = torch.matmul(a.to(v.dtype), v)                                        # [.., Q, d]
    return out.masked_fill(invalid.all(dim=-1, keepdim=True), 0.0)

# The body of block_sparse_attention (L = n) and hst_attention (with_reps, L = n + m over [X; R]).
# The query rows are laid out as blocks, [B, H, m, bq, d]: b token rows, plus R_i as row b under
# HST. A token row reads its layout columns, R_i's row only rep_row's; the g global rows read every
# key, so they are computed apart, densely, [B, H, g, L] (cost O(g L)), and replace their rows.
def _stage1(q, k, v, attention_mask, *, with_reps, generator, dropout_p, mask_fn, pattern):
    """q, k, v [B, H, L, d] -> [B, H, L, d]."""
    p = Pattern(**pattern)
    B, H, L, d = q.shape
    b = p.block_size
    # The tokens; the L - n others are the m representatives.
    n = L * b // (b + 1) if with_reps else L
    m = n // b
    g = min(p.num_global, n)
    fits = n % b == 0 and L == (n + m if with_reps else n)
    assert fits, f"length {L} does not fit block size {b}"
    dev = q.device
    real = real_keys(attention_mask, n, b, with_reps, B, dev)
    rand_idx, rand_ok = random_blocks(m, num_heads=H, generator=generator, device=dev, **pattern)
    lay = key_layout(n, p, rand_idx, rand_ok, with_reps)

    # valid[.., i, row, col]: the pattern allows the pair and the key is real (global rows: below).
    bq = b + 1 if with_reps else b                                              # query rows/block
    row_ok = torch.ones(m, bq, lay.kidx.shape[-1], dtype=torch.bool, device=dev)
    row_ok[:, :b] &= (torch.arange(n, device=dev) >= g).view(m, b, 1)
    if with_reps:
        row_ok[:, b] = lay.rep_row
    valid = (lay.kin & real[:, lay.kidx])[:, :, :, None, :] & row_ok            # [B, H, m, bq, K]

    # The query rows in the block layout, [B, H, L, e] -> [B, H, m, bq, e] (H, or the G-Net's 1).
    def queries(a):
        ab = a[:, :, :n].reshape(B, a.shape[1], m, b, a.shape[-1])
        if with_reps:
            return torch.cat([ab, a[:, :, n:, None]], dim=3)
        return ab

    # AttendOut's pair scores a_i . c_j; one head and no random blocks: one gather serves all.
    def pair_local(a, c):
        if c.shape[1] == 1 and p.num_random == 0:
            kidx = lay.kidx[:1]
        else:
            kidx = lay.kidx
        return torch.matmul(queries(a), gather_keys(c, kidx, m).transpose(-1, -2))

    # The real query rows (mask_fn counts only real pairs): real tokens, and real R_i under HST.
    real_rows = real[:, :n].view(B, 1, m, b, 1)                                 # [B, 1, m, b, 1]
    if with_reps:
        rep_rows = real[:, n:].view(B, 1, m, 1, 1)
        real_rows = torch.cat([real_rows, rep_rows], dim=3)                     # [B, 1, m, bq, 1]

    out = _attend(queries(q), gather_keys(k, lay.kidx, m), gather_keys(v, lay.kidx, m), valid,
                  dropout_p, mask_fn, pair_local, real_rows)                    # [B, H, m, bq, d]
    tok_out = out[:, :, :, :b].reshape(B, H, n, d)                              # [B, H, n, d]

    if g > 0:
        def pair_global(a, c):
            return torch.matmul(a[:, :, :g], c.transpose(-1, -2))               # [B, H, g, L]

        out_g = _attend(q[:, :, :g], k, v, real[:, None, None, :], dropout_p, mask_fn,
                        pair_global, real[:, None, :g, None])                   # [B, H, g, d]
        tok_out = torch.cat([out_g, tok_out[:, :, g:]], dim=2)
    if not with_reps:
        return tok_out
    return torch.cat([tok_out, out[:, :, :, b]], dim=2)                         # [B, H, n + m, d]

# The two entry points model.Attention calls: q, k, v [B, H, L, d_h] -> [B, H, L, d_h];
# attention_mask [B, n] (1 = real); pattern: the Pattern keywords; generator None: torch's own.
# mask_fn(S, valid, pair_scores), AttendOut's masked pass (methods.md §3.1), sees the layout's
# logits [B, H, m, b, K], then the global rows' [B, H, g, L]. flex=True (CUDA), with nothing to
# drop or mask, runs flex_stage1 instead. Block-sparse attention (methods.md §2.1): L = n.
def block_sparse_attention(q, k, v, attention_mask=None, *, generator=None, dropout_p=0.0,
                           mask_fn=None, flex=False, **pattern):
    if flex and mask_fn is None and dropout_p == 0:
        return flex_stage1(q, k, v, attention_mask, with_reps=False, generator=generator,
                           **pattern)
    return _stage1(q, k, v, attention_mask, with_reps=False, generator=generator,
                   dropout_p=dropout_p, mask_fn=mask_fn, pattern=pattern)

# HST stage 1 (methods.md §2.2, reconstructed), L = n + m over [X; R]: a token in block j reads its
# §2.1 keys and R_j; a global token everything; R_j the tokens of block j, the globals and itself
# (valid iff block j holds a real token). R_j is query row b and key column K of block j's layout.
def hst_attention(q, k, v, attention_mask=None, *, generator=None, dropout_p=0.0, mask_fn=None,
                  flex=False, **pattern):
    if flex and mask_fn is None and dropout_p == 0:
        return flex_stage1(q, k, v, attention_mask, with_reps=True, generator=generator,
                           **pattern)
    return _stage1(q, k, v, attention_mask, with_reps=True, generator=generator,
                   dropout_p=dropout_p, mask_fn=mask_fn, pattern=pattern)


# -----------------------------------------------------------------------------
# FlexAttention (methods.md §2.1; CUDA, nothing to drop): the same layout as a BlockMask, run by
# PyTorch's block-sparse kernel, in two steps: create_block_mask, then flex_attention. On CUDA both
# are compiled once per process for dynamic shapes, so a new batch size or length reuses the
# compiled code: a few compiles per run, not one per shape (past torch's recompile limit, 8, the
# eager kernel would run, which builds every score). DYNAMIC_SHAPES makes that hold for any spread
# of lengths: equal sizes are not tied into one symbol (use_duck_shape), and a size of 1 (a batch
# of one, a single flex block) is not compiled apart (backed_size_oblivious). Inside a model that
# is being compiled itself (--compile) the plain functions are called, which the model's graph
# takes in without a break. On the CPU flex runs eagerly: a slow reference for the tests.
DYNAMIC_SHAPES = dict(use_duck_shape=False, backed_size_oblivious=True)
_compiled_flex = None

# (make_block_mask, attend) compiled with `backend` (the tests give a counting one), each call run
# under DYNAMIC_SHAPES; the signatures of create_block_mask and flex_attention.
def compile_flex(backend="inductor"):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = [torch.compile(f, dynamic=True, backend=backend)
                for f in (create_block_mask, flex_attention)]

    def under_dynamic_shapes(f):
        def call(*args, **kwargs):
            with torch.fx.experimental._config.patch(**DYNAMIC_SHAPES):
                return f(*args, **kwargs)
        return call

    return tuple(under_dynamic_shapes(f) for f in compiled)

# The pair flex_stage1 uses on `device`: compiled on CUDA (built on first use), plain elsewhere
# and inside a model being compiled.
def flex_functions(device):
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if device.type != "cuda" or torch.compiler.is_compiling():
        return create_block_mask, flex_attention
    if _compiled_flex is None:
        _compiled_flex = compile_flex()
    return _compiled_flex

# FlexAttention asks mask_mod(batch, head, query, key) -> bool for every pair: the gather kernel's
# sets, for a real key. A token row of block i reads its window / random blocks (table[h, i, j]),
# the globals and R_i; a global row every key; R_j's row (query n + j) block j, globals and R_j.
def layout_mask_mod(lay, real, n, b, g):
    H, m, _ = lay.blocks.shape
    table = torch.zeros(H, m, m, dtype=torch.long, device=real.device)
    table = table.scatter_add_(-1, lay.blocks, lay.blocks_ok.long()) > 0       # [H, m, m]

    def mask_mod(bi, h, qi, ki):
        q_tok = qi < n
        k_tok = ki < n
        i = torch.where(q_tok, qi // b, qi - n).clamp(0, m - 1)                 # the query's block
        j = (ki // b).clamp(0, m - 1)                                           # the key's block
        token_row = (k_tok & ((ki < g) | table[h, i, j])) | (~k_tok & (ki - n == i))
        rep_row = (k_tok & ((ki < g) | (j == i))) | (~k_tok & (ki - n == i))
        allowed = torch.where(q_tok, token_row | (qi < g), rep_row)
        return allowed & real[bi, ki]

    return mask_mod

# Stage 1 through flex_attention: the BlockMask comes from the same random draw and key_layout as
# the gather kernel's, so the outputs are equal (tests/test_flex.py).
def flex_stage1(q, k, v, attention_mask, *, with_reps, generator=None, **pattern):
    p = Pattern(**pattern)
    B, H, L, d = q.shape
    b = p.block_size
    n = L * b // (b + 1) if with_reps else L
    m = n // b
    g = min(p.num_global, n)
    dev = q.device
    real = real_keys(attention_mask, n, b, with_reps, B, dev)
    rand_idx, rand_ok = random_blocks(m, num_heads=H, generator=generator, device=dev, **pattern)
    lay = key_layout(n, p, rand_idx, rand_ok, with_reps)
    mask_mod = layout_mask_mod(lay, real, n, b, g)
    make_block_mask, attend = flex_functions(dev)
    block_mask = make_block_mask(mask_mod, B, H, L, L, device=dev)
    return attend(q, k, v, block_mask=block_mask)


# -----------------------------------------------------------------------------
# The equivalent dense masks (methods.md §2.1, "Reference"), from the kernel's own random draw,
# for tests and teaching: these ARE n x n. layout_rows, bool [H, m, L]: the keys query block i
# reads through the columns where cols [H, m, K] holds; a key in several columns counts once.
def layout_rows(lay, L, cols):
    H, m, K = lay.kidx.shape
    hits = torch.zeros(H, m, L, dtype=torch.long)
    hits = hits.scatter_add_(-1, lay.kidx.cpu(), cols.long().cpu())
    return hits > 0

# key_layout written out densely, bool [B, H, L, L] (True: query i may attend key j): token rows
# read their block's layout, global rows every key, R_j's row rep_row; padding keys are masked.
def dense_layout_mask(n, attention_mask, *, with_reps, generator, num_heads, batch_size,
                      **pattern):
    p = Pattern(**pattern)
    b = p.block_size
    m = n // b
    g = min(p.num_global, n)
    L = n + m if with_reps else n
    rand_idx, rand_ok = random_blocks(m, num_heads=num_heads, generator=generator, **pattern)
    lay = key_layout(n, p, rand_idx.cpu(), rand_ok.cpu(), with_reps)
    rows = layout_rows(lay, L, lay.kin)[:, torch.arange(n) // b]                # [H, n, L]
    rows[:, :g] = True
    if with_reps:
        rep_rows = layout_rows(lay, L, lay.kin & lay.rep_row)                   # [H, m, L]
        rows = torch.cat([rows, rep_rows], dim=1)
    real = real_keys(attention_mask, n, b, with_reps, batch_size, "cpu")
    return rows[None] & real[:, None, None, :]

# Block-sparse (methods.md §2.1) and HST stage 1 (§2.2) as dense masks, bool [B, H, L, L].
def dense_mask(n, attention_mask=None, *, generator=None, num_heads=1, batch_size=1, **pattern):
    return dense_layout_mask(n, attention_mask, with_reps=False, generator=generator,
                             num_heads=num_heads, batch_size=batch_size, **pattern)

def hst_dense_mask(n, attention_mask=None, *, generator=None, num_heads=1, batch_size=1, **pattern):
    return dense_layout_mask(n, attention_mask, with_reps=True, generator=generator,
                             num_heads=num_heads, batch_size=batch_size, **pattern)
