"""model.py: a RoBERTa-family Transformer encoder, its heads, and checkpoint conversion.

What it is: one post-LayerNorm encoder (RoBERTa, XLM-R and BERT compute the same thing up to position ids
and token types), a masked-LM head and a sequence-classification / regression head, written from raw
PyTorch so that every line can be read against methods.md §1.

The idea in three lines: the two methods this project teaches both live inside self-attention. The
attention sub-layer below (`Attention`) is the one place where the *topology* (dense, block-sparse, HST;
sparse.py) and the *attention-dropout method* (standard, none, AttendOut, scheduled; attendout.py) plug in.

How to run it:
    python model.py convert HF_DIR OUT.pt        # HF folder (config.json + weights + tokenizer) -> one file
    (convert / export keep an existing OUT.pt unless --force)
    python model.py info OUT.pt                   # print the config and parameter count
    >>> from model import load_pretrained
    >>> model = load_pretrained("OUT.pt", attention="sparse", max_positions=4096)
"""
import signal
import sys

if __name__ == "__main__":      # Ctrl-C while torch loads: exit 130 without a traceback (main takes over after)
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import json
import math
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import data
from attendout import attendout_modules, make_attn_dropout
from cli import ArgumentParser, one_line_errors
from sparse import block_sparse_attention, hst_attention, pattern_of


# -----------------------------------------------------------------------------
# Config: every knob of the model and of the methods, with its default, in one place.

@dataclass
class Config:
    # --- the encoder (filled from the checkpoint's config.json when converting) ---
    vocab_size: int = 50265
    hidden_size: int = 768            # d
    num_layers: int = 12
    num_heads: int = 12               # H; d_h = d / H
    intermediate_size: int = 3072     # FFN inner size
    max_positions: int = 514          # rows of the position table (RoBERTa: 512 + pad offset of 2)
    type_vocab_size: int = 1          # 1 for RoBERTa / XLM-R, 2 for BERT
    pad_id: int = 1                   # padding token id (also the RoBERTa position offset, methods.md §1)
    layer_norm_eps: float = 1e-5      # 1e-5 RoBERTa, 1e-12 BERT
    position_style: str = "roberta"   # "roberta": positions skip padding; "bert": 0 .. L-1
    hidden_dropout_p: float = 0.1     # dropout on embeddings and on each residual branch
    attn_dropout_p: float = 0.1       # attention-probability dropout rate p0 (standard method, G-Net init)
    # --- heads ---
    num_labels: int = 0               # 0: no classifier; 1: regression (MSE); >= 2: classification
    classifier_dropout_p: float = -1.0  # < 0: use hidden_dropout_p (as HF does for classifier_dropout=None)
    head: str = "cls"                 # "cls": first token; "pair": LRA retrieval's dual encoder; "span": QA start/end
    # --- attention topology (methods.md §2; sparse.py) ---
    attention: str = "dense"          # "dense" | "sparse" (BigBird-style) | "hst" (ERNIE-Sparse)
    block_size: int = 64              # b; sequences are padded to a multiple of b under sparse / hst
    window: int = 1                   # w: query block i sees key blocks i-w .. i+w
    num_global: int = 1               # g: the first g tokens attend to, and are attended by, everything
    num_random: int = 0               # r: random key blocks per query block (BigBird uses 3)
    flex_attention: bool = True       # sparse / hst with no attention dropout, on CUDA: FlexAttention (False: gather)
    # --- attention dropout method (methods.md §3; attendout.py) ---
    attn_dropout: str = "standard"    # "standard" | "none" | "attendout" | "scheduled"
    gnet_dim: int = 16                # d_g, G-Net projection size per head
    gnet_tau: float = 0.5             # temperature of the relaxed Bernoulli
    gnet_budget: float | None = None  # rho, the mean drop rate the G-Nets are held at; None: attn_dropout_p
    gnet_lr: float = 3e-3             # the G-Nets' own peak learning rate (AdamW, no decay, same schedule; 0: frozen)
    gnet_mask: str = "capped"         # how the keep mask is applied (attendout.apply_keep_mask, methods.md §3.1):
                                      # "capped" | "logit" | "rowscale" | "inverted" (README's ablation)
    gnet_max_pi: float = 0.5          # "capped": no pair's drop probability exceeds this (rescale <= 1/(1 - it))
    gnet_reverse: bool = True         # gradient reversal: the G-Net maximises the task loss (False: cooperative)
    gnet_budget_scope: str = "mean"   # "mean": the mean rate over layers is held at rho; "layer": every layer's
                                      # own rate is (methods.md §3.1 budget)
    schedule: str = ""                # scheduled dropout: a droprates.jsonl FILE or "linear:P_LOW:P_HIGH"
    layerdrop: float = 0.0            # LayerDrop: skip a whole layer with this probability (training)
    attn_layerdrop: float = 0.0       # Attn.LayerDrop: skip only the attention sub-layer (training)
    # --- compute (the same numbers, a different speed) ---
    ffn_chunk: int = 0                # run the feed-forward on this many positions at a time (0: all at once);
                                      # on long inputs keeps its [chunk, FFN] activations in cache (CPU)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_heads

    @property
    def max_len(self):
        """Longest sequence the position table allows (RoBERTa spends pad_id + 1 rows on its offset)."""
        offset = self.pad_id + 1 if self.position_style == "roberta" else 0
        return self.max_positions - offset


