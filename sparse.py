"""sparse.py: block-sparse attention and the HST stage-1 kernel, in plain PyTorch (no n x n matrix, ever).

Idea: BigBird-style block-sparse attention cuts the sequence into blocks of b tokens; query block i reads only
key blocks i-w..i+w, r random blocks and the first g (global) tokens, so a layer costs O(n). ERNIE-Sparse's
Hierarchical Sparse Transformer (Liu et al. 2022) adds one representative R_j per block (its stage 1 is here).

Run:  python train.py --attention sparse   (or hst)  # model.Attention calls block_sparse_attention / hst_attention
      python -m pytest -q tests/test_sparse.py        # the kernels = dense attention under dense_mask
      python research/patterns.py                     # draws the patterns (text and docs/attention_*.png)
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------------------
# The pattern's knobs (methods.md §2.1). To add a pattern (e.g. a dilated window, docs/exercises.md): a field
# here, the blocks it reads in window_offsets or key_layout, and the model.Config field / train.py flag.

class Pattern(NamedTuple):
    """The knobs, named as the model.Config fields that set them; every function takes them as keywords."""
    block_size: int = 64      # b, tokens per block
    window: int = 1           # w, window blocks on each side
    num_global: int = 1       # g, global tokens at the start
    num_random: int = 0       # r, random key blocks per query block

    def window_offsets(self):
        """The key blocks of query block i's window, as offsets from i (0, the own block, must be one)."""
        return list(range(-self.window, self.window + 1))                        # i-w .. i+w


def pattern_of(cfg):
    """The Pattern keywords of a model.Config (its fields of the same names)."""
    return {f: getattr(cfg, f) for f in Pattern._fields}


def window_matrix(m, p, device=None):
    """bool [m, m]: key block j is in query block i's window."""
    blk = torch.arange(m, device=device)
    offsets = torch.tensor(p.window_offsets(), device=device)
    return ((blk[None, :] - blk[:, None])[..., None] == offsets).any(-1)        # [m, m]: j - i in offsets


# ---------------------------------------------------------------------------------------------------------
# Random blocks (methods.md §2.1)

def random_blocks(num_blocks, *, num_heads=1, generator=None, device=None, **pattern):
    """r key blocks per (head, query block), uniform among the blocks outside its window -> (idx, ok), long and
    bool [H, m, r]. One draw serves the whole batch (as BigBird). A query block with fewer than r blocks outside
    its window gets window blocks in its surplus slots, with ok False. r = 0 leaves the generator untouched."""
    p = Pattern(**pattern)
    m, H = num_blocks, num_heads
    offsets = p.window_offsets()
    in_range = [len([o for o in offsets if 0 <= i + o < m]) for i in range(m)]  # window blocks per query block
    r = min(p.num_random, m - min(in_range, default=0))                         # at most the blocks left
    if r == 0:
        idx = torch.zeros(H, m, 0, dtype=torch.long, device=device)
        return idx, idx.bool()
    draw_device = generator.device if generator is not None else device
    in_window = window_matrix(m, p, draw_device)                                # [m, m]
    u = torch.rand(H, m, m, generator=generator, device=draw_device)            # [H, m, m] uniform keys
    u = u.masked_fill(in_window, 2.0)                                           # window blocks sort last
    idx = u.argsort(dim=-1)[..., :r].contiguous()                               # [H, m, r] the r smallest
    ok = ~in_window.expand(H, m, m).gather(-1, idx)                             # surplus slots: False
    return idx.to(device), ok.to(device)


# ---------------------------------------------------------------------------------------------------------
# The key layout: THE one place that says which keys query block i reads, as token indices (methods.md §2.1):
#     [ window blocks i-w .. i+w | r random blocks | g global tokens | R_i (HST only) ]      K columns in all
#          (2w + 1) b                 r b               g               1
# The kernel, the FlexAttention path and the dense reference masks all read it.

