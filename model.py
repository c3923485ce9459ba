"""model.py: the encoder (RoBERTa, XLM-R, BERT), its task heads, and its weights to and from transformers.

What it is: one post-LayerNorm Transformer encoder in plain PyTorch, to be read beside docs/methods.md §1.
The idea in three lines: both methods this project teaches live inside self-attention. `Attention` is the one
place where the topology (dense, block-sparse, HST: sparse.py, methods.md §2) and the attention-dropout method
(standard, none, AttendOut, scheduled: attendout.py, methods.md §3) plug in; the rest is a plain BERT.

How to run it (an existing output is kept unless --force):
    python model.py convert HF_DIR OUT.pt          # an HF folder (config, weights, tokenizer) -> one file
    python model.py export CKPT OUT.pt             # a trained run -> inference weights (no G-Nets, no optimizer)
    python model.py export CKPT OUT_DIR --hf       # ... -> a folder transformers' from_pretrained loads
    python model.py info CKPT                      # the config and the parameter count
    >>> model.load_pretrained("OUT.pt", attention="sparse", max_positions=4096)   # in Python: a Model
"""
import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save

import data
from attendout import METHODS, begin_forward, export_without_gnet, make_attn_dropout
from data import ArgumentParser, one_line_errors
from sparse import block_sparse_attention, hst_attention, pattern_of

# ---- Config: every knob of the model and of the methods, with its default, in one place
@dataclass
class Config:
    vocab_size: int = 50265           # the encoder: convert fills it in from config.json (defaults: roberta-base)
    hidden_size: int = 768            # d
    num_layers: int = 12
    num_heads: int = 12               # H; one head has d_h = d / H
    intermediate_size: int = 3072     # the feed-forward's inner size
    max_positions: int = 514          # rows of the position table (RoBERTa: 512 + its offset of 2)
    type_vocab_size: int = 1          # token types: 1 for RoBERTa / XLM-R, 2 for BERT
    pad_id: int = 1                   # the padding id (also RoBERTa's position offset, methods.md §1)
    layer_norm_eps: float = 1e-5      # 1e-5 RoBERTa, 1e-12 BERT
    position_style: str = "roberta"   # "roberta": positions skip padding; "bert": 0 .. L-1 (methods.md §1)
    family: str = ""                  # "roberta" | "xlm-roberta" | "bert", set by convert; "": from scratch
    hidden_dropout_p: float = 0.1     # dropout on the embeddings, each residual branch and the heads
    num_labels: int = 0               # the task head. 0: none (MLM only); 1: regression (MSE); >= 2: classes
    head: str = "cls"                 # "cls": first token; "pair": LRA retrieval's dual encoder; "span": QA
    attention: str = "dense"          # the topology (§2, sparse.py): "dense" | "sparse" (BigBird) | "hst" (ERNIE)
    block_size: int = 64              # b; sparse / hst pad a sequence to a multiple of b
    window: int = 1                   # w: query block i sees key blocks i-w .. i+w
    num_global: int = 1               # g: the first g tokens see, and are seen by, every token
    num_random: int = 0               # r: random key blocks per query block (BigBird: 3)
    attn_dropout: str = "standard"    # attention dropout (§3, attendout.py), one of attendout.METHODS
    attn_dropout_p: float = 0.1       # the standard rate (AttendOut: no attention dropout in either pass)
    gnet_shape: str = "shared"        # AttendOut's G-Net: "shared" (one mask for all heads, d -> d) | "per-head"
    gnet_dim: int = 16                # per-head: the G-Net's projection size per head
    gnet_tau: float = 0.5             # the keep reward's weight is tau^2 (methods.md §3.1)
    gnet_lr: float | None = None      # the G-Nets' own peak learning rate (None: the backbone's, as the author)
    schedule: str = ""                # scheduled dropout: a droprates.jsonl or "linear:P_LOW:P_HIGH"
    layerdrop: float = 0.0            # LayerDrop: skip a whole layer with this probability (training)
    attn_layerdrop: float = 0.0       # Attn.LayerDrop: skip only the attention sub-layer (training)

    @property
    def max_len(self):                # the longest input: RoBERTa spends pad_id + 1 rows on its offset
        return self.max_positions - (self.pad_id + 1 if self.position_style == "roberta" else 0)