ATTENTIONS = ("dense", "sparse", "hst")


def check_config(cfg):
    """Fail early, naming the field (and so the train.py flag), on values the model cannot run."""
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    if cfg.attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {cfg.attention!r} (--attention): choose one of {', '.join(ATTENTIONS)}")
    if cfg.position_style not in ("roberta", "bert"):
        raise ValueError(f"unknown position_style {cfg.position_style!r}: 'roberta' or 'bert'")
    for name in ("hidden_dropout_p", "attn_dropout_p", "layerdrop", "attn_layerdrop"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ValueError(f"{name} = {getattr(cfg, name)} must be in [0, 1) (--{name.replace('_', '-')})")
    if cfg.head not in ("cls", "pair", "span"):
        raise ValueError(f"unknown head {cfg.head!r}: 'cls', 'pair' or 'span'")
    if cfg.ffn_chunk < 0:
        raise ValueError(f"ffn_chunk = {cfg.ffn_chunk} must be >= 0 (--ffn-chunk; 0 = no chunking)")
    if cfg.block_size < 1 or cfg.window < 0 or cfg.num_global < 0 or cfg.num_random < 0:
        raise ValueError("block_size must be >= 1 and window, num_global, num_random >= 0")


# -----------------------------------------------------------------------------
# Dense attention: the textbook formula, or PyTorch's fused kernel when nothing needs the probabilities.

def dense_attention(q, k, v, key_mask=None, dropout_p=0.0, drop_fn=None):
    """softmax(Q K^T / sqrt(d_h) + mask) V  (methods.md §1). q, k, v: [B, H, L, d_h]; key_mask: [B, L] bool or None.

    Fast path: `scaled_dot_product_attention` (fused; applies plain Bernoulli dropout_p itself).
    Explicit path, used when a dropout hook (AttendOut's G-Net) must see the probability matrix A."""
    if drop_fn is None:
        mask = None if key_mask is None else key_mask[:, None, None, :]           # [B, 1, 1, L]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))                       # [B, H, L, L]
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        real_pairs = key_mask[:, None, :, None] & key_mask[:, None, None, :]       # [B, 1, L, L]
    else:
        real_pairs = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    A = scores.softmax(dim=-1)                                                     # [B, H, L, L]
    # G-Net's mask (methods.md §3.1); real_pairs tells it which pairs count for its drop-rate statistics
    A = drop_fn(A, real_pairs, lambda a, c: a @ c.transpose(-1, -2))
    return A @ v                                                                   # [B, H, L, d_h]


# -----------------------------------------------------------------------------
# The encoder.

class Embeddings(nn.Module):
    """E = LN(word[ids] + pos[pos_ids] + type[type_ids]), then dropout (methods.md §1)."""

    def __init__(self, cfg):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.types = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.hidden_dropout_p)

    def forward(self, input_ids, position_ids, token_type_ids):
        x = self.word(input_ids) + self.pos(position_ids) + self.types(token_type_ids)  # [B, L, d]
        return self.drop(self.ln(x))