class Layout(NamedTuple):
    kidx: torch.Tensor       # long [H, m, K]: token index of every key column (a position in [X] or [X; R])
    kin: torch.Tensor        # bool [H, m, K]: the pattern allows the column (padding aside)
    blocks: torch.Tensor     # long [H, m, nw + r]: the key block of each window / random slot (clamped)
    blocks_ok: torch.Tensor  # bool [H, m, nw + r]: the slot is a real, allowed block
    window: slice            # columns of the window blocks
    own: slice               # columns of query block i itself (inside the window)
    random: slice            # columns of the random blocks
    glob: slice              # columns of the g global tokens
    rep: slice               # the column of R_i (HST; empty otherwise)
    rep_row: torch.Tensor    # bool [K]: the columns R_i's own query row reads (HST: own block, globals, R_i)


def key_layout(n, p, rand_idx, rand_ok, with_reps=False):
    """The keys of every query block: K = (nw + r) b + g (+ 1) columns, nw = 2w + 1 window blocks.
    A window block off either end is clamped onto block 0 or m-1 and masked; a global token inside a window or
    random block is masked there: it is attended through its global column only, never counted twice."""
    b = p.block_size
    m, g = n // b, min(p.num_global, n)
    H, r = rand_idx.shape[0], rand_idx.shape[-1]
    dev = rand_idx.device
    offsets = p.window_offsets()
    nw = len(offsets)
    i = torch.arange(m, device=dev)
    win = i[:, None] + torch.tensor(offsets, device=dev)                         # [m, nw] window blocks
    blocks = torch.cat([win.clamp(0, m - 1).expand(H, m, nw), rand_idx], dim=-1)  # [H, m, nw + r]
    blocks_ok = torch.cat([((win >= 0) & (win < m)).expand(H, m, nw), rand_ok], dim=-1)
    tok = blocks[..., None] * b + torch.arange(b, device=dev)                    # [H, m, nw + r, b] tokens
    kidx = [tok.flatten(2), torch.arange(g, device=dev).expand(H, m, g)]         # block keys, then globals
    kin = [(blocks_ok[..., None] & (tok >= g)).flatten(2), torch.ones(H, m, g, dtype=torch.bool, device=dev)]
    if with_reps:                                                                # R_i sits at n + i (§2.2)
        kidx.append((n + i).view(1, m, 1).expand(H, m, 1))
        kin.append(torch.ones(H, m, 1, dtype=torch.bool, device=dev))
    kidx, kin = torch.cat(kidx, dim=-1), torch.cat(kin, dim=-1)                  # [H, m, K]
    c_win, c_rand = nw * b, (nw + r) * b                                         # column boundaries
    own = offsets.index(0) * b
    window, own, random = slice(0, c_win), slice(own, own + b), slice(c_win, c_rand)
    glob, rep = slice(c_rand, c_rand + g), slice(c_rand + g, kidx.shape[-1])
    rep_row = torch.zeros(kidx.shape[-1], dtype=torch.bool, device=dev)
    if with_reps:                                                                # R_i reads block i, the
        for cols in (own, glob, rep):                                            # globals and itself
            rep_row[cols] = True
    return Layout(kidx, kin, blocks, blocks_ok, window, own, random, glob, rep, rep_row)


def real_keys(attention_mask, n, block_size, with_reps, batch_size=1, device=None):
    """bool [B, L]: which keys are real (not padding). HST: R_j is real iff block j holds a real token."""
    real = (torch.ones(batch_size, n, dtype=torch.bool, device=device) if attention_mask is None
            else attention_mask.to(device=device).bool())                        # [B, n]
    if with_reps:
        real = torch.cat([real, real.view(real.shape[0], -1, block_size).any(-1)], dim=1)  # [B, n + m]
    return real


# ---------------------------------------------------------------------------------------------------------
# The gather kernel: every query block gathers its K keys by index and does one small attention. Time and memory
# are O(n K): autograd keeps A [B, H, m, b, K] and the gathered k, v (K / b times the size of k), never n x n.

def gather_keys(c, kidx, m):
    """c [B, H, L, e] -> [B, H, m, K, e]: row kidx[h, i, j] of head h, by ONE index_select (its backward is
    one index_add_). Used for k, v and (AttendOut) the G-Net's features alike. A c with one head (the shared
    G-Net) is read through every head's kidx: [B, 1, L, e] -> [B, H_kidx, m, K, e]."""
    B, Hc, L, e = c.shape
    H = kidx.shape[0]
    heads = torch.arange(H, device=kidx.device)[:, None, None] if Hc > 1 else 0
    flat = (kidx + heads * L).reshape(-1)                                        # [H m K] rows h L + l
    return c.reshape(B, Hc * L, e).index_select(1, flat).view(B, H, m, -1, e)