def check_config(cfg):                # a value the model cannot run: one error naming the field (= train.py's flag)
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    for name, choices in (("attention", ("dense", "sparse", "hst")), ("attn_dropout", METHODS), ("head", HEADS),
                          ("gnet_shape", ("shared", "per-head"))):
        if getattr(cfg, name) not in choices:      # METHODS: the one list of attention-dropout methods
            raise ValueError(f"unknown {name} {getattr(cfg, name)!r}: choose one of {', '.join(choices)}")
    for name in ("hidden_dropout_p", "attn_dropout_p", "layerdrop", "attn_layerdrop"):
        if not 0.0 <= getattr(cfg, name) < 1.0:    # probabilities of dropping
            raise ValueError(f"{name} = {getattr(cfg, name)} must be in [0, 1) (--{name.replace('_', '-')})")

# ---- A layer's parts: attention (the fused kernel unless a hook needs the probabilities), embeddings, FFN
def dense_attention(q, k, v, key_mask=None, dropout_p=0.0, mask_fn=None):
    """softmax(Q K^T / sqrt(d_h) + mask) V (methods.md §1). q, k, v [B, H, L, d_h], key_mask [B, L] bool.
    Fused (SDPA) unless AttendOut's masked pass must change the logits: then step by step (§3.1)."""
    if mask_fn is None:
        mask = None if key_mask is None else key_mask[:, None, None, :]           # [B, 1, 1, L]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    # AttendOut's masked pass: S' = S - 10000 (1 - M) on the real pairs, padding keys leave the softmax.
    S = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))                           # [B, H, L, L]
    real_pairs = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)        # every pair is real
    if key_mask is not None:
        real_pairs = key_mask[:, None, :, None] & key_mask[:, None, None, :]      # [B, 1, L, L]
    S = mask_fn(S, real_pairs, lambda a, c: a @ c.transpose(-1, -2))               # the G-Net's mask
    if key_mask is not None:
        S = S.masked_fill(~key_mask[:, None, None, :], torch.finfo(S.dtype).min)
    return S.softmax(dim=-1) @ v                                                   # [B, H, L, d_h]

class Embeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.types = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.hidden_dropout_p)
    def forward(self, input_ids, position_ids, token_type_ids):   # E = Dropout(LN(word + pos + type)), methods.md §1
        return self.drop(self.ln(self.word(input_ids) + self.pos(position_ids) + self.types(token_type_ids)))

class Attention(nn.Module):
    """Multi-head self-attention, THE plug-in point: QKV, a kernel chosen by the topology (dense, sparse, HST
    stage 1), W_o. The kernel drops attention at the layer's rate (attendout.py), or, in AttendOut's masked
    pass (the last of `views`), lets the G-Net's mask_fn change its logits (methods.md §3.1)."""
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # [W_q | W_k | W_v] fused: one matmul
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)      # W_o
        self.drop = make_attn_dropout(cfg, layer_idx)                # standard / none / attendout / scheduled
        self.step_frac = 0.0                                         # training progress (scheduled dropout)

    def eval_generator(self, device):  # random blocks: fresh in training, in eval one fixed draw per layer (§2.1)
        fixed = not self.training and self.cfg.num_random > 0
        return torch.Generator(device=device).manual_seed(1_000_003 * (self.layer_idx + 1)) if fixed else None

    def forward(self, x, key_mask, kernel, views=1, masked=False):
        # x: [B, L, d] (HST: L = n + m); key_mask: [B, n] bool | None; views: the stacked views of sar.py,
        # the last one AttendOut's masked pass when masked (training only)
        B, L, d = x.shape                                                        # Q = x W_q, K = x W_k, V = x W_v:
        q, k, v = (t.view(B, L, self.cfg.num_heads, -1).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))
        p = self.drop.rate(self.step_frac) if self.training else 0.0             # Bernoulli rate (0 in eval)
        masked = masked and self.training
        if kernel == "dense" and not masked:                                     # one fused call for all rows
            return self.out(dense_attention(q, k, v, key_mask, p).transpose(1, 2).reshape(B, L, d))
        attend = {"dense": dense_attention, "sparse": block_sparse_attention, "hst": hst_attention}[kernel]
        ys = []                                                                  # views (§2.3), each with
        for i, (xv, qv, kv, vv, mv) in enumerate(zip(*(split_views(t, views) for t in (x, q, k, v, key_mask)))):
            mask_fn = self.drop.hook(xv) if masked and i == views - 1 else None  # AttendOut's masked pass
            if kernel == "dense":
                ys.append(dense_attention(qv, kv, vv, mv, p, mask_fn))
            else:                                                                # its own random blocks
                ys.append(attend(qv, kv, vv, mv, generator=self.eval_generator(x.device), dropout_p=p,
                                 mask_fn=mask_fn, flex=x.is_cuda, **pattern_of(self.cfg)))   # [B, H, L, d_h]
        y = torch.cat(ys) if views > 1 else ys[0]
        return self.out(y.transpose(1, 2).reshape(B, L, d))                      # heads side by side, W_o: [B, L, d]