class Attention(nn.Module):
    """Multi-head self-attention: THE plug-in point of the project.

    One fused QKV projection, then a *kernel* chosen by the topology (dense / block-sparse / HST stage 1),
    then the output projection. Every kernel drops attention probabilities through one hook: the layer's
    attention-dropout module (attendout.py) either gives a plain Bernoulli rate, or (AttendOut while
    training) a function drop_fn(A, valid, pair_scores) that the kernel applies to A in its own layout."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # W_q | W_k | W_v fused: one matmul
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)      # W_o
        self.drop = make_attn_dropout(cfg, layer_idx)                # standard / none / attendout / scheduled
        self.step_frac = 0.0                                         # training progress, for scheduled dropout
        self.eval_draw = 0                                           # which eval draw of random blocks (Model.set_eval_draw)

    def dropout_plan(self, x):
        """(plain Bernoulli rate, drop_fn) for this forward: nothing in eval, G-Net's hook for AttendOut."""
        if not self.training:
            return 0.0, None
        if self.drop.needs_hook:
            return 0.0, self.drop.hook(x)
        return self.drop.rate(self.step_frac), None

    def eval_generator(self, device):
        """Random blocks are drawn afresh in training; in eval from a fixed seed per (layer, eval_draw) (methods.md
        §2.1): draw 0 is the model's own topology, draws 1, 2, ... other ones (train.py --eval-redraw)."""
        if self.training or self.cfg.num_random == 0:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(1_000_003 * (self.layer_idx + 1) + 1_000_000_007 * self.eval_draw)   # distinct per (layer, draw)
        return g

    def forward(self, x, key_mask, kernel, views=1):
        # x: [B, L, d] (for HST, L = n tokens + m representatives); key_mask: [B, n] bool or None
        # views: the batch holds this many views of one batch, stacked (SAR / R-Drop: 2); each gets its own
        # sparse-kernel call below, and so its own random blocks (methods.md §2.3: the shifted view re-draws them)
        B, L, d = x.shape
        H, dh = self.cfg.num_heads, self.cfg.head_dim
        # split, not one permute of [B, L, 3, H, d_h]: the backward is then one cat of the three gradients
        # (a permute's backward would stack and then copy them again)
        q, k, v = (t.view(B, L, H, dh).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))  # 3 x [B, H, L, d_h]
        if kernel == "dense":
            y = dense_attention(q, k, v, key_mask, *self.dropout_plan(x))
        else:
            sparse_kernel = block_sparse_attention if kernel == "sparse" else hst_attention
            c = self.cfg
            ys = []
            masks = key_mask.chunk(views) if key_mask is not None else [None] * views
            for xv, qv, kv, vv, mv in zip(x.chunk(views), q.chunk(views), k.chunk(views), v.chunk(views), masks):
                p, drop_fn = self.dropout_plan(xv)
                ys.append(sparse_kernel(qv, kv, vv, mv, generator=self.eval_generator(x.device), dropout_p=p,
                                        drop_fn=drop_fn, flex=c.flex_attention and x.is_cuda,
                                        **pattern_of(c)))           # block_size, window, num_global, ...
            y = torch.cat(ys) if views > 1 else ys[0]                          # [B, H, L, d_h]
        y = y.transpose(1, 2).reshape(B, L, d)                                 # [B, L, d]
        return self.out(y)


class FeedForward(nn.Module):
    """W2 gelu(W1 x), exact (erf) GELU (methods.md §1). Position-wise, so it can run on a chunk of positions at a
    time (cfg.ffn_chunk, HF's chunk_size_feed_forward) with the same result."""

    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)    # W1
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)  # W2
        self.chunk = cfg.ffn_chunk

    def forward(self, x):                                              # x: [B, L, d]
        if 0 < self.chunk < x.size(1):
            return torch.cat([self.down(F.gelu(self.up(c))) for c in x.split(self.chunk, dim=1)], dim=1)
        return self.down(F.gelu(self.up(x)))


