"""Block-sparse attention (BigBird-style) and the HST stage-1 kernel, in plain PyTorch.

Idea (methods.md §2.1, 2.2): cut the sequence into blocks of b tokens; query block i attends only to the key
blocks i-w..i+w, r random blocks and the first g (global) tokens, which themselves attend to everything, so a
layer costs O(n). HST adds one representative R_j per block that reads its block (stage 1, here).

Run:  python sparse.py                     # draws the attention patterns (text + docs/*.png)
      python -m pytest tests/test_sparse.py -q

Layout. Every query block gathers its keys once, in this order (K columns in all):
    [ window blocks i-w .. i+w | r random blocks | g global tokens | (HST only) R_i ]
    (2w+1)*b              r*b               g                  1
  The keys are gathered by token index (key_layout, one index_select for k, v and pair_scores).
  - window blocks that fall off either end are clamped onto an existing block and masked;
  - a global token is attended through its global column only: wherever it also lies in a window or
    random block it is masked there, so no key is counted twice (methods.md §2.1);
  - the g global query rows are computed densely against all keys ([B, H, g, n], O(g n)); their rows in
    the block layout are masked and replaced.
  Without dropout the block layout runs through PyTorch's fused attention (scores never stored), a chunk
  of query blocks at a time, and so do the global rows; neither the gathered keys nor the layout are kept
  for the backward (FusedSparseAttention builds and gathers them again), and the chunks' key gradients add
  up in one buffer, so time and memory are linear in n. No n x n tensor is ever built.
  FlexAttention (flex=True, model.Config.flex_attention on CUDA): without dropout, stage 1 can also run
  through torch's FlexAttention with a BlockMask made from the same layout (flex_stage1); the gather kernel
  stays the reference and the path for dropout and AttendOut.
  drop_fn (the AttendOut hook; model.Attention, methods.md §3.1) sees the block layout [B, H, m, b, K]
  (HST: [B, H, m, b + 1, K + 1]) and then the global rows [B, H, g, L], with valid marking the real
  (query, key) pairs the pattern allows. Padding masks keys in the attention itself (as dense).

How to add a pattern (e.g. a dilated window). The layout is built in ONE place, key_layout (it returns
the columns and the slices window / own / random / glob / rep); the kernel, the FlexAttention path and the
dense reference masks (dense_layout_mask) all read it, so a new pattern changes only:
  1. Pattern: a field with its default (the kernels and masks take it as a keyword, pattern_of reads it
     from model.Config by name);
  2. the function that defines the piece: Pattern.window_offsets for the window (random_blocks avoids
     whatever it returns), key_layout for a new group of key columns (give it a slice; R_i's row is rep_row;
     FlexAttention's layout_mask_mod reads lay.blocks, so only a new column group needs a clause there);
  3. outside sparse.py: the model.Config field of the same name, its check in model.check_config, and the
     train.py flag (CONFIG_FLAGS + add_argument). Test it against the dense reference (tests/test_sparse.py).
"""
import argparse
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------------------
# The pattern's knobs, and the window (the one place that says which blocks a window holds)

class Pattern(NamedTuple):
    """The sparse pattern's knobs, named as the model.Config fields (and train.py flags) that set them. Every
    public function here takes them as keywords (block_size=64, window=1, ...) and builds this."""
    block_size: int = 64      # b, tokens per block
    window: int = 1           # w, window blocks on each side
    num_global: int = 1       # g, global tokens at the start
    num_random: int = 0       # r, random key blocks per query block

    def window_offsets(self):
        """Key blocks of query block i's window, as offsets from i: i-w .. i+w. Must hold 0 (the own block)."""
        return list(range(-self.window, self.window + 1))


def pattern_of(cfg):
    """The Pattern keywords of a model.Config (its fields of the same names)."""
    return {f: getattr(cfg, f) for f in Pattern._fields}


def window_matrix(m, p, device=None):
    """bool [m, m]: key block j is in query block i's window (j - i is one of p.window_offsets())."""
    blk = torch.arange(m, device=device)
    offsets = torch.tensor(p.window_offsets(), device=device)
    return ((blk[None, :] - blk[:, None])[..., None] == offsets).any(-1)              # [m, m]


# ---------------------------------------------------------------------------------------------------------
# Random blocks (methods.md §2.1)

