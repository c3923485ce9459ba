"""The FlexAttention path (sparse.flex_stage1): its output equals the gather kernel's and the dense reference's
on the CPU, forward only (torch refuses FlexAttention's backward on the CPU; the gradients are compared on a
GPU by tests/test_cuda.py). Global rows, padding, random blocks and representatives.
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


def test_the_compiled_flex_kernel_compiles_a_few_times_over_many_shapes():
    """sparse.compile_flex is what flex_stage1 runs on CUDA (issue 55): compiled for dynamic shapes, so 10 lengths
    and several batch sizes (a batch of 1 and a single flex block among them) compile at most 3 times in all,
    well below torch's recompile limit (8), past which the slow eager kernel would run. Its compiled path is
    CUDA's, so here torch's compiler drives it on the CPU with a backend that counts the compiles (each graph
    then runs as traced); the outputs still equal the gather kernel's."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    import sparse
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = sparse.compile_flex(backend=counter)
    kw = dict(block_size=4, window=1, num_global=1, num_random=1)
    try:
        for i, n in enumerate([8, 40, 12, 64, 160, 20, 28, 24, 36, 16]):
            B = (1, 3, 2)[i % 3]
            L = n + n // 4
            q, k, v = (t.float() for t in qkv(B, 2, L, d=8, seed=i))
            am = torch.ones(B, n, dtype=torch.long)
            am[0, n - 3:] = 0
            make_block_mask, attend = compiled
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sparse, "flex_functions", lambda device: compiled)
                flex = hst_attention(q, k, v, am, generator=torch.Generator().manual_seed(i), flex=True, **kw)
            gather = hst_attention(q, k, v, am, generator=torch.Generator().manual_seed(i), **kw)
            torch.testing.assert_close(flex, gather, atol=1e-5, rtol=1e-5)
        assert 1 <= counter.frame_count <= 3
    finally:
        torch._dynamo.reset()


def test_a_compiled_model_takes_flex_in_without_a_graph_break(monkeypatch):
    """--compile with sparse or HST (issue 55): inside a model being compiled, flex_stage1 calls the plain
    create_block_mask and flex_attention, which the model's graph takes in, so there is no graph break per flex call
    (the deprecated create_block_mask(_compile=True) broke it twice per call). The CUDA branch is forced on the CPU:
    every HST call takes flex, and sparse.flex_functions answers as it would on CUDA. A training forward of
    --attn-dropout none (nothing to drop, so flex runs; no gradient: flex has no CPU backward)."""
    import torch._dynamo

    import model as M
    import sparse
    from tests.test_precision import tiny_batch, tiny_model
    on_cuda = sparse.flex_functions
    monkeypatch.setattr(sparse, "flex_functions", lambda device: on_cuda(torch.device("cuda")))
    monkeypatch.setattr(M, "hst_attention", lambda *a, **kw: hst_attention(*a, **{**kw, "flex": True}))
    model = tiny_model("hst", "none", "cls")
    b = tiny_batch("cls")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(b["input_ids"], b["attention_mask"], b["token_type_ids"])
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1 and "flex_attention" in explained.graphs[0].code
