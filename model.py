"""
model.py: the encoder of attnreg (RoBERTa, XLM-R, BERT), its task heads, and its weights to and
from transformers, in plain PyTorch (docs/methods.md §1). The idea: both methods taught here live
in self-attention, so `Attention` is where the topology (sparse.py) and the attention-dropout
method (attendout.py) plug in; the rest is a plain BERT that gives transformers' numbers.

Run:  python model.py convert HF_DIR OUT.pt       # an HF folder -> .pt (OUT kept unless --force)
      python model.py export CKPT OUT.pt [--hf]   # inference weights, no G-Nets; --hf: an HF folder
      python model.py info CKPT                   # the config, the parameter count, the task
      python model.py predict CKPT FILE [--out OUT.jsonl]   # classify every example of a file
      python model.py look CKPT "a text" [--png FILE]      # what each layer attends to in it
Test: python -m pytest -q tests/test_model.py tests/test_export.py tests/test_fidelity.py
      python -m pytest -q tests/test_use.py
"""
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save
from tqdm import tqdm

import data
from attendout import METHODS, begin_forward, export_without_gnet, make_attn_dropout
from data import ArgumentParser, one_line_errors
from sparse import block_sparse_attention, hst_attention, hst_dense_mask, pattern_of
from sparse import dense_mask as block_dense_mask

# -----------------------------------------------------------------------------
# Config: every knob, with its default (roberta-base). `python model.py convert` fills the encoder
# group from config.json; train.py sets the rest from the flag of the same name (--num-random).
@dataclass
class Config:
    # The encoder (methods.md §1).
    vocab_size: int = 50265
    hidden_size: int = 768            # d
    num_layers: int = 12
    num_heads: int = 12               # H; one head has d_h = d / H
    intermediate_size: int = 3072     # the feed-forward's inner size
    max_positions: int = 514          # rows of the position table (RoBERTa: 512 + its offset 2)
    type_vocab_size: int = 1          # token types: 1 for RoBERTa / XLM-R, 2 for BERT
    pad_id: int = 1                   # the padding id (also RoBERTa's position offset)
    layer_norm_eps: float = 1e-5      # 1e-5 RoBERTa, 1e-12 BERT
    position_style: str = "roberta"   # "roberta": count only the real tokens; "bert": 0 .. L-1
    family: str = ""                  # "roberta" | "xlm-roberta" | "bert"; "": from scratch
    hidden_dropout_p: float = 0.1     # on the embeddings, each residual branch and the heads
    # The task head: num_labels 0 none (MLM only), 1 regression (MSE), >= 2 classes.
    num_labels: int = 0
    head: str = "cls"                 # "cls" | "pair" (LRA retrieval) | "span" (QA): see HEADS
    # The topology (methods.md §2, sparse.py): "dense" | "sparse" (BigBird) | "hst" (ERNIE).
    attention: str = "dense"
    block_size: int = 64              # b
    window: int = 1                   # w: query block i sees key blocks i-w .. i+w
    num_global: int = 1               # g: the first g tokens see, and are seen by, every token
    num_random: int = 0               # r: random key blocks per query block (BigBird: 3)
    # Attention dropout (methods.md §3): one of attendout.METHODS; attn_dropout_p, the rate of the
    # methods that take one (standard's Bernoulli rate). AttendOut (methods.md §3.1): the keep
    # reward's weight gnet_tau^2; the G-Nets' own peak learning rate gnet_lr (None: the backbone's,
    # with its warmup and decay, as the author's code).
    attn_dropout: str = "standard"
    attn_dropout_p: float = 0.1
    gnet_tau: float = 0.5
    gnet_lr: float | None = None
    schedule: str = ""                # methods.md §3.2: droprates.jsonl or "linear:P_LOW:P_HIGH"
    # LayerDrop skips a whole layer, Attn.LayerDrop only its attention (methods.md §3.3, training).
    layerdrop: float = 0.0
    attn_layerdrop: float = 0.0
    # The longest input the position table allows: RoBERTa spends pad_id + 1 rows on its offset.
    @property
    def max_len(self):
        offset = self.pad_id + 1 if self.position_style == "roberta" else 0
        return self.max_positions - offset

# A value the model cannot run is one error naming the field (= the train.py flag), before a build.
def check_config(cfg):
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    choices_of = (("attention", ("dense", "sparse", "hst")), ("attn_dropout", METHODS),
                  ("head", HEADS))
    for name, choices in choices_of:
        value = getattr(cfg, name)
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(choices)}")
    for name in ("hidden_dropout_p", "attn_dropout_p", "layerdrop", "attn_layerdrop"):
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name} = {value} must be in [0, 1) ({flag})")

# -----------------------------------------------------------------------------
# Attention (methods.md §1 for the formula, §2 for the topologies, §3 for attention dropout).
# Dense: S = Q K^T / sqrt(d_h), out = softmax(S + mask) V, by PyTorch's fused kernel (standard
# dropout included). A method on the logits (methods.md §3, e.g. AttendOut's masked pass) runs
# step by step: mask_fn(S, valid, pair_scores) turns S into S' on the real pairs (valid), with
# pair_scores(a, c) = a c^T here (the G-Net's scores); then the padding keys leave the softmax
# whatever mask_fn did. S' may come back in fp32 (AttendOut under bf16); the weights meet V in
# V's dtype.
def dense_attention(q, k, v, key_mask=None, dropout_p=0.0, mask_fn=None):
    """q, k, v [B, H, L, d_h], key_mask [B, L] bool (True: a real token) or None."""
    if mask_fn is None:
        mask = None if key_mask is None else key_mask[:, None, None, :]           # [B, 1, 1, L]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    S = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))                           # [B, H, L, L]
    real_pairs = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    if key_mask is not None:
        real_pairs = key_mask[:, None, :, None] & key_mask[:, None, None, :]      # [B, 1, L, L]

    def pair_scores(a, c):
        return a @ c.transpose(-1, -2)                                            # G = a c^T

    S = mask_fn(S, real_pairs, pair_scores)                                       # S'
    if key_mask is not None:
        S = S.masked_fill(~key_mask[:, None, None, :], torch.finfo(S.dtype).min)
    return S.softmax(dim=-1).to(v.dtype) @ v                                      # [B, H, L, d_h]

