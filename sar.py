"""sar.py: Self-Attention Regularization (ERNIE-Sparse) and the R-Drop baseline.

What it is: the consistency losses that ask a model for the same answer under two views of one batch.

The idea in three lines (methods.md §2.3, reconstructed): a sparse model's answer depends on where the block
boundaries fall. SAR shifts the topology (s padding tokens after the first token move every boundary by s),
runs both views and penalises the symmetric KL between their predictions, on top of cross-entropy.
R-Drop is the same loss with two unshifted passes that differ only by dropout. Evaluation runs once.

How to run it:  python train.py --attention hst --sar 1.0 --sar-shift 1      (or --rdrop 1.0)
"""
import torch
import torch.nn.functional as F


def shift(input_ids, attention_mask, shift=1, pad_id=1, position_ids=None, token_type_ids=None):
    """methods.md §2.3: insert `shift` padding tokens right after the first token. [B, L] -> [B, L + shift].

    The content keeps its position ids (pass the model's position_ids to carry them; the inserted tokens get
    pad_id, as RoBERTa padding does) and the inserted tokens are masked, so only the sparse topology moves."""
    def insert(t, fill):
        B = t.size(0)
        return torch.cat([t[:, :1], t.new_full((B, shift), fill), t[:, 1:]], dim=1)

    return (insert(input_ids, pad_id), insert(attention_mask, 0),
            None if position_ids is None else insert(position_ids, pad_id),
            None if token_type_ids is None else insert(token_type_ids, 0))


def unshift(outputs, shift_by):
    """Per-token outputs of a shifted view back on the original positions: drop the shift_by inserted after the
    first token. [B, L + s, ...] -> [B, L, ...] (QA's span logits, masked LM's logits)."""
    return torch.cat([outputs[:, :1], outputs[:, 1 + shift_by:]], dim=1) if shift_by else outputs


def task_loss(logits, labels, regression=False):
    """Cross-entropy, or MSE for a 1-output regression head (methods.md §1)."""
    if regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    return F.cross_entropy(logits.float(), labels)


def consistency(z1, z2, regression=False):
    """1/2 (KL(p1 || p2) + KL(p2 || p1)), p = softmax(z), averaged over the batch (methods.md §2.3).
    For regression heads: the squared difference of the two outputs."""
    if regression:
        return ((z1.float() - z2.float()) ** 2).mean()
    lp1, lp2 = F.log_softmax(z1.float(), dim=-1), F.log_softmax(z2.float(), dim=-1)   # [B, C]
    kl12 = (lp1.exp() * (lp1 - lp2)).sum(-1)                                           # KL(p1 || p2), [B]
    kl21 = (lp2.exp() * (lp2 - lp1)).sum(-1)                                           # KL(p2 || p1), [B]
    return (0.5 * (kl12 + kl21)).mean()


def paired_loss(z1, z2, labels, alpha, regression=False):
    """L = 1/2 (CE(z1, y) + CE(z2, y)) + alpha * consistency(z1, z2). Returns (L, CE part, consistency)."""
    ce = 0.5 * (task_loss(z1, labels, regression) + task_loss(z2, labels, regression))
    cons = consistency(z1, z2, regression)
    return ce + alpha * cons, ce, cons


def two_views(model, batch, shift_by):
    """Logits of the original and the shifted view (shift_by = 0: R-Drop's two identical views).

    Both views go through the model as ONE batch of 2B: the original is padded on the right by shift_by
    (padding at the end moves no block boundary that a real token sees), the shifted view gets its
    padding after the first token. views=2 tells the model so: each half gets its own sparse-kernel call,
    and so its own random blocks (methods.md §2.3: re-drawn for the shifted view); dropout masks differ anyway."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    types = batch.get("token_type_ids")
    pos = model.position_ids(ids)
    if shift_by > 0:
        pad_id = model.cfg.pad_id
        s_ids, s_mask, s_pos, s_types = shift(ids, mask, shift_by, pad_id, pos, types)
        right = (0, shift_by)
        ids, mask, pos = F.pad(ids, right, value=pad_id), F.pad(mask, right, value=0), F.pad(pos, right, value=pad_id)
        types = None if types is None else F.pad(types, right, value=0)
    else:
        s_ids, s_mask, s_pos, s_types = ids, mask, pos, types
    cat = lambda a, b: None if a is None else torch.cat([a, b], dim=0)
    z = model(cat(ids, s_ids), cat(mask, s_mask), cat(types, s_types), cat(pos, s_pos), views=2)  # [2B, C]
    return z.chunk(2, dim=0)


def sar_loss(model, batch, alpha=1.0, shift_by=1, regression=False):
    """SAR (methods.md §2.3): CE on both topologies + alpha * symmetric KL between them."""
    if shift_by < 1:
        raise ValueError(f"--sar-shift {shift_by}: SAR needs a shift of at least 1 token (a shift of 0 moves no "
                         "block boundary: that is R-Drop, --rdrop)")
    z1, z2 = two_views(model, batch, shift_by)
    return paired_loss(z1, z2, batch["labels"], alpha, regression)


def rdrop_loss(model, batch, alpha=1.0, regression=False):
    """R-Drop: the same loss, both passes on the original topology (they differ only by dropout)."""
    z1, z2 = two_views(model, batch, 0)
    return paired_loss(z1, z2, batch["labels"], alpha, regression)
