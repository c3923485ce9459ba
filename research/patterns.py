"""research/patterns.py: draw the block-sparse and HST attention patterns of sparse.py, as text
and PNGs.

Idea: the pattern is a set of (query, key) pairs; drawing it from the same random draw and key
layout as the kernel (sparse.key_layout, sparse.hst_dense_mask) shows window, global, random and
representative keys as the kernel reads them (methods.md §2.1, §2.2).

Run:  python research/patterns.py      # n 32, block 4: both printed, docs/results/attention_*.png
      python research/patterns.py --n 64 --block-size 8 --num-random 2 --out-dir /tmp/pat
"""
import argparse
import os
import sys

import torch

# The six files' folder, so that sparse.py imports.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sparse import Pattern, hst_dense_mask, key_layout, layout_rows, random_blocks  # noqa: E402

CHARS = ".#grR"   # 0 nothing, 1 window, 2 global, 3 random, 4 representative


def mask_parts(n, *, generator=None, **pattern):
    """The pieces of the §2.1 pattern (head 0, no padding): window, glob, rand, each bool
    [n, n]."""
    p = Pattern(**pattern)
    b, g = p.block_size, min(p.num_global, n)
    rand_idx, rand_ok = random_blocks(n // b, generator=generator, **pattern)
    lay = key_layout(n, p, rand_idx, rand_ok)
    token_rows = torch.arange(n) // b                      # query token -> its block

    # The keys of the layout's columns in slice s, as a bool [n, n].
    def columns(s):
        cols = torch.zeros_like(lay.kin)
        cols[..., s] = lay.kin[..., s]
        return layout_rows(lay, n, cols)[0, token_rows]    # [n, n]

    pos = torch.arange(n)
    glob = (pos[:, None] < g) | (pos[None, :] < g)         # global rows and columns [n, n]
    return columns(lay.window), glob, columns(lay.random)


def pattern_codes(n, *, block_size, window, num_global, num_random, seed, hst=False):
    """int [L, L] with codes indexing CHARS, head 0 of batch 0, no padding (L = n, or n + m with
    hst)."""
    kw = dict(block_size=block_size, window=window, num_global=num_global, num_random=num_random)
    win, glob, rand = mask_parts(n, generator=torch.Generator().manual_seed(seed), **kw)
    codes = torch.zeros(n, n, dtype=torch.long)
    codes[rand] = 3                                        # later codes win where pieces overlap
    codes[win] = 1
    codes[glob] = 2
    if not hst:
        return codes
    generator = torch.Generator().manual_seed(seed)
    allowed = hst_dense_mask(n, generator=generator, **kw)[0, 0]        # [L, L]
    full = torch.where(allowed, 4, 0)                      # R wherever a representative is involved
    full[:n, :n] = codes
    # R_j's row reads its block's tokens: window codes, or global ones for the global tokens.
    is_glob = (torch.arange(n) < num_global)[None, :]
    full[n:, :n] = torch.where(allowed[n:, :n], torch.where(is_glob, 2, 1), 0)
    return full


def draw_text(codes, n):
    """The codes as text, one row per query; representatives after a bar (columns) and a rule
    (rows)."""
    rows = []
    for i, row in enumerate(codes.tolist()):
        if i == n:
            rows.append("-" * (len(row) + 1))              # the representatives' rows below
        line = "".join(CHARS[c] for c in row[:n])
        if len(row) > n:
            line += "|" + "".join(CHARS[c] for c in row[n:])
        rows.append(line)
    return "\n".join(rows)


def save_png(codes, path, title):
    """The codes as a PNG (False without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        return False
    # One colour a code.
    cmap = ListedColormap(["white", "tab:blue", "tab:orange", "tab:green", "tab:red"])
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.imshow(codes.numpy(), cmap=cmap, vmin=0, vmax=4, interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def main():
    p = argparse.ArgumentParser(
        description="Draw the block-sparse and HST patterns (methods.md §2.1, §2.2).")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--num-global", type=int, default=2)
    p.add_argument("--num-random", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join("docs", "results"))
    a = p.parse_args()
    kw = dict(block_size=a.block_size, window=a.window, num_global=a.num_global,
              num_random=a.num_random, seed=a.seed)
    sparse = pattern_codes(a.n, **kw)
    hst = pattern_codes(a.n, hst=True, **kw)
    print(f"block-sparse, n={a.n} b={a.block_size} w={a.window} g={a.num_global} "
          f"r={a.num_random} (rows = queries; # window, g global, r random)")
    print(draw_text(sparse, a.n))
    print("\nHST stage 1 over [X; R] (R = representatives after the bars)")
    print(draw_text(hst, a.n))
    os.makedirs(a.out_dir, exist_ok=True)
    figs = [(torch.ones(a.n, a.n, dtype=torch.long), "attention_dense.png", "dense"),
            (sparse, "attention_sparse.png", "block-sparse (methods.md §2.1)"),
            (hst, "attention_hst.png", "HST stage 1 over [X; R] (methods.md §2.2)")]
    for codes, name, title in figs:
        path = os.path.join(a.out_dir, name)
        if save_png(codes, path, title):
            print("wrote", path)


if __name__ == "__main__":
    main()