def split_views(t, views):            # [views B, ...] -> views tensors [B, ...] (None: views Nones)
    return [None] * views if t is None else t.chunk(views)

class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)    # W1
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)  # W2
    def forward(self, x):
        return self.down(F.gelu(self.up(x)))                           # W2 gelu(W1 x), exact erf GELU: [B, L, d]

# ---- The layer: post-LN, with HST's second stage and LayerDrop
class Layer(nn.Module):
    """x = LN1(x + Drop(Attn(x))), x = LN2(x + Drop(FFN(x))) (methods.md §1). HST (§2.2): x is [X; R], tokens and
    block representatives; stage 1 attends over [X; R], stage 2 R over R with the same weights and LN1."""
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
        if self.training and cfg.layerdrop > 0 and torch.rand(()) < cfg.layerdrop:   # LayerDrop (methods.md §3.3)
            return x
        if not (self.training and cfg.attn_layerdrop > 0 and torch.rand(()) < cfg.attn_layerdrop):  # Attn.LayerDrop
            x = self.ln1(x + self.drop(self.attn(x, key_mask, cfg.attention, views, masked)))  # x = LN1(x + Drop(Attn(x)))
            if cfg.attention == "hst":                                                 # stage 2 (methods.md §2.2):
                n, r = x.size(1) - rep_mask.size(1), x[:, -rep_mask.size(1):]          # R1: [B, m, d]
                r = self.ln1(r + self.drop(self.attn(r, rep_mask, "dense", views, masked)))           # R2 = LN1(R1 + Drop(Attn(R1)))
                x = torch.cat([x[:, :n], r], dim=1)                                    # [X1; R2]
        return self.ln2(x + self.drop(self.ffn(x)))                                    # x = LN2(x + Drop(FFN(x)))

# ---- The heads: masked LM, classification / regression, LRA retrieval's pairs, QA spans
class MLMHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
    def forward(self, h, word_embeddings):    # decoder(LN(gelu(dense(h)))), decoder = the word embeddings (§1)
        return F.linear(self.ln(F.gelu(self.dense(h))), word_embeddings, self.bias)    # [B, L, vocab]

class ClassifierHead(nn.Module):              # RoBERTa's on the first token (§1); BERT's pooler is `dense`
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)
        self.drop = nn.Dropout(cfg.hidden_dropout_p)
    def forward(self, h):
        return self.out_proj(self.drop(torch.tanh(self.dense(self.drop(h[:, 0])))))  # W_o Drop(tanh(W Drop(h_0)))

