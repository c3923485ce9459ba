"""
model.py: the encoder of attnreg (RoBERTa, XLM-R, BERT), its task heads, and its weights to and from
transformers.

What it is: one post-LayerNorm Transformer encoder in plain PyTorch, to be read beside
docs/methods.md §1. It loads HuggingFace checkpoints and gives the same numbers as transformers.
The idea: both methods this project teaches live inside self-attention. `Attention` is the one place
where the topology (dense, block-sparse, HST: sparse.py, methods.md §2) and the attention-dropout
method (standard, none, AttendOut, scheduled: attendout.py, methods.md §3) plug in; the rest is a
plain BERT. Top to bottom: Config, the attention kernel and Attention, Embeddings, FeedForward,
Layer, the heads, Model; then checkpoints (read, convert, build, save, export); then the CLI.

How to run it (an existing output is kept unless --force):
    python model.py convert HF_DIR OUT.pt        # an HF folder (config, weights, tokenizer) -> .pt
    python model.py export CKPT OUT.pt           # a trained run -> inference weights (no G-Nets)
    python model.py export CKPT OUT_DIR --hf     # ... -> a folder for transformers' from_pretrained
    python model.py info CKPT                    # the config and the parameter count
    >>> model.load_pretrained("OUT.pt", attention="sparse", max_positions=4096)   # a Model

How to test it:
    python -m pytest -q tests/test_model.py tests/test_export.py tests/test_fidelity.py
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

# -----------------------------------------------------------------------------
# Config: every knob of the model and of the methods, with its default, in one place. The encoder
# group is filled in by `python model.py convert` from the checkpoint's config.json (defaults:
# roberta-base); the rest train.py sets from the flag of the same name (--num-random: num_random).
@dataclass
class Config:
    # The encoder (methods.md §1): sizes, positions, LayerNorm, hidden dropout.
    vocab_size: int = 50265
    hidden_size: int = 768            # d
    num_layers: int = 12
    num_heads: int = 12               # H; one head has d_h = d / H
    intermediate_size: int = 3072     # the feed-forward's inner size
    max_positions: int = 514          # rows of the position table (RoBERTa: 512 + its offset 2)
    type_vocab_size: int = 1          # token types: 1 for RoBERTa / XLM-R, 2 for BERT
    pad_id: int = 1                   # the padding id (also RoBERTa's position offset)
    layer_norm_eps: float = 1e-5      # 1e-5 RoBERTa, 1e-12 BERT
    # "roberta": positions count only the real tokens; "bert": 0 .. L-1.
    position_style: str = "roberta"
    # "roberta" | "xlm-roberta" | "bert", set by convert; "": a model trained from scratch.
    family: str = ""
    # Dropout on the embeddings, on each residual branch and in the heads.
    hidden_dropout_p: float = 0.1

    # The task head. num_labels 0: none (MLM only); 1: regression (MSE); >= 2: classes.
    # head "cls": the first token; "pair": LRA retrieval's dual encoder; "span": extractive QA.
    num_labels: int = 0
    head: str = "cls"

    # The topology (methods.md §2, sparse.py): "dense" | "sparse" (BigBird) | "hst" (ERNIE).
    # Block-sparse and HST pad a sequence to a multiple of the block size b.
    attention: str = "dense"
    block_size: int = 64              # b
    window: int = 1                   # w: query block i sees key blocks i-w .. i+w
    num_global: int = 1               # g: the first g tokens see, and are seen by, every token
    num_random: int = 0               # r: random key blocks per query block (BigBird: 3)

    # Attention dropout (methods.md §3, attendout.py): one of attendout.METHODS. attn_dropout_p is
    # the standard rate; AttendOut has no attention dropout in either of its passes.
    attn_dropout: str = "standard"
    attn_dropout_p: float = 0.1
    # AttendOut's G-Net (methods.md §3.1): "shared" (one mask for all heads, d -> d) or
    # "per-head" (gnet_dim per head); the keep reward's weight is gnet_tau^2; the G-Nets' own
    # peak learning rate (None: the backbone's, as the author trains them).
    gnet_shape: str = "shared"
    gnet_dim: int = 16
    gnet_tau: float = 0.5
    gnet_lr: float | None = None
    # Scheduled dropout (methods.md §3.2): a droprates.jsonl or "linear:P_LOW:P_HIGH".
    schedule: str = ""
    # LayerDrop skips a whole layer, Attn.LayerDrop only its attention (methods.md §3.3, training).
    layerdrop: float = 0.0
    attn_layerdrop: float = 0.0

    # The longest input the position table allows: RoBERTa spends pad_id + 1 rows on its offset.
    @property
    def max_len(self):
        offset = self.pad_id + 1 if self.position_style == "roberta" else 0
        return self.max_positions - offset

# A value the model cannot run is refused before anything is built, with one error that names the
# field (= the train.py flag). METHODS is attendout.py's one list of attention-dropout methods,
# HEADS (below, beside Model) the one table of task heads.
def check_config(cfg):
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    choices_of = (("attention", ("dense", "sparse", "hst")), ("attn_dropout", METHODS),
                  ("head", HEADS), ("gnet_shape", ("shared", "per-head")))
    for name, choices in choices_of:
        value = getattr(cfg, name)
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(choices)}")
    # Probabilities of dropping: 1 would drop everything.
    for name in ("hidden_dropout_p", "attn_dropout_p", "layerdrop", "attn_layerdrop"):
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name} = {value} must be in [0, 1) ({flag})")

# -----------------------------------------------------------------------------
# Attention (methods.md §1 for the formula, §2 for the topologies, §3 for attention dropout).
#
# Dense attention is the textbook formula, with padding keys masked out:
#     S = Q K^T / sqrt(d_h)                    # [B, H, L, L]
#     A = softmax(S + mask),   out = A V       # [B, H, L, d_h]
# PyTorch's fused scaled_dot_product_attention computes it without storing A, and applies the
# standard attention dropout itself. AttendOut's masked pass (methods.md §3.1) must change the
# logits before the softmax, so it runs step by step: the G-Net's mask_fn turns S into
#     S' = S - 10000 (1 - M)
# on the real (query, key) pairs; then the padding keys leave the softmax. pair_scores(a, c) tells
# the G-Net how to score pairs in this kernel's layout: here the full a c^T (sparse.py: blocks).
def dense_attention(q, k, v, key_mask=None, dropout_p=0.0, mask_fn=None):
    """q, k, v [B, H, L, d_h], key_mask [B, L] bool (True: a real token) or None; mask_fn:
    AttendOut's hook on the logits, or None. Returns [B, H, L, d_h]."""
    if mask_fn is None:
        mask = None if key_mask is None else key_mask[:, None, None, :]           # [B, 1, 1, L]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    # AttendOut's masked pass, step by step. The logits first:
    S = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))                           # [B, H, L, L]
    # The real pairs: query and key both real tokens (all of them without a key mask).
    real_pairs = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    if key_mask is not None:
        real_pairs = key_mask[:, None, :, None] & key_mask[:, None, None, :]      # [B, 1, L, L]

    # G = a c^T over all pairs; the G-Net's mask enters the logits.
    def pair_scores(a, c):
        return a @ c.transpose(-1, -2)

    S = mask_fn(S, real_pairs, pair_scores)
    # Padding keys are masked whatever the G-Net says, then the softmax and A V.
    if key_mask is not None:
        S = S.masked_fill(~key_mask[:, None, None, :], torch.finfo(S.dtype).min)
    return S.softmax(dim=-1) @ v                                                  # [B, H, L, d_h]

