"""Devices, checked without a GPU: forward, loss and backward with the model and the batch on the `meta`
device (shapes and dtypes only, no data). A tensor that the forward or the loss creates without device=
lands on the CPU and meets meta tensors: PyTorch refuses to mix them, as it refuses CPU and CUDA tensors.
So this catches, on a CPU-only machine, what would break only on a GPU: random-block draws, masks, index
tensors, G-Net noise, SAR's inserted padding.

Meta tensors hold no values, so the few places that read one (the dense fast-path test `bool(key_mask.all())`,
the position-id check `int(...)`, logged numbers `.item()`) get a stand-in answer here (`values_on_meta`).
Not covered: masked-LM, whose masking runs on the CPU by design (train.mlm_loss moves ids to the CPU), and the
eval generator (torch.Generator has no meta device; it is built on the input's device, Attention.eval_generator).
Run: python -m pytest tests/test_devices.py -q
"""
import pytest
import torch

import train
from helpers import train_args
from tests.test_precision import ATTENTIONS, DROPOUTS, LOSS_FLAGS, TOK, tiny_batch, tiny_model, tiny_task


@pytest.fixture
def values_on_meta(monkeypatch):
    """Value reads of a meta tensor answer a stand-in (int 0, bool True, item 0.0, tolist []) instead of failing."""
    for name, stand_in in (("__int__", 0), ("__bool__", True), ("item", 0.0), ("tolist", [])):
        real = getattr(torch.Tensor, name)

        def read(self, *a, _real=real, _stand_in=stand_in):
            return _stand_in if self.is_meta else _real(self, *a)
        monkeypatch.setattr(torch.Tensor, name, read)


def on_meta(attention, attn_dropout):
    model = tiny_model(attention, attn_dropout, "cls").to("meta")
    batch = {k: v.to("meta") for k, v in tiny_batch("cls").items()}
    return model, batch


@pytest.mark.parametrize("loss", ["plain", "sar", "rdrop"])
@pytest.mark.parametrize("attn_dropout", DROPOUTS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_train_step_on_meta(attention, attn_dropout, loss, values_on_meta):
    """The task's training loss (train.objective: task loss, SAR, R-Drop, G-Net) and backward, everything on meta."""
    model = tiny_model(attention, attn_dropout, "cls").to("meta")
    batch = {k: v.to("meta") for k, v in tiny_batch("cls").items()}
    args = train_args(*LOSS_FLAGS[loss])
    value, _ = train.objective(args.task)[0](model, batch, args, tiny_task("cls"), TOK)
    value.backward()
    assert value.device.type == "meta"
    assert all(p.grad.device.type == "meta" for p in model.parameters() if p.grad is not None)