def random_blocks(num_blocks, *, num_heads=1, generator=None, device=None, **pattern):
    """Draw `num_random` key blocks per (head, query block), uniformly among the blocks outside the window.

    Returns (idx, ok): idx long [H, m, r], ok bool [H, m, r]. The draw is shared by every batch element
    (one draw per layer call, head and query block, like BigBird). Clamping: r = min(num_random, the most
    non-window blocks any query block has); a query block with fewer non-window blocks than r gets window
    blocks in its surplus slots and those slots have ok = False (masked). num_random = 0 draws nothing and
    leaves the generator untouched. Used by both the kernel and the dense masks, so the same generator state
    gives the same pattern.
    """
    p = Pattern(**pattern)
    m, H = num_blocks, num_heads
    offsets = p.window_offsets()
    in_range = [len([o for o in offsets if 0 <= i + o < m]) for i in range(m)]  # window blocks per query block
    fewest = min(in_range) if in_range else 0
    r = min(p.num_random, m - fewest)
    if r == 0:
        idx = torch.zeros(H, m, 0, dtype=torch.long, device=device)
        return idx, idx.bool()
    draw_device = generator.device if generator is not None else device
    in_window = window_matrix(m, p, draw_device)                               # [m, m]
    u = torch.rand(H, m, m, generator=generator, device=draw_device)        # [H, m, m] uniform keys
    u = u.masked_fill(in_window, 2.0)                                       # window blocks sort last
    # [H, m, r]: the r smallest = uniform; a copy, not a view, so the [H, m, m] sort is not kept alive with it
    idx = u.argsort(dim=-1)[..., :r].contiguous()
    ok = ~in_window.expand(H, m, m).gather(-1, idx)                         # [H, m, r]
    return idx.to(device), ok.to(device)


# ---------------------------------------------------------------------------------------------------------
# The key layout: one query block's keys, [window | random | global | representative], as token indices.
# THE one place that builds it; the kernel, the FlexAttention path and the dense masks all read it.

class Layout(NamedTuple):
    kidx: torch.Tensor      # long [H, m, K]: token index of every key column (positions in [X] or [X; R])
    kin: torch.Tensor       # bool [H, m, K]: the pattern allows the column (before padding)
    blocks: torch.Tensor    # long [H, m, nw + r]: key block of each window / random slot (clamped)
    blocks_ok: torch.Tensor  # bool [H, m, nw + r]: the slot is a real, allowed block
    window: slice           # columns of the window blocks
    own: slice              # columns of query block i itself (inside the window)
    random: slice           # columns of the random blocks
    glob: slice             # columns of the g global tokens
    rep: slice              # column of R_i (HST; empty otherwise)
    rep_row: torch.Tensor   # bool [K]: the columns R_i's own query row reads (HST: own block, globals, R_i)


def key_layout(n, p, rand_idx, rand_ok, with_reps=False):
    """The keys of every query block, K = (nw + r) b + g (+ 1 with representatives) columns, nw = 2w + 1.

    Window blocks off either end are clamped (kin False); a global token inside a window or random block has
    kin False there, it is attended through its global column (methods.md §2.1: never counted twice)."""
    b = p.block_size
    m, g = n // b, min(p.num_global, n)
    H, r = rand_idx.shape[0], rand_idx.shape[-1]
    dev = rand_idx.device
    offsets = p.window_offsets()
    nw = len(offsets)
    i = torch.arange(m, device=dev)
    win = i[:, None] + torch.tensor(offsets, device=dev)                              # [m, nw] window
    blocks = torch.cat([win.clamp(0, m - 1).expand(H, m, nw), rand_idx], dim=-1)      # [H, m, nw + r]
    blocks_ok = torch.cat([((win >= 0) & (win < m)).expand(H, m, nw), rand_ok], dim=-1)
    tok = blocks[..., None] * b + torch.arange(b, device=dev)                          # [H, m, nw + r, b]
    kidx = [tok.flatten(2), torch.arange(g, device=dev).expand(H, m, g)]              # blocks, globals
    kin = [(blocks_ok[..., None] & (tok >= g)).flatten(2), torch.ones(H, m, g, dtype=torch.bool, device=dev)]
    if with_reps:                                                                     # R_i column (methods.md §2.2)
        kidx.append((n + i).view(1, m, 1).expand(H, m, 1))
        kin.append(torch.ones(H, m, 1, dtype=torch.bool, device=dev))
    kidx, kin = torch.cat(kidx, dim=-1), torch.cat(kin, dim=-1)                       # [H, m, K]
    c_win, c_rand = nw * b, (nw + r) * b                                              # column boundaries
    own = offsets.index(0) * b
    window, own, random = slice(0, c_win), slice(own, own + b), slice(c_win, c_rand)
    glob, rep = slice(c_rand, c_rand + g), slice(c_rand + g, kidx.shape[-1])
    rep_row = torch.zeros(kidx.shape[-1], dtype=torch.bool, device=dev)
    if with_reps:                                       # R_i reads the tokens of block i, the globals and R_i
        for cols in (own, glob, rep):
            rep_row[cols] = True
    return Layout(kidx, kin, blocks, blocks_ok, window, own, random, glob, rep, rep_row)