# Multi-head self-attention, THE plug-in point of the project. One fused matmul gives
#     Q = x W_q,  K = x W_k,  V = x W_v        (qkv = [W_q | W_k | W_v])
# then a kernel chosen by the topology (dense here; block-sparse or HST stage 1 in sparse.py,
# methods.md §2.1, §2.2), then the heads side by side through W_o.
#
# The attention-dropout module (attendout.make_attn_dropout, methods.md §3) gives the Bernoulli
# rate the kernel drops attention at (0 in evaluation) and, for AttendOut, the hook whose mask_fn
# changes the logits of the masked pass (methods.md §3.1). The batch may stack several views
# (SAR's or R-Drop's copies, methods.md §2.3; AttendOut's masked copy is always the last); each
# view is attended separately, so each draws its own random blocks, and only the masked one gets
# the hook.
class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        # [W_q | W_k | W_v] fused: one matmul; then W_o.
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        # Standard / none / attendout / scheduled (attendout.py).
        self.drop = make_attn_dropout(cfg, layer_idx)
        # Training progress 0 .. 1, for scheduled dropout (Model.set_progress sets it).
        self.step_frac = 0.0

    # Random key blocks (methods.md §2.1) are drawn afresh on every training forward (generator
    # None: torch's global one). In evaluation each layer uses one fixed draw, from a generator
    # seeded by the layer index, so evaluation is deterministic.
    def eval_generator(self, device):
        fixed = not self.training and self.cfg.num_random > 0
        if not fixed:
            return None
        seed = 1_000_003 * (self.layer_idx + 1)
        return torch.Generator(device=device).manual_seed(seed)

    def forward(self, x, key_mask, kernel, views=1, masked=False):
        """x [B, L, d] (HST: L = n + m, tokens then representatives); key_mask [B, n] bool or None;
        kernel "dense" | "sparse" | "hst"; views: the stacked views (sar.py); masked: the last view
        is AttendOut's masked pass (training only). Returns [B, L, d]."""
        B, L, d = x.shape
        H = self.cfg.num_heads
        q, k, v = self.qkv(x).split(d, dim=-1)                                    # 3 x [B, L, d]
        q = q.view(B, L, H, -1).transpose(1, 2)                                   # [B, H, L, d_h]
        k = k.view(B, L, H, -1).transpose(1, 2)                                   # [B, H, L, d_h]
        v = v.view(B, L, H, -1).transpose(1, 2)                                   # [B, H, L, d_h]

        # The Bernoulli rate of attention dropout: the method's, and 0 in evaluation.
        p = self.drop.rate(self.step_frac) if self.training else 0.0
        masked = masked and self.training

        # The common case: dense attention and no masked pass, one fused call for all the rows.
        if kernel == "dense" and not masked:
            y = dense_attention(q, k, v, key_mask, p)                             # [B, H, L, d_h]
            return self.out(y.transpose(1, 2).reshape(B, L, d))

        # Otherwise view by view: each view its own random blocks, the last one (when masked)
        # AttendOut's masked pass with the G-Net's mask_fn.
        kernels = {"dense": dense_attention, "sparse": block_sparse_attention, "hst": hst_attention}
        attend = kernels[kernel]
        per_view = zip(split_views(x, views), split_views(q, views), split_views(k, views),
                       split_views(v, views), split_views(key_mask, views))
        ys = []
        for i, (xv, qv, kv, vv, mv) in enumerate(per_view):
            mask_fn = None
            if masked and i == views - 1:
                mask_fn = self.drop.hook(xv)
            if kernel == "dense":
                y = dense_attention(qv, kv, vv, mv, p, mask_fn)
            else:
                generator = self.eval_generator(x.device)
                y = attend(qv, kv, vv, mv, generator=generator, dropout_p=p, mask_fn=mask_fn,
                           flex=x.is_cuda, **pattern_of(self.cfg))
            ys.append(y)                                                          # [B', H, L, d_h]
        y = torch.cat(ys) if views > 1 else ys[0]
        # The heads side by side, then W_o.
        return self.out(y.transpose(1, 2).reshape(B, L, d))                      # [B, L, d]

