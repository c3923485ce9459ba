"""sar.py: Self-Attention Regularization (ERNIE-Sparse, Liu et al. 2022) and its control, R-Drop.

What it is: the consistency losses that ask a model for the same answer under two views of one batch.

The idea in three lines (docs/methods.md §2.3, reconstructed): a sparse model's answer depends on where its
block boundaries fall. SAR shifts the topology (s padding tokens after the first token move every boundary
by s), runs both views, and adds the symmetric KL between their predictions to the cross-entropy.
R-Drop (Liang et al. 2021) is the same loss on two unshifted views that differ only by dropout.
Evaluation runs once, on the original topology: SAR costs nothing at inference.

How to run it:  python train.py --attention hst --sar 1.0 --sar-shift 1      (or --rdrop 1.0)
"""
import torch
import torch.nn.functional as F


def shift(input_ids, attention_mask, shift=1, pad_id=1, position_ids=None, token_type_ids=None):
    """methods.md §2.3: insert `shift` padding tokens right after the first token, [B, L] -> [B, L + shift].
    Pass the model's position_ids so the content keeps its positions: only the sparse topology moves."""
    def insert(t, fill):                                 # t[:, :1] | `shift` x fill | t[:, 1:]
        return torch.cat([t[:, :1], t.new_full((t.size(0), shift), fill), t[:, 1:]], dim=1)

    return (insert(input_ids, pad_id),                   # the inserted tokens are padding ...
            insert(attention_mask, 0),                   # ... masked out as keys ...
            None if position_ids is None else insert(position_ids, pad_id),    # ... at the padding position
            None if token_type_ids is None else insert(token_type_ids, 0))


def unshift(outputs, shift_by):
    """Per-token outputs of a shifted view back on the original tokens, [B, L + s, ...] -> [B, L, ...]."""
    return torch.cat([outputs[:, :1], outputs[:, 1 + shift_by:]], dim=1) if shift_by else outputs


def task_loss(logits, labels, regression=False):
    """Cross-entropy, or MSE for a 1-output regression head (methods.md §1)."""
    if regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())         # logits: [B, 1]
    return F.cross_entropy(logits.float(), labels)                            # logits: [B, C]


def consistency(z1, z2, regression=False):
    """The consistency term of methods.md §2.3, averaged over the batch."""
    if regression:                                       # regression: the squared difference of the outputs
        return ((z1.float() - z2.float()) ** 2).mean()
    lp1, lp2 = F.log_softmax(z1.float(), dim=-1), F.log_softmax(z2.float(), dim=-1)   # log p, [B, C]
    kl12 = (lp1.exp() * (lp1 - lp2)).sum(-1)             # KL(p1 || p2) = sum_c p1 (log p1 - log p2), [B]
    kl21 = (lp2.exp() * (lp2 - lp1)).sum(-1)             # KL(p2 || p1), [B]
    return (0.5 * (kl12 + kl21)).mean()                  # 1/2 (KL(p1 || p2) + KL(p2 || p1))


def paired_loss(z1, z2, labels, alpha, regression=False):
    """Returns (L, its CE part, the consistency term), so the console can show them apart."""
    ce = 0.5 * (task_loss(z1, labels, regression) + task_loss(z2, labels, regression))  # 1/2 (CE(z1) + CE(z2))
    cons = consistency(z1, z2, regression)
    return ce + alpha * cons, ce, cons                   # L = 1/2 (CE1 + CE2) + alpha * consistency, §2.3


def two_views(model, batch, shift_by):
    """Logits of the original and the shifted view (shift_by = 0: R-Drop's two identical views), [B, C] each.

    Both views run as ONE batch of 2B rows. views=2 tells the model so: each half gets its own sparse-kernel
    call and so its own random blocks (methods.md §2.3: they are re-drawn for the shifted view)."""
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")
    raw = getattr(model, "module", model)                # the Model itself, also under DistributedDataParallel
    pos = raw.position_ids(ids)                          # the content's positions, kept by both views
    s_ids, s_mask, s_pos, s_types = ids, mask, pos, types
    if shift_by > 0:
        pad = raw.cfg.pad_id
        s_ids, s_mask, s_pos, s_types = shift(ids, mask, shift_by, pad, pos, types)       # [B, L + s]
        # the original is padded at the END to the same length: padding there moves no boundary a token sees
        right = (0, shift_by)
        ids, mask, pos = F.pad(ids, right, value=pad), F.pad(mask, right, value=0), F.pad(pos, right, value=pad)
        types = None if types is None else F.pad(types, right, value=0)
    cat = lambda a, b: None if a is None else torch.cat([a, b], dim=0)                    # [2B, L + s]
    z = model(cat(ids, s_ids), cat(mask, s_mask), cat(types, s_types), cat(pos, s_pos), views=2)  # [2B, C]
    return z.chunk(2, dim=0)


def sar_loss(model, batch, alpha=1.0, shift_by=1, regression=False):
    """SAR (methods.md §2.3): CE on both topologies + alpha * their symmetric KL."""
    if shift_by < 1:
        raise ValueError(f"--sar-shift {shift_by}: SAR needs a shift of at least 1 token (0 is R-Drop, --rdrop)")
    z1, z2 = two_views(model, batch, shift_by)
    return paired_loss(z1, z2, batch["labels"], alpha, regression)


def rdrop_loss(model, batch, alpha=1.0, regression=False):
    """R-Drop: the same loss, both passes on the original topology (they differ only by dropout)."""
    z1, z2 = two_views(model, batch, 0)
    return paired_loss(z1, z2, batch["labels"], alpha, regression)


def eval_shifts(eval_shift, sparse, block_size):
    """The shifts train.py --eval-shift scores: N alone, or 'all' (every s = 1 .. b-1; dense: s = 1 alone,
    since a dense model has no block boundary to move)."""
    if eval_shift != "all":
        return [eval_shift] if eval_shift else []
    return list(range(1, block_size)) if sparse else [1]


def add_shifted(metrics, by_shift, lower_is_better=False):
    """The perturbed-topology test (methods.md §2.3): metrics[split]["shift"] = {"by": {s: metrics under shift s},
    "mean": .., "worst": ..} for every split of `metrics` (the original topology's), from by_shift {s: metrics}."""
    for split in metrics if by_shift else ():
        runs = [m[split] for m in by_shift.values()]
        names = [k for k, v in runs[0].items() if isinstance(v, float)]     # scores, not counts
        worst = max if lower_is_better else min                             # the masked LM's loss: max is worst
        metrics[split]["shift"] = {"by": {str(s): m[split] for s, m in by_shift.items()},
                                   "mean": {k: sum(m[k] for m in runs) / len(runs) for k in names},
                                   "worst": {k: worst(m[k] for m in runs) for k in names}}
