"""SAR and R-Drop (methods.md §2.3): the shift, the views' consistency, the loss train.py builds from them
(train.classify_loss), and sparse / HST models built on the encoder."""
import pytest
import torch
import torch.nn.functional as F

import data
import sar
import train
from helpers import train_args
from model import Config, Model, load_pretrained


def tiny(attention="dense", dropout=0.0, **kw):
    torch.manual_seed(0)
    cfg = Config(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, max_positions=80,
                 pad_id=1, num_labels=3, attention=attention, block_size=4, hidden_dropout_p=dropout,
                 attn_dropout_p=dropout, **kw)
    model = Model(cfg)
    with torch.no_grad():   # larger than BERT's 0.02 init, so differences between views are not hidden in tiny logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30, (3, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 9:] = 0
    ids = ids.masked_fill(mask == 0, 1)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
            "labels": torch.tensor([0, 2, 1])}


def test_shift_inserts_padding_after_first_token():
    ids = torch.tensor([[5, 6, 7, 1]])
    mask = torch.tensor([[1, 1, 1, 0]])
    pos = torch.tensor([[2, 3, 4, 1]])
    s_ids, s_mask, s_pos, s_types = sar.shift(ids, mask, 2, pad_id=1, position_ids=pos)
    assert s_ids.tolist() == [[5, 1, 1, 6, 7, 1]]
    assert s_mask.tolist() == [[1, 0, 0, 1, 1, 0]]
    assert s_pos.tolist() == [[2, 1, 1, 3, 4, 1]]       # content keeps its positions
    assert s_types is None


@pytest.mark.parametrize("style", ["roberta", "bert"])
def test_dense_shift_gives_same_token_outputs_and_zero_consistency(style):
    model = tiny("dense", position_style=style).eval()
    b = batch()
    pos = model.position_ids(b["input_ids"])
    ids, mask, spos, types = sar.shift(b["input_ids"], b["attention_mask"], 1, 1, pos, b["token_type_ids"])
    with torch.no_grad():
        h = model.encode(b["input_ids"], b["attention_mask"], b["token_type_ids"], pos)
        hs = model.encode(ids, mask, types, spos)
    hs = torch.cat([hs[:, :1], hs[:, 2:]], dim=1)          # drop the inserted token
    real = b["attention_mask"].bool()
    assert (h - hs)[real].abs().max() < 1e-5
    model.train()   # no dropout configured: train mode is deterministic too
    z0, z1 = sar.stacked_views(model, b, second=1)
    assert abs(sar.consistency(z0, z1).item()) < 1e-6


@pytest.mark.parametrize("attention", ["sparse", "hst"])
def test_sparse_topologies_have_positive_consistency(attention):
    model = tiny(attention, window=0, num_global=1).train()
    b = batch()
    z0, z1 = sar.stacked_views(model, b, second=1)
    cons = sar.consistency(z0, z1)
    assert cons.item() > 1e-6
    (F.cross_entropy(z0, b["labels"]) + F.cross_entropy(z1, b["labels"]) + cons).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("mlm."))


def test_rdrop_consistency_comes_from_dropout_only():
    b = batch()
    cons = sar.consistency(*sar.stacked_views(tiny("sparse", dropout=0.0).train(), b, second=0))
    assert abs(cons.item()) < 1e-6
    cons = sar.consistency(*sar.stacked_views(tiny("sparse", dropout=0.3).train(), b, second=0))
    assert cons.item() > 1e-6


@pytest.mark.parametrize("method", ["--sar", "--rdrop"])
def test_alpha_weighs_the_consistency_in_the_loss_train_py_optimises(method):
    """train.classify_loss with --sar ALPHA (--rdrop ALPHA): L = CE part + ALPHA x consistency. The same seed
    before every call gives the same dropout noise and random blocks, so the views are the same in every call:
    doubling ALPHA adds exactly one consistency. Each method's own CE part by default: SAR's the original view's
    (--ce original, as the digest reads), R-Drop's the mean of the two views' (--ce all, as its paper has it).
    SAR: a sparse model without dropout (the views differ by topology); R-Drop: with dropout."""
    model = tiny("sparse", dropout=0.0 if method == "--sar" else 0.3, window=0, num_global=1).train()
    b = batch()
    task = data.TaskData(train=[], dev={}, num_labels=3, is_regression=False, metric_name="acc",
                         label_names=["0", "1", "2"])
    runs = {}
    for alpha in (1.0, 2.0):
        torch.manual_seed(0)
        loss, parts = train.classify_loss(model, b, train_args(method, str(alpha)), task, None)
        runs[alpha] = loss.item(), parts
    (loss1, parts), (loss2, parts2) = runs[1.0], runs[2.0]
    same = ("ce", "consistency")
    assert [parts[k] for k in same] == [parts2[k] for k in same]    # the same views in both calls
    assert (parts["loss"], parts2["loss"]) == (loss1, loss2)        # the logged loss is the optimised one
    assert parts["consistency"] > 1e-6                       # the views differ: alpha has something to weigh
    assert loss1 == pytest.approx((parts["ce"] + parts["consistency"]).item(), rel=1e-6)
    assert loss2 - loss1 == pytest.approx(parts["consistency"].item(), rel=1e-4)
    torch.manual_seed(0)                                     # the CE part: the method's own
    z0, z1 = sar.stacked_views(model, b, second=1 if method == "--sar" else 0)
    ce0 = F.cross_entropy(z0, b["labels"]).item()
    ce1 = F.cross_entropy(z1, b["labels"]).item()
    assert abs(ce0 - ce1) > 1e-5                             # the views differ: the two forms differ
    assert parts["ce"] == pytest.approx(ce0 if method == "--sar" else 0.5 * (ce0 + ce1), rel=1e-6)
    assert parts["consistency"] == pytest.approx(sar.consistency(z0, z1).item(), rel=1e-6)


