"""Tests for sparse.py: the block-sparse and HST kernels equal dense masked attention under their masks.

Run: python -m pytest tests/test_sparse.py -q
"""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparse import (block_sparse_attention, dense_mask, hst_attention, hst_dense_mask, random_blocks,  # noqa: E402
                    real_keys)

TOL = 1e-9


def masked_attention(q, k, v, mask):
    """Reference: softmax(q k^T / sqrt(d) + mask) v, [B, H, L, L] bool mask; rows with no key -> 0."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    A = torch.nan_to_num(s.softmax(-1), nan=0.0)
    return A @ v


def qkv(B, H, L, d=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, d, generator=g, dtype=torch.float64, requires_grad=grad) for _ in range(3)]


def padding(n, b):
    """Right-padded rows: full, last block all padding, about half, two tokens."""
    lengths = [n, n - b, n // 2 - 1, 2]
    return (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()  # [4, n]


@pytest.mark.parametrize("n", [16, 32, 48])
@pytest.mark.parametrize("b", [4, 8])
@pytest.mark.parametrize("w", [0, 1, 2])
@pytest.mark.parametrize("g", [0, 1, 3])
def test_block_sparse_equals_dense(n, b, w, g):
    am = padding(n, b)
    q, k, v = qkv(am.shape[0], 2, n, seed=n + b + w + g)
    kw = dict(block_size=b, window=w, num_global=g)
    out = block_sparse_attention(q, k, v, am, **kw)
    ref = masked_attention(q, k, v, dense_mask(n, am, num_heads=2, **kw))
    assert out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("n,b,w,g,r", [(32, 4, 1, 1, 1), (32, 4, 1, 2, 2), (48, 8, 0, 3, 2), (16, 4, 1, 1, 2),
                                       (64, 4, 2, 0, 3)])
def test_block_sparse_random_equals_dense(n, b, w, g, r):
    am = padding(n, b)
    H = 3
    q, k, v = qkv(am.shape[0], H, n, seed=1)
    kw = dict(block_size=b, window=w, num_global=g, num_random=r)
    gen = torch.Generator().manual_seed(123)
    gen2 = torch.Generator().manual_seed(123)
    out = block_sparse_attention(q, k, v, am, generator=gen, **kw)
    mask = dense_mask(n, am, num_heads=H, generator=gen2, **kw)
    torch.testing.assert_close(out, masked_attention(q, k, v, mask), atol=TOL, rtol=0)
    # the generator moved on: a second draw is a different pattern (for r > 0 and enough blocks)
    if n // b - (2 * w + 1) > r:
        assert not torch.equal(mask, dense_mask(n, am, num_heads=H, generator=gen2, **kw))


def test_random_blocks_outside_window_and_clamped():
    m, w = 6, 1
    idx, ok = random_blocks(m, window=w, num_random=10, num_heads=4, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (4, m, m - 2)                     # edge blocks have m - 2 non-window blocks
    i = torch.arange(m)[None, :, None]
    assert torch.equal(ok, (idx - i).abs() > w)           # slots beyond what a block has are masked
    for h in range(4):                                    # every non-window block picked exactly once
        for qb in range(m):
            picked = sorted(idx[h, qb][ok[h, qb]].tolist())
            assert picked == [j for j in range(m) if abs(j - qb) > w]


def test_dense_mask_by_hand():
    # n=8, b=2, w=1, g=1: blocks {0,1} {2,3} {4,5} {6,7}; token 0 global
    M = dense_mask(8, block_size=2, window=1, num_global=1)[0, 0].int()
    expect = torch.tensor([
        [1, 1, 1, 1, 1, 1, 1, 1],   # global row
        [1, 1, 1, 1, 0, 0, 0, 0],   # block 0: blocks 0, 1
        [1, 1, 1, 1, 1, 1, 0, 0],   # block 1: blocks 0, 1, 2
        [1, 1, 1, 1, 1, 1, 0, 0],
        [1, 0, 1, 1, 1, 1, 1, 1],   # block 2: global + blocks 1, 2, 3
        [1, 0, 1, 1, 1, 1, 1, 1],
        [1, 0, 0, 0, 1, 1, 1, 1],   # block 3: global + blocks 2, 3
        [1, 0, 0, 0, 1, 1, 1, 1],
    ])
    assert torch.equal(M, expect)
    # padding masks keys only
    M = dense_mask(8, torch.tensor([[1] * 5 + [0] * 3]), block_size=2, window=1, num_global=1)[0, 0]
    assert not M[:, 5:].any() and M[:, :5].sum() == expect[:, :5].sum()


def test_hst_dense_mask_by_hand():
    # n=4, b=2, w=0, g=1: [t0 t1 t2 t3 R0 R1]
    M = hst_dense_mask(4, block_size=2, window=0, num_global=1)[0, 0].int()
    expect = torch.tensor([
        [1, 1, 1, 1, 1, 1],   # global token: everything
        [1, 1, 0, 0, 1, 0],   # t1: block 0 + R0
        [1, 0, 1, 1, 0, 1],   # t2: global + block 1 + R1
        [1, 0, 1, 1, 0, 1],
        [1, 1, 0, 0, 1, 0],   # R0: block 0 (holds the global) + R0
        [1, 0, 1, 1, 0, 1],   # R1: global + block 1 + R1
    ])
    assert torch.equal(M, expect)


@pytest.mark.parametrize("n,b,w,g,r", [(16, 4, 1, 1, 0), (32, 4, 1, 2, 1), (48, 8, 0, 3, 2), (32, 8, 2, 0, 0),
                                       (32, 4, 0, 5, 2)])
def test_hst_equals_dense(n, b, w, g, r):
    am = padding(n, b)
    H, m = 2, n // b
    q, k, v = qkv(am.shape[0], H, n + m, seed=2)
    kw = dict(block_size=b, window=w, num_global=g, num_random=r)
    out = hst_attention(q, k, v, am, generator=torch.Generator().manual_seed(7), **kw)
    mask = hst_dense_mask(n, am, num_heads=H, generator=torch.Generator().manual_seed(7), **kw)
    assert out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, masked_attention(q, k, v, mask), atol=TOL, rtol=0)


@pytest.mark.parametrize("hst", [False, True])
def test_mask_fn_hook(hst):
    """AttendOut's contract with the kernels (methods.md §3.1): mask_fn(S, valid, pair_scores) -> S' is called on
    the LOGITS of the block layout, then of the global rows: S = q k^T / sqrt(d) there, before any mask; valid
    marks exactly the real (query, key) pairs the pattern allows, each once; pair_scores(a, c) is a_i . c_j at
    the layout's (query i, key j); and the kernel's softmax runs on what the hook returns."""
    n, b, H, d, g = 32, 4, 2, 8, 2
    m = n // b
    am = padding(n, b)
    B = am.shape[0]
    L = n + m if hst else n
    q, k, v = qkv(B, H, L, d=d, seed=3)
    kernel = hst_attention if hst else block_sparse_attention
    kw = dict(block_size=b, window=1, num_global=g, num_random=1)
    allowed = (hst_dense_mask if hst else dense_mask)(n, am, num_heads=H, batch_size=B,
                                                      generator=torch.Generator().manual_seed(0), **kw)
    real = real_keys(am, n, b, hst, B)                                   # [B, L]: real tokens (HST: and R_j)
    allowed_real = allowed & real[:, None, :, None]                      # the pairs AttendOut counts
    idx = torch.arange(L, dtype=torch.float64).view(1, 1, L, 1).expand(B, H, L, 1)
    one = torch.ones(B, H, L, 1, dtype=torch.float64)
    a, c = qkv(B, H, L, d=3, seed=4)[:2]                                 # any G-Net features
    calls = []

    def record(S, valid, pair_scores):
        assert valid.dtype == torch.bool and torch.broadcast_shapes(valid.shape, S.shape) == S.shape
        torch.testing.assert_close(S, pair_scores(q, k) / math.sqrt(d), atol=TOL, rtol=0)   # the raw logits
        assert torch.isfinite(S).all()                                   # no mask filled in yet
        assert pair_scores(q[..., :3], torch.ones_like(k[..., :3])).shape == S.shape         # any last dim e
        qi, kj = pair_scores(idx, one).long(), pair_scores(one, idx).long()   # each entry's (query, key)
        flat = (qi * L + kj).reshape(B, H, -1)
        dense_G = (a @ c.transpose(-1, -2)).reshape(B, H, -1)            # a c^T, densely
        torch.testing.assert_close(pair_scores(a, c), dense_G.gather(2, flat).view(S.shape), atol=TOL, rtol=0)
        count = torch.zeros(B, H, L * L, dtype=torch.float64)
        count.scatter_add_(2, flat, valid.expand_as(S).reshape(B, H, -1).double())
        count = count.view(B, H, L, L)
        assert count.max() <= 1                                          # no pair marked twice
        # the block layout answers every row but the g global ones (their output comes from the second call)
        rows = torch.arange(L) >= g if not calls else torch.arange(L) < g
        assert torch.equal(count[:, :, rows] > 0, allowed_real[:, :, rows])
        calls.append(S.shape)
        return S

    out = kernel(q, k, v, am, generator=torch.Generator().manual_seed(0), mask_fn=record, **kw)
    ref = kernel(q, k, v, am, generator=torch.Generator().manual_seed(0), **kw)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    bq, K = (b + 1, 3 * b + b + 2 + 1) if hst else (b, 3 * b + b + 2)
    assert calls == [(B, H, m, bq, K), (B, H, g, L)]  # block layout, then the global rows

    # the returned logits are the ones softmaxed: -10000 on every pair of key j0 (found through pair_scores, as
    # the G-Net finds its pairs) gives that key probability 0 (no gradient reaches its value), and the output is
    # dense attention under the pattern without that key
    j0 = 9                                            # a token of block 2, real in three of the four rows
    q, k, v = qkv(B, H, L, d=d, seed=3, grad=True)
    out = kernel(q, k, v, am, generator=torch.Generator().manual_seed(0), **kw,
                 mask_fn=lambda S, valid, pair_scores: S - 10000.0 * (pair_scores(one, idx) == j0))
    without = allowed & (torch.arange(L) != j0)
    torch.testing.assert_close(out, masked_attention(q, k, v, without), atol=TOL, rtol=0)
    assert not torch.allclose(out, masked_attention(q, k, v, allowed), atol=1e-3)   # j0 mattered
    out.pow(2).sum().backward()
    assert (v.grad[:, :, j0] == 0).all() and (v.grad[:3, :, j0 + 1] != 0).all()


def test_plain_dropout_changes_output():
    q, k, v = qkv(2, 2, 32, seed=4)
    kw = dict(block_size=4, window=1, num_global=1)
    torch.manual_seed(0)
    out = block_sparse_attention(q, k, v, dropout_p=0.5, **kw)
    assert torch.isfinite(out).all() and not torch.allclose(out, block_sparse_attention(q, k, v, **kw))


@pytest.mark.parametrize("hst", [False, True])
def test_backward(hst):
    n, b = 32, 4
    am = padding(n, b)
    L = n + n // b if hst else n
    q, k, v = qkv(am.shape[0], 2, L, seed=5, grad=True)
    kernel = hst_attention if hst else block_sparse_attention
    kw = dict(block_size=b, window=1, num_global=2, num_random=1)
    kernel(q, k, v, am, generator=torch.Generator().manual_seed(0), **kw).pow(2).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    # gradients equal those of the dense reference
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mk = hst_dense_mask if hst else dense_mask
    mask = mk(n, am, num_heads=2, generator=torch.Generator().manual_seed(0), **kw)
    masked_attention(q, k, v, mask).pow(2).sum().backward()
    for g1, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g1, t.grad, atol=TOL, rtol=0)


@pytest.mark.parametrize("drop", ["none", "dropout", "hook"])
def test_no_quadratic_tensor(monkeypatch, drop):
    """Every score matrix in the kernel is block-sized: no matmul result has two sides of length n (without
    dropout, with dropout, and with an AttendOut-style mask_fn that asks for the pair scores q_i . k_j)."""
    n, b = 512, 16
    q, k, v = (torch.randn(1, 1, n, 8) for _ in range(3))
    kw = dict(dropout_p=0.1) if drop == "dropout" else {}
    if drop == "hook":
        kw = dict(mask_fn=lambda S, valid, pair_scores: S - 10000.0 * (pair_scores(q, k) <= 0))
    biggest = []
    real_matmul = torch.matmul

    def spy_matmul(x, y):
        out = real_matmul(x, y)
        biggest.append(out.numel())
        return out

    monkeypatch.setattr(torch, "matmul", spy_matmul)
    block_sparse_attention(q, k, v, block_size=b, window=1, num_global=1, num_random=2,
                           generator=torch.Generator().manual_seed(0), **kw)
    assert biggest and max(biggest) <= n * (5 * b + 1) < n * n // 4  # global rows 1 x n; blocks n x (5b + 1)


@pytest.mark.parametrize("hst", [False, True])
def test_gradcheck_global_rows_across_blocks(hst):
    """gradcheck of the kernel, with global rows spanning two blocks (g = 6 > b = 4), padding and random blocks;
    its values equal the dense reference's."""
    n, b, H = 16, 4, 2
    m = n // b
    L = n + m if hst else n
    am = torch.tensor([[1] * n, [1] * 9 + [0] * 7])
    kernel = hst_attention if hst else block_sparse_attention
    kw = dict(block_size=b, window=1, num_global=6, num_random=1)
    q, k, v = qkv(2, H, L, d=3, seed=8, grad=True)

    def run(q, k, v):
        return kernel(q, k, v, am, generator=torch.Generator().manual_seed(1), **kw)
    mk = hst_dense_mask if hst else dense_mask
    mask = mk(n, am, num_heads=H, generator=torch.Generator().manual_seed(1), **kw)
    torch.testing.assert_close(run(q, k, v), masked_attention(q, k, v, mask), atol=TOL, rtol=0)
    assert torch.autograd.gradcheck(run, (q, k, v), fast_mode=True)