# The stacked views of one batch, [views B, ...], as `views` tensors [B, ...]. A missing key mask
# (None) stays None for every view.
def split_views(t, views):
    return [None] * views if t is None else t.chunk(views)

# -----------------------------------------------------------------------------
# The rest of a layer (methods.md §1): embeddings, feed-forward, and the post-LN layer itself.
#
# A token's vector is the sum of three looked-up rows (word, position, token type), normalised,
# then dropped out:
#     E = Dropout(LN(word[ids] + pos[pos_ids] + type[type_ids]))     # [B, L, d]
# The position ids come from Model.position_ids (the RoBERTa or the BERT rule).
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

# The feed-forward network, the same for every token:
#     FFN(x) = W2 gelu(W1 x)        (the exact erf GELU, as BERT and RoBERTa)
class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)      # W1
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)    # W2

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))                             # [B, L, d]

# One post-LN layer (methods.md §1): attention and the feed-forward network, each wrapped in
# dropout, a residual connection and a LayerNorm after the sum:
#     x = LN1(x + Dropout(Attn(x)))
#     x = LN2(x + Dropout(FFN(x)))
# HST (methods.md §2.2) carries x = [X; R], the tokens and one representative per block. Stage 1
# is the attention call above, over [X; R]; stage 2 lets the representatives attend to each other
# densely, with the same weights and the same LN1:
#     R2 = LN1(R1 + Dropout(Attn(R1)))
# and the feed-forward runs on [X1; R2].
# Two baselines of methods.md §3.3 act here, in training only: LayerDrop skips the whole layer,
# Attn.LayerDrop only its attention sub-layer (x goes straight to the feed-forward).
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
        # LayerDrop: the input passes through unchanged.
        if self.training and cfg.layerdrop > 0 and torch.rand(()) < cfg.layerdrop:
            return x

        # Attn.LayerDrop: the attention sub-layer (both HST stages) is skipped.
        attention_dropped = (self.training and cfg.attn_layerdrop > 0
                             and torch.rand(()) < cfg.attn_layerdrop)
        if not attention_dropped:
            # x = LN1(x + Dropout(Attn(x))); under HST this is stage 1, over [X; R].
            x = self.ln1(x + self.drop(self.attn(x, key_mask, cfg.attention, views, masked)))
            if cfg.attention == "hst":
                # Stage 2: R2 = LN1(R1 + Dropout(Attn(R1))), dense over the m representatives.
                m = rep_mask.size(1)
                n = x.size(1) - m
                r = x[:, -m:]                                                     # R1: [B, m, d]
                r = self.ln1(r + self.drop(self.attn(r, rep_mask, "dense", views, masked)))
                x = torch.cat([x[:, :n], r], dim=1)                               # [X1; R2]

        # x = LN2(x + Dropout(FFN(x)))
        return self.ln2(x + self.drop(self.ffn(x)))