def _attend(q, k, v, valid, dropout_p, mask_fn, pair_scores, real_rows):
    """softmax(q k^T / sqrt(d_h), masked by valid) v over any leading layout: q [.., Q, d], k, v [.., K, d],
    valid bool [.., Q, K]. real_rows [.., Q, 1]: the query rows that are real tokens (mask_fn counts only
    real pairs). A row with no valid key gives 0."""
    invalid = ~valid
    a = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))  # S = q k^T / sqrt(d_h) §1
    if mask_fn is not None:                                   # AttendOut's masked pass (methods.md §3.1):
        a = mask_fn(a, valid & real_rows, pair_scores)        # S' = S - 10000 (1 - M), in this layout
    with torch.no_grad():                                     # a finite fill, in place, outside autograd: a
        a.masked_fill_(invalid, torch.finfo(a.dtype).min)     # masked score gets probability 0, gradient 0
    a = a.softmax(dim=-1)                                     # A = softmax(S) [.., Q, K] (S freed here)
    if dropout_p > 0:
        a = F.dropout(a, dropout_p, training=True)            # standard attention dropout
    out = torch.matmul(a, v)                                  # A V [.., Q, d]
    return out.masked_fill(invalid.all(dim=-1, keepdim=True), 0.0)  # no valid key: 0, not a uniform mean


def _stage1(q, k, v, attention_mask, *, with_reps, generator, dropout_p, mask_fn, pattern):
    """The body of block_sparse_attention (with_reps=False, L = n) and hst_attention (L = n + m, [X; R]).
    q, k, v [B, H, L, d]; returns [B, H, L, d]."""
    p = Pattern(**pattern)
    B, H, L, d = q.shape
    b = p.block_size
    n = L * b // (b + 1) if with_reps else L                                     # tokens (L - n = m reps)
    m, g = n // b, min(p.num_global, n)
    assert n % b == 0 and L == (n + m if with_reps else n), f"length {L} does not fit block size {b}"
    dev = q.device
    real = real_keys(attention_mask, n, b, with_reps, B, dev)                    # [B, L]
    rand_idx, rand_ok = random_blocks(m, num_heads=H, generator=generator, device=dev, **pattern)  # [H, m, r]
    lay = key_layout(n, p, rand_idx, rand_ok, with_reps)                         # kidx, kin [H, m, K]
    bq = b + 1 if with_reps else b                                               # query rows per block
    row_ok = torch.ones(m, bq, lay.kidx.shape[-1], dtype=torch.bool, device=dev)  # [m, bq, K]
    row_ok[:, :b] &= (torch.arange(n, device=dev) >= g).view(m, b, 1)           # global rows: done below
    if with_reps:
        row_ok[:, b] = lay.rep_row                                               # R_i: block i, globals, R_i
    valid = (lay.kin & real[:, lay.kidx])[:, :, :, None, :] & row_ok            # [B, H, m, bq, K]

    def queries(a):                                  # [B, H, L, e] -> [B, H, m, bq, e]; R_i is row b (HST)
        ab = a[:, :, :n].reshape(B, a.shape[1], m, b, a.shape[-1])               # (H or the G-Net's 1)
        return torch.cat([ab, a[:, :, n:, None]], dim=3) if with_reps else ab

    def pair_local(a, c):                            # a_i . c_j in the block layout, [B, H, m, bq, K]
        kidx = lay.kidx[:1] if c.shape[1] == 1 and p.num_random == 0 else lay.kidx   # heads alike: one
        return torch.matmul(queries(a), gather_keys(c, kidx, m).transpose(-1, -2))

    real_rows = real[:, :n].view(B, 1, m, b, 1)                                  # real query tokens
    if with_reps:                                                                # and real R_i rows
        real_rows = torch.cat([real_rows, real[:, n:].view(B, 1, m, 1, 1)], dim=3)  # [B, 1, m, bq, 1]
    out = _attend(queries(q), gather_keys(k, lay.kidx, m), gather_keys(v, lay.kidx, m), valid, dropout_p,
                  mask_fn, pair_local, real_rows)                                # [B, H, m, bq, d]
    tok_out = out[:, :, :, :b].reshape(B, H, n, d)                               # [B, H, n, d]
    if g > 0:                                        # the g global rows attend to every key, densely: O(g L)
        def pair_global(a, c):                       # [B, H, g, L]
            return torch.matmul(a[:, :, :g], c.transpose(-1, -2))

        out_g = _attend(q[:, :, :g], k, v, real[:, None, None, :], dropout_p, mask_fn, pair_global,
                        real[:, None, :g, None])                                 # [B, H, g, d]
        tok_out = torch.cat([out_g, tok_out[:, :, g:]], dim=2)                  # they replace their block rows
    if not with_reps:
        return tok_out
    return torch.cat([tok_out, out[:, :, :, b]], dim=2)                          # [B, H, n + m, d]: [X; R]


