"""CUDA-only checks (skipped without a GPU; run by research/gpu_check.sh on a lent one): FlexAttention's
gradients against the gather kernel's, and bf16 training steps through both sparse paths.
Run: python -m pytest tests/test_cuda.py -q
"""
import pytest
import torch

from sparse import block_sparse_attention, hst_attention
from tests.test_sparse import padding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("hst", [False, True])
def test_flex_gradients_equal_gather_kernel(hst):
    n, b, H, d = 256, 16, 2, 32
    m = n // b
    L = n + m if hst else n
    am = padding(n, b).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(am.shape[0], H, L, d, device="cuda", generator=g) for _ in range(3)]
    kernel = hst_attention if hst else block_sparse_attention
    kw = dict(block_size=b, window=1, num_global=20, num_random=2)
    outs, grads = [], []
    for flex in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = kernel(q, k, v, am, generator=torch.Generator(device="cuda").manual_seed(1), flex=flex, **kw)
        out.pow(2).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in (q, k, v)])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=2e-3)      # TF32 / fused-kernel rounding
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("attention", ["sparse", "hst"])
def test_bf16_train_step_flex_and_gather(attention, monkeypatch):
    """A bf16 autocast step on CUDA (as train.py runs it) through FlexAttention and through the gather kernel
    (the kernels model.py calls, given flex=False): finite, and the same loss within bf16
    tolerance (both draw the same random blocks)."""
    import model as model_py
    from tests.test_precision import tiny_batch, tiny_model
    losses = []
    for flex in (True, False):
        if not flex:                                  # the kernels take Flex only with flex=True: force False
            for name in ("block_sparse_attention", "hst_attention"):
                real = getattr(model_py, name)
                monkeypatch.setattr(model_py, name, lambda *a, _real=real, **kw: _real(*a, **{**kw, "flex": False}))
        model = tiny_model(attention, "none", "cls").cuda()
        for mod in model.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
        batch = {k: v.cuda() for k, v in tiny_batch("cls").items()}
        torch.manual_seed(0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
            loss = torch.nn.functional.cross_entropy(logits.float(), batch["labels"])
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 0.03 * abs(losses[1]) + 0.01


def test_eval_forward_on_cuda():
    """Eval draws random blocks from a per-layer CUDA generator (Attention.eval_generator)."""
    from tests.test_precision import tiny_batch, tiny_model
    model = tiny_model("hst", "standard", "cls").cuda().eval()
    batch = {k: v.cuda() for k, v in tiny_batch("cls").items()}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    assert out.is_cuda and torch.isfinite(out).all()