# -----------------------------------------------------------------------------
# The heads (methods.md §1): masked LM, classification / regression, LRA retrieval's pairs, QA
# spans. Each reads the last hidden states h [B, L, d].
#
# The masked-LM head, RoBERTa's and BERT's:
#     logits = decoder(LN(gelu(dense(h)))) + bias
# whose decoder weight is tied to the word embeddings (passed in, not stored twice).
class MLMHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, h, word_embeddings):
        x = self.ln(F.gelu(self.dense(h)))                                        # [B, L, d]
        return F.linear(x, word_embeddings, self.bias)                            # [B, L, vocab]

# The classification head reads the first token, RoBERTa style:
#     logits = out_proj(Dropout(tanh(dense(Dropout(h_0)))))
# For a BERT checkpoint, `dense` starts from BERT's pooler. One output is a regression (STS-B).
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

# LRA Retrieval's dual encoder (its classifier_head_dual, "NLI"): the batch holds the two documents
# of pair i in rows 2i and 2i + 1; each is read at its first token (u, v), and an MLP with hidden
# sizes FFN and FFN / 2 classifies
#     MLP([u, v, u * v, u - v])
class PairHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        m = cfg.intermediate_size
        self.mlp = nn.Sequential(
            nn.Dropout(cfg.hidden_dropout_p),
            nn.Linear(4 * d, m), nn.ReLU(),
            nn.Linear(m, m // 2), nn.ReLU(),
            nn.Linear(m // 2, cfg.num_labels),
        )

    def forward(self, h):                                                         # h: [2B, L, d]
        u = h[0::2, 0]                                                            # [B, d]
        v = h[1::2, 0]                                                            # [B, d]
        return self.mlp(torch.cat([u, v, u * v, u - v], dim=-1))                  # [B, C]

# Extractive QA (BERT's SQuAD head, readers/qa.py): a start and an end score for every token,
#     (s_i, e_i) = W h_i + b
class SpanHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.out = nn.Linear(cfg.hidden_size, 2)

    def forward(self, h):
        return self.out(h)                                                        # [B, L, 2]

# Config.head -> its class: the one table of task heads.
HEADS = {"cls": ClassifierHead, "pair": PairHead, "span": SpanHead}

# -----------------------------------------------------------------------------
# The model: embeddings, num_layers layers, the masked-LM head and (num_labels > 0) a task head.
# Under HST it also holds rep_embedding, a learned vector added to each block's mean; it starts at
# zero, so a converted checkpoint begins with plain mean pooling (methods.md §2.2).
class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        self.emb = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.mlm = MLMHead(cfg)
        # No task head (None): a masked-LM model only.
        self.cls = HEADS[cfg.head](cfg) if cfg.num_labels else None
        hst = cfg.attention == "hst"
        self.rep_embedding = nn.Parameter(torch.zeros(cfg.hidden_size)) if hst else None
        self.apply(self._init_weights)

    # BERT's initialisation (normal, std 0.02; biases 0; LayerNorm keeps its 1 and 0): a model from
    # scratch, or the new head of a converted checkpoint.
    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    # Position ids (methods.md §1). RoBERTa / XLM-R number only the real tokens:
    #     pos_ids = pad_id + cumsum(ids != pad_id) * (ids != pad_id)
    # so the first real token gets pad_id + 1 and a padding token pad_id wherever it stands (SAR,
    # methods.md §2.3, relies on it). BERT: 0, 1, ..., L-1.
    def position_ids(self, input_ids):
        if self.cfg.position_style == "roberta":
            real = (input_ids != self.cfg.pad_id).long()                          # [B, L]
            return torch.cumsum(real, dim=1) * real + self.cfg.pad_id             # [B, L]
        positions = torch.arange(input_ids.size(1), device=input_ids.device)      # [L]
        return positions.expand_as(input_ids)                                     # [B, L]

    # The forward pass up to the last hidden states. Sparse and HST pad the sequence (with masked
    # tokens) to a multiple of the block size; HST appends the block representatives, [X; R]; the
    # padding and R are cut off again at the end.
    def encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
               views=1, masked=False):
        """The last hidden states [B, L, d] of input_ids [B, L]. attention_mask: 1 for a real
        token; views: sar.py's stacked views; masked: the last view is AttendOut's masked pass."""
        c = self.cfg
        L = input_ids.size(1)
        # AttendOut: each layer's counts start afresh for this forward.
        if self.training:
            begin_forward(self)

        # The defaults: every token real, token type 0, the positions of the family's rule.
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        pos = self.position_ids(input_ids) if position_ids is None else position_ids

        # Our own positions stay below max_positions when L <= max_len, so only longer inputs and
        # given position ids are checked (the check is a device sync).
        if (position_ids is not None or L > c.max_len) and int(pos.max()) >= c.max_positions:
            raise ValueError(
                f"sequence of length {L} needs position {int(pos.max())}, the model has "
                f"{c.max_positions} (max length {c.max_len}): raise --max-positions "
                f"(copies the table) or truncate it")

        # Sparse / HST: pad n to a multiple of b; the padding is masked.
        extra = (-L) % c.block_size if c.attention != "dense" else 0
        pos_pad = c.pad_id if c.position_style == "roberta" else 0
        ids = F.pad(input_ids, (0, extra), value=c.pad_id)                        # [B, n]
        mask = F.pad(mask, (0, extra), value=0)                                   # [B, n]
        pos = F.pad(pos, (0, extra), value=pos_pad)                               # [B, n]
        types = F.pad(types, (0, extra), value=0)                                 # [B, n]

        x = self.emb(ids, pos, types)                                             # E: [B, n, d]
        # None: no padding key under dense attention, the fastest path.
        key_mask = None if c.attention == "dense" and bool(mask.all()) else mask.bool()   # [B, n]
        rep_mask = None
        if c.attention == "hst":
            x, rep_mask = self.add_representatives(x, key_mask)                   # [B, n + m, d]

        for layer in self.layers:
            x = layer(x, key_mask, rep_mask, views, masked)
        # Without the block padding and R.
        return x[:, :L]                                                           # [B, L, d]

    # HST's initial representatives (methods.md §2.2): each block's mean over its real tokens,
    # plus the learned rep_embedding,
    #     R_j = mean_{t in block j, t real} E_t + rep_embedding
    # A block made only of padding has no mean (its pooled part is 0) and is masked as a key.
    def add_representatives(self, x, key_mask):
        """x [B, n, d], key_mask [B, n] -> ([X; R] [B, n + m, d], R's key mask [B, m])."""
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

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                head="cls", views=1, masked=False):
        """The head's logits: classes / regression [B, C]; pair [B / 2, C]; span [B, L, 2].
        head="mlm": mlm_logits."""
        if head == "mlm":
            return self.mlm_logits(input_ids, attention_mask, token_type_ids, position_ids)
        if self.cls is None:
            raise ValueError(
                "this model has no task head (num_labels = 0); use mlm_logits or encode")
        h = self.encode(input_ids, attention_mask, token_type_ids, position_ids, views, masked)
        return self.cls(h)

    # How far training is (0 .. 1), for scheduled dropout (methods.md §3.2).
    def set_progress(self, step_frac):
        for layer in self.layers:
            layer.attn.step_frac = float(step_frac)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