class PairHead(nn.Module):                    # LRA Retrieval's dual encoder (classifier_head_dual, "NLI")
    def __init__(self, cfg):
        super().__init__()
        d, m = cfg.hidden_size, cfg.intermediate_size                           # hidden sizes FFN, FFN / 2 (LRA)
        self.mlp = nn.Sequential(nn.Dropout(cfg.hidden_dropout_p), nn.Linear(4 * d, m), nn.ReLU(),
                                 nn.Linear(m, m // 2), nn.ReLU(), nn.Linear(m // 2, cfg.num_labels))
    def forward(self, h):                                                          # h: [2B, L, d]
        u, v = h[0::2, 0], h[1::2, 0]                                              # pair i: rows 2i, 2i + 1: [B, d]
        return self.mlp(torch.cat([u, v, u * v, u - v], dim=-1))                   # MLP([u, v, u v, u - v]): [B, C]

class SpanHead(nn.Module):                    # extractive QA (BERT's SQuAD head, qa.py)
    def __init__(self, cfg):
        super().__init__()
        self.out = nn.Linear(cfg.hidden_size, 2)
    def forward(self, h):
        return self.out(h)                                                         # (s_i, e_i) = W h_i + b: [B, L, 2]

# ---- The model
HEADS = {"cls": ClassifierHead, "pair": PairHead, "span": SpanHead}                # Config.head -> its class
class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        self.emb = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.mlm = MLMHead(cfg)
        self.cls = HEADS[cfg.head](cfg) if cfg.num_labels else None                # none: MLM only
        # HST: a learned vector added to the mean-pooled block representatives, zero at start (methods.md §2.2)
        self.rep_embedding = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.attention == "hst" else None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):        # BERT's init (normal, std 0.02; LayerNorm 1, 0): from scratch, or a new head
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    def position_ids(self, input_ids):  # methods.md §1
        if self.cfg.position_style == "roberta":                                   # RoBERTa / XLM-R:
            real = (input_ids != self.cfg.pad_id).long()                           # [B, L]
            return torch.cumsum(real, dim=1) * real + self.cfg.pad_id              # pad_id + cumsum(real) * real
        return torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)   # BERT: 0 .. L-1

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, views=1, masked=False):
        # the last hidden states [B, L, d] of input_ids [B, L] (mask 1: a real token; views: sar.py's stacked
        # views; masked: the last view is AttendOut's masked pass, methods.md §3.1)
        c, L = self.cfg, input_ids.size(1)
        if self.training:                              # AttendOut: fresh counts for this forward
            begin_forward(self)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        pos = self.position_ids(input_ids) if position_ids is None else position_ids
        # ours stay below max_positions when L <= max_len: only longer inputs or given ids are checked (a sync)
        if (position_ids is not None or L > c.max_len) and int(pos.max()) >= c.max_positions:
            raise ValueError(f"sequence of length {L} needs position {int(pos.max())}, the model has {c.max_positions}"
                             f" (max length {c.max_len}): raise --max-positions (copies the table) or truncate it")
        extra = (-L) % c.block_size if c.attention != "dense" else 0  # sparse / HST: pad n to a multiple of b
        pad = lambda t, value: F.pad(t, (0, extra), value=value)
        ids, mask = pad(input_ids, c.pad_id), pad(mask, 0)                         # the padding is masked
        pos, types = pad(pos, c.pad_id if c.position_style == "roberta" else 0), pad(types, 0)
        x = self.emb(ids, pos, types)                                              # E: [B, n, d]
        key_mask = None if c.attention == "dense" and bool(mask.all()) else mask.bool()   # None: fastest path
        x, rep_mask = self.add_representatives(x, key_mask) if c.attention == "hst" else (x, None)   # HST: [X; R]
        for layer in self.layers:
            x = layer(x, key_mask, rep_mask, views, masked)
        return x[:, :L]                                                            # without block padding and R

    def add_representatives(self, x, key_mask):  # HST (methods.md §2.2) -> [X; R] and R's mask
        B, n, d = x.shape
        b = self.cfg.block_size
        w = key_mask.view(B, n // b, b, 1).to(x.dtype)                              # 1 = real token: [B, m, b, 1]
        count = w.sum(dim=2)                                                       # real tokens per block: [B, m, 1]
        r = (x.view(B, n // b, b, d) * w).sum(dim=2) / count.clamp(min=1)          # their mean: [B, m, d]
        return torch.cat([x, r + self.rep_embedding], dim=1), count.squeeze(-1) > 0   # R_j = mean + rep_embedding

    def mlm_logits(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        h = self.encode(input_ids, attention_mask, token_type_ids, position_ids)   # [B, L, d]
        return self.mlm(h, self.emb.word.weight)                                   # [B, L, vocab]

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, head="cls", views=1,
                masked=False):
        # the head's logits: classes / regression [B, C]; pair [B / 2, C]; span [B, L, 2]. head="mlm": mlm_logits
        if head == "mlm":
            return self.mlm_logits(input_ids, attention_mask, token_type_ids, position_ids)
        if self.cls is None:
            raise ValueError("this model has no task head (num_labels = 0); use mlm_logits or encode")
        return self.cls(self.encode(input_ids, attention_mask, token_type_ids, position_ids, views, masked))

    def set_progress(self, step_frac):  # how far training is (0 .. 1), for scheduled dropout
        for layer in self.layers:
            layer.attn.step_frac = float(step_frac)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

# ---- From and to transformers (nanoGPT's from_pretrained). The whole mapping is this one table, read forwards by
# convert and backwards by export --hf. {p}: the backbone prefix ("roberta." for RoBERTa and XLM-R, "bert."),
# {i}: a layer, {wb}: weight or bias; qkv[s]: cat(query, key, value) on the output dim. Our name "": HF's alone
# (tied decoder, NSP, an unused pooler). A row with a family is only that family's.
HF_TABLE = [  # (HF name, our name, family)
    ("{p}embeddings.word_embeddings.weight", "emb.word.weight", ""),
    ("{p}embeddings.position_embeddings.weight", "emb.pos.weight", ""),
    ("{p}embeddings.token_type_embeddings.weight", "emb.types.weight", ""),
    ("{p}embeddings.LayerNorm.{wb}", "emb.ln.{wb}", ""),
    ("{p}embeddings.position_ids", "", ""),                             # a buffer old checkpoints stored
    ("{p}encoder.layer.{i}.attention.self.query.{wb}", "layers.{i}.attn.qkv.{wb}[0]", ""),
    ("{p}encoder.layer.{i}.attention.self.key.{wb}", "layers.{i}.attn.qkv.{wb}[1]", ""),
    ("{p}encoder.layer.{i}.attention.self.value.{wb}", "layers.{i}.attn.qkv.{wb}[2]", ""),
    ("{p}encoder.layer.{i}.attention.output.dense.{wb}", "layers.{i}.attn.out.{wb}", ""),
    ("{p}encoder.layer.{i}.attention.output.LayerNorm.{wb}", "layers.{i}.ln1.{wb}", ""),
    ("{p}encoder.layer.{i}.intermediate.dense.{wb}", "layers.{i}.ffn.up.{wb}", ""),
    ("{p}encoder.layer.{i}.output.dense.{wb}", "layers.{i}.ffn.down.{wb}", ""),
    ("{p}encoder.layer.{i}.output.LayerNorm.{wb}", "layers.{i}.ln2.{wb}", ""),
    ("lm_head.dense.{wb}", "mlm.dense.{wb}", "roberta"),                # masked LM, RoBERTa / XLM-R
    ("lm_head.layer_norm.{wb}", "mlm.ln.{wb}", "roberta"),
    ("lm_head.bias", "mlm.bias", "roberta"),
    ("lm_head.decoder.{wb}", "", "roberta"),                            # tied: word embeddings, mlm.bias
    ("cls.predictions.transform.dense.{wb}", "mlm.dense.{wb}", "bert"),  # masked LM, BERT
    ("cls.predictions.transform.LayerNorm.{wb}", "mlm.ln.{wb}", "bert"),
    ("cls.predictions.bias", "mlm.bias", "bert"),
    ("cls.predictions.decoder.{wb}", "", "bert"),                       # tied
    ("cls.seq_relationship.{wb}", "", "bert"),                          # next-sentence prediction
    ("classifier.dense.{wb}", "cls.dense.{wb}", "roberta"),             # sequence classification, RoBERTa
    ("classifier.out_proj.{wb}", "cls.out_proj.{wb}", "roberta"),
    ("{p}pooler.dense.{wb}", "", "roberta"),                            # a pooler RoBERTa's heads never use
    ("{p}pooler.dense.{wb}", "cls.dense.{wb}", "bert"),                 # BERT: pooler + classifier
    ("classifier.{wb}", "cls.out_proj.{wb}", "bert"),
    ("qa_outputs.{wb}", "cls.out.{wb}", ""),                            # extractive QA: our span head
]
FAMILIES = {"roberta": ("roberta", "Roberta"), "xlm-roberta": ("roberta", "XLMRoberta"),  # family: (its table
            "bert": ("bert", "Bert")}                                                     # rows, class prefix)
HF_CONFIG = {  # HF config.json key -> Config field, both ways (the first six are required)
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_positions", "type_vocab_size": "type_vocab_size", "pad_token_id": "pad_id",
    "layer_norm_eps": "layer_norm_eps", "hidden_dropout_prob": "hidden_dropout_p",
    "attention_probs_dropout_prob": "attn_dropout_p"}
BERT_DEFAULTS = dict(type_vocab_size=2, pad_id=0, layer_norm_eps=1e-12, position_style="bert")  # RoBERTa: Config's

class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the offending weights."""

def table(family, prefix):            # HF_TABLE's rows of a family, prefix for {p}: (HF name, ours, qkv slot | None)
    return [(hf.replace("{p}", prefix), ours.split("[")[0], int(ours[-2]) if ours.endswith("]") else None)
            for hf, ours, fam in HF_TABLE if fam in ("", FAMILIES[family][0])]

def match(pattern, name):             # the {i} and {wb} that make `pattern` read `name` (a dict), or None
    m = re.fullmatch(pattern.replace(".", r"\.").format(i=r"(?P<i>\d+)", wb="(?P<wb>weight|bias)"), name)
    return m.groupdict() if m else None

def convert_hf_state(hf_state, cfg, path):    # HF names -> ours (HF_TABLE forwards, qkv fused), or one error
    rows, ours, qkv, unexpected = table(cfg.family, ""), {}, {}, []   # names matched without the backbone prefix
    for name, t in hf_state.items():               # (old TF-made BERT files say gamma / beta for weight / bias)
        short = re.sub(r"^(roberta|bert)\.", "", name).replace(".gamma", ".weight").replace(".beta", ".bias")
        hit = next(((o, s, g) for h, o, s in rows if (g := match(h, short)) is not None), None)
        if hit is None:
            unexpected.append(name)
        elif hit[1] is not None:                   # query / key / value: slot s of qkv
            qkv.setdefault(hit[0].format(**hit[2]), [None] * 3)[hit[1]] = t
        elif hit[0]:                               # (our name "": HF's alone, not kept)
            ours[hit[0].format(**hit[2])] = t
    if unexpected:
        raise CheckpointError(f"{path}: unexpected weights not in the conversion table: {', '.join(unexpected[:8])}")
    for key, parts in qkv.items():
        if any(p is None for p in parts):
            raise CheckpointError(f"{path}: {key}: query/key/value incomplete in the checkpoint")
        ours[key] = torch.cat(parts, dim=0)        # W_qkv = [W_q; W_k; W_v]: [3d, d]
    if "cls.out_proj.weight" not in ours:          # a BERT pooler without a classifier is no head of ours
        ours = {k: v for k, v in ours.items() if not k.startswith("cls.dense.")}
    return ours

def read_hf_config(path):             # Config from an HF config.json (methods.md §1: LN eps, position style)
    try:
        hf = json.loads(data.read_text(path))     # (a missing or non-UTF-8 file: one line naming it)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    family = hf.get("model_type") if isinstance(hf, dict) else None
    if family not in FAMILIES:
        raise CheckpointError(f"{path}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    if (hf.get("hidden_act", "gelu"), hf.get("position_embedding_type", "absolute")) != ("gelu", "absolute"):
        raise CheckpointError(f"{path}: only hidden_act 'gelu' and absolute position embeddings are supported")
    missing = [k for k in list(HF_CONFIG)[:6] if not isinstance(hf.get(k), int) or hf[k] < 1]
    if missing:
        raise CheckpointError(f"{path}: no positive integer {', '.join(missing)}")
    cfg = Config(family=family, **(BERT_DEFAULTS if family == "bert" else {}))
    for key, name in HF_CONFIG.items():
        setattr(cfg, name, hf[key] if hf.get(key) is not None else getattr(cfg, name))
    return cfg

def safe_load(path):                 # .safetensors, or torch.load(weights_only=True): a pickle with code is refused
    try:
        return load_file(path) if path.endswith(".safetensors") else torch.load(path, "cpu", weights_only=True)
    except Exception as e:                         # never retried without weights_only
        why = "refused to load: not a plain-tensor checkpoint" if "Weights only" in str(e) else "truncated or corrupt"
        raise CheckpointError(f"{path}: {why} ({(str(e) or type(e).__name__).splitlines()[0][:160]})") from None

def read_checkpoint(path):            # (Config, state dict, tokenizer files, raw dict) of an HF folder or a .pt
    if os.path.isdir(path):
        cfg, st = read_hf_config(os.path.join(path, "config.json")), os.path.join(path, "model.safetensors")
        state = convert_hf_state(safe_load(st if os.path.exists(st) else st[:-17] + "pytorch_model.bin"), cfg, path)
        if "cls.out.weight" in state:              # a QA model (qa_outputs): our span head
            cfg.head, cfg.num_labels = "span", 2
        elif "cls.out_proj.weight" in state:       # a classifier: as many labels as rows
            cfg.num_labels = state["cls.out_proj.weight"].size(0)
        return cfg, state, data.files_to_tensors(data.read_tokenizer_folder(path)), {}   # files as uint8 tensors
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: neither an HF model folder nor a checkpoint file")
    ckpt = safe_load(path)
    if not (isinstance(ckpt, dict) and ckpt.get("format") == "attnreg-v1" and isinstance(ckpt.get("config"), dict)
            and isinstance(ckpt.get("model"), dict)):
        raise CheckpointError(f"{path}: not an attnreg checkpoint (convert HF folders with `python model.py convert`)")
    cfg = Config(**{k: v for k, v in ckpt["config"].items() if k in {f.name for f in fields(Config)}})  # deleted: gone
    return cfg, ckpt["model"], ckpt.get("tokenizer", {}).get("files", {}), ckpt

def extend_positions(weight, new_rows, cfg):  # the learned rows copied again and again (methods.md §1, Longformer)
    offset = cfg.pad_id + 1 if cfg.position_style == "roberta" else 0   # RoBERTa's offset rows stay in place
    reps = math.ceil((new_rows - offset) / (weight.size(0) - offset))
    return torch.cat([weight[:offset], weight[offset:].repeat(reps, 1)])[:new_rows].clone()   # [new_rows, d]

def build_model(cfg, state, path):    # Model(cfg) holding state, or one error naming the missing / unexpected ones
    state = dict(state)
    if "emb.pos.weight" in state and state["emb.pos.weight"].size(0) != cfg.max_positions:
        state["emb.pos.weight"] = extend_positions(state["emb.pos.weight"], cfg.max_positions, cfg)
    expected = (model := Model(cfg)).state_dict()
    state = {k: v for k, v in state.items()        # a head of another task or size starts fresh
             if not k.startswith("cls.") or (k in expected and expected[k].shape == v.shape)}
    fresh = lambda k: k.startswith(("mlm.", "cls.", "rep_embedding")) or ".attn.drop." in k   # G-Nets: trained here
    problems = [f"{what}: {', '.join(names[:8])}" for what, names in (
        ("missing weights", [k for k in expected if k not in state and not fresh(k)]),
        ("unexpected weights", [k for k in state if k not in expected and ".attn.drop." not in k]),
        ("wrong shapes", [f"{k} {tuple(v.shape)} != {tuple(expected[k].shape)}" for k, v in state.items()
                          if k in expected and v.shape != expected[k].shape])) if names]
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    return model

def apply_overrides(cfg, overrides):  # a copy of cfg with some fields replaced
    names = sorted(f.name for f in fields(Config))
    if set(overrides) - set(names):
        raise ValueError(f"unknown Config field(s) {', '.join(sorted(set(overrides) - set(names)))}; "
                         f"valid fields: {', '.join(names)}")
    return Config(**{**asdict(cfg), **overrides})

def load_pretrained(path, **overrides):  # a Model of an HF folder or a .pt, overrides: Config fields (methods.md §1)
    cfg, state, _, _ = read_checkpoint(path)
    return build_model(apply_overrides(cfg, overrides), state, path)

def checkpoint_dict(model, tokenizer_files, **extra):   # the one file format: plain tensors, weights_only-safe
    return {"format": "attnreg-v1", "config": asdict(model.cfg), "model": model.state_dict(),
            "tokenizer": {"files": dict(tokenizer_files)}, **extra}

def save_atomic(obj, path):           # torch.save (bytes: as they are) to a temporary file, renamed once complete
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(obj) if isinstance(obj, bytes) else torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())                   # on disk before the rename makes it the file
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:           # ENOSPC, a read-only folder; torch's "file write failed"
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise OSError(f"{path}: could not write the checkpoint ({why}; is the disk full?)") from None
    finally:                                       # the old file stays as it was; no temporary file is left
        if os.path.exists(tmp):
            os.remove(tmp)

def export(src, out, hf=False):
    """Inference weights (no G-Nets: AttendOut exports as standard dropout, the same eval forward, methods.md §3.1)
    of any checkpoint (convert: an HF folder's); hf: a folder for transformers, HF_TABLE read backwards."""
    cfg, state, tok, _ = read_checkpoint(src)
    try:                                           # the file alone must be enough: a tokenizer that works
        data.tokenizer_from_files(data.tensors_to_files(tok))
    except data.DataError as e:
        raise CheckpointError(f"{src}: no usable tokenizer ({e})") from None
    cfg.attn_dropout = "standard" if cfg.attn_dropout == "attendout" else cfg.attn_dropout
    hst = " (with its representatives' embedding)" if cfg.attention == "hst" else ""
    no = [(cfg.family not in FAMILIES, "no model family (trained from scratch, or converted before convert kept it)"),
          (cfg.attention != "dense", f"{cfg.attention} attention{hst} has no transformers counterpart (only dense)"),
          (cfg.num_labels and cfg.head == "pair", "the pair head (LRA retrieval) has no transformers counterpart"),
          (not set(tok) & set(data.HF_TOKENIZER_FILES), f"its tokenizer {sorted(tok)} is not one transformers reads")]
    for why in [why for bad, why in no if bad and hf][:1]:        # one line, before anything is written
        raise CheckpointError(f"{src}: {why}")
    model = build_model(cfg, export_without_gnet(state), src)
    if not hf:
        save_atomic(checkpoint_dict(model, tok), out)
        return model
    rows, weights = [r for r in table(cfg.family, FAMILIES[cfg.family][0] + ".") if r[1]], {}
    for key, t in model.state_dict().items():
        hits = [(h.format(**g), s) for h, ours, s in rows if (g := match(ours, key)) is not None]
        if not hits:
            raise CheckpointError(f"{key}: no row of model.HF_TABLE maps it to transformers")
        for name, s in hits if not (model.cls and key.startswith("mlm.")) else ():  # a task's class: no MLM head
            weights[name] = t if s is None else t.chunk(3)[s].clone()         # W_qkv [3d, d] -> W_q, W_k, W_v
    kind = {"span": "QuestionAnswering"}.get(cfg.head, "SequenceClassification") if cfg.num_labels else "MaskedLM"
    config = {key: getattr(cfg, name) for key, name in HF_CONFIG.items()}   # HF_CONFIG read backwards
    config.update(model_type=cfg.family, architectures=[f"{FAMILIES[cfg.family][1]}For{kind}"], hidden_act="gelu")
    if kind == "SequenceClassification":           # 1 label: regression (MSE), as BERT / RoBERTa read it
        config.update(id2label={i: f"LABEL_{i}" for i in range(cfg.num_labels)},
                      problem_type="regression" if cfg.num_labels == 1 else "single_label_classification")
    os.makedirs(out, exist_ok=True)
    for name, content in [*data.tensors_to_files(tok).items(), ("model.safetensors", save(weights, {"format": "pt"})),
                          ("config.json", json.dumps(config, indent=2).encode())]:    # config.json last
        save_atomic(content, os.path.join(out, name))
    return model
convert = export                      # convert HF_DIR OUT.pt: the export of an HF folder

def main(argv=None):
    ap = ArgumentParser(description="HF checkpoints (roberta, xlm-roberta, bert) to attnreg files, and back")
    ap.add_argument("cmd", choices=["convert", "export", "info"], help="convert HF OUT, export CKPT OUT, info CKPT")
    ap.add_argument("src", help="an HF folder or a .pt checkpoint")
    ap.add_argument("out", nargs="?", help="the file (.pt) or, with --hf, the folder to write")
    ap.add_argument("--hf", action="store_true", help="export: OUT is a folder transformers' from_pretrained loads")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = ap.parse_args(argv)
    if (args.out is None) != (args.cmd == "info") or (args.hf and args.cmd != "export"):
        ap.error(f"usage: {args.cmd} " + {"info": "CKPT", "convert": "HF_DIR OUT.pt"}.get(args.cmd, "CKPT OUT [--hf]"))
    with one_line_errors():                        # a bad file or checkpoint: one `error:` line, exit 2
        if args.cmd == "info":
            cfg, state, tok, _ = read_checkpoint(args.src)
            print(json.dumps(asdict(cfg), indent=1))
            return print(f"{sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters, tokenizer {sorted(tok)}")
        out, parent, hf = args.out, os.path.dirname(os.path.abspath(args.out)), args.hf
        for bad, why in ((os.path.isdir(out) and not hf, f"is a folder; give the file to write (e.g. {out}/x.pt)"),
                         (os.path.exists(out) and not args.force, "exists; pass --force to replace it"),
                         (not os.path.isdir(parent), f"no folder {parent} to write into")):
            if bad:                                # before any work: an existing output is kept
                data.fail(f"{out}: {why}")
        model = export(args.src, out, hf)
        print(f"wrote {out}: {model.num_params() / 1e6:.1f}M parameters, {model.cfg.num_layers} layers, "
              f"d={model.cfg.hidden_size}, max length {model.cfg.max_len}, attn_dropout={model.cfg.attn_dropout}")

if __name__ == "__main__":
    main()