def test_random_blocks_fresh_without_generator_fixed_with_one():
    """Training (generator None) draws afresh from torch's global RNG on every call; evaluation passes a generator
    seeded the same way each time, and so gets the same pattern and output."""
    q, k, v = qkv(1, 2, 64, seed=9)
    kw = dict(block_size=4, window=1, num_global=1, num_random=2)
    torch.manual_seed(0)
    fresh = [block_sparse_attention(q, k, v, **kw) for _ in range(2)]
    assert not torch.allclose(fresh[0], fresh[1])
    fixed = [block_sparse_attention(q, k, v, generator=torch.Generator().manual_seed(5), **kw) for _ in range(2)]
    assert torch.equal(fixed[0], fixed[1])


@pytest.mark.parametrize("training", [False, True])
def test_random_blocks_do_not_depend_on_the_inputs_device(training, monkeypatch):
    """One generator kind on every device (issue 55): random blocks are drawn on the CPU (torch's global CPU stream in
    training, model.Attention.eval_generator's CPU generator in evaluation) and then moved, so a model on another
    device draws the very numbers a CPU model draws. The `meta` device stands in for a GPU: it holds no values, so
    the draws are caught where they are made (torch.rand), in a CPU model and a meta one at the same seed."""
    from tests.test_precision import tiny_batch, tiny_model
    rand = torch.rand
    draws = {}
    for device in ("cpu", "meta"):
        caught = draws[device] = []

        def record(*args, **kwargs):
            u = rand(*args, **kwargs)
            caught.append(u)
            return u
        monkeypatch.setattr(torch, "rand", record)
        model = tiny_model("hst", "none", "cls").train(training).to(device)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0                                      # hidden dropout draws on its own device
        b = {k: v.to(device) for k, v in tiny_batch("cls").items()}
        torch.manual_seed(3)
        with torch.no_grad():
            out = model(b["input_ids"], b["attention_mask"], b["token_type_ids"])
        assert out.device.type == device
    assert len(draws["cpu"]) == len(draws["meta"]) == 2            # one draw per layer
    for on_cpu, for_meta in zip(draws["cpu"], draws["meta"]):
        assert for_meta.device.type == "cpu" and torch.equal(on_cpu, for_meta)