def real_keys(attention_mask, n, block_size, with_reps, batch_size=1, device=None):
    """bool [B, L]: which keys are real (not padding). HST: R_j is real iff block j has a real token."""
    real = (torch.ones(batch_size, n, dtype=torch.bool, device=device) if attention_mask is None
            else attention_mask.to(device=device).bool())                               # [B, n]
    if with_reps:
        real = torch.cat([real, real.view(real.shape[0], -1, block_size).any(-1)], dim=1)  # [B, n + m]
    return real


def flat_index(kidx, L):
    """kidx [H, m, K] -> long [H m K], positions in a [H L] flattening of heads and sequence."""
    H = kidx.shape[0]
    return (kidx + torch.arange(H, device=kidx.device)[:, None, None] * L).reshape(-1)


def gather_keys(c, flat, m):
    """c [B, H, L, e] -> [B, H, m, K, e] by one index_select (backward: one index_add_); flat from
    flat_index. Used for k, v and pair_scores alike."""
    B, H, L, e = c.shape
    return c.reshape(B, H * L, e).index_select(1, flat).view(B, H, m, -1, e)


def _attend(q, k, v, valid, dropout_p, drop_fn, pair_scores, real_rows=None):
    """softmax(q k^T / sqrt(d_h) masked by valid) v, any leading layout. q [.., Q, d], k/v [.., K, d].
    real_rows (bool, broadcastable to [.., Q, 1]): which query rows are real tokens; drop_fn counts only
    real (query, key) pairs in its statistics."""
    invalid = ~valid
    s = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))   # [.., Q, K]  methods.md §1
    # Mask with a finite fill (no NaN), in place and outside autograd: softmax already gives a masked score
    # zero gradient (its probability is exactly 0), and rows with no valid key are zeroed at the output
    # below, so their gradient is 0 too. Saves two full passes over the scores in the backward.
    with torch.no_grad():
        s.masked_fill_(invalid, torch.finfo(s.dtype).min)
    A = s.softmax(dim=-1)                                                        # [.., Q, K]
    if drop_fn is not None:
        real_pairs = valid if real_rows is None else valid & real_rows
        A = drop_fn(A.masked_fill(invalid, 0.0), real_pairs, pair_scores)  # AttendOut hook, in its own layout
    elif dropout_p > 0:
        A = F.dropout(A, dropout_p, training=True)
    out = torch.matmul(A, v)                                                     # [.., Q, d]
    # a row with no valid key softmaxes to a uniform mean over masked keys: give 0 instead
    return out.masked_fill(invalid.all(dim=-1, keepdim=True), 0.0)


def _mask_bias(ok, dtype):
    """bool mask -> additive bias with a finite fill (no NaN; a row with no valid key is zeroed after)."""
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, torch.finfo(dtype).min)


# ---------------------------------------------------------------------------------------------------------
# Kernels

CHUNK_ELEMENTS = 2 ** 21   # a gathered k or v chunk holds at most this many numbers (8 MB in fp32)


def _rows(c):
    """[B, H, L, d] -> [B, H L, d]: heads and positions as rows, the table that the flat indices h L + l point
    into (one copy of c: a strided view of the QKV projection cannot be flattened in place)."""
    B, H, L, d = c.shape
    return c.reshape(B, H * L, d)


def _heads_first(c, B, K, Hm):
    """A key-major gather [B, K Hm, d] -> [B, Hm, K, d] (a view: SDPA's key gradients come back in the
    gather's layout)."""
    return c.view(B, K, Hm, c.shape[-1]).transpose(1, 2)


# The fused attention of one chunk, forward and backward. On the CPU we call the two ATen ops behind
# F.scaled_dot_product_attention directly: the forward also returns each row's log-sum-exp, and with it (and
# the output) the backward needs no forward pass of its own. Elsewhere (CUDA with --no-flex, ...) the backward
# recomputes the chunk's forward through F.scaled_dot_product_attention and differentiates that.
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _chunk_forward(q, k, v, bias):
    """q [N, M, Q, d], k/v [N, M, K, d], bias [N, M, Q or 1, K] -> (out [N, M, Q, d], lse [N, M, Q] or None)."""
    if q.device.type == "cpu":
        return _CPU_FLASH(q, k, v, attn_mask=bias)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias), None


def _chunk_backward(grad, q, k, v, bias, out, lse):
    """Gradients (dq, dk, dv) of _chunk_forward's out, given its out and lse."""
    if lse is not None:
        return _CPU_FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, False, attn_mask=bias)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)                 # recomputed
    return torch.autograd.grad(o, (q, k, v), grad)