# -----------------------------------------------------------------------------
# From and to transformers (methods.md §1; nanoGPT's from_pretrained).
#
# The whole mapping is this one table, read forwards by convert and backwards by export --hf.
# In a name, {p} is the backbone prefix ("roberta." for RoBERTa and XLM-R, "bert."), {i} a layer
# and {wb} "weight" or "bias". qkv.{wb}[s] is slot s of our fused qkv: query, key and value are
# concatenated on the output dimension. Our name "" marks a weight that only HF has (the tied
# decoder, BERT's next-sentence head, an unused pooler). A row with a family is only that
# family's; a row with "" is everyone's.
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
FAMILIES = {
    "roberta": ("roberta", "Roberta"),
    "xlm-roberta": ("roberta", "XLMRoberta"),
    "bert": ("bert", "Bert"),
}

# HF config.json key -> Config field, read both ways. The first six are required.
HF_CONFIG = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_positions", "type_vocab_size": "type_vocab_size",
    "pad_token_id": "pad_id", "layer_norm_eps": "layer_norm_eps",
    "hidden_dropout_prob": "hidden_dropout_p", "attention_probs_dropout_prob": "attn_dropout_p",
}

# What BERT changes in Config's defaults (which are RoBERTa's).
BERT_DEFAULTS = dict(type_vocab_size=2, pad_id=0, layer_norm_eps=1e-12, position_style="bert")

