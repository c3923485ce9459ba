"""sar.py: Self-Attention Regularization (ERNIE-Sparse, Liu et al. 2022) and its control, R-Drop.

What it is: the views of one batch (the original, the shifted topology) and the consistency term that asks
a model for the same answer under two of them. The losses themselves are written out in train.py.

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


def consistency(z1, z2, regression=False):
    """The consistency term of methods.md §2.3 (SAR, R-Drop) and §3.1 (AttendOut), averaged over the batch:
    1/2 (KL(p1 || p2) + KL(p2 || p1)) of the two predictions; regression: their squared difference."""
    if regression:
        return ((z1.float() - z2.float()) ** 2).mean()
    lp1 = F.log_softmax(z1.float(), dim=-1)              # log p1, [B, C]
    lp2 = F.log_softmax(z2.float(), dim=-1)              # log p2, [B, C]
    kl12 = (lp1.exp() * (lp1 - lp2)).sum(-1)             # KL(p1 || p2) = sum_c p1 (log p1 - log p2), [B]
    kl21 = (lp2.exp() * (lp2 - lp1)).sum(-1)             # KL(p2 || p1), [B]
    return (0.5 * (kl12 + kl21)).mean()


def stacked_views(model, batch, second=None, masked=False):
    """The logits [B, C] of every view of one batch, run as ONE stacked batch (methods.md §2.3, §3.1):
        the original;
        second = s >= 1: the topology shifted by s tokens (SAR); second = 0: a plain copy (R-Drop);
        masked: a copy of the original, last, that AttendOut's G-Nets mask (training only).
    views = their number tells the model: each view gets its own sparse-kernel call, so its own random
    blocks, and the model knows which view is the masked one."""
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")
    raw = getattr(model, "module", model)                # the Model itself, also under DistributedDataParallel
    pos = raw.position_ids(ids)                          # the content's positions, kept by every view
    views = [(ids, mask, pos, types)]
    if second is not None and second > 0:
        pad = raw.cfg.pad_id
        s_ids, s_mask, s_pos, s_types = shift(ids, mask, second, pad, pos, types)     # [B, L + s]
        # the original is padded at the END to the same length: padding there moves no boundary
        right = (0, second)
        ids = F.pad(ids, right, value=pad)
        mask = F.pad(mask, right, value=0)
        pos = F.pad(pos, right, value=pad)
        types = None if types is None else F.pad(types, right, value=0)
        views = [(ids, mask, pos, types), (s_ids, s_mask, s_pos, s_types)]
    elif second == 0:
        views.append(views[0])                           # R-Drop: the same rows twice
    if masked:
        views.append(views[0])                           # AttendOut: the original, masked
    cat = lambda i: None if views[0][i] is None else torch.cat([v[i] for v in views], dim=0)
    z = model(cat(0), cat(1), cat(3), cat(2), views=len(views), masked=masked)   # [views B, C]
    return list(z.chunk(len(views), dim=0))


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