class FusedSparseAttention(torch.autograd.Function):
    """Stage 1 without dropout, all of it: the block layout a chunk of `step` query blocks at a time (gather
    the chunk's keys and values, fused attention), then the g global rows densely (one more fused call, over
    all keys). q, k, v [B, H, L, d]; real [B, L]; chunks() -> (step, idxs, oks): idxs one int32 [K H mc] per
    chunk (flat rows h L + l, key-major), oks one bool [B, H, mc, bq or 1, K] per chunk. Returns [B, H, L, d].

    Memory: the gathered keys and values are K = (2w + 1 + r) b + g (+ 1) rows per query block, K / b times
    the size of k and v, so nothing gathered is kept for the backward: it saves q, k, v (the layer keeps them
    anyway), its own output (which the layer's output projection keeps anyway) and each row's log-sum-exp
    (one number per row; the g global rows keep a second, from their call over all keys). Not even the
    layout is kept: chunks() builds it again in the backward from the random blocks it was drawn from
    (H m r numbers). The backward gathers each chunk's keys and values again and runs the fused kernel's
    backward on them (_chunk_backward), adding every chunk's gradients into ONE buffer per q, k, v
    (autograd's own index_select backward would zero-fill a full-size gradient per chunk, O(n^2) in all).
    So memory is O(n d), like dense fused attention's, and time is linear in n.

    Two kinds of rows get no gradient from their chunk: the g global rows (their block results are replaced)
    and rows with no valid key (set to 0). Their output gradient is zeroed before the kernel's backward; with
    dO = 0 a row adds nothing to dq, dk or dv, whatever out holds there (the global result, or 0)."""

    @staticmethod
    def forward(ctx, q, k, v, n, b, g, real, chunks):
        step, idxs, oks = chunks()
        B, H, L, d = q.shape     # out [B, H, L, d] laid out as [B, L, H, d]: the layer's merge of heads is a view
        out = torch.empty(B, L, H, d, dtype=q.dtype, device=q.device).transpose(1, 2)
        kf, vf = _rows(k), _rows(v)                                                 # [B, H L, d]
        lses = []
        for i, (idx, ok) in enumerate(zip(idxs, oks)):
            mc, K = ok.shape[2], ok.shape[-1]
            okf = ok.flatten(1, 2)                                                  # [B, H mc, bq or 1, K]
            qc = _chunk_rows(q, n, b, i * step, mc).reshape(B, H * mc, -1, d)        # [B, H mc, bq, d]
            oc, lse = _chunk_forward(qc, _heads_first(kf.index_select(1, idx), B, K, H * mc),
                                     _heads_first(vf.index_select(1, idx), B, K, H * mc),
                                     _mask_bias(okf, q.dtype))                       # methods.md §1
            oc = oc.masked_fill(~okf.any(-1, keepdim=True), 0.0)                     # no valid key: 0
            _put_chunk_rows(out, oc.view(B, H, mc, -1, d), n, b, i * step)
            lses.append(lse)
        if g > 0:                            # methods.md §2.1: global rows attend to every key; replace their block rows
            og, lse = _chunk_forward(q[:, :, :g], k, v, _mask_bias(real[:, None, None, :], q.dtype))  # [B,H,g,d]
            out[:, :, :g] = og.masked_fill(~real.any(-1)[:, None, None, None], 0.0)         # no valid key: 0
            lses.insert(0, lse)                                                     # the global rows' first
        ctx.save_for_backward(q, k, v, out, real, *[t for t in lses if t is not None])
        ctx.sizes, ctx.chunks = (n, b, g), chunks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, real, *lses = ctx.saved_tensors
        n, b, g = ctx.sizes
        step, idxs, oks = ctx.chunks()                                               # the layout again
        lses = lses or [None] * (len(idxs) + (g > 0))                               # None: not on the CPU
        B, H, L, d = k.shape
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)   # every row is written by its chunk below
        if g > 0:   # the global rows first: their key and value gradients (full size) become the buffers
            lse, *lses = lses
            gg = grad_out[:, :, :g].masked_fill(~real.any(-1)[:, None, None, None], 0.0)   # no valid key: none
            dq_glob, dk, dv = _chunk_backward(gg, q[:, :, :g], k, v, _mask_bias(real[:, None, None, :], q.dtype),
                                              out[:, :, :g], lse)
            dk, dv = (t.contiguous().view(B, H * L, d) for t in (dk, dv))              # [B, H L, d]
        else:
            dk = torch.zeros(B, H * L, d, dtype=k.dtype, device=k.device)          # [B, H L, d]
            dv = torch.zeros(B, H * L, d, dtype=v.dtype, device=v.device)
        kf, vf = _rows(k), _rows(v)
        for i, (idx, ok, lse) in enumerate(zip(idxs, oks, lses)):
            a, mc, K = i * step, ok.shape[2], ok.shape[-1]

            def chunk(t):                                                           # [B, H mc, bq, d]
                return _chunk_rows(t, n, b, a, mc).reshape(B, H * mc, -1, d)
            okf = ok.flatten(1, 2)                                                  # [B, H mc, bq or 1, K]
            gc = chunk(grad_out).masked_fill(~okf.any(-1, keepdim=True), 0.0)       # no valid key: no gradient
            if a * b < g:                    # the global rows' block results were replaced: no gradient
                glob = torch.arange(a * b, (a + mc) * b, device=q.device).view(1, 1, mc, b, 1) < g
                gc.view(B, H, mc, -1, d)[:, :, :, :b].masked_fill_(glob, 0.0)      # token rows, not R_j
            kc = _heads_first(kf.index_select(1, idx), B, K, H * mc)                 # [B, H mc, K, d] again
            vc = _heads_first(vf.index_select(1, idx), B, K, H * mc)
            gq, gk, gv = _chunk_backward(gc, chunk(q), kc, vc, _mask_bias(okf, q.dtype), chunk(out), lse)
            _put_chunk_rows(dq, gq.view(B, H, mc, -1, d), n, b, a)
            dk.index_add_(1, idx, gk.transpose(1, 2).reshape(B, K * H * mc, d))     # back to key-major rows
            dv.index_add_(1, idx, gv.transpose(1, 2).reshape(B, K * H * mc, d))
        if g > 0:
            dq[:, :, :g] += dq_glob
        return dq, dk.view(B, H, L, d), dv.view(B, H, L, d), None, None, None, None, None