class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the offending weights."""

# HF_TABLE's rows for one family, with {p} replaced by `prefix`, as (HF name, our name, slot):
# slot is the qkv slot 0, 1, 2 of a query / key / value row, else None.
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

# Convert: HF weight names -> ours, reading HF_TABLE forwards, with query / key / value fused into
# W_qkv = [W_q; W_k; W_v]. A weight no row knows, or an incomplete qkv, is one error.
def convert_hf_state(hf_state, cfg, path):
    # Names are matched without the backbone prefix.
    rows = table(cfg.family, "")
    ours = {}
    qkv = {}
    unexpected = []
    for name, t in hf_state.items():
        # Old TF-made BERT files say gamma / beta for a LayerNorm's weight / bias.
        short = re.sub(r"^(roberta|bert)\.", "", name)
        short = short.replace(".gamma", ".weight").replace(".beta", ".bias")
        # The first row whose HF name matches.
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
            # Query / key / value: slot s of qkv, fused below.
            key = our_pattern.format(**groups)
            qkv.setdefault(key, [None] * 3)[slot] = t
        elif our_pattern:
            # (Our name "": HF's alone, not kept.)
            ours[our_pattern.format(**groups)] = t
    if unexpected:
        names = ", ".join(unexpected[:8])
        raise CheckpointError(f"{path}: unexpected weights not in the conversion table: {names}")
    for key, parts in qkv.items():
        if any(p is None for p in parts):
            raise CheckpointError(f"{path}: {key}: query/key/value incomplete in the checkpoint")
        ours[key] = torch.cat(parts, dim=0)                                       # [3d, d]
    # A BERT pooler without a classifier is no head of ours.
    if "cls.out_proj.weight" not in ours:
        ours = {k: v for k, v in ours.items() if not k.startswith("cls.dense.")}
    return ours

# A Config from an HF config.json: the family, the sizes, and what differs between families
# (methods.md §1: LayerNorm eps, the position style). Only GELU and absolute positions are ours.
def read_hf_config(path):
    # A missing or non-UTF-8 file: data.read_text raises one line naming it.
    try:
        hf = json.loads(data.read_text(path))
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
    # Config's defaults are RoBERTa's; BERT changes a few. A key the file gives wins.
    cfg = Config(family=family, **(BERT_DEFAULTS if family == "bert" else {}))
    for key, name in HF_CONFIG.items():
        if hf.get(key) is not None:
            setattr(cfg, name, hf[key])
    return cfg

# Load a weights file: .safetensors, or torch.load(weights_only=True). A pickle that carries code is
# refused, and never retried without weights_only.
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

# Any checkpoint, as (Config, state dict, tokenizer files, the raw dict): an HF folder (converted
# on the fly) or one of our .pt files. An HF folder's head decides num_labels and the head kind;
# its tokenizer files travel as uint8 tensors, so the file stays weights_only-safe. Config fields
# that a newer version deleted are dropped when an old file is read.
def read_checkpoint(path):
    if os.path.isdir(path):
        cfg = read_hf_config(os.path.join(path, "config.json"))
        weights = os.path.join(path, "model.safetensors")
        if not os.path.exists(weights):
            weights = os.path.join(path, "pytorch_model.bin")
        state = convert_hf_state(safe_load(weights), cfg, path)
        if "cls.out.weight" in state:
            # A QA model (qa_outputs): our span head.
            cfg.head = "span"
            cfg.num_labels = 2
        elif "cls.out_proj.weight" in state:
            # A classifier: as many labels as rows.
            cfg.num_labels = state["cls.out_proj.weight"].size(0)
        tokenizer_files = data.files_to_tensors(data.read_tokenizer_folder(path))
        return cfg, state, tokenizer_files, {}

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: neither an HF model folder nor a checkpoint file")
    ckpt = safe_load(path)
    is_ours = (isinstance(ckpt, dict)
               and ckpt.get("format") == "attnreg-v1"
               and isinstance(ckpt.get("config"), dict)
               and isinstance(ckpt.get("model"), dict))
    if not is_ours:
        raise CheckpointError(f"{path}: not an attnreg checkpoint "
                              f"(convert HF folders with `python model.py convert`)")
    known = {f.name for f in fields(Config)}
    cfg = Config(**{k: v for k, v in ckpt["config"].items() if k in known})
    tokenizer_files = ckpt.get("tokenizer", {}).get("files", {})
    return cfg, ckpt["model"], tokenizer_files, ckpt

# Longer inputs than the checkpoint (methods.md §1): a longer position table made by copying the
# learned rows again and again (Longformer's recipe). RoBERTa's offset rows stay in place.
def extend_positions(weight, new_rows, cfg):
    offset = cfg.pad_id + 1 if cfg.position_style == "roberta" else 0
    reps = math.ceil((new_rows - offset) / (weight.size(0) - offset))
    copies = weight[offset:].repeat(reps, 1)
    return torch.cat([weight[:offset], copies])[:new_rows].clone()                # [new_rows, d]

# A Model(cfg) holding `state`, or one error naming the missing, unexpected and misshapen weights.
# The position table is extended when cfg asks for more rows. A task head of another task or size
# starts fresh, and so do the parts a checkpoint need not have: the MLM head, a task head, HST's
# rep_embedding and AttendOut's G-Nets (trained here).
def build_model(cfg, state, path):
    state = dict(state)
    if "emb.pos.weight" in state and state["emb.pos.weight"].size(0) != cfg.max_positions:
        state["emb.pos.weight"] = extend_positions(state["emb.pos.weight"], cfg.max_positions, cfg)
    model = Model(cfg)
    expected = model.state_dict()
    # Drop a head of another task or size.
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
def checkpoint_dict(model, tokenizer_files, **extra):
    return {"format": "attnreg-v1", "config": asdict(model.cfg), "model": model.state_dict(),
            "tokenizer": {"files": dict(tokenizer_files)}, **extra}

# Write a file atomically: torch.save (bytes: as they are) to a temporary file, synced to disk, then
# renamed over `path` once complete. On failure the old file stays as it was and no temporary file
# is left; a full disk or a read-only folder is one error line.
def save_atomic(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if isinstance(obj, bytes):
                f.write(obj)
            else:
                torch.save(obj, f)
            f.flush()
            # On disk before the rename makes it the file.
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        # ENOSPC, a read-only folder; torch's "file write failed".
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        message = f"{path}: could not write the checkpoint ({why}; is the disk full?)"
        raise OSError(message) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

# Export (methods.md §1, "To and from transformers"): the inference weights of checkpoint src (an
# HF folder or a .pt) as one .pt file `out`; returns the Model. The G-Nets are dropped: an
# AttendOut model exports as standard dropout, whose eval forward is the same (methods.md §3.1).
# With hf=True, `out` is a folder that transformers' from_pretrained loads: HF_TABLE and HF_CONFIG
# read backwards, the checkpoint's own tokenizer files. What has no transformers counterpart is
# refused in one line before anything is written.
def export(src, out, hf=False):
    cfg, state, tok, _ = read_checkpoint(src)
    # The file alone must be enough: a tokenizer that works.
    try:
        data.tokenizer_from_files(data.tensors_to_files(tok))
    except data.DataError as e:
        raise CheckpointError(f"{src}: no usable tokenizer ({e})") from None
    if cfg.attn_dropout == "attendout":
        cfg.attn_dropout = "standard"

    # For transformers: the first reason it cannot be done, one line, before anything is written.
    if hf:
        hst = " (with its representatives' embedding)" if cfg.attention == "hst" else ""
        no_family = "no model family (trained from scratch, or converted before convert kept it)"
        reasons = [
            (cfg.family not in FAMILIES, no_family),
            (cfg.attention != "dense",
             f"{cfg.attention} attention{hst} has no transformers counterpart (only dense)"),
            (cfg.num_labels and cfg.head == "pair",
             "the pair head (LRA retrieval) has no transformers counterpart"),
            (not set(tok) & set(data.HF_TOKENIZER_FILES),
             f"its tokenizer {sorted(tok)} is not one transformers reads"),
        ]
        for bad, why in reasons:
            if bad:
                raise CheckpointError(f"{src}: {why}")

    model = build_model(cfg, export_without_gnet(state), src)
    if not hf:
        save_atomic(checkpoint_dict(model, tok), out)
        return model

    # Our weights under HF's names: HF_TABLE read backwards, W_qkv [3d, d] split into W_q, W_k,
    # W_v. A model with a task's classifier is saved without its MLM head.
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
            # W_qkv's slot: [d, d] or [d].
            weights[name] = t if slot is None else t.chunk(3)[slot].clone()

    # config.json: HF_CONFIG read backwards, and the class transformers builds.
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
        # One label: a regression (MSE), as BERT / RoBERTa read it.
        problem_type = "regression" if cfg.num_labels == 1 else "single_label_classification"
        config.update(id2label={i: f"LABEL_{i}" for i in range(cfg.num_labels)},
                      problem_type=problem_type)

    # The tokenizer files, the weights, and config.json last.
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
# The command line: convert, export, info. A bad file or checkpoint is one `error:` line (exit 2),
# and the output is checked before any work, so an existing output is kept.
def main(argv=None):
    what = "HF checkpoints (roberta, xlm-roberta, bert) to attnreg files, and back"
    ap = ArgumentParser(description=what)
    ap.add_argument("cmd", choices=["convert", "export", "info"],
                    help="convert HF OUT, export CKPT OUT, info CKPT")
    ap.add_argument("src", help="an HF folder or a .pt checkpoint")
    ap.add_argument("out", nargs="?", help="the file (.pt) or, with --hf, the folder to write")
    ap.add_argument("--hf", action="store_true",
                    help="export: OUT is a folder transformers' from_pretrained loads")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = ap.parse_args(argv)

    # info takes no OUT, the others need one; only export has --hf.
    if (args.out is None) != (args.cmd == "info") or (args.hf and args.cmd != "export"):
        usage = {"info": "CKPT", "convert": "HF_DIR OUT.pt"}.get(args.cmd, "CKPT OUT [--hf]")
        ap.error(f"usage: {args.cmd} " + usage)

    with one_line_errors():
        if args.cmd == "info":
            cfg, state, tok, _ = read_checkpoint(args.src)
            print(json.dumps(asdict(cfg), indent=1))
            millions = sum(t.numel() for t in state.values()) / 1e6
            print(f"{millions:.1f}M parameters, tokenizer {sorted(tok)}")
            return

        # Before any work: a folder given as the file, an existing output, no folder to write into.
        out = args.out
        parent = os.path.dirname(os.path.abspath(out))
        if os.path.isdir(out) and not args.hf:
            data.fail(f"{out}: is a folder; give the file to write (e.g. {out}/x.pt)")
        if os.path.exists(out) and not args.force:
            data.fail(f"{out}: exists; pass --force to replace it")
        if not os.path.isdir(parent):
            data.fail(f"{out}: no folder {parent} to write into")

        model = export(args.src, out, args.hf)
        c = model.cfg
        print(f"wrote {out}: {model.num_params() / 1e6:.1f}M parameters, {c.num_layers} layers, "
              f"d={c.hidden_size}, max length {c.max_len}, attn_dropout={c.attn_dropout}")

if __name__ == "__main__":
    main()