# Multi-head self-attention, THE plug-in point: Q = x W_q, K = x W_k, V = x W_v (one fused matmul),
# a kernel chosen by the topology (dense, or sparse.py's, methods.md §2.1, §2.2), the heads through
# W_o. The layer's attention-dropout module (attendout.make_attn_dropout, methods.md §3) answers
# two questions in training: rate(t), the Bernoulli rate on the weights after the softmax, and,
# per view, logits_fn(x_view, masked) -> None or the mask_fn the kernel applies to the logits
# before it (masked: the view is AttendOut's masked copy, the last). The batch may stack views
# (SAR's or R-Drop's copies, methods.md §2.3; AttendOut's masked copy last): each is attended
# alone, drawing its own random blocks. Dense attention with no mask_fn in any view stays one
# fused call. In evaluation neither is asked: the plain model.
class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)        # [W_q | W_k | W_v]
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)            # W_o
        self.drop = make_attn_dropout(cfg, layer_idx)
        self.step_frac = 0.0                      # training progress 0 .. 1 (Model.set_progress)

    # Random blocks (methods.md §2.1): fresh each training forward; in evaluation one per layer,
    # from a CPU generator on every device (sparse.random_blocks draws on the CPU, then moves).
    def eval_generator(self):
        fixed = not self.training and self.cfg.num_random > 0
        if not fixed:
            return None
        seed = 1_000_003 * (self.layer_idx + 1)
        return torch.Generator().manual_seed(seed)

    # x [B, L, d] -> [B, L, d]; views: sar.py's stacked views; masked: the last is AttendOut's.
    def forward(self, x, key_mask, kernel, views=1, masked=False):
        B, L, d = x.shape
        H = self.cfg.num_heads
        q, k, v = self.qkv(x).split(d, dim=-1)                                    # 3 x [B, L, d]
        q = q.view(B, L, H, -1).transpose(1, 2)                                   # [B, H, L, d_h]
        k = k.view(B, L, H, -1).transpose(1, 2)
        v = v.view(B, L, H, -1).transpose(1, 2)
        p = self.drop.rate(self.step_frac) if self.training else 0.0               # 0 in evaluation
        mask_fns = [None] * views                                                 # evaluation
        if self.training:
            mask_fns = [self.drop.logits_fn(xv, masked and i == views - 1)
                        for i, xv in enumerate(split_views(x, views))]
        if kernel == "dense" and all(fn is None for fn in mask_fns):              # one fused call
            y = dense_attention(q, k, v, key_mask, p)                             # [B, H, L, d_h]
            return self.out(y.transpose(1, 2).reshape(B, L, d))
        # Otherwise view by view, each with its own mask_fn.
        attend = block_sparse_attention if kernel == "sparse" else hst_attention   # or dense below
        per_view = zip(mask_fns, split_views(q, views), split_views(k, views),
                       split_views(v, views), split_views(key_mask, views))
        ys = []
        for mask_fn, qv, kv, vv, mv in per_view:
            if kernel == "dense":
                y = dense_attention(qv, kv, vv, mv, p, mask_fn)
            else:
                generator = self.eval_generator()
                y = attend(qv, kv, vv, mv, generator=generator, dropout_p=p, mask_fn=mask_fn,
                           flex=x.is_cuda, **pattern_of(self.cfg))
            ys.append(y)                                                          # [B', H, L, d_h]
        y = torch.cat(ys) if views > 1 else ys[0]
        return self.out(y.transpose(1, 2).reshape(B, L, d))                      # [B, L, d]

# The stacked views of one batch, [views B, ...], as `views` tensors [B, ...]; None stays None.
def split_views(t, views):
    return [None] * views if t is None else t.chunk(views)

# -----------------------------------------------------------------------------
# The rest of a layer (methods.md §1). A token's vector sums three looked-up rows, then LN, dropout:
#     E = Dropout(LN(word[ids] + pos[pos_ids] + type[type_ids]))     # [B, L, d]
class Embeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.types = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.hidden_dropout_p)

    def forward(self, input_ids, position_ids, token_type_ids):
        x = self.word(input_ids) + self.pos(position_ids) + self.types(token_type_ids)   # [B, L, d]
        return self.drop(self.ln(x))

# The feed-forward network, per token: FFN(x) = W2 gelu(W1 x), the exact erf GELU as in BERT.
class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)      # W1
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)    # W2

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))                             # [B, L, d]

# One post-LN layer (methods.md §1): x = LN1(x + Dropout(Attn(x))), x = LN2(x + Dropout(FFN(x))).
# HST (methods.md §2.2) carries x = [X; R]: stage 1 attends over [X; R], stage 2 densely among the
# representatives with the same weights and LN1, R2 = LN1(R1 + Dropout(Attn(R1))). In training,
# LayerDrop skips the layer, Attn.LayerDrop its attention (methods.md §3.3).
class Layer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, layer_idx)
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.hidden_dropout_p)

    def forward(self, x, key_mask, rep_mask=None, views=1, masked=False):
        cfg = self.cfg
        if self.training and cfg.layerdrop > 0 and torch.rand(()) < cfg.layerdrop:
            return x
        attention_dropped = (self.training and cfg.attn_layerdrop > 0
                             and torch.rand(()) < cfg.attn_layerdrop)
        if not attention_dropped:
            x = self.ln1(x + self.drop(self.attn(x, key_mask, cfg.attention, views, masked)))
            if cfg.attention == "hst":                                            # stage 2
                m = rep_mask.size(1)
                n = x.size(1) - m
                r = x[:, -m:]                                                     # R1: [B, m, d]
                r = self.ln1(r + self.drop(self.attn(r, rep_mask, "dense", views, masked)))
                x = torch.cat([x[:, :n], r], dim=1)                               # [X1; R2]
        return self.ln2(x + self.drop(self.ffn(x)))

# -----------------------------------------------------------------------------
# The heads (methods.md §1) read the last hidden states h [B, L, d]. Masked LM, its decoder tied
# to the word embeddings (passed in): logits = decoder(LN(gelu(dense(h)))) + bias
class MLMHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, h, word_embeddings):
        x = self.ln(F.gelu(self.dense(h)))                                        # [B, L, d]
        return F.linear(x, word_embeddings, self.bias)                            # [B, L, vocab]

# The classification head, RoBERTa style (BERT's `dense` is its pooler; 1 output: a regression):
#     logits = out_proj(Dropout(tanh(dense(Dropout(h_0)))))
class ClassifierHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)
        self.drop = nn.Dropout(cfg.hidden_dropout_p)

    def forward(self, h):
        x = self.drop(h[:, 0])                                                    # [B, d]
        x = self.drop(torch.tanh(self.dense(x)))
        return self.out_proj(x)                                                   # [B, C]

