"""Mixed precision on the CPU: one training step (forward, the task's loss from train.py, backward) under bf16 autocast,
for every combination train.py allows, against the same step in fp32.

Why on the CPU: train.py runs bf16 autocast on CUDA, and no GPU has been lent to this project; dtype
mismatches (a mask or a noise tensor in fp32 meeting bf16 activations, an fp32-only kernel) show up the same
under CPU autocast. Both steps draw the same random numbers (torch.manual_seed before each): dropout masks,
random blocks and G-Net noise come from the same RNG stream in both precisions.

Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2%); through two layers, a softmax and
the loss the errors compound to a few 0.1% - 1% of the values, so the loss must agree within 3% (+ 0.01),
and the whole gradient (all parameters as one vector) within a cosine of 0.99 and a norm ratio within 10%.
A real mistake (a wrong mask, a dropped term) moves these by far more than that.
Run: python -m pytest tests/test_precision.py -q
"""
from types import SimpleNamespace

import pytest
import torch

import attendout
import data
import train
from helpers import train_args
from model import Config, Model

N, V = 32, 40                     # tokens per example, vocabulary
TOK = SimpleNamespace(pad_id=0, cls_id=1, sep_id=2, mask_id=3, vocab_size=V)   # what the losses read of a tokenizer
ATTENTIONS = ("dense", "sparse", "hst")
DROPOUTS = tuple(attendout.METHODS)  # every --attn-dropout method (a new one is checked here too)
# (consistency loss, task): SAR / R-Drop need labels, so masked-LM runs plain only (train.py fails otherwise)
LOSSES = [("plain", "cls"), ("sar", "cls"), ("rdrop", "cls"), ("plain", "mlm")]
LOSS_FLAGS = {"plain": [], "sar": ["--sar", "1.0"], "rdrop": ["--rdrop", "1.0"]}   # train.py's flags for each


def tiny_model(attention, attn_dropout, task):
    cfg = Config(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                 max_positions=N + 8, type_vocab_size=2, pad_id=TOK.pad_id, position_style="bert",
                 layer_norm_eps=1e-12, num_labels=3 if task == "cls" else 0, attention=attention,
                 block_size=4, window=1, num_global=2, num_random=1, attn_dropout=attn_dropout,
                 attn_dropout_p=0.1, hidden_dropout_p=0.1,
                 schedule="linear:0.05:0.2" if attn_dropout == "scheduled" else "")
    torch.manual_seed(0)
    model = Model(cfg).train()
    model.set_progress(0.5)
    return model


def tiny_batch(task):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, V, (3, N - 2), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0                                  # padding: a short example
    ids = ids.masked_fill(mask == 0, TOK.pad_id)
    batch = dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
    if task == "cls":
        batch["labels"] = torch.tensor([0, 2, 1])
    return batch


def tiny_task(task):
    """The data.TaskData the losses read (labels and regression; no examples needed)."""
    return data.TaskData([], {}, 3 if task == "cls" else 0, False, "acc" if task == "cls" else "loss", [])


def step(model, batch, loss, task, bf16):
    """The training step's loss (train.objective: listops for "cls", mlm), fp32 or under CPU bf16
    autocast -> (loss, flat fp32 gradient)."""
    args = train_args("--task", "listops" if task == "cls" else "mlm", *LOSS_FLAGS[loss])
    task_data = tiny_task(task)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)                            # the same masks, blocks and noise in both precisions
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        value, _ = train.objective(args.task)[0](model, batch, args, task_data, TOK)
    value.backward()
    grads = [p.grad.float().flatten() for p in model.parameters() if p.grad is not None]
    return value.detach().float(), torch.cat(grads)


@pytest.mark.parametrize("loss,task", LOSSES)
@pytest.mark.parametrize("attn_dropout", DROPOUTS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_bf16_step_matches_fp32(attention, attn_dropout, loss, task):
    model = tiny_model(attention, attn_dropout, task)
    batch = tiny_batch(task)
    l32, g32 = step(model, batch, loss, task, bf16=False)
    l16, g16 = step(model, batch, loss, task, bf16=True)
    assert torch.isfinite(l16) and torch.isfinite(g16).all()
    assert g16.numel() == g32.numel()                 # the same parameters received gradients
    assert abs(l16 - l32) <= 0.03 * abs(l32) + 0.01, (l16.item(), l32.item())
    cos = torch.nn.functional.cosine_similarity(g16, g32, dim=0)
    assert cos >= 0.99, cos.item()
    assert abs(g16.norm() / g32.norm() - 1) <= 0.1, (g16.norm().item(), g32.norm().item())
