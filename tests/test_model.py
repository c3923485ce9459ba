"""The encoder against the reference: tiny random `transformers` models, saved with save_pretrained in both
file formats, converted, and compared to 1e-4 in fp32 (hidden states and MLM logits)."""
import json
import os
import pickle

import pytest
import torch

import data

transformers = pytest.importorskip("transformers")

from model import (CheckpointError, Config, Model, convert, extend_positions, load_pretrained, main,
                   read_checkpoint)

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=40, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
FAMILIES = {
    "roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM, "roberta", dict(pad_token_id=1)),
    "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaForMaskedLM, "roberta", dict(pad_token_id=1)),
    "bert": (transformers.BertConfig, transformers.BertForMaskedLM, "bert", dict(pad_token_id=0, type_vocab_size=2)),
}


def make_hf(tmp_path, family, safetensors=True, head=None, **extra):
    cfg_cls, model_cls, _, kw = FAMILIES[family]
    torch.manual_seed(0)
    cfg = cfg_cls(**TINY, **kw, **extra)
    cfg._attn_implementation = "eager"
    if head == "cls":
        model_cls = getattr(transformers, model_cls.__name__.replace("MaskedLM", "SequenceClassification"))
        cfg.num_labels = 3
    hf = model_cls(cfg).eval()
    with torch.no_grad():   # random LN params, so a wrong LN mapping cannot hide behind ones/zeros
        for n, p in hf.named_parameters():
            if "LayerNorm" in n or "layer_norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path / f"{family}-{safetensors}-{head}"
    hf.save_pretrained(d, safe_serialization=safetensors)
    # a small WordPiece vocabulary: `convert` refuses a folder without a tokenizer the converted file could carry
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghij"]) + "\n")
    return hf, str(d)


def batch(family, padding):
    pad = FAMILIES[family][3]["pad_token_id"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 99, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    lens = [11, 7, 4]
    for i, n in enumerate(lens):
        if padding == "right":
            mask[i, n:] = 0
        elif padding == "left":
            mask[i, :11 - n] = 0
    ids = ids.masked_fill(mask == 0, pad)
    types = None
    if family == "bert":
        types = torch.zeros_like(ids)
        types[:, 6:] = 1
    return ids, mask, types


def hf_outputs(hf, ids, mask, types):
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("safetensors", [True, False])
def test_matches_transformers(tmp_path, family, safetensors):
    hf, folder = make_hf(tmp_path, family, safetensors)
    out = tmp_path / "conv.pt"
    convert(folder, str(out))
    for path in (folder, str(out)):
        ours = load_pretrained(path).eval()
        for padding in ("none", "right", "left"):
            ids, mask, types = batch(family, padding)
            ref_h, ref_logits = hf_outputs(hf, ids, mask, types)
            with torch.no_grad():
                h = ours.encode(ids, mask, types)
                logits = ours.mlm_logits(ids, mask, types)
            real = mask.bool()   # padding positions are not defined outputs; compare real tokens
            assert (h - ref_h)[real].abs().max() < 1e-4, (path, padding)
            assert (logits - ref_logits)[real].abs().max() < 1e-4, (path, padding)


@pytest.mark.parametrize("family", ["roberta", "bert"])
def test_classifier_head_matches(tmp_path, family):
    hf, folder = make_hf(tmp_path, family, head="cls")
    ours = load_pretrained(folder).eval()
    assert ours.cfg.num_labels == 3
    ids, mask, types = batch(family, "right")
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        got = ours(ids, mask, types)
    assert (got - ref).abs().max() < 1e-4


def test_textbook_path_equals_fused(tmp_path):
    """The explicit softmax path (used when AttendOut's mask_fn changes the logits) equals SDPA under an
    identity mask_fn."""
    from model import dense_attention
    q, k, v = torch.randn(3, 2, 4, 6, 8, dtype=torch.float64).unbind(0)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]).bool()
    calls = []

    def identity(S, valid, pair_scores):
        calls.append(S.shape)
        return S
    assert torch.allclose(dense_attention(q, k, v, mask), dense_attention(q, k, v, mask, mask_fn=identity), atol=1e-12)
    assert calls == [(2, 4, 6, 6)]                        # the explicit path ran, once, on the logits [B, H, L, L]


def test_position_extension_by_copying(tmp_path):
    hf, folder = make_hf(tmp_path, "roberta")
    model = load_pretrained(folder, max_positions=4 * 40)
    old = hf.roberta.embeddings.position_embeddings.weight
    new = model.emb.pos.weight
    assert new.shape[0] == 160
    assert torch.equal(new[:40], old)                       # the original rows, offset included
    assert torch.equal(new[40:78], old[2:40])               # then the learned rows (after the offset) again
    ids = torch.randint(5, 99, (1, 150))
    assert model.eval().encode(ids).shape == (1, 150, 32)
    bert = extend_positions(torch.arange(3.0)[:, None], 7, Config(position_style="bert"))
    assert bert.squeeze(1).tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_too_long_sequence_is_a_clear_error(tmp_path):
    _, folder = make_hf(tmp_path, "roberta")
    model = load_pretrained(folder)
    with pytest.raises(ValueError, match="--max-positions"):
        model.encode(torch.randint(5, 99, (1, 60)))


def test_unknown_override_field(tmp_path):
    _, folder = make_hf(tmp_path, "bert")
    with pytest.raises(ValueError, match="unknown Config field.*not_a_field"):
        load_pretrained(folder, not_a_field=3)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the crafted pickle is protocol 4 on purpose
