"""research/oracle_mask.py: `python train.py` with AttendOut's learned masks replaced by an
oracle's.

What it is: a probe for docs/results.md, "A shortcut in real text", not part of the course. A word
that gives the label away stands at token 1 of every sentence (research/experiments.py
shortcut-text). If the G-Nets learned the perfect adversarial mask, they would mask exactly that
word's column: every query's pair with key 1, in some layers, in AttendOut's masked pass, and
nothing else. This script runs train.py with that mask instead of the G-Nets' (dense attention
only: its layout's last axis is the key's position), so that the rest of AttendOut (the clean
pass's cross-entropy plus the consistency between the clean and the masked pass, methods.md §3.1)
is measured with the best mask it could hope for. Does the backbone then stop reading the word?

How: attendout.AttendOut.hook's mask_fn is given, in place of the G-Net's scores G, the oracle's
    G_oracle[.., i, j] = -1 if j = 1 and the layer is one of --oracle-layers, else +1   (+ 0 x G)
so that KeepMask keeps every pair but the word's, and the counts (masking rates, masked_by_key)
stay the G-Net code's own. The 0 x G keeps the G-Nets in the graph: their keep reward's gradient
is zero, they do not learn, and the optimizer steps them by weight decay alone.

Run (every train.py flag, plus --oracle-layers, 1-based), e.g.
    python research/oracle_mask.py --oracle-layers 1 --attn-dropout attendout --init CKPT ...
"""
import os
import sys

import torch

# The repository root, where the six files lie.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import attendout  # noqa: E402
import train  # noqa: E402
from data import fail  # noqa: E402

WORD = 1                    # the word's position: the first token after [CLS]


def oracle_layers(argv):
    """(the 0-based layers of --oracle-layers L [L ...], 1-based on the command line; the other
    flags)."""
    if "--oracle-layers" not in argv:
        fail("research/oracle_mask.py needs --oracle-layers L [L ...] (1-based layers whose word "
             "column to mask)")
    at = argv.index("--oracle-layers")
    values = []
    end = at + 1
    while end < len(argv) and argv[end].isdigit():
        values.append(int(argv[end]) - 1)
        end += 1
    if not values or min(values) < 0:
        fail("--oracle-layers: give layer numbers >= 1")
    return set(values), argv[:at] + argv[end:]


def install(layers):
    """Number each AttendOut by its layer as the model builds it, and replace the scores its mask_fn
    reads."""
    make = attendout.AttendOut.__init__
    learned_hook = attendout.AttendOut.hook

    def numbered(self, cfg, layer_idx=0):
        make(self, cfg, layer_idx)
        self.layer_idx = layer_idx

    def oracle_hook(self, x):
        mask_fn = learned_hook(self, x)
        masks_word = self.layer_idx in layers

        def oracle_mask_fn(S, valid, pair_scores):
            if not self.dense:
                raise ValueError("research/oracle_mask.py: dense attention only (the key axis is "
                                 "the position)")

            def oracle_scores(a, c):
                G = pair_scores(a, c)                                  # [B, 1, L, L]
                keep = torch.ones(G.shape[-1], dtype=G.dtype, device=G.device)
                if masks_word:
                    keep[WORD] = -1.0
                return 0 * G + keep                # the word's column masked, or none
            return mask_fn(S, valid, oracle_scores)

        return oracle_mask_fn

    attendout.AttendOut.__init__ = numbered
    attendout.AttendOut.hook = oracle_hook


if __name__ == "__main__":
    chosen, flags = oracle_layers(sys.argv[1:])
    install(chosen)
    train.main(flags)