def block_sparse_attention(q, k, v, attention_mask=None, *, generator=None, dropout_p=0.0, mask_fn=None,
                           flex=False, **pattern):
    """methods.md §2.1. q, k, v [B, H, n, d_h], attention_mask [B, n] (1 = real), n a multiple of block_size;
    pattern: the Pattern keywords. generator: the random blocks' (None: torch's global one, a fresh draw).
    mask_fn(S, valid, pair_scores), AttendOut's masked pass (methods.md §3.1), is called on the logits of the
    block layout S [B, H, m, b, K], then of the global rows [B, H, g, n]. flex=True (CUDA): with nothing to
    drop or mask, run through FlexAttention (flex_stage1). Returns [B, H, n, d_h]."""
    if flex and mask_fn is None and dropout_p == 0:
        return flex_stage1(q, k, v, attention_mask, with_reps=False, generator=generator, **pattern)
    return _stage1(q, k, v, attention_mask, with_reps=False, generator=generator, dropout_p=dropout_p,
                   mask_fn=mask_fn, pattern=pattern)


def hst_attention(q, k, v, attention_mask=None, *, generator=None, dropout_p=0.0, mask_fn=None, flex=False,
                  **pattern):
    """methods.md §2.2 stage 1 (reconstructed). q, k, v [B, H, n + m, d_h]: n tokens, then m representatives.
    A token in block j: its §2.1 keys + R_j; a global token: every token and representative; R_j: the tokens
    of block j, the globals and R_j (valid iff block j holds a real token). The block layout is
    [B, H, m, b + 1, K + 1]: R_j is query row b and key column K of block j. Returns [B, H, n + m, d_h]."""
    if flex and mask_fn is None and dropout_p == 0:
        return flex_stage1(q, k, v, attention_mask, with_reps=True, generator=generator, **pattern)
    return _stage1(q, k, v, attention_mask, with_reps=True, generator=generator, dropout_p=dropout_p,
                   mask_fn=mask_fn, pattern=pattern)


# ---------------------------------------------------------------------------------------------------------
# FlexAttention (CUDA, nothing to drop): the same layout as a BlockMask, run by PyTorch's block-sparse kernel

_compiled_flex = None


