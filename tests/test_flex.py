"""The FlexAttention path (sparse.flex_stage1): its output equals the gather kernel's and the dense reference's
on the CPU, forward only (torch refuses FlexAttention's backward on the CPU; the gradients are compared on a
GPU by tests/test_cuda.py). Global rows, padding, random blocks and representatives. How often the compiled
kernel compiles over 10 lengths (sparse.compile_flex: at most 3), and that a compiled HST model takes flex in
with no graph break, are research/gpu_check.py's flex and compile parts, which the suite runs on the CPU
(research/tests/test_gpu_check.py) and a lent GPU runs for real.
Run: python -m pytest tests/test_flex.py -q
"""
import pytest
import torch

from sparse import block_sparse_attention, dense_mask, hst_attention, hst_dense_mask
from tests.test_sparse import masked_attention, padding, qkv


@pytest.mark.parametrize("hst", [False, True])
@pytest.mark.parametrize("n,b,w,g,r", [(32, 4, 1, 2, 1), (48, 8, 0, 3, 2), (32, 4, 2, 0, 0), (64, 4, 1, 5, 3)])
def test_flex_equals_gather_and_dense(hst, n, b, w, g, r):
    am = padding(n, b)
    H, m = 2, n // b
    L = n + m if hst else n
    q, k, v = (t.float() for t in qkv(am.shape[0], H, L, d=16, seed=n + g))
    kernel, mk = (hst_attention, hst_dense_mask) if hst else (block_sparse_attention, dense_mask)
    kw = dict(block_size=b, window=w, num_global=g, num_random=r)

    def gen():
        return torch.Generator().manual_seed(3)
    flex = kernel(q, k, v, am, generator=gen(), flex=True, **kw)
    gather = kernel(q, k, v, am, generator=gen(), **kw)
    ref = masked_attention(q, k, v, mk(n, am, num_heads=H, generator=gen(), **kw))
    torch.testing.assert_close(flex, gather, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


def test_flex_is_not_used_with_dropout(monkeypatch):
    """Attention dropout needs the probabilities: flex=True then falls back to the gather kernel."""
    import sparse
    monkeypatch.setattr(sparse, "flex_stage1", lambda *a, **k: pytest.fail("flex used with dropout"))
    q, k, v = qkv(1, 2, 32)
    block_sparse_attention(q, k, v, block_size=4, dropout_p=0.1, flex=True)


def test_model_uses_flex_only_on_cuda(monkeypatch):
    """On the CPU the model never takes the FlexAttention path (eager flex materialises every score)."""
    import sparse
    from tests.test_precision import tiny_batch, tiny_model
    monkeypatch.setattr(sparse, "flex_stage1", lambda *a, **k: pytest.fail("flex used on the CPU"))
    model = tiny_model("sparse", "none", "cls")
    b = tiny_batch("cls")
    model(b["input_ids"], b["attention_mask"], b["token_type_ids"])