def test_pickle_with_code_is_refused(tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    _, good = make_hf(tmp_path, "roberta")
    (folder / "config.json").write_text(open(os.path.join(good, "config.json")).read())
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    with pytest.raises(CheckpointError, match="refused"):
        load_pretrained(str(folder))
    assert not marker.exists()


def test_missing_unexpected_and_misshaped_weights(tmp_path):
    from safetensors.torch import load_file, save_file
    _, folder = make_hf(tmp_path, "roberta")
    st = os.path.join(folder, "model.safetensors")
    orig = load_file(st)

    state = dict(orig)
    del state["roberta.encoder.layer.1.output.dense.weight"]
    save_file(state, st)
    with pytest.raises(CheckpointError, match=r"missing weights: layers\.1\.ffn\.down\.weight"):
        load_pretrained(folder)

    state = dict(orig)
    state["roberta.encoder.layer.0.surprise.weight"] = torch.zeros(2)
    save_file(state, st)
    with pytest.raises(CheckpointError, match="unexpected weights.*surprise"):
        load_pretrained(folder)

    state = dict(orig)
    state["roberta.encoder.layer.0.intermediate.dense.weight"] = torch.zeros(5, 32)
    save_file(state, st)
    with pytest.raises(CheckpointError, match=r"wrong shapes: layers\.0\.ffn\.up\.weight \(5, 32\)"):
        load_pretrained(folder)


def test_unknown_model_type_names_supported(tmp_path):
    _, folder = make_hf(tmp_path, "bert")
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="supported: roberta, xlm-roberta, bert"):
        load_pretrained(folder)


def test_convert_cli_and_errors(tmp_path, capsys):
    _, folder = make_hf(tmp_path, "xlm-roberta")
    out = tmp_path / "x.pt"
    main(["convert", folder, str(out)])
    assert "wrote" in capsys.readouterr().out
    cfg, state, tok, raw = read_checkpoint(str(out))
    assert raw["format"] == "attnreg-v1" and cfg.position_style == "roberta"
    with pytest.raises(SystemExit) as e:
        main(["info", str(tmp_path / "nope")])
    assert e.value.code == 2 and "neither an HF model folder nor a checkpoint" in capsys.readouterr().err


def test_train_mode_hidden_dropout_is_active():
    model = Model(Config(vocab_size=20, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=20,
                         max_positions=20, num_labels=2)).train()
    ids = torch.randint(3, 20, (2, 8))
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


def test_export_drops_gnet_and_keeps_eval_outputs(tmp_path):
    from model import checkpoint_dict, save_atomic
    torch.manual_seed(0)
    cfg = Config(vocab_size=20, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=20, max_positions=20,
                 num_labels=2, attn_dropout="attendout")
    model = Model(cfg).eval()
    save_atomic(checkpoint_dict(model, data.files_to_tensors(data.ListOpsTokenizer().files)), str(tmp_path / "ft.pt"))
    main(["export", str(tmp_path / "ft.pt"), str(tmp_path / "small.pt")])
    small = load_pretrained(str(tmp_path / "small.pt")).eval()
    assert small.cfg.attn_dropout == "standard"
    assert not any("gnet" in k for k in small.state_dict())
    ids = torch.randint(3, 20, (2, 7))
    assert torch.equal(small(ids), model(ids))


def test_hst_layer_equals_dense_masked_two_stage_reference():
    """One HST layer (methods.md §2.2) = stage 1 as dense attention under hst_dense_mask over [X; R], then stage 2 as
    dense attention among the representatives with the same Q/K/V/O and LN1, then the shared feed-forward."""
    import math
    from sparse import hst_dense_mask
    torch.manual_seed(0)
    cfg = Config(vocab_size=20, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=24, max_positions=40,
                 attention="hst", block_size=4, window=1, num_global=2, hidden_dropout_p=0.0, attn_dropout_p=0.0)
    model = Model(cfg).double().eval()
    layer = model.layers[0]
    B, n, m, d, H = 2, 16, 4, 16, 2
    key_mask = torch.ones(B, n, dtype=torch.bool)
    key_mask[1, 10:] = False                                    # the last block of row 1 is all padding
    x = torch.randn(B, n, d, dtype=torch.float64)
    xr, rep_mask = model.add_representatives(x, key_mask)       # [B, n + m, d], [B, m]

    def attend(z, mask):                                        # mask [B, H|1, Lq, Lk] bool
        q, k, v = layer.attn.qkv(z).view(B, z.size(1), 3, H, d // H).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2) / math.sqrt(d // H)).masked_fill(~mask, float("-inf"))
        a = torch.nan_to_num(s.softmax(-1))                     # rows without keys -> 0
        return layer.attn.out((a @ v).transpose(1, 2).reshape(B, z.size(1), d))

    mask1 = hst_dense_mask(n, key_mask, block_size=4, window=1, num_global=2, num_heads=H, batch_size=B)
    x1 = layer.ln1(xr + attend(xr, mask1))                      # stage 1
    r = x1[:, n:]
    r2 = layer.ln1(r + attend(r, rep_mask[:, None, None, :].expand(B, 1, m, m)))   # stage 2
    x2 = torch.cat([x1[:, :n], r2], dim=1)
    ref = layer.ln2(x2 + layer.ffn(x2))
    with torch.no_grad():
        got = layer(xr, key_mask, rep_mask)
    real = torch.cat([key_mask, rep_mask], dim=1)
    assert (got - ref)[real].abs().max() < 1e-9