# LRA Retrieval's dual encoder (classifier_head_dual): rows 2i, 2i + 1 hold pair i's documents,
# read at the first token (u, v), classified by MLP([u, v, u * v, u - v]) (hidden FFN, FFN / 2).
class PairHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        m = cfg.intermediate_size
        self.mlp = nn.Sequential(nn.Dropout(cfg.hidden_dropout_p), nn.Linear(4 * d, m), nn.ReLU(),
                                 nn.Linear(m, m // 2), nn.ReLU(), nn.Linear(m // 2, cfg.num_labels))

    def forward(self, h):                                                         # h: [2B, L, d]
        u = h[0::2, 0]                                                            # [B, d]
        v = h[1::2, 0]                                                            # [B, d]
        return self.mlp(torch.cat([u, v, u * v, u - v], dim=-1))                  # [B, C]

# Extractive QA (BERT's SQuAD head, readers/qa.py): start and end scores (s_i, e_i) = W h_i + b.
class SpanHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.out = nn.Linear(cfg.hidden_size, 2)

    def forward(self, h):
        return self.out(h)                                                        # [B, L, 2]

HEADS = {"cls": ClassifierHead, "pair": PairHead, "span": SpanHead}

# -----------------------------------------------------------------------------
# The model: embeddings, layers, the MLM head and (num_labels > 0) a task head. HST's rep_embedding
# (added to each block's mean) starts at zero: plain mean pooling at first (methods.md §2.2).
class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        self.emb = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.mlm = MLMHead(cfg)
        self.cls = HEADS[cfg.head](cfg) if cfg.num_labels else None              # None: MLM only
        hst = cfg.attention == "hst"
        self.rep_embedding = nn.Parameter(torch.zeros(cfg.hidden_size)) if hst else None
        self.apply(self._init_weights)

    # BERT's init (normal, std 0.02; biases 0; LayerNorm keeps 1, 0): from scratch, or a new head.
    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    # Position ids (methods.md §1). BERT: 0 .. L-1. RoBERTa / XLM-R number only the real tokens,
    #     pos_ids = pad_id + cumsum(ids != pad_id) * (ids != pad_id)
    # so a padding token gets pad_id wherever it stands (SAR, methods.md §2.3, relies on it).
    def position_ids(self, input_ids):
        if self.cfg.position_style == "roberta":
            real = (input_ids != self.cfg.pad_id).long()
            return torch.cumsum(real, dim=1) * real + self.cfg.pad_id             # [B, L]
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        return positions.expand_as(input_ids)                                     # [B, L]

    # The last hidden states [B, L, d]. Sparse and HST pad to a multiple of b with masked tokens,
    # HST appends R; both are cut off at the end. Positions are checked only for longer inputs or
    # given ids (a device sync): ours stay below max_positions when L <= max_len.
    def encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
               views=1, masked=False):
        c = self.cfg
        L = input_ids.size(1)
        if self.training:
            begin_forward(self)                   # AttendOut: each layer's counts start afresh
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        pos = self.position_ids(input_ids) if position_ids is None else position_ids
        if (position_ids is not None or L > c.max_len) and int(pos.max()) >= c.max_positions:
            raise ValueError(f"sequence of length {L} needs position {int(pos.max())}, the model "
                             f"has {c.max_positions} (max length {c.max_len}): raise "
                             f"--max-positions (copies the table) or truncate it")
        extra = (-L) % c.block_size if c.attention != "dense" else 0             # block padding
        pos_pad = c.pad_id if c.position_style == "roberta" else 0
        ids = F.pad(input_ids, (0, extra), value=c.pad_id)                        # [B, n]
        mask = F.pad(mask, (0, extra), value=0)
        pos = F.pad(pos, (0, extra), value=pos_pad)
        types = F.pad(types, (0, extra), value=0)
        x = self.emb(ids, pos, types)                                             # E: [B, n, d]
        # None: no padding key under dense attention, the fastest path.
        key_mask = None if c.attention == "dense" and bool(mask.all()) else mask.bool()   # [B, n]
        rep_mask = None
        if c.attention == "hst":
            x, rep_mask = self.add_representatives(x, key_mask)                   # [B, n + m, d]
        for layer in self.layers:
            x = layer(x, key_mask, rep_mask, views, masked)
        return x[:, :L]                                                           # [B, L, d]

    # HST's initial representatives (methods.md §2.2), x [B, n, d] -> ([X; R], R's key mask [B, m]):
    #     R_j = mean_{t in block j, t real} E_t + rep_embedding
    # An all-padding block has no mean (its pooled part is 0) and is masked as a key.
    def add_representatives(self, x, key_mask):
        B, n, d = x.shape
        b = self.cfg.block_size
        w = key_mask.view(B, n // b, b, 1).to(x.dtype)                            # [B, m, b, 1]
        count = w.sum(dim=2)                                                      # [B, m, 1]
        r = (x.view(B, n // b, b, d) * w).sum(dim=2) / count.clamp(min=1)         # [B, m, d]
        reps = r + self.rep_embedding
        return torch.cat([x, reps], dim=1), count.squeeze(-1) > 0

    def mlm_logits(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        h = self.encode(input_ids, attention_mask, token_type_ids, position_ids)  # [B, L, d]
        return self.mlm(h, self.emb.word.weight)                                  # [B, L, vocab]

    # The head's logits: classes [B, C]; pair [B / 2, C]; span [B, L, 2]; head="mlm": mlm_logits.
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                head="cls", views=1, masked=False):
        if head == "mlm":
            return self.mlm_logits(input_ids, attention_mask, token_type_ids, position_ids)
        if self.cls is None:
            raise ValueError(
                "this model has no task head (num_labels = 0); use mlm_logits or encode")
        h = self.encode(input_ids, attention_mask, token_type_ids, position_ids, views, masked)
        # The head in the parameters' fp32, also under bf16 autocast (train.py's on CUDA): the
        # consistency terms compare views whose logits may differ by 0.01, below bf16's step
        # (methods.md §1).
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return self.cls(h.to(self.emb.word.weight.dtype))

    # How far training is (0 .. 1), for scheduled dropout (methods.md §3.2).
    def set_progress(self, step_frac):
        for layer in self.layers:
            layer.attn.step_frac = float(step_frac)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

# -----------------------------------------------------------------------------
# From and to transformers (methods.md §1; nanoGPT's from_pretrained): one table, read forwards by
# convert, backwards by export --hf. {p} is "roberta." (also XLM-R) or "bert.", {i} a layer, {wb}
# weight or bias; qkv.{wb}[s] is slot s of our fused qkv. Our name "": HF's alone (tied decoder,
# next-sentence head, unused pooler). A row with a family is that family's only; "" everyone's.
HF_TABLE = [  # (HF name, our name, family)
    ("{p}embeddings.word_embeddings.weight", "emb.word.weight", ""),
    ("{p}embeddings.position_embeddings.weight", "emb.pos.weight", ""),
    ("{p}embeddings.token_type_embeddings.weight", "emb.types.weight", ""),
    ("{p}embeddings.LayerNorm.{wb}", "emb.ln.{wb}", ""),
    # A buffer that old checkpoints stored.
    ("{p}embeddings.position_ids", "", ""),
    # One layer: attention (query, key, value fused into qkv), its LayerNorm, the feed-forward.
    ("{p}encoder.layer.{i}.attention.self.query.{wb}", "layers.{i}.attn.qkv.{wb}[0]", ""),
    ("{p}encoder.layer.{i}.attention.self.key.{wb}", "layers.{i}.attn.qkv.{wb}[1]", ""),
    ("{p}encoder.layer.{i}.attention.self.value.{wb}", "layers.{i}.attn.qkv.{wb}[2]", ""),
    ("{p}encoder.layer.{i}.attention.output.dense.{wb}", "layers.{i}.attn.out.{wb}", ""),
    ("{p}encoder.layer.{i}.attention.output.LayerNorm.{wb}", "layers.{i}.ln1.{wb}", ""),
    ("{p}encoder.layer.{i}.intermediate.dense.{wb}", "layers.{i}.ffn.up.{wb}", ""),
    ("{p}encoder.layer.{i}.output.dense.{wb}", "layers.{i}.ffn.down.{wb}", ""),
    ("{p}encoder.layer.{i}.output.LayerNorm.{wb}", "layers.{i}.ln2.{wb}", ""),
    # The masked-LM head, RoBERTa / XLM-R; the decoder is tied (word embeddings, mlm.bias).
    ("lm_head.dense.{wb}", "mlm.dense.{wb}", "roberta"),
    ("lm_head.layer_norm.{wb}", "mlm.ln.{wb}", "roberta"),
    ("lm_head.bias", "mlm.bias", "roberta"),
    ("lm_head.decoder.{wb}", "", "roberta"),
    # The masked-LM head, BERT (tied decoder), and its next-sentence prediction.
    ("cls.predictions.transform.dense.{wb}", "mlm.dense.{wb}", "bert"),
    ("cls.predictions.transform.LayerNorm.{wb}", "mlm.ln.{wb}", "bert"),
    ("cls.predictions.bias", "mlm.bias", "bert"),
    ("cls.predictions.decoder.{wb}", "", "bert"),
    ("cls.seq_relationship.{wb}", "", "bert"),
    # Sequence classification, RoBERTa; it never uses the pooler.
    ("classifier.dense.{wb}", "cls.dense.{wb}", "roberta"),
    ("classifier.out_proj.{wb}", "cls.out_proj.{wb}", "roberta"),
    ("{p}pooler.dense.{wb}", "", "roberta"),
    # Sequence classification, BERT: pooler + classifier.
    ("{p}pooler.dense.{wb}", "cls.dense.{wb}", "bert"),
    ("classifier.{wb}", "cls.out_proj.{wb}", "bert"),
    # Extractive QA: our span head.
    ("qa_outputs.{wb}", "cls.out.{wb}", ""),
]

# model_type -> (its rows of HF_TABLE, its transformers class prefix).
FAMILIES = {"roberta": ("roberta", "Roberta"), "xlm-roberta": ("roberta", "XLMRoberta"),
            "bert": ("bert", "Bert")}

# HF config.json key -> Config field, read both ways. The first six are required.
HF_CONFIG = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
             "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
             "intermediate_size": "intermediate_size", "max_position_embeddings": "max_positions",
             "type_vocab_size": "type_vocab_size", "pad_token_id": "pad_id",
             "layer_norm_eps": "layer_norm_eps", "hidden_dropout_prob": "hidden_dropout_p",
             "attention_probs_dropout_prob": "attn_dropout_p"}

# What BERT changes in Config's defaults (which are RoBERTa's).
BERT_DEFAULTS = dict(type_vocab_size=2, pad_id=0, layer_norm_eps=1e-12, position_style="bert")

class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the offending weights."""

# HF_TABLE's rows for a family, {p} = prefix, as (HF name, our name, qkv slot 0-2 or None).
def table(family, prefix):
    rows = []
    for hf, ours, fam in HF_TABLE:
        if fam not in ("", FAMILIES[family][0]):
            continue
        slot = int(ours[-2]) if ours.endswith("]") else None
        rows.append((hf.replace("{p}", prefix), ours.split("[")[0], slot))
    return rows

# The {i} and {wb} that make a table pattern read `name`, as a dict, or None if it does not match.
def match(pattern, name):
    regex = pattern.replace(".", r"\.").format(i=r"(?P<i>\d+)", wb="(?P<wb>weight|bias)")
    m = re.fullmatch(regex, name)
    return None if m is None else m.groupdict()

# Convert: HF names -> ours by HF_TABLE's first matching row (no backbone prefix; TF-made BERT's
# gamma / beta read as weight / bias), query / key / value fused into W_qkv = [W_q; W_k; W_v].
# An unknown weight or an incomplete qkv is one error; a BERT pooler alone is no head of ours.
def convert_hf_state(hf_state, cfg, path):
    rows = table(cfg.family, "")
    ours = {}
    qkv = {}
    unexpected = []
    for name, t in hf_state.items():
        short = re.sub(r"^(roberta|bert)\.", "", name)
        short = short.replace(".gamma", ".weight").replace(".beta", ".bias")
        hit = None
        for hf_pattern, our_pattern, slot in rows:
            groups = match(hf_pattern, short)
            if groups is not None:
                hit = (our_pattern, slot, groups)
                break
        if hit is None:
            unexpected.append(name)
            continue
        our_pattern, slot, groups = hit
        if slot is not None:
            key = our_pattern.format(**groups)
            qkv.setdefault(key, [None] * 3)[slot] = t                             # fused below
        elif our_pattern:
            ours[our_pattern.format(**groups)] = t                                # "": HF's alone
    if unexpected:
        names = ", ".join(unexpected[:8])
        raise CheckpointError(f"{path}: unexpected weights not in the conversion table: {names}")
    for key, parts in qkv.items():
        if any(p is None for p in parts):
            raise CheckpointError(f"{path}: {key}: query/key/value incomplete in the checkpoint")
        ours[key] = torch.cat(parts, dim=0)                                       # [3d, d]
    if "cls.out_proj.weight" not in ours:
        ours = {k: v for k, v in ours.items() if not k.startswith("cls.dense.")}
    return ours

# A Config from an HF config.json (methods.md §1): RoBERTa's defaults, BERT_DEFAULTS for BERT, then
# the file's keys. Only GELU and absolute positions are supported.
def read_hf_config(path):
    try:
        hf = json.loads(data.read_text(path))                   # a missing file: one error line
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    family = hf.get("model_type") if isinstance(hf, dict) else None
    if family not in FAMILIES:
        supported = ", ".join(FAMILIES)
        raise CheckpointError(
            f"{path}: model_type {family!r} is not supported; supported: {supported}")
    activation = hf.get("hidden_act", "gelu")
    positions = hf.get("position_embedding_type", "absolute")
    if activation != "gelu" or positions != "absolute":
        raise CheckpointError(
            f"{path}: only hidden_act 'gelu' and absolute position embeddings are supported")
    required = list(HF_CONFIG)[:6]
    missing = [k for k in required if not isinstance(hf.get(k), int) or hf[k] < 1]
    if missing:
        raise CheckpointError(f"{path}: no positive integer {', '.join(missing)}")
    cfg = Config(family=family, **(BERT_DEFAULTS if family == "bert" else {}))
    for key, name in HF_CONFIG.items():
        if hf.get(key) is not None:
            setattr(cfg, name, hf[key])
    return cfg

# .safetensors, or torch.load(weights_only=True): a pickle carrying code is refused, never retried.
def safe_load(path):
    try:
        if path.endswith(".safetensors"):
            return load_file(path)
        return torch.load(path, "cpu", weights_only=True)
    except Exception as e:
        if "Weights only" in str(e):
            why = "refused to load: not a plain-tensor checkpoint"
        else:
            why = "truncated or corrupt"
        first_line = (str(e) or type(e).__name__).splitlines()[0][:160]
        raise CheckpointError(f"{path}: {why} ({first_line})") from None

# Any checkpoint as (Config, state dict, tokenizer files, raw dict): an HF folder, converted on
# the fly (its head sets num_labels and the head kind; its tokenizer files travel as uint8
# tensors, weights_only-safe), or our .pt (Config fields deleted since are dropped).
def read_checkpoint(path):
    if os.path.isdir(path):
        cfg = read_hf_config(os.path.join(path, "config.json"))
        weights = os.path.join(path, "model.safetensors")
        if not os.path.exists(weights):
            weights = os.path.join(path, "pytorch_model.bin")
        state = convert_hf_state(safe_load(weights), cfg, path)
        if "cls.out.weight" in state:
            cfg.head = "span"                                                     # QA: qa_outputs
            cfg.num_labels = 2
        elif "cls.out_proj.weight" in state:
            cfg.num_labels = state["cls.out_proj.weight"].size(0)                 # a classifier
        tokenizer_files = data.files_to_tensors(data.read_tokenizer_folder(path))
        return cfg, state, tokenizer_files, {"task": hf_task(path, cfg)}
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: neither an HF model folder nor a checkpoint file")
    ckpt = safe_load(path)
    is_ours = (isinstance(ckpt, dict) and ckpt.get("format") == "attnreg-v1"
               and isinstance(ckpt.get("config"), dict) and isinstance(ckpt.get("model"), dict))
    if not is_ours:
        raise CheckpointError(f"{path}: not an attnreg checkpoint "
                              f"(convert HF folders with `python model.py convert`)")
    known = {f.name for f in fields(Config)}
    cfg = Config(**{k: v for k, v in ckpt["config"].items() if k in known})
    tokenizer_files = ckpt.get("tokenizer", {}).get("files", {})
    return cfg, ckpt["model"], tokenizer_files, ckpt

# What a prediction needs besides the weights (train.task_record writes it into every checkpoint):
# the task's name, its label names in class-index order (None: a regression or unknown), the
# columns it read, --max-len and --batch-size. An HF classifier brings only its id2label.
def hf_task(path, cfg):
    config = json.loads(data.read_text(os.path.join(path, "config.json")))
    id2label = config.get("id2label") or {}
    labels = [id2label.get(str(i)) for i in range(cfg.num_labels)]
    known = cfg.head == "cls" and cfg.num_labels > 1 and None not in labels
    return {"labels": labels if known else None}

# A checkpoint's task (a dict of hf_task's fields); one written before checkpoints kept it has its
# run's flags, which tell all but the label names.
def checkpoint_task(raw):
    if "task" in raw:
        return dict(raw["task"])
    args = raw.get("args", {})
    names = ("text_col", "text_pair_col", "label_col", "max_len", "batch_size")
    return {"name": args.get("task"), "labels": None, **{n: args.get(n) for n in names}}

# The tokenizer a checkpoint's files make, or one error naming the checkpoint.
def checkpoint_tokenizer(path, tokenizer_files):
    try:
        return data.tokenizer_from_files(data.tensors_to_files(tokenizer_files))
    except data.DataError as e:
        raise CheckpointError(f"{path}: no usable tokenizer ({e})") from None

# Longer inputs than the checkpoint (methods.md §1): a longer position table made by copying the
# learned rows again and again (Longformer's recipe). RoBERTa's offset rows stay in place.
def extend_positions(weight, new_rows, cfg):
    offset = cfg.pad_id + 1 if cfg.position_style == "roberta" else 0
    reps = math.ceil((new_rows - offset) / (weight.size(0) - offset))
    copies = weight[offset:].repeat(reps, 1)
    return torch.cat([weight[:offset], copies])[:new_rows].clone()                # [new_rows, d]

# A Model(cfg) holding `state` (the position table extended if cfg asks for more rows), or one
# error naming the missing, unexpected and misshapen weights. Fresh, as no checkpoint need hold
# them: the MLM head, a task head (or one of another size), rep_embedding, the G-Nets.
def build_model(cfg, state, path):
    state = dict(state)
    if "emb.pos.weight" in state and state["emb.pos.weight"].size(0) != cfg.max_positions:
        state["emb.pos.weight"] = extend_positions(state["emb.pos.weight"], cfg.max_positions, cfg)
    model = Model(cfg)
    expected = model.state_dict()
    state = {k: v for k, v in state.items()
             if not k.startswith("cls.") or (k in expected and expected[k].shape == v.shape)}

    def fresh(k):
        return k.startswith(("mlm.", "cls.", "rep_embedding")) or ".attn.drop." in k

    missing = [k for k in expected if k not in state and not fresh(k)]
    unexpected = [k for k in state if k not in expected and ".attn.drop." not in k]
    wrong = []
    for k, v in state.items():
        if k in expected and v.shape != expected[k].shape:
            wrong.append(f"{k} {tuple(v.shape)} != {tuple(expected[k].shape)}")
    problems = []
    for what, names in (("missing weights", missing), ("unexpected weights", unexpected),
                        ("wrong shapes", wrong)):
        if names:
            problems.append(f"{what}: {', '.join(names[:8])}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    return model

# A copy of cfg with some fields replaced; an unknown field is one error listing the valid ones.
def apply_overrides(cfg, overrides):
    names = sorted(f.name for f in fields(Config))
    unknown = set(overrides) - set(names)
    if unknown:
        raise ValueError(f"unknown Config field(s) {', '.join(sorted(unknown))}; "
                         f"valid fields: {', '.join(names)}")
    return Config(**{**asdict(cfg), **overrides})

# A Model from an HF folder or a .pt; overrides are Config fields (methods.md §1), e.g.
# load_pretrained(path, attention="sparse", max_positions=4096).
def load_pretrained(path, **overrides):
    cfg, state, _, _ = read_checkpoint(path)
    return build_model(apply_overrides(cfg, overrides), state, path)

# The one file format: plain tensors and plain values, safe under torch.load(weights_only=True).
# task: checkpoint_task's fields, where known.
def checkpoint_dict(model, tokenizer_files, task=None, **extra):
    task = {} if task is None else {"task": task}
    return {"format": "attnreg-v1", "config": asdict(model.cfg), "model": model.state_dict(),
            "tokenizer": {"files": dict(tokenizer_files)}, **task, **extra}

# The names of a classifier's classes: the task's, or (a checkpoint from before they were kept)
# default.format(i) for class i, which one `note:` line says.
def label_names(task, num_labels, path, default="{}"):
    if task.get("labels") and len(task["labels"]) == num_labels:
        return list(task["labels"])
    example = ", ".join(default.format(i) for i in range(min(num_labels, 2)))
    print(f"note: {path} holds no label names (saved before checkpoints kept them); the classes "
          f"are shown by index ({example}, ...)", file=sys.stderr)
    return [default.format(i) for i in range(num_labels)]

# Write atomically: torch.save (bytes as they are) to a synced temporary file, renamed over `path`
# once complete. On failure the old file stays, no temporary is left, and one error line says why.
def save_atomic(obj, path, what="the checkpoint"):
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if isinstance(obj, bytes):
                f.write(obj)
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        # ENOSPC, a read-only folder; torch's "file write failed".
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        message = f"{path}: could not write {what} ({why}; is the disk full?)"
        raise OSError(message) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

# Export (methods.md §1, "To and from transformers"): src's inference weights as one .pt `out`; the
# G-Nets go (AttendOut exports as standard dropout: same eval forward, methods.md §3.1). hf=True:
# `out` is a from_pretrained folder (HF_TABLE, HF_CONFIG read backwards; src's tokenizer files).
# No working tokenizer, or no transformers counterpart: refused in one line before any write.
def export(src, out, hf=False):
    cfg, state, tok, raw = read_checkpoint(src)
    task = checkpoint_task(raw)
    checkpoint_tokenizer(src, tok)
    if cfg.attn_dropout == "attendout":
        cfg.attn_dropout = "standard"
    if hf:
        hst = " (with its representatives' embedding)" if cfg.attention == "hst" else ""
        no_family = "no model family (trained from scratch, or converted before convert kept it)"
        reasons = [(cfg.family not in FAMILIES, no_family),
                   (cfg.attention != "dense",
                    f"{cfg.attention} attention{hst} has no transformers counterpart (only dense)"),
                   (cfg.num_labels and cfg.head == "pair",
                    "the pair head (LRA retrieval) has no transformers counterpart"),
                   (not set(tok) & set(data.HF_TOKENIZER_FILES),
                    f"its tokenizer {sorted(tok)} is not one transformers reads")]
        for bad, why in reasons:
            if bad:
                raise CheckpointError(f"{src}: {why}")
    model = build_model(cfg, export_without_gnet(state), src)
    if not hf:
        save_atomic(checkpoint_dict(model, tok, task=task), out)
        return model
    # HF_TABLE backwards (W_qkv split into W_q, W_k, W_v); a task model goes without its MLM head.
    rows = [row for row in table(cfg.family, FAMILIES[cfg.family][0] + ".") if row[1]]
    weights = {}
    for key, t in model.state_dict().items():
        hits = []
        for hf_pattern, our_pattern, slot in rows:
            groups = match(our_pattern, key)
            if groups is not None:
                hits.append((hf_pattern.format(**groups), slot))
        if not hits:
            raise CheckpointError(f"{key}: no row of model.HF_TABLE maps it to transformers")
        if model.cls and key.startswith("mlm."):
            continue
        for name, slot in hits:
            weights[name] = t if slot is None else t.chunk(3)[slot].clone()
    # config.json: HF_CONFIG backwards, the class to build; one label is a regression (MSE).
    if not cfg.num_labels:
        kind = "MaskedLM"
    elif cfg.head == "span":
        kind = "QuestionAnswering"
    else:
        kind = "SequenceClassification"
    config = {key: getattr(cfg, name) for key, name in HF_CONFIG.items()}
    architecture = f"{FAMILIES[cfg.family][1]}For{kind}"
    config.update(model_type=cfg.family, architectures=[architecture], hidden_act="gelu")
    if kind == "SequenceClassification":
        problem_type = "regression" if cfg.num_labels == 1 else "single_label_classification"
        names = ["LABEL_0"]                                                      # a regression
        if cfg.num_labels > 1:
            names = label_names(task, cfg.num_labels, src, default="LABEL_{}")
        config.update(id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
                      problem_type=problem_type)
    os.makedirs(out, exist_ok=True)
    files = list(data.tensors_to_files(tok).items())
    files.append(("model.safetensors", save(weights, {"format": "pt"})))
    files.append(("config.json", json.dumps(config, indent=2).encode()))
    for name, content in files:
        save_atomic(content, os.path.join(out, name))
    return model

# convert HF_DIR OUT.pt is the export of an HF folder.
convert = export

# -----------------------------------------------------------------------------
# Use a trained model: `predict` scores a file, `look` shows what the model attends to in one text.
# Both run the model as train.py's evaluation does: eval mode (no dropout, no G-Net), bf16 autocast
# on CUDA. A checkpoint for use: the Model in eval mode on its device, the tokenizer, its task.
def load_for_use(path, device):
    cfg, state, tok_files, raw = read_checkpoint(path)
    tok = checkpoint_tokenizer(path, tok_files)
    model = build_model(cfg, state, path).to(device).eval()
    return model, tok, checkpoint_task(raw)

# --device (train.py, predict, look): auto (CUDA when there is one), cpu, cuda (cuda:0) or cuda:N
# for a GPU this machine has; anything else is one error naming the flag and the GPUs there are.
def pick_device(name):
    gpus = torch.cuda.device_count()
    if name == "auto":
        name = "cuda" if gpus else "cpu"
    kind, _, index = name.partition(":")
    index = index or "0"                                 # "cuda" is cuda:0
    if not (name == "cpu" or (kind == "cuda" and index.isdigit() and int(index) < gpus)):
        raise ValueError(f"--device {name}: not available here (auto, cpu, cuda or cuda:N; this "
                         f"machine has {gpus} GPUs)")
    return torch.device(name)

# What predict serves: a class or a value per text, from a task data.py reads (GLUE, tsv, listops,
# the lab), or a converted classifier on plain text. Anything else is one error saying what it is.
def check_predictable(path, cfg, task):
    name = task.get("name")
    why = None
    if not cfg.num_labels:
        why = "a masked-LM model: it predicts tokens, not a class or a value"
    elif cfg.head != "cls":
        why = {"span": "an extractive QA model: it predicts spans",
               "pair": "LRA Retrieval's pair model: it reads two documents per example"}[cfg.head]
    elif name is not None and data.TASKS[name].load is None:
        why = f"task {name}, whose files readers/ reads (docs/tasks.md)"
    if why:
        raise CheckpointError(f"{path}: {why}; predict serves the classification and regression "
                              "tasks of data.py (GLUE, tsv, listops, lab-*)")

# The logits of examples in their own order, [N, C]: batched as train.evaluate batches a dev set
# (longest first, batch_size at a time, each padded to its longest), so the same file scores the
# same; a bar on a long file.
@torch.no_grad()
def logits_in_order(model, examples, batch_size, pad_id, device):
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids), reverse=True)
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    found = [None] * len(examples)
    for batch in tqdm(batches, desc="predict", unit="batch", disable=len(batches) < 20):
        rows = data.collate([examples[i] for i in batch], pad_id)
        rows = {k: v.to(device) for k, v in rows.items()}
        with data.autocast(device):                                               # bf16 on CUDA
            z = model(rows["input_ids"], rows["attention_mask"], rows["token_type_ids"])
        for i, zi in zip(batch, z.float().cpu()):
            found[i] = zi
    return torch.stack(found)                                                     # [N, C]

# python model.py predict CKPT FILE: one record per example, {"label": NAME, "probs": {NAME: p}}
# (a classifier, p = softmax of the logits) or {"value": x} (a regression), into OUT (JSON lines,
# written whole or not at all) or as a table on stdout. A file with labels is also scored as the
# dev set is, printed as train.py prints it ("acc 87.5%").
def predict(path, file, out=None, batch_size=None, device="auto"):
    device = pick_device(device)
    model, tok, task = load_for_use(path, device)
    cfg = model.cfg
    check_predictable(path, cfg, task)
    task["max_len"] = min(task.get("max_len") or cfg.max_len, cfg.max_len)   # the run's --max-len
    regression = cfg.num_labels == 1
    names = None if regression else label_names(task, cfg.num_labels, path)
    examples, texts, has_labels, cut = data.prediction_examples(file, task, tok, names)
    if cut:
        data.warn(f"{cut} examples were longer than {task['max_len']} tokens (the run's --max-len) "
                  "and were truncated, as its evaluation truncated them")
    batch_size = batch_size or task.get("batch_size") or 32
    logits = logits_in_order(model, examples, batch_size, tok.pad_id, device)    # [N, C]
    if regression:
        records = [{"value": float(z)} for z in logits[:, 0]]
    else:
        probs = logits.softmax(-1)                                                # [N, C]
        records = [{"label": names[int(p.argmax())],
                    "probs": {n: round(float(x), 6) for n, x in zip(names, p)}} for p in probs]
    if out:
        lines = "".join(json.dumps(r) + "\n" for r in records)
        save_atomic(lines.encode(), out, what="the predictions")
        print(f"wrote {out}: {len(records)} predictions")
    else:
        print_predictions(records, texts)
    if has_labels:                                   # scored as its task (a converted model: tsv)
        preds = logits[:, 0] if regression else logits.argmax(-1)
        labels = [e.label for e in examples]
        scored_as = task.get("name") or "tsv"
        metrics = data.compute_metrics(scored_as, preds.numpy(), labels)
        print(f"{file}: {data.show_metrics(scored_as, metrics)}")
    return records

# The table predict prints without --out, under a header: the file's line, the answer (the label and
# its probability, or the value), the text's start.
def print_predictions(records, texts):
    answer = "value" if records and "value" in records[0] else "label p"
    print(f"{'line':>6}  {answer:<16}  text")
    for record, (where, text) in zip(records, texts):
        line = where.rsplit(":", 1)[-1]
        if "value" in record:
            answer = f"{record['value']:.4f}"
        else:
            answer = f"{record['label']} {record['probs'][record['label']]:.3f}"
        shown = text if len(text) <= 70 else text[:67] + "..."
        print(f"{line:>6}  {answer:<16}  {shown}")

# look (python model.py look CKPT TEXT): what the model attends to in one text, layer by layer.
# Each layer's input is caught on its way into Attention (stage 1 under HST), and the attention
# weights are computed again from it, as evaluation computes them, averaged over the H heads:
#     A = mean_h softmax(Q_h K_h^T / sqrt(d_h) + mask)                     [L, K]
# mask: -inf where the topology has no pair (sparse.dense_mask, sparse.hst_dense_mask, from the
# layer's own random draw) or the key is padding, so a key outside the layout has weight 0. Under
# HST the keys are [X; R]: R_j, block j's representative (methods.md §2.2).
# masked=True: the input of training's masked pass instead (see gnet_masked), as [(x, key_mask)].
def layer_inputs(model, ids, types, masked=False):
    caught = {}

    def catch(attn, args):                               # the first call of each layer: stage 1
        caught.setdefault(attn.layer_idx, (args[0], args[1]))

    hooks = [layer.attn.register_forward_pre_hook(catch) for layer in model.layers]
    if masked:
        for layer in model.layers:
            layer.attn.train()                           # the G-Nets' hooks, as in training
        torch.manual_seed(0)                             # the masked pass's random blocks
    try:
        with torch.no_grad():
            model.encode(ids, None, types, masked=masked)
    finally:
        model.eval()
        for hook in hooks:
            hook.remove()
    return [caught[i] for i in range(len(model.layers))]

# The pairs a layer may attend, bool [1, H, L, K]: the real keys (dense), or the block-sparse or HST
# layout written out densely, with the random blocks evaluation draws for this layer.
def layout_mask(model, layer, x, key_mask):
    cfg = model.cfg
    B, L, _ = x.shape
    if cfg.attention == "dense":
        real = torch.ones(B, L, dtype=torch.bool, device=x.device) if key_mask is None else key_mask
        return real[:, None, None, :].expand(B, cfg.num_heads, L, L)
    n = key_mask.size(1)                                 # the tokens, padded to blocks of b
    dense_mask = hst_dense_mask if cfg.attention == "hst" else block_dense_mask
    return dense_mask(n, key_mask, generator=layer.attn.eval_generator(),
                      num_heads=cfg.num_heads, batch_size=B, **pattern_of(cfg))

# One text's attention weights in a layer, [H, L, K], from the layer's input x [1, L, d], and the
# pairs allowed [H, L, K].
def attention_weights(model, layer, x, key_mask):
    H = model.cfg.num_heads
    L = x.size(1)
    q, k, _ = layer.attn.qkv(x).split(x.size(-1), dim=-1)
    q = q.view(1, L, H, -1).transpose(1, 2)                                       # [1, H, L, d_h]
    k = k.view(1, L, H, -1).transpose(1, 2)
    S = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))                           # [1, H, L, K]
    allowed = layout_mask(model, layer, x, key_mask)
    return S.masked_fill(~allowed, -math.inf).softmax(-1)[0], allowed[0]

# AttendOut's masks on the text (methods.md §3.1): M = [a c^T > 0] per pair, the pairs masked
# being those with M = 0 among the pairs the layer attends. The G-Nets read each layer's input as
# in training's masked pass, after the earlier layers' masks (read from the clean pass's input, a
# G-Net masks other pairs): layer_inputs(masked=True) runs the attention modules as in training
# (no dropout under AttendOut, random blocks drawn afresh), everything else as in evaluation. The
# pairs are counted over the layout evaluation attends (with random blocks, the masked pass drew
# its own).
# The pairs a layer's G-Net masks on its input x [1, L, d], bool [L, K]: M = 0 where allowed.
def gnet_masked(layer, x, allowed):
    a, c = layer.attn.drop.gnet.features(x)                                       # [1, 1, L, d]
    G = (a @ c.transpose(-1, -2))[0, 0]                                           # [L, K]
    return (G <= 0) & allowed.any(0)

# The keys one row attends to most, as ("word", 0.31) (pieces joined into their word, whose weight
# is the sum of its pieces'; a special token as <cls>, R_j as <rep j>): the top `top` of a row [K]
# (top=None: every key with a weight).
def top_keys(weights, words, word_of, top=3):
    n_words = len(words)
    totals = torch.zeros(n_words + weights.numel())
    for t, w in enumerate(word_of):
        totals[w] += weights[t]
    reps = weights[len(word_of):]                        # block padding's columns are 0 anyway
    names = [w if w.startswith("<") and w.endswith(">") else f'"{w}"' for w in words]
    names += [f"<rep {j}>" for j in range(reps.numel())]
    totals = torch.cat([totals[:n_words], reps])
    order = totals.argsort(descending=True)[:top]
    return [(names[i], float(totals[i])) for i in order if totals[i] > 0]

# python model.py look CKPT TEXT: a line per layer, the keys the first token attends to most (and,
# with AttendOut, the pairs its G-Net masks); --png draws the layers' maps (draw_maps). Returns
# what it shows, a dict per layer: "keys", every key of the first token's row by top_keys (the
# line shows the first 3), and with AttendOut "masked" and "pairs", the count and its total.
def look(path, text, png=None, device="cpu"):
    device = pick_device(device)
    model, tok, task = load_for_use(path, device)
    cfg = model.cfg
    max_len = min(task.get("max_len") or cfg.max_len, cfg.max_len)
    ids, words, word_of = tok.encode_words(text, max_len=max_len)
    L = len(ids)
    ids = torch.tensor([ids], device=device)                                      # [1, L]
    types = torch.zeros_like(ids)
    inputs = layer_inputs(model, ids, types)
    attendout_on = cfg.attn_dropout == "attendout"
    masked_inputs = layer_inputs(model, ids, types, masked=True) if attendout_on else None
    # the key columns shown: the L tokens, then (HST) the representatives of their blocks
    cols = list(range(L))
    if cfg.attention == "hst":
        n = inputs[0][1].size(1)                                                  # padded tokens
        cols += list(range(n, n + math.ceil(L / cfg.block_size)))
    layout = {"dense": "", "sparse": "; a key outside the block-sparse layout has weight 0",
              "hst": "; a key outside the layout has weight 0; <rep j>: block j's representative"}
    print(f"{path}, {L} tokens: the keys {words[0]} attends to most in each of the "
          f"{cfg.num_layers} layers, averaged over {cfg.num_heads} heads ({cfg.attention} attention"
          f"{layout[cfg.attention]})")
    if attendout_on:
        print("the G-Nets' masks: read from each layer's input in training's masked pass (after "
              "the earlier layers' masks), over the pairs the layer attends")
    maps = []
    shown = []
    for i, (layer, (x, key_mask)) in enumerate(zip(model.layers, inputs)):
        with torch.no_grad():
            A, allowed = attention_weights(model, layer, x, key_mask)             # [H, L', K]
        mean = A.mean(0)[:L][:, cols].float().cpu()                               # [L, keys]
        keys = top_keys(mean[0], words, word_of, top=None)                        # row 0: <cls>
        line = f"layer {i + 1}: " + ", ".join(f"{name} {w:.2f}" for name, w in keys[:3])
        masked = None
        shown.append({"keys": keys})
        if attendout_on:
            with torch.no_grad():
                masked = gnet_masked(layer, masked_inputs[i][0], allowed)[:L][:, cols].cpu()
            pairs = int(allowed.any(0)[:L][:, cols].sum())
            count = int(masked.sum())
            by_key = top_keys(masked.sum(0).float(), words, word_of)
            most = ", ".join(f"{name} {int(c)}" for name, c in by_key) or "none"
            line += (f" | G-Net masks {count} of {pairs} pairs ({100 * count / pairs:.0f}%), "
                     f"keys masked most (pairs): {most}")
            shown[-1].update(masked=count, pairs=pairs)
        print(line)
        maps.append((mean, masked))
    if png:
        labels = [tok.token_text(int(t)).strip() for t in ids[0]]
        labels += [f"<rep {j}>" for j in range(len(cols) - L)]
        draw_maps(maps, labels, png, f"{os.path.basename(path)}: {text}")
        print(f"wrote {png}")
    return shown

# The layers' maps A [L, keys] as one PNG (pillow): a panel per layer, rows the queries, columns the
# keys (their labels turned upright above), darker for more weight (scaled by the row's largest
# weight); AttendOut's masked pairs as red dots. Under the title, a legend line: the colour scale
# (0 to the row's largest weight) and, with AttendOut, what a red dot is. The text is pillow's own
# font at 12 px (at its default 10 px a space is 2 px wide, and a title's words run together).
def draw_maps(maps, labels, path, title, cell=14):
    from PIL import Image, ImageDraw, ImageFont         # pillow: required (requirements.txt)
    try:
        font = ImageFont.load_default(size=12)
    except TypeError:                                    # pillow < 10.1: its bitmap font
        font = ImageFont.load_default()
    L, K = maps[0][0].shape
    cell = max(10, min(cell, 420 // K))
    margin = 8 + int(max(font.getlength(s[:12]) for s in labels))    # the longest label
    width = margin + K * cell + 16
    height = 20 + margin + L * cell + 8
    per_row = min(3, len(maps))
    rows = math.ceil(len(maps) / per_row)
    header = 44                                          # the title, then the legend line
    scale = "1  the weight, as a share of its row's largest"
    dot = "a pair the layer's G-Net masks (AttendOut)"
    dots = any(masked is not None for _, masked in maps)
    dot_left = 140 + int(font.getlength(scale))
    legend_end = dot_left + 20 + int(font.getlength(dot)) if dots else dot_left
    image_width = max(per_row * width, 16 + int(font.getlength(title[:150])), legend_end)
    image = Image.new("RGB", (image_width, header + rows * height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((8, 4), title[:150], fill="black", font=font)
    # the legend: the colour of a weight as a share of its row's largest, 0 (white) to 1 (blue)
    draw.text((8, 24), "0", fill="black", font=font)
    for x in range(100):
        level = int(255 * (1 - x / 99))
        draw.line([(20 + x, 24), (20 + x, 36)], fill=(level, level, 255))
    draw.text((124, 24), scale, fill="black", font=font)
    if dots:
        draw.ellipse([dot_left, 26, dot_left + 8, 34], fill="red")
        draw.text((dot_left + 14, 24), dot, fill="black", font=font)
    for i, (A, masked) in enumerate(maps):
        left = (i % per_row) * width + margin
        top = header + (i // per_row) * height + 20 + margin
        corner = (left - margin + 4, top - margin - 16)
        draw.text(corner, f"layer {i + 1}", fill="black", font=font)
        for k in range(K):                               # a key's label, written, turned upright
            text = Image.new("RGB", (margin - 4, cell), "white")
            ImageDraw.Draw(text).text((0, 0), labels[k][:12], fill="black", font=font)
            image.paste(text.rotate(90, expand=True), (left + k * cell, top - margin + 2))
        shade = A / A.amax(-1, keepdim=True).clamp(min=1e-9)                      # [L, keys]
        for q in range(L):
            draw.text((left - margin + 4, top + q * cell), labels[q][:12], fill="black", font=font)
            for k in range(K):
                level = int(255 * (1 - float(shade[q, k])))
                box = [left + k * cell, top + q * cell, left + (k + 1) * cell - 1,
                       top + (q + 1) * cell - 1]
                draw.rectangle(box, fill=(level, level, 255))
                if masked is not None and masked[q, k]:
                    inset = cell // 4
                    dot = [box[0] + inset, box[1] + inset, box[2] - inset, box[3] - inset]
                    draw.ellipse(dot, fill="red")
    image.save(path, format="PNG")

# -----------------------------------------------------------------------------
# The command line: convert, export, info, predict, look. A bad file is one `error:` line (exit 2);
# an output is checked before any work (one of the command's inputs, a folder as the file, one that
# exists, no folder), so an old one stays.
def make_parser():
    what = "attnreg checkpoints: from and to transformers, and used (predict, look)"
    ap = ArgumentParser(description=what)
    commands = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    c = commands.add_parser("convert", help="an HF folder -> one .pt file")
    c.add_argument("src", metavar="HF_DIR", help="an HF model folder (roberta, xlm-roberta, bert)")
    c.add_argument("out", metavar="OUT", help="the .pt file to write")
    e = commands.add_parser("export", help="a checkpoint's inference weights (no G-Nets)")
    e.add_argument("src", metavar="CKPT", help="a .pt checkpoint (or an HF folder)")
    e.add_argument("out", metavar="OUT", help="the .pt file, or with --hf the folder, to write")
    e.add_argument("--hf", action="store_true",
                   help="OUT is a folder transformers' from_pretrained loads")
    i = commands.add_parser("info", help="a checkpoint's config, size and task")
    i.add_argument("src", metavar="CKPT", help="a .pt checkpoint or an HF folder")
    p = commands.add_parser("predict", help="classify (or score) every example of a file")
    p.add_argument("src", metavar="CKPT", help="a checkpoint train.py wrote (or export's .pt)")
    p.add_argument("file", metavar="FILE",
                   help="a file the checkpoint's task reads (.tsv, .csv, .jsonl in its columns; "
                        "labels optional), or plain text (any other file), one example a line")
    p.add_argument("--out", help="write one JSON line per example here, replacing the file if it "
                                 "exists, unless it is CKPT or FILE (default: a table on stdout)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="examples per batch (default: the run's --batch-size, else 32)")
    look_ = commands.add_parser("look", help="what the model attends to in one text")
    look_.add_argument("src", metavar="CKPT", help="a checkpoint train.py wrote, or an HF folder")
    look_.add_argument("text", metavar="TEXT", help="the text (one example of the task)")
    look_.add_argument("--png", help="also draw each layer's attention map into this PNG file "
                                     "(replaced if it exists, unless it is CKPT)")
    for sub in (c, e):
        sub.add_argument("--force", action="store_true", help="replace OUT if it exists")
    for sub in (p, look_):
        sub.add_argument("--device", default="auto",
                         help="auto (CUDA when present), cpu, cuda or cuda:N")
    return ap

# The command's flags; a number that means nothing is one error line naming its flag.
def parse_args(argv):
    args = make_parser().parse_args(argv)
    if getattr(args, "batch_size", None) is not None and args.batch_size < 1:
        data.fail(f"--batch-size {args.batch_size}: must be >= 1")
    return args

# No command writes over a file it reads: an output that is one of its inputs (compared as files,
# so ./a and a, or a link and its target, are one), or a file inside an input folder (an HF
# checkpoint's), is one error naming the flag and the file, before anything is read or written.
# inputs: (what it is, its path) pairs.
def check_not_input(out, flag, inputs):
    if not os.path.exists(out):
        return                                           # a new file is none of the inputs
    for what, path in inputs:
        same = os.path.exists(path) and os.path.samefile(out, path)
        inside = os.path.isdir(path) and os.path.samefile(os.path.dirname(os.path.realpath(out)),
                                                          path)
        if same or inside:
            where = "is" if same else "lies in"
            data.fail(f"{flag} {out}: {where} {what} {path}, which this command reads; give "
                      "another file to write")

# An output the command may write: not a folder (unless it writes one), not there already (unless
# --force: a checkpoint is precious; predictions and figures are replaced), in a folder that exists.
def check_output(out, force, folder=False):
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out) and not folder:
        data.fail(f"{out}: is a folder; give the file to write (e.g. {out}/x.pt)")
    if os.path.exists(out) and not force:
        data.fail(f"{out}: exists; pass --force to replace it")
    if not os.path.isdir(parent):
        data.fail(f"{out}: no folder {parent} to write into")

def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with one_line_errors():
        if args.cmd == "info":
            cfg, state, tok, raw = read_checkpoint(args.src)
            print(json.dumps(asdict(cfg), indent=1))
            millions = sum(t.numel() for t in state.values()) / 1e6
            print(f"{millions:.1f}M parameters, tokenizer {sorted(tok)}")
            print(f"task: {json.dumps(checkpoint_task(raw))}")
            return
        if args.cmd == "predict":
            if args.out:
                inputs = [("the checkpoint", args.src), ("the input file", args.file)]
                check_not_input(args.out, "--out", inputs)
                check_output(args.out, force=True)
            predict(args.src, args.file, args.out, args.batch_size, args.device)
            return
        if args.cmd == "look":
            if args.png:
                check_not_input(args.png, "--png", [("the checkpoint", args.src)])
                check_output(args.png, force=True)
            look(args.src, args.text, args.png, args.device)
            return
        check_not_input(args.out, "OUT", [("the checkpoint", args.src)])
        check_output(args.out, args.force, folder=getattr(args, "hf", False))
        model = export(args.src, args.out, getattr(args, "hf", False))
        c = model.cfg
        print(f"wrote {args.out}: {model.num_params() / 1e6:.1f}M parameters, {c.num_layers} "
              f"layers, d={c.hidden_size}, max length {c.max_len}, attn_dropout={c.attn_dropout}")

if __name__ == "__main__":
    main()