def _chunk_rows(a, n, b, start, mc):
    """The query rows of blocks start .. start + mc - 1: [B, H, L, e] -> [B, H, mc, bq, e] (HST, L > n: R_j
    is row b)."""
    B, H, L, e = a.shape
    rows = a[:, :, start * b:(start + mc) * b].reshape(B, H, mc, b, e)
    return torch.cat([rows, a[:, :, n + start:n + start + mc, None]], dim=3) if L > n else rows


def _put_chunk_rows(out, oc, n, b, start):
    """The inverse of _chunk_rows: write oc [B, H, mc, bq, e] into the rows of out [B, H, L, e]."""
    B, H, mc, _, e = oc.shape
    out[:, :, start * b:(start + mc) * b] = oc[:, :, :, :b].reshape(B, H, mc * b, e)
    if out.shape[2] > n:
        out[:, :, n + start:n + start + mc] = oc[:, :, :, b]


@torch.compiler.disable   # off the CPU its backward calls torch.autograd.grad (_chunk_backward): dynamo can't trace it
def _stage1_fused(q, k, v, n, b, g, real, layout):
    """Stage 1 without dropout by FusedSparseAttention, in chunks of query blocks. q, k, v [B, H, L, d],
    real [B, L]; layout() -> (kidx_flat [H, m, K] (flat_index), ok [B, H, m, bq or 1, K]), called in the
    forward and again in the backward. Chunks keep each gathered key tensor, and each fused call's working
    set, small (<= CHUNK_ELEMENTS): large ones are fresh memory (page faults) on every step and fall out of
    cache, so time would grow faster than n. Returns [B, H, L, d]."""
    B, H, L, d = q.shape

    def chunks():
        kidx_flat, ok = layout()
        K = kidx_flat.shape[-1]
        step = max(1, CHUNK_ELEMENTS // (B * H * K * d))                           # query blocks per chunk
        # [K H mc] each, key-major; int32: index_select and index_add_ take it, at half the memory
        idxs = [c.permute(2, 0, 1).reshape(-1).to(torch.int32) for c in kidx_flat.split(step, dim=1)]
        return step, idxs, list(ok.split(step, dim=2))
    return FusedSparseAttention.apply(q, k, v, n, b, g, real, chunks)


def _stage1(q, k, v, attention_mask, *, with_reps, generator, dropout_p, drop_fn, pattern):
    """Shared body of block_sparse_attention (with_reps=False, L = n) and hst_attention (L = n + m)."""
    p = Pattern(**pattern)
    B, H, L, d = q.shape
    b = p.block_size
    n = L * b // (b + 1) if with_reps else L
    m = n // b
    assert n % b == 0 and L == (n + m if with_reps else n), f"length {L} does not fit block size {b}"
    g = min(p.num_global, n)
    dev = q.device
    real = real_keys(attention_mask, n, b, with_reps, B, dev)                       # [B, L]
    rand_idx, rand_ok = random_blocks(m, num_heads=H, generator=generator, device=dev, **pattern)  # [H, m, r]
    bq = b + 1 if with_reps else b

    def layout():
        """This draw's key columns and masks: flat [H m K] (flat_index), valid_keys [B, H, m, 1, K] (the
        pattern allows the key and it is real), row_ok [m, bq, K] (query side: global query rows are done
        densely below; R_j reads only what lay.rep_row says)."""
        lay = key_layout(n, p, rand_idx, rand_ok, with_reps)
        K = lay.kidx.shape[-1]                                                      # kidx [H, m, K]
        row_ok = torch.ones(m, bq, K, dtype=torch.bool, device=dev)                # [m, bq, K]
        row_ok[:, :b] &= (torch.arange(n, device=dev) >= g).view(m, b, 1)
        if with_reps:
            row_ok[:, b, :] = lay.rep_row
        return flat_index(lay.kidx, L), (lay.kin & real[:, lay.kidx])[:, :, :, None, :], row_ok

    if drop_fn is None and dropout_p == 0:   # no dropout: PyTorch's fused attention, scores never stored
        def fused_layout():
            flat, valid_keys, row_ok = layout()
            # without HST, row_ok only masks the global query rows, which are replaced: keys alone suffice
            return flat.view(H, m, -1), valid_keys & row_ok if with_reps else valid_keys  # ok [B, H, m, bq or 1, K]
        return _stage1_fused(q, k, v, n, b, g, real, fused_layout)                 # [B, H, L, d]
    flat, valid_keys, row_ok = layout()

    def queries(a):                                  # [B, H, L, e] -> [B, H, m, bq, e], R_j is row b (HST)
        ab = a[:, :, :n].reshape(B, H, m, b, a.shape[-1])
        return torch.cat([ab, a[:, :, n:, None]], dim=3) if with_reps else ab

    def pair_local(a, c):                            # a_i . c_j in the block layout, [B, H, m, bq, K]
        return torch.matmul(queries(a), gather_keys(c, flat, m).transpose(-1, -2))

    valid = valid_keys & row_ok                                                     # [B, H, m, bq, K]
    real_rows = real[:, :n].view(B, 1, m, b, 1)                                     # real query tokens
    if with_reps:                                                                   # and real R_j rows
        real_rows = torch.cat([real_rows, real[:, n:].view(B, 1, m, 1, 1)], dim=3)  # [B, 1, m, bq, 1]
    out = _attend(queries(q), gather_keys(k, flat, m), gather_keys(v, flat, m), valid, dropout_p, drop_fn,
                  pair_local, real_rows)                                            # [B, H, m, bq, d]
    tok_out = out[:, :, :, :b].reshape(B, H, n, d)                                  # [B, H, n, d]
    if g > 0:  # methods.md §2.1: global tokens attend to every token (and, HST, every representative)
        def pair_global(a, c):                       # [B, H, g, L]
            return torch.matmul(a[:, :, :g], c.transpose(-1, -2))

        out_g = _attend(q[:, :, :g], k, v, real[:, None, None, :], dropout_p, drop_fn, pair_global,
                        real[:, None, :g, None])
        tok_out = torch.cat([out_g, tok_out[:, :, g:]], dim=2)                     # [B, H, n, d]
    if not with_reps:
        return tok_out
    return torch.cat([tok_out, out[:, :, :, b]], dim=2)                             # [B, H, n + m, d]


def block_sparse_attention(q, k, v, attention_mask=None, *, generator=None, dropout_p=0.0, drop_fn=None,
                           flex=False, **pattern):
    """methods.md §2.1. q, k, v [B, H, n, d_h], attention_mask [B, n] (1 = real), n a multiple of block_size;
    pattern: the Pattern keywords (block_size, window=1, num_global=1, num_random=0).
    drop_fn (the AttendOut hook, methods.md §3.1) is called twice: on the block layout A [B, H, m, b, K] and on the global rows
    [B, H, g, n]. flex=True: without dropout, run through FlexAttention (flex_stage1). Returns [B, H, n, d_h]."""
    if flex and drop_fn is None and dropout_p == 0:
        return flex_stage1(q, k, v, attention_mask, with_reps=False, generator=generator, **pattern)
    return _stage1(q, k, v, attention_mask, with_reps=False, generator=generator, dropout_p=dropout_p,
                   drop_fn=drop_fn, pattern=pattern)


def hst_attention(q, k, v, attention_mask, *, generator=None, dropout_p=0.0, drop_fn=None, flex=False, **pattern):
    """methods.md §2.2 stage 1 (reconstructed). q, k, v [B, H, n + m, d_h]: n tokens then m representatives.
    Token in block j: its 2.1 neighbourhood + R_j; global token: all tokens and representatives;
    R_j: the tokens of block j, the global tokens and R_j. R_j is valid (as a key) iff block j has a real
    token. The block layout is [B, H, m, b + 1, K + 1]: R_j is query row b and key column K of block j.
    flex=True: without dropout, run through FlexAttention (flex_stage1). Returns [B, H, n + m, d_h]."""
    if flex and drop_fn is None and dropout_p == 0:
        return flex_stage1(q, k, v, attention_mask, with_reps=True, generator=generator, **pattern)
    return _stage1(q, k, v, attention_mask, with_reps=True, generator=generator, dropout_p=dropout_p,
                   drop_fn=drop_fn, pattern=pattern)


# ---------------------------------------------------------------------------------------------------------
# FlexAttention path (no dropout, no G-Net): the same layout as a BlockMask, PyTorch's fused block-sparse kernel

_compiled_flex = None


def _flex_kernel(device):
    """flex_attention, compiled on CUDA (eager flex_attention is a slow reference there); eager on the CPU."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def layout_mask_mod(lay, real, n, b, g):
    """FlexAttention's mask_mod(batch, head, query, key) -> bool for the layout `lay` over [X] or [X; R]:
    token row in block i: the key blocks of its window / random slots (lay.blocks), the global tokens, R_i;
    global row: every key; R_j's row (query n + j): the tokens of block j, the globals, R_j (lay.rep_row);
    and the key must be real (not padding). The same sets as the gather kernel's columns."""
    H, m, _ = lay.blocks.shape
    table = torch.zeros(H, m, m, dtype=torch.long, device=real.device)
    table = table.scatter_add_(-1, lay.blocks, lay.blocks_ok.long()) > 0              # [H, m, m] block i reads j

    def mask_mod(bi, h, qi, ki):
        q_tok, k_tok = qi < n, ki < n
        i = torch.where(q_tok, qi // b, qi - n).clamp(0, m - 1)                      # query's block (R_j: j)
        j = (ki // b).clamp(0, m - 1)                                                # key's block
        token_row = k_tok & ((ki < g) | table[h, i, j]) | ~k_tok & (ki - n == i)
        rep_row = k_tok & ((ki < g) | (j == i)) | ~k_tok & (ki - n == i)
        allowed = torch.where(q_tok, token_row | (qi < g), rep_row)
        return allowed & real[bi, ki]
    return mask_mod


def flex_stage1(q, k, v, attention_mask, *, with_reps, generator=None, **pattern):
    """Stage 1 through torch.nn.attention.flex_attention (no dropout, no G-Net: nothing needs the
    probabilities). The BlockMask comes from the same key_layout (and random draw) as the gather kernel, so
    the outputs are equal. q, k, v [B, H, L, d] -> [B, H, L, d]. A row with no valid key gives 0 (as ours)."""
    from torch.nn.attention.flex_attention import create_block_mask
    p = Pattern(**pattern)
    B, H, L, d = q.shape
    b = p.block_size
    n = L * b // (b + 1) if with_reps else L
    m, g = n // b, min(p.num_global, n)
    dev = q.device
    real = real_keys(attention_mask, n, b, with_reps, B, dev)                        # [B, L]
    rand_idx, rand_ok = random_blocks(m, num_heads=H, generator=generator, device=dev, **pattern)
    lay = key_layout(n, p, rand_idx, rand_ok, with_reps)
    block_mask = create_block_mask(layout_mask_mod(lay, real, n, b, g), B, H, L, L, device=dev,
                                   _compile=dev.type == "cuda")
    return _flex_kernel(dev)(q, k, v, block_mask=block_mask)                        # [B, H, L, d]


# ---------------------------------------------------------------------------------------------------------
# Equivalent dense masks (teaching and tests only: these ARE n x n)

def layout_rows(lay, L, cols):
    """bool [H, m, L]: the keys that query block i's token rows read, from the layout columns where `cols`
    ([H, m, K] bool) holds. A key held by several columns counts once (a bool mask is a set)."""
    H, m, K = lay.kidx.shape
    hits = torch.zeros(H, m, L, dtype=torch.long).scatter_add_(-1, lay.kidx.cpu(), cols.long().cpu())
    return hits > 0


def dense_layout_mask(n, attention_mask, *, with_reps, generator, num_heads, batch_size, **pattern):
    """bool [B, H, L, L], True = query i may attend key j: the layout of key_layout written out densely
    (L = n, or n + m for [X; R]); the same random draw as the kernel."""
    p = Pattern(**pattern)
    b = p.block_size
    m, g = n // b, min(p.num_global, n)
    L = n + m if with_reps else n
    rand_idx, rand_ok = random_blocks(m, num_heads=num_heads, generator=generator, **pattern)
    lay = key_layout(n, p, rand_idx.cpu(), rand_ok.cpu(), with_reps)
    rows = layout_rows(lay, L, lay.kin)[:, torch.arange(n) // b]                   # [H, n, L] token rows
    rows[:, :g] = True                                                              # global rows: every key
    if with_reps:
        rows = torch.cat([rows, layout_rows(lay, L, lay.kin & lay.rep_row)], dim=1)  # + R_j's rows [H, L, L]
    real = real_keys(attention_mask, n, b, with_reps, batch_size, "cpu")            # [B, L]
    return rows[None] & real[:, None, None, :]                                      # padding keys masked


def dense_mask(n, attention_mask=None, *, generator=None, num_heads=1, batch_size=1, **pattern):
    """bool [B, H, n, n], True = query i may attend key j (methods.md §2.1); the same random draw as the kernel."""
    return dense_layout_mask(n, attention_mask, with_reps=False, generator=generator, num_heads=num_heads,
                             batch_size=batch_size, **pattern)


def hst_dense_mask(n, attention_mask=None, *, generator=None, num_heads=1, batch_size=1, **pattern):
    """bool [B, H, n + m, n + m] for [X; R] (n tokens, m representatives), HST stage 1 (methods.md §2.2)."""
    return dense_layout_mask(n, attention_mask, with_reps=True, generator=generator, num_heads=num_heads,
                             batch_size=batch_size, **pattern)


def mask_parts(n, *, generator=None, **pattern):
    """The pieces of the 2.1 pattern, for drawing (head 0, no padding): window, glob, rand, bool [n, n]."""
    p = Pattern(**pattern)
    b, g = p.block_size, min(p.num_global, n)
    rand_idx, rand_ok = random_blocks(n // b, generator=generator, **pattern)
    lay = key_layout(n, p, rand_idx, rand_ok)
    token_rows = torch.arange(n) // b

    def columns(s):                                  # the keys of the columns in slice s, [n, n]
        cols = torch.zeros_like(lay.kin)
        cols[..., s] = lay.kin[..., s]
        return layout_rows(lay, n, cols)[0, token_rows]

    pos = torch.arange(n)
    glob = (pos[:, None] < g) | (pos[None, :] < g)                                  # [n, n]
    return columns(lay.window), glob, columns(lay.random)


# ---------------------------------------------------------------------------------------------------------
# CLI: draw the patterns

CHARS = ".#grR"   # 0 nothing, 1 window, 2 global, 3 random, 4 representative


def pattern_codes(n, *, block_size, window, num_global, num_random, seed, hst=False):
    """int [L, L] with codes indexing CHARS, head 0 of batch 0, no padding."""
    kw = dict(block_size=block_size, window=window, num_global=num_global, num_random=num_random)
    win, glob, rand = mask_parts(n, generator=torch.Generator().manual_seed(seed), **kw)
    codes = torch.zeros(n, n, dtype=torch.long)
    codes[rand] = 3
    codes[win] = 1
    codes[glob] = 2
    if not hst:
        return codes
    allowed = hst_dense_mask(n, generator=torch.Generator().manual_seed(seed), **kw)[0, 0]
    full = torch.where(allowed, 4, 0)                   # R everywhere a representative is involved ...
    full[:n, :n] = codes
    is_glob = (torch.arange(n) < num_global)[None, :]
    full[n:, :n] = torch.where(allowed[n:, :n], torch.where(is_glob, 2, 1), 0)  # ... but R_j's tokens
    return full


def draw_text(codes, n):
    rows = []
    for i, row in enumerate(codes.tolist()):
        if i == n:
            rows.append("-" * (len(row) + 1))
        line = "".join(CHARS[c] for c in row[:n])
        rows.append(line if len(row) == n else line + "|" + "".join(CHARS[c] for c in row[n:]))
    return "\n".join(rows)


def save_png(codes, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        return False
    cmap = ListedColormap(["white", "tab:blue", "tab:orange", "tab:green", "tab:red"])
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.imshow(codes.numpy(), cmap=cmap, vmin=0, vmax=4, interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def main():
    p = argparse.ArgumentParser(description="Draw the block-sparse and HST attention patterns (methods.md §2.1, 2.2).")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--num-global", type=int, default=2)
    p.add_argument("--num-random", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="docs")
    a = p.parse_args()
    kw = dict(block_size=a.block_size, window=a.window, num_global=a.num_global, num_random=a.num_random,
              seed=a.seed)
    sparse = pattern_codes(a.n, **kw)
    hst = pattern_codes(a.n, hst=True, **kw)
    print(f"block-sparse, n={a.n} b={a.block_size} w={a.window} g={a.num_global} r={a.num_random} "
          f"(rows = queries; # window, g global, r random)")
    print(draw_text(sparse, a.n))
    print("\nHST stage 1 over [X; R] (R = representatives after the bars)")
    print(draw_text(hst, a.n))
    os.makedirs(a.out_dir, exist_ok=True)
    figs = [(torch.ones(a.n, a.n, dtype=torch.long), "attention_dense.png", "dense"),
            (sparse, "attention_sparse.png", "block-sparse (methods.md §2.1)"),
            (hst, "attention_hst.png", "HST stage 1 over [X; R] (methods.md §2.2)")]
    for codes, name, title in figs:
        path = os.path.join(a.out_dir, name)
        if save_png(codes, path, title):
            print("wrote", path)


if __name__ == "__main__":
    main()