def test_ce_and_views_flags_pick_the_views_the_labels_reach():
    """--ce all (R-Drop's form): CE on both views; --ce original (SAR's default): on the original view alone, the
    shifted view learning from the consistency term only; --views 2 at --sar 0: the shifted view runs, its
    consistency is logged, and the loss is the CE alone; one view: no consistency at all."""
    model = tiny("sparse", window=0, num_global=1).train()
    b = batch()
    task = data.TaskData(train=[], dev={}, num_labels=3, is_regression=False, metric_name="acc",
                         label_names=["0", "1", "2"])
    torch.manual_seed(0)
    z0, z1 = sar.stacked_views(model, b, second=1)
    ce0 = F.cross_entropy(z0, b["labels"]).item()
    ce1 = F.cross_entropy(z1, b["labels"]).item()
    cons = sar.consistency(z0, z1).item()
    assert cons > 1e-6 and abs(ce0 - ce1) > 1e-4           # the views differ, so the forms differ
    for flags, ce, alpha in ((["--sar", "1", "--ce", "all"], 0.5 * (ce0 + ce1), 1.0),
                             (["--sar", "1", "--ce", "original"], ce0, 1.0),
                             (["--sar", "1"], ce0, 1.0),
                             (["--views", "2", "--ce", "all"], 0.5 * (ce0 + ce1), 0.0),
                             (["--views", "2"], ce0, 0.0)):
        torch.manual_seed(0)
        loss, parts = train.classify_loss(model, b, train_args(*flags), task, None)
        assert parts["ce"] == pytest.approx(ce, rel=1e-6), flags
        assert parts["consistency"] == pytest.approx(cons, rel=1e-5), flags
        assert loss.item() == pytest.approx(ce + alpha * cons, rel=1e-6), flags
    loss, parts = train.classify_loss(model, b, train_args(), task, None)
    assert "consistency" not in parts and train_args().views == 1


def test_stacked_views_put_the_masked_view_last_on_the_original_topology():
    """SAR with AttendOut: views [original, shifted, masked]; the masked view is a copy of the ORIGINAL (a G-Net
    that keeps every pair leaves it equal to view 1), not of the shifted view (which differs on a sparse model)."""
    model = tiny("sparse", window=0, num_global=1, attn_dropout="attendout").train()
    for layer in model.layers:
        with torch.no_grad():
            layer.attn.drop.gnet.weight.zero_()
            layer.attn.drop.gnet.bias.fill_(1.0)            # G = 1 > 0 on every pair: nothing masked
    z = sar.stacked_views(model, batch(), second=1, masked=True)
    assert len(z) == 3 and all(zi.shape == (3, 3) for zi in z)
    assert torch.allclose(z[2], z[0], atol=1e-5)
    assert sar.consistency(z[0], z[1]).item() > 1e-6
    assert [layer.attn.drop.mask_rate().item() for layer in model.layers] == [0.0, 0.0]   # the masked pass ran


def test_consistency_is_symmetric_kl_and_squared_difference():
    z1, z2 = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([[0.5, 0.5, 0.0]])
    p, q = z1.softmax(-1), z2.softmax(-1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum()
    assert torch.allclose(sar.consistency(z1, z2), 0.5 * (kl(p, q) + kl(q, p)))
    assert torch.allclose(sar.consistency(z1, z2), sar.consistency(z2, z1))
    assert sar.consistency(z1, z1).item() == 0.0
    r1, r2 = torch.tensor([[1.0], [3.0]]), torch.tensor([[2.0], [0.0]])
    assert sar.consistency(r1, r2, regression=True).item() == pytest.approx((1 + 9) / 2)


@pytest.mark.parametrize("attention", ["sparse", "hst"])
def test_converted_checkpoint_runs_sparse_at_four_times_its_positions(tmp_path, attention):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.RobertaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=40, max_position_embeddings=34)   # 32 tokens + offset 2
    transformers.RobertaForMaskedLM(cfg).save_pretrained(tmp_path / "hf")
    model = load_pretrained(str(tmp_path / "hf"), attention=attention, block_size=8, max_positions=4 * 34,
                            num_random=1).eval()
    n = 4 * 32
    ids = torch.randint(3, 50, (2, n))
    ids[1, 100:] = 1
    with torch.no_grad():
        h = model.encode(ids, (ids != 1).long())
        again = model.encode(ids, (ids != 1).long())
    assert h.shape == (2, n, 32) and torch.isfinite(h).all()
    assert torch.equal(h, again)          # eval: random blocks from a fixed generator, deterministic
    # an odd length is padded up to a block multiple inside the model
    assert model.encode(ids[:, :61]).shape == (2, 61, 32)
