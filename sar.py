"""sar.py: Self-Attention Regularization (ERNIE-Sparse, Liu et al. 2022) and its control, R-Drop.

What it is: the views of one batch (the original, the shifted topology, AttendOut's masked copy),
run as one stacked batch, and the consistency term that asks for the same answer under two of them.
The losses are written out in train.py (classify_loss), one hop from the training step.

The idea (docs/methods.md §2.3, reconstructed): a sparse model's answer depends on where its block
boundaries fall. SAR shifts the topology, runs both views, and adds the symmetric KL between their
predictions to the original view's cross-entropy (--ce all: both views'). R-Drop (Liang et al.
2021) is the same loss on two unshifted views that differ only by dropout, the cross-entropy on
both. Evaluation runs once, on the original topology.

How to run it:  python train.py --attention hst --sar 1.0 --sar-shift 1      (or --rdrop 1.0)
Its tests:      python -m pytest -q tests/test_sar.py
"""
import torch
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# The shift (methods.md §2.3)
#
# Insert s padding tokens right after the first token:
#     ids   <s> a b c d    ->   <s> PAD a b c d
#     mask   1  1 1 1 1    ->    1   0  1 1 1 1
# The inserted tokens are masked out as keys and the real tokens keep their position ids, so the
# content the model reads is unchanged; only every block boundary moves by s. The first token stays
# in place: it is the global token and the classifier's input.

def shift(input_ids, attention_mask, shift=1, pad_id=1, position_ids=None, token_type_ids=None):
    """[B, L] -> [B, L + shift] for each of the four inputs (None stays None). Pass the model's
    position_ids so the content keeps its positions: only the sparse topology moves."""

    # t[:, :1] | shift x fill | t[:, 1:]
    def insert(t, fill):
        padding = t.new_full((t.size(0), shift), fill)
        return torch.cat([t[:, :1], padding, t[:, 1:]], dim=1)

    # the inserted tokens are padding, masked out as keys, at the padding position
    ids = insert(input_ids, pad_id)
    mask = insert(attention_mask, 0)
    positions = None
    if position_ids is not None:
        positions = insert(position_ids, pad_id)
    types = None
    if token_type_ids is not None:
        types = insert(token_type_ids, 0)
    return ids, mask, positions, types


def unshift(outputs, shift_by):
    """Per-token outputs of a shifted view back on the original tokens, [B, L + s, ...] -> [B, L,
    ...]."""
    if not shift_by:
        return outputs
    # drop the s inserted rows after the first token
    return torch.cat([outputs[:, :1], outputs[:, 1 + shift_by:]], dim=1)


# -----------------------------------------------------------------------------
# The consistency term (methods.md §2.3 for SAR and R-Drop, §3.1 for AttendOut)
#
# For two predictions p1 = softmax(z1), p2 = softmax(z2) of the same examples:
#     consistency = 1/2 (KL(p1 || p2) + KL(p2 || p1)),   KL(p || q) = sum_c p_c (log p_c - log q_c)
# symmetric, so neither view is the teacher; averaged over the batch. A regression head has no
# distribution: there it is the squared difference of the two outputs.

def consistency(z1, z2, regression=False):
    """The symmetric KL between the predictions of logits z1, z2 [B, C], averaged over the batch.
    """
    if regression:
        return ((z1.float() - z2.float()) ** 2).mean()
    lp1 = F.log_softmax(z1.float(), dim=-1)              # log p1, [B, C]
    lp2 = F.log_softmax(z2.float(), dim=-1)              # log p2, [B, C]
    kl12 = (lp1.exp() * (lp1 - lp2)).sum(-1)             # KL(p1 || p2), [B]
    kl21 = (lp2.exp() * (lp2 - lp1)).sum(-1)             # KL(p2 || p1), [B]
    return (0.5 * (kl12 + kl21)).mean()


# -----------------------------------------------------------------------------
# The views as one batch (methods.md §2.3, §3.1)
#
# Every view of a batch goes through the model in ONE stacked batch of (views x B) rows:
#     [original; second view; masked copy]
# the second view being the shifted topology (SAR) or a plain copy (R-Drop), the masked copy
# AttendOut's. The shifted view is s tokens longer, so the original (and its masked copy) get s
# padding tokens at the END, which moves no boundary a real token sees. `views` tells the model how
# many views the rows hold: each view gets its own sparse-kernel call, so its own random blocks,
# and with masked=True the model knows the last view is the one the G-Nets mask.