class Layer(nn.Module):
    """Post-LN layer: x = LN1(x + Drop(Attn(x))), x = LN2(x + Drop(FFN(x)))  (methods.md §1).

    Under HST (methods.md §2.2, reconstructed) x holds [X; R] (tokens then one representative per block):
    stage 1 is the attention call over [X; R]; stage 2 lets R attend to all of R with the *same* attention
    weights and the same LN1; the feed-forward is shared by both."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, layer_idx)
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.hidden_dropout_p)

    def forward(self, x, key_mask, rep_mask=None, views=1):
        cfg = self.cfg
        # LayerDrop (methods.md §3.3): skip the whole layer; Attn.LayerDrop: skip only its attention branch.
        if self.training and cfg.layerdrop > 0 and torch.rand(()) < cfg.layerdrop:
            return x
        skip_attn = self.training and cfg.attn_layerdrop > 0 and torch.rand(()) < cfg.attn_layerdrop
        if not skip_attn:
            x = self.ln1(x + self.drop(self.attn(x, key_mask, cfg.attention, views)))  # stage 1 / plain
            if cfg.attention == "hst":                                            # stage 2, methods.md §2.2
                n = x.size(1) - rep_mask.size(1)
                r = x[:, n:]                                                      # R1: [B, m, d]
                r = self.ln1(r + self.drop(self.attn(r, rep_mask, "dense")))      # R2 = LN1(R1 + Drop(O(attn(R1,R1))))
                x = torch.cat([x[:, :n], r], dim=1)
        return self.ln2(x + self.drop(self.ffn(x)))


class MLMHead(nn.Module):
    """decoder(LN(gelu(dense(h)))), decoder tied to the word embeddings, plus a bias (methods.md §1)."""

    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, h, word_embeddings):
        return F.linear(self.ln(F.gelu(self.dense(h))), word_embeddings, self.bias)   # [B, L, vocab]


class ClassifierHead(nn.Module):
    """RoBERTa style on the first token: out_proj(Drop(tanh(dense(Drop(h_0)))))  (methods.md §1)."""

    def __init__(self, cfg):
        super().__init__()
        p = cfg.classifier_dropout_p if cfg.classifier_dropout_p >= 0 else cfg.hidden_dropout_p
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)
        self.drop = nn.Dropout(p)

    def forward(self, h):
        h0 = h[:, 0]                                                                  # [B, d]
        return self.out_proj(self.drop(torch.tanh(self.dense(self.drop(h0)))))        # [B, num_labels]


class PairHead(nn.Module):
    """LRA Retrieval's dual-encoder head (LRA classifier_head_dual, interaction "NLI"). The two documents of pair i
    come as rows 2i and 2i + 1 (data.flatten_pairs), each encoded on its own by the same encoder; pooled by their
    first token: u, v [B, d];  z = [u, v, u * v, u - v] [B, 4d];  logits = W3 relu(W2 relu(W1 Drop(z))),
    hidden sizes FFN and FFN / 2 (LRA: mlp_dim, mlp_dim // 2)."""

    def __init__(self, cfg):
        super().__init__()
        p = cfg.classifier_dropout_p if cfg.classifier_dropout_p >= 0 else cfg.hidden_dropout_p
        d, m = cfg.hidden_size, cfg.intermediate_size
        self.mlp = nn.Sequential(nn.Dropout(p), nn.Linear(4 * d, m), nn.ReLU(), nn.Linear(m, m // 2), nn.ReLU(),
                                 nn.Linear(m // 2, cfg.num_labels))

    def forward(self, h):                                                             # h: [2B, L, d]
        u, v = h[0::2, 0], h[1::2, 0]                                                 # [B, d] each
        return self.mlp(torch.cat([u, v, u * v, u - v], dim=-1))                      # [B, num_labels]


class SpanHead(nn.Module):
    """Extractive QA (BERT's SQuAD head): a start and an end logit per token, (s_i, e_i) = W h_i + b (qa.py)."""

    def __init__(self, cfg):
        super().__init__()
        self.out = nn.Linear(cfg.hidden_size, 2)

    def forward(self, h):                                                             # h: [B, L, d]
        return self.out(h)                                                            # [B, L, 2]: start, end


def make_head(cfg):
    """The task head of Config.head (None without labels: MLM only)."""
    if cfg.num_labels == 0:
        return None
    if cfg.head == "pair":
        return PairHead(cfg)
    if cfg.head == "span":
        return SpanHead(cfg)
    return ClassifierHead(cfg)


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        self.emb = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.mlm = MLMHead(cfg)
        self.cls = make_head(cfg)        # classifier, LRA retrieval's pair head or QA's span head (Config.head)
        # HST: a learned vector added to the mean-pooled block representatives, zero at start (methods.md §2.2)
        self.rep_embedding = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.attention == "hst" else None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        """BERT's initialisation (normal, std 0.02), used when training from scratch or for new heads."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    # --- inputs -----------------------------------------------------------------
    def position_ids(self, input_ids):
        """methods.md §1. RoBERTa / XLM-R: pad_id + cumsum(ids != pad) * (ids != pad); BERT: 0 .. L-1."""
        if self.cfg.position_style == "roberta":
            real = (input_ids != self.cfg.pad_id).long()
            return torch.cumsum(real, dim=1) * real + self.cfg.pad_id
        return torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)

    def pad_to_block(self, input_ids, attention_mask, position_ids, token_type_ids):
        """Sparse / HST need n to be a multiple of the block size: pad on the right (masked)."""
        b = self.cfg.block_size
        extra = (-input_ids.size(1)) % b
        if self.cfg.attention == "dense" or extra == 0:
            return input_ids, attention_mask, position_ids, token_type_ids
        pad_pos = self.cfg.pad_id if self.cfg.position_style == "roberta" else 0
        return (F.pad(input_ids, (0, extra), value=self.cfg.pad_id), F.pad(attention_mask, (0, extra), value=0),
                F.pad(position_ids, (0, extra), value=pad_pos), F.pad(token_type_ids, (0, extra), value=0))

    # --- the encoder --------------------------------------------------------------
    def encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, views=1):
        """Last hidden states [B, L, d] for input_ids [B, L] (attention_mask: 1 = real token). views: the batch
        is that many views of one batch stacked along B (sar.two_views); each draws its own random blocks."""
        B, L = input_ids.shape
        if B % views:
            raise ValueError(f"a batch of {B} cannot hold {views} views of equal size")
        if self.training:                 # AttendOut's drop statistics describe exactly this forward
            for m in attendout_modules(self):
                m.reset_stats()
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # our own position ids stay below max_positions whenever L <= max_len (methods.md §1), so only a longer input,
        # or ids given by the caller, need the check (it reads a value off the device: a sync on CUDA)
        check = position_ids is not None or L > self.cfg.max_len
        if position_ids is None:
            position_ids = self.position_ids(input_ids)
        if check and int(position_ids.max()) >= self.cfg.max_positions:
            raise ValueError(f"sequence of length {L} needs position {int(position_ids.max())} but the model has "
                             f"{self.cfg.max_positions} position rows (max length {self.cfg.max_len}); "
                             f"raise --max-positions (extends the table by copying) or truncate the input")
        ids, mask, pos, types = self.pad_to_block(input_ids, attention_mask, position_ids, token_type_ids)
        x = self.emb(ids, pos, types)                                               # [B, n, d]
        key_mask = mask.bool()                                                      # [B, n]
        if self.cfg.attention == "dense" and bool(key_mask.all()):
            key_mask = None                                                         # no padding: fastest path
        rep_mask = None
        if self.cfg.attention == "hst":
            x, rep_mask = self.add_representatives(x, key_mask)                      # [B, n + m, d]
        for layer in self.layers:
            x = layer(x, key_mask, rep_mask, views)
        return x[:, :L]                                                             # drop block padding and R

    def add_representatives(self, x, key_mask):
        """HST (methods.md §2.2): R_j = mean of block j's real embedding outputs + rep_embedding. -> [X; R], mask of R."""
        B, n, d = x.shape
        b = self.cfg.block_size
        w = key_mask.view(B, n // b, b, 1).to(x.dtype)                               # [B, m, b, 1]
        count = w.sum(dim=2)                                                        # [B, m, 1]
        r = (x.view(B, n // b, b, d) * w).sum(dim=2) / count.clamp(min=1)          # [B, m, d]
        r = r + self.rep_embedding
        return torch.cat([x, r], dim=1), count.squeeze(-1) > 0                      # [B, n+m, d], [B, m]

    # --- heads --------------------------------------------------------------------
    def mlm_logits(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        h = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        return self.mlm(h, self.emb.word.weight)                                    # [B, L, vocab]

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, head="cls", views=1):
        """Classifier / regression logits [B, num_labels] from the first token (head="mlm": mlm_logits).
        Config.head "pair": input rows 2i, 2i + 1 are the documents of pair i, logits [B, num_labels];
        "span": start / end logits [B, L, 2]."""
        if head == "mlm":
            return self.mlm_logits(input_ids, attention_mask, token_type_ids, position_ids)
        if self.cls is None:
            raise ValueError("this model has no classifier head (num_labels = 0); use mlm_logits or encode")
        return self.cls(self.encode(input_ids, attention_mask, token_type_ids, position_ids, views))

    # --- method bookkeeping ---------------------------------------------------------
    def attn_dropouts(self):
        """The layers' attention-dropout modules, in order (AttendOut's G-Nets live in them)."""
        return [layer.attn.drop for layer in self.layers]

    def set_progress(self, step_frac):
        """Tell scheduled dropout how far training is (0 .. 1)."""
        for layer in self.layers:
            layer.attn.step_frac = float(step_frac)

    def set_eval_draw(self, draw):
        """Evaluate with another fixed draw of the random blocks (0: the usual one; train.py --eval-redraw)."""
        for layer in self.layers:
            layer.attn.eval_draw = int(draw)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


# -----------------------------------------------------------------------------
# Checkpoint conversion from the HuggingFace layout. The whole name mapping is this one table.
# Keys are HF names after the model prefix ("roberta.", "bert.", ...) is removed; {i} is the layer index.
# "qkv" rows are fused: our qkv weight is cat(query, key, value) along the output dimension.

HF_TO_OURS = {
    "embeddings.word_embeddings.weight":        "emb.word.weight",
    "embeddings.position_embeddings.weight":    "emb.pos.weight",
    "embeddings.token_type_embeddings.weight":  "emb.types.weight",
    "embeddings.LayerNorm.weight":              "emb.ln.weight",
    "embeddings.LayerNorm.bias":                "emb.ln.bias",
    "encoder.layer.{i}.attention.self.query.{wb}":      "layers.{i}.attn.qkv.{wb}[0]",
    "encoder.layer.{i}.attention.self.key.{wb}":        "layers.{i}.attn.qkv.{wb}[1]",
    "encoder.layer.{i}.attention.self.value.{wb}":      "layers.{i}.attn.qkv.{wb}[2]",
    "encoder.layer.{i}.attention.output.dense.{wb}":    "layers.{i}.attn.out.{wb}",
    "encoder.layer.{i}.attention.output.LayerNorm.{wb}": "layers.{i}.ln1.{wb}",
    "encoder.layer.{i}.intermediate.dense.{wb}":        "layers.{i}.ffn.up.{wb}",
    "encoder.layer.{i}.output.dense.{wb}":              "layers.{i}.ffn.down.{wb}",
    "encoder.layer.{i}.output.LayerNorm.{wb}":          "layers.{i}.ln2.{wb}",
    # masked-LM head: RoBERTa / XLM-R "lm_head.*", BERT "cls.predictions.*" (decoder weight is tied)
    "lm_head.dense.{wb}":                       "mlm.dense.{wb}",
    "lm_head.layer_norm.{wb}":                  "mlm.ln.{wb}",
    "lm_head.bias":                             "mlm.bias",
    "cls.predictions.transform.dense.{wb}":     "mlm.dense.{wb}",
    "cls.predictions.transform.LayerNorm.{wb}": "mlm.ln.{wb}",
    "cls.predictions.bias":                     "mlm.bias",
    # sequence classification: RoBERTa head, or BERT pooler (-> dense) + classifier (-> out_proj)
    "classifier.dense.{wb}":                    "cls.dense.{wb}",
    "classifier.out_proj.{wb}":                 "cls.out_proj.{wb}",
    "pooler.dense.{wb}":                        "cls.dense.{wb}",
    "classifier.{wb}":                          "cls.out_proj.{wb}",
}
HF_PREFIXES = ("roberta.", "bert.", "xlm_roberta.", "model.")   # stripped from backbone names
HF_IGNORED = ("embeddings.position_ids", "lm_head.decoder.weight", "cls.predictions.decoder.weight",
              "lm_head.decoder.bias", "cls.predictions.decoder.bias", "cls.seq_relationship.")
SUPPORTED_MODEL_TYPES = ("roberta", "xlm-roberta", "bert")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the offending weights."""


def config_from_hf(hf, path="config.json"):
    """Config from an HF config.json dict (methods.md §1: LN eps and position style come from the checkpoint)."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{path}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (only exact 'gelu')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"{path}: position_embedding_type {hf['position_embedding_type']!r} is not supported")
    need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings")
    missing = [k for k in need if not isinstance(hf.get(k), int) or hf[k] < 1]
    if missing:
        raise CheckpointError(f"{path}: no positive integer {', '.join(missing)}")
    bert = mt == "bert"
    labels = len(hf["id2label"]) if "id2label" in hf and any("ForSequenceClassification" in a for a in hf.get("architectures") or []) else 0
    cd = hf.get("classifier_dropout")
    return Config(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
        max_positions=hf["max_position_embeddings"], type_vocab_size=hf.get("type_vocab_size", 1 if not bert else 2),
        pad_id=hf.get("pad_token_id", 0 if bert else 1), layer_norm_eps=hf.get("layer_norm_eps", 1e-12 if bert else 1e-5),
        position_style="bert" if bert else "roberta", hidden_dropout_p=hf.get("hidden_dropout_prob", 0.1),
        attn_dropout_p=hf.get("attention_probs_dropout_prob", 0.1), num_labels=labels,
        classifier_dropout_p=-1.0 if cd is None else cd)


def map_hf_name(name):
    """HF weight name -> (our name, qkv slot or None), or None when the table has no row for it."""
    for prefix in HF_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    name = name.replace(".gamma", ".weight").replace(".beta", ".bias")   # old TF-converted BERT files
    parts = name.split(".")
    layer = next((p for p in parts if p.isdigit()), None)
    wb = parts[-1]
    for hf_pat, ours in HF_TO_OURS.items():
        if hf_pat.format(i=layer, wb=wb) == name:
            ours = ours.format(i=layer, wb=wb)
            if ours.endswith("]"):
                return ours[:-3], int(ours[-2])
            return ours, None
    return None


def read_hf_weights(folder):
    """HF state dict from model.safetensors (or its sharded index) or pytorch_model.bin, read safely."""
    st, st_index, binf = (os.path.join(folder, f) for f in
                          ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if os.path.exists(st) or os.path.exists(st_index):
        if os.path.exists(st):
            return read_safetensors(st)
        shards = sorted(set(read_json(st_index).get("weight_map", {}).values()))
        out = {}
        for s in shards:
            out.update(read_safetensors(os.path.join(folder, s)))
        return out
    if os.path.exists(binf):
        return safe_torch_load(binf)
    raise CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin")


def read_safetensors(path):
    """A .safetensors file's tensors; a truncated or foreign file is a one-line CheckpointError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({str(e).splitlines()[0][:200]})") from None


def read_json(path):
    """A config / index JSON object; bad JSON names the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not UTF-8 text") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def safe_torch_load(path):
    """torch.load with weights_only=True: tensors and plain containers only, a pickle carrying code is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and friends: never retry without weights_only
        first = str(e).splitlines()[0].split(". ")[0][:200] if str(e) else type(e).__name__
        if "Weights only load failed" in str(e):
            raise CheckpointError(f"{path}: refused to load: it is not a plain-tensor checkpoint "
                                  f"(weights_only=True rejected it: {first})") from None
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint, not readable ({first})") from None


def convert_hf_state(hf_state, cfg, path):
    """Map an HF state dict onto our names. Unknown weights, missing backbone weights: one clear error."""
    ours, qkv, unexpected = {}, {}, []
    for name, t in hf_state.items():
        if any(name.startswith(p) or name.endswith(p) or ("." + p) in name for p in HF_IGNORED):
            continue
        mapped = map_hf_name(name)
        if mapped is None:
            unexpected.append(name)
            continue
        key, slot = mapped
        if slot is None:
            ours[key] = t
        else:
            qkv.setdefault(key, [None, None, None])[slot] = t
    for key, parts in qkv.items():
        if any(p is None for p in parts):
            raise CheckpointError(f"{path}: {key}: query/key/value incomplete in the checkpoint")
        ours[key] = torch.cat(parts, dim=0)
    if unexpected:
        raise CheckpointError(f"{path}: unexpected weights not in the conversion table: {', '.join(unexpected[:8])}"
                              + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
    # a BERT pooler alone (no classifier) is not a head of ours: drop it rather than half-fill cls
    if "cls.out_proj.weight" not in ours:
        for k in [k for k in ours if k.startswith("cls.")]:
            del ours[k]
    return ours


def extend_positions(weight, new_rows, cfg):
    """methods.md §1 (the Longformer recipe): a longer position table made by copying the learned one repeatedly.
    RoBERTa keeps its first pad_id + 1 rows (the offset) and tiles the rest."""
    old = weight.size(0)
    if new_rows <= old:
        return weight[:new_rows].clone()
    offset = cfg.pad_id + 1 if cfg.position_style == "roberta" else 0
    learned = weight[offset:]
    reps = math.ceil((new_rows - offset) / learned.size(0))
    return torch.cat([weight[:offset], learned.repeat(reps, 1)], dim=0)[:new_rows].clone()


def build_model(cfg, state, path):
    """Model(cfg) loaded from `state`. Heads that the checkpoint lacks (or of another size) start fresh;
    every backbone weight must be present and of the right shape."""
    state = dict(state)
    if "emb.pos.weight" in state and state["emb.pos.weight"].size(0) != cfg.max_positions:
        state["emb.pos.weight"] = extend_positions(state["emb.pos.weight"], cfg.max_positions, cfg)
    model = Model(cfg)
    expected = model.state_dict()
    for k in [k for k in state if k.startswith("cls.")]:
        if k not in expected or expected[k].shape != state[k].shape:
            del state[k]                                  # a classifier of another size: start it fresh
    missing = [k for k in expected if k not in state and not k.startswith(("mlm.", "cls.", "rep_embedding"))
               and ".attn.drop." not in k]
    unexpected = [k for k in state if k not in expected and ".attn.drop." not in k]
    wrong = [f"{k} {tuple(state[k].shape)} != {tuple(expected[k].shape)}"
             for k in state if k in expected and state[k].shape != expected[k].shape]
    problems = []
    if missing:
        problems.append("missing weights: " + ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if unexpected:
        problems.append("unexpected weights: " + ", ".join(unexpected[:8]))
    if wrong:
        problems.append("wrong shapes: " + ", ".join(wrong[:8]))
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    state = {k: v for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False)   # heads / G-Net / rep_embedding absent: freshly initialised
    return model


def apply_overrides(cfg, overrides):
    names = {f.name for f in fields(Config)}
    bad = [k for k in overrides if k not in names]
    if bad:
        raise ValueError(f"unknown Config field(s) {', '.join(bad)}; valid fields: {', '.join(sorted(names))}")
    return Config(**{**asdict(cfg), **overrides})


def read_hf_folder(folder):
    """(Config, our state dict, tokenizer files) from an HF folder."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{folder}: no config.json (expected an HF model folder or a converted .pt)")
    cfg = config_from_hf(read_json(cfg_path), cfg_path)
    state = convert_hf_state(read_hf_weights(folder), cfg, folder)
    if "cls.out_proj.weight" in state:
        cfg.num_labels = state["cls.out_proj.weight"].size(0)
    return cfg, state, data.files_to_tensors(data.read_tokenizer_folder(folder))   # embedded as uint8 tensors


def read_checkpoint(path):
    """(Config, state, tokenizer files, the raw dict) from an HF folder or a converted / training .pt."""
    if os.path.isdir(path):
        cfg, state, tok = read_hf_folder(path)
        return cfg, state, tok, {}
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: neither an HF model folder nor a checkpoint file")
    ckpt = safe_torch_load(path)
    if not isinstance(ckpt, dict) or ckpt.get("format") != "attnreg-v1":
        raise CheckpointError(f"{path}: not an attnreg checkpoint (convert HF folders with `python model.py convert`)")
    if not isinstance(ckpt.get("config"), dict) or not isinstance(ckpt.get("model"), dict):
        raise CheckpointError(f"{path}: an attnreg checkpoint without its config or weights (a damaged file?)")
    names = {f.name for f in fields(Config)}
    cfg = Config(**{k: v for k, v in ckpt["config"].items() if k in names})
    return cfg, ckpt["model"], ckpt.get("tokenizer", {}).get("files", {}), ckpt


def load_pretrained(path, **overrides):
    """A Model from an HF folder or a converted .pt; `overrides` are Config fields (e.g. attention="sparse",
    max_positions=4096, num_labels=3). Position tables grow by copying (methods.md §1)."""
    cfg, state, _, _ = read_checkpoint(path)
    cfg = apply_overrides(cfg, overrides)
    return build_model(cfg, state, path)


def checkpoint_dict(model, tokenizer_files, **extra):
    """The one file format: config, weights and tokenizer files (plain tensors, loadable with weights_only)."""
    return {"format": "attnreg-v1", "config": asdict(model.cfg), "model": model.state_dict(),
            "tokenizer": {"files": dict(tokenizer_files)}, **extra}


def save_atomic(obj, path):
    """torch.save to a temporary file, then rename: a crash never leaves a half-written checkpoint, and a failed
    write (disk full) removes its temporary file and leaves the old checkpoint as it was."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())        # on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, RuntimeError):     # torch.save's "file write failed": the disk is full, most likely
            raise OSError(f"{path}: could not write the checkpoint ({str(e).splitlines()[0]}); is the disk full?") from None
        if isinstance(e, OSError):          # ENOSPC from fsync, a read-only folder: name the checkpoint
            raise OSError(f"{path}: could not write the checkpoint ({e.strerror or e})") from None
        raise


def convert(hf_dir, out_path):
    cfg, state, tok, _ = read_checkpoint(hf_dir)
    try:       # the converted file alone is enough to fine-tune: it must carry a tokenizer that works
        data.tokenizer_from_files(data.tensors_to_files(tok))
    except data.DataError as e:
        raise CheckpointError(f"{hf_dir}: no usable tokenizer ({e})") from None
    model = build_model(cfg, state, hf_dir)
    save_atomic(checkpoint_dict(model, tok), out_path)
    return model


def export(ckpt_path, out_path):
    """A fine-tuned model for inference: G-Net parameters, optimizer and RNG state dropped; an AttendOut model
    becomes a standard-dropout one (its eval forward is the same, methods.md §3.1: no extra inference cost)."""
    from attendout import export_without_gnet
    cfg, state, tok, _ = read_checkpoint(ckpt_path)
    if cfg.attn_dropout == "attendout":
        cfg.attn_dropout = "standard"
    model = build_model(cfg, export_without_gnet(state), ckpt_path)
    save_atomic(checkpoint_dict(model, tok), out_path)
    return model


def check_output(path, force):
    """convert / export write a new file: an existing one (a training run's ckpt_last.pt, say) is kept unless
    --force; a folder or a missing parent folder is one clear line, before any work."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a folder; give the file to write (e.g. {os.path.join(path, 'model.pt')})")
    if os.path.exists(path) and not force:
        raise CheckpointError(f"{path}: exists; pass --force to replace it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CheckpointError(f"{path}: no folder {parent} to write into")


def main(argv=None):
    ap = ArgumentParser(description="Convert HF checkpoints (roberta, xlm-roberta, bert) to attnreg .pt files")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="HF_DIR OUT.pt: config, weights and tokenizer files in one file")
    c.add_argument("hf_dir")
    c.add_argument("out")
    c.add_argument("--force", action="store_true", help="replace OUT.pt if it exists")
    i = sub.add_parser("info", help="print the config and size of a checkpoint")
    i.add_argument("path")
    e = sub.add_parser("export", help="CKPT OUT.pt: a trained model without G-Nets and training state")
    e.add_argument("ckpt")
    e.add_argument("out")
    e.add_argument("--force", action="store_true", help="replace OUT.pt if it exists")
    args = ap.parse_args(argv)
    with one_line_errors():
        if args.cmd in ("export", "convert"):
            check_output(args.out, args.force)
        if args.cmd == "export":
            model = export(args.ckpt, args.out)
            print(f"wrote {args.out}: {model.num_params() / 1e6:.1f}M parameters (attn_dropout={model.cfg.attn_dropout})")
        elif args.cmd == "convert":
            model = convert(args.hf_dir, args.out)
            print(f"wrote {args.out}: {model.num_params() / 1e6:.1f}M parameters, "
                  f"{model.cfg.num_layers} layers, d={model.cfg.hidden_size}, max length {model.cfg.max_len}")
        else:
            cfg, state, tok, _ = read_checkpoint(args.path)
            print(json.dumps(asdict(cfg), indent=1))
            print(f"{sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters; tokenizer files: {sorted(tok)}")


if __name__ == "__main__":
    main()