def _flex_kernel(device):
    """flex_attention, compiled on CUDA (eager flex_attention is a slow reference); eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)            # compiled once per process
    return _compiled_flex


def layout_mask_mod(lay, real, n, b, g):
    """FlexAttention's mask_mod(batch, head, query, key) -> bool, the gather kernel's sets over [X] or [X; R]:
    a token row of block i reads its window / random blocks (lay.blocks), the globals and R_i; a global row
    reads every key; R_j's row (query n + j): block j, the globals and R_j; and the key must be real."""
    H, m, _ = lay.blocks.shape
    table = torch.zeros(H, m, m, dtype=torch.long, device=real.device)
    table = table.scatter_add_(-1, lay.blocks, lay.blocks_ok.long()) > 0        # [H, m, m] block i reads j

    def mask_mod(bi, h, qi, ki):
        q_tok, k_tok = qi < n, ki < n                                            # tokens, not representatives
        i = torch.where(q_tok, qi // b, qi - n).clamp(0, m - 1)                 # the query's block (R_j: j)
        j = (ki // b).clamp(0, m - 1)                                            # the key's block
        token_row = k_tok & ((ki < g) | table[h, i, j]) | ~k_tok & (ki - n == i)
        rep_row = k_tok & ((ki < g) | (j == i)) | ~k_tok & (ki - n == i)
        allowed = torch.where(q_tok, token_row | (qi < g), rep_row)             # a global row reads all
        return allowed & real[bi, ki]
    return mask_mod


def flex_stage1(q, k, v, attention_mask, *, with_reps, generator=None, **pattern):
    """Stage 1 through torch's flex_attention (nothing needs the probabilities): the BlockMask comes from the
    same random draw and key_layout as the gather kernel, so the outputs are equal. [B, H, L, d] -> same."""
    from torch.nn.attention.flex_attention import create_block_mask
    p = Pattern(**pattern)
    B, H, L, d = q.shape
    b = p.block_size
    n = L * b // (b + 1) if with_reps else L
    m, g = n // b, min(p.num_global, n)
    dev = q.device
    real = real_keys(attention_mask, n, b, with_reps, B, dev)                    # [B, L]
    rand_idx, rand_ok = random_blocks(m, num_heads=H, generator=generator, device=dev, **pattern)
    lay = key_layout(n, p, rand_idx, rand_ok, with_reps)
    block_mask = create_block_mask(layout_mask_mod(lay, real, n, b, g), B, H, L, L, device=dev,
                                   _compile=dev.type == "cuda")
    return _flex_kernel(dev)(q, k, v, block_mask=block_mask)                     # [B, H, L, d]


# ---------------------------------------------------------------------------------------------------------
# The equivalent dense masks (teaching and tests only: these ARE n x n). block kernel = dense under the mask.

def layout_rows(lay, L, cols):
    """bool [H, m, L]: the keys that query block i's token rows read through the columns where cols [H, m, K]
    holds. A key held by several columns counts once (a bool mask is a set)."""
    H, m, K = lay.kidx.shape
    hits = torch.zeros(H, m, L, dtype=torch.long).scatter_add_(-1, lay.kidx.cpu(), cols.long().cpu())
    return hits > 0


def dense_layout_mask(n, attention_mask, *, with_reps, generator, num_heads, batch_size, **pattern):
    """bool [B, H, L, L], True = query i may attend key j (L = n, or n + m for [X; R]): key_layout written
    out densely, from the same random draw as the kernel's."""
    p = Pattern(**pattern)
    b = p.block_size
    m, g = n // b, min(p.num_global, n)
    L = n + m if with_reps else n
    rand_idx, rand_ok = random_blocks(m, num_heads=num_heads, generator=generator, **pattern)
    lay = key_layout(n, p, rand_idx.cpu(), rand_ok.cpu(), with_reps)
    rows = layout_rows(lay, L, lay.kin)[:, torch.arange(n) // b]                 # [H, n, L] token rows
    rows[:, :g] = True                                                           # global rows: every key
    if with_reps:
        rows = torch.cat([rows, layout_rows(lay, L, lay.kin & lay.rep_row)], dim=1)  # + R_j's rows [H, L, L]
    real = real_keys(attention_mask, n, b, with_reps, batch_size, "cpu")         # [B, L]
    return rows[None] & real[:, None, None, :]                                   # padding keys masked


def dense_mask(n, attention_mask=None, *, generator=None, num_heads=1, batch_size=1, **pattern):
    """bool [B, H, n, n], True = query i may attend key j (methods.md §2.1), the kernel's random draw."""
    return dense_layout_mask(n, attention_mask, with_reps=False, generator=generator, num_heads=num_heads,
                             batch_size=batch_size, **pattern)


def hst_dense_mask(n, attention_mask=None, *, generator=None, num_heads=1, batch_size=1, **pattern):
    """bool [B, H, n + m, n + m] over [X; R] (n tokens, m representatives): HST stage 1 (methods.md §2.2)."""
    return dense_layout_mask(n, attention_mask, with_reps=True, generator=generator, num_heads=num_heads,
                             batch_size=batch_size, **pattern)