# Which second view a run's flags ask for: R-Drop's plain copy (--rdrop alpha), SAR's topology
# shifted by --sar-shift (--sar alpha, or --views 2 at alpha 0), or none; with its weight alpha.
# train.classify_loss and readers/qa.py both ask here.

def second_view(args):
    """(second, alpha) for stacked_views: second None (one view), 0 (R-Drop) or s >= 1 (SAR)."""
    if args.rdrop > 0:
        return 0, args.rdrop
    if args.views == 2:
        return args.sar_shift, args.sar
    return None, 0.0


def stacked_views(model, batch, second=None, masked=False):
    """The logits of every view of one batch, a list of [B, ...]: the original; then second = s >=
    1, the topology shifted by s tokens (SAR), or second = 0, a plain copy (R-Drop); then, if
    masked, AttendOut's masked copy of the original (training only)."""
    ids = batch["input_ids"]
    mask = batch["attention_mask"]
    types = batch.get("token_type_ids")
    raw = getattr(model, "module", model)                # the Model, also under DDP
    # The content's positions, given to the model only with SAR's shifted view: the model checks
    # given positions against its table, a read off the device (Model.encode), and computes the
    # same ones itself for the views on the original topology.
    shifting = second is not None and second > 0
    pos = raw.position_ids(ids) if shifting else None
    views = [(ids, mask, pos, types)]

    # SAR: the shifted topology, [B, L + s]; the original padded at the end to the same length
    if shifting:
        pad = raw.cfg.pad_id
        shifted = shift(ids, mask, second, pad, pos, types)
        right = (0, second)
        ids = F.pad(ids, right, value=pad)
        mask = F.pad(mask, right, value=0)
        pos = F.pad(pos, right, value=pad)
        if types is not None:
            types = F.pad(types, right, value=0)
        views = [(ids, mask, pos, types), shifted]

    # R-Drop: the same rows twice (they differ only by dropout)
    if second == 0:
        views.append(views[0])

    # AttendOut: the original once more, last; the model masks it
    if masked:
        views.append(views[0])

    # stack each input over the views: [views B, L]
    stacked = []
    for i in range(4):
        if views[0][i] is None:
            stacked.append(None)
        else:
            stacked.append(torch.cat([view[i] for view in views], dim=0))
    ids, mask, pos, types = stacked
    z = model(ids, mask, types, pos, views=len(views), masked=masked)    # [views B, ...]
    return list(z.chunk(len(views), dim=0))


# -----------------------------------------------------------------------------
# Evaluation under a perturbed topology (methods.md §2.3, train.py --eval-shift)
#
# The dev set is scored once more with the topology shifted by s; --eval-shift all scores every
# s = 1 .. b-1 (a shift of b puts every boundary back on a boundary). Dense attention has no
# boundary to move: there s = 1 alone is scored, as a check that it changes nothing.

def eval_shifts(eval_shift, sparse, block_size):
    """The shifts train.py --eval-shift scores: N alone, or 'all'."""
    if eval_shift != "all":
        if eval_shift:
            return [eval_shift]
        return []
    if sparse:
        return list(range(1, block_size))
    return [1]


def add_shifted(metrics, by_shift, lower_is_better=False):
    """metrics[split]["shift"] = {"by": {s: metrics under shift s}, "mean": .., "worst": ..} for
    every split of `metrics` (the original topology's), from by_shift {s: metrics}.
    lower_is_better: the masked LM's loss, whose worst is the largest."""
    if not by_shift:
        return
    worst = max if lower_is_better else min
    for split in metrics:
        runs = [m[split] for m in by_shift.values()]
        # the scores, not the counts
        names = [k for k, v in runs[0].items() if isinstance(v, float)]
        mean = {k: sum(run[k] for run in runs) / len(runs) for k in names}
        worst_of = {k: worst(run[k] for run in runs) for k in names}
        by = {str(s): m[split] for s, m in by_shift.items()}
        metrics[split]["shift"] = {"by": by, "mean": mean, "worst": worst_of}
