"""The pictures the pages draw from the toolkit's own objects, and the style
of every figure on the site. Matplotlib is imported when a picture is drawn."""

import numpy as np

from .batches import offsets_from_lengths, token_index

# 12-point text at 100 dpi is about 17 px, as large as the page's body text
# when a figure of at most 8 inches (800 px) is shown at its natural size in
# the content column.
#: Matplotlib ``rcParams`` for the pages' figures (``plt.rcParams.update(FIGURE_STYLE)``).
FIGURE_STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "figure.figsize": (8, 4.5),
    "font.size": 12,
    "axes.titlesize": 12,
    "axes.labelsize": 12,
    "xtick.labelsize": 12,
    "ytick.labelsize": 12,
    "legend.fontsize": 12,
}


def _cell(ax, x, y, color, text="", ink="white", width=0.92, height=0.86):
    import matplotlib.pyplot as plt

    ax.add_patch(plt.Rectangle((x, y), width, height, color=color))
    if text:
        ax.text(x + width / 2, y + height / 2, text, ha="center", va="center", color=ink)


def draw_batch(lengths):
    """A figure of one batch both ways: padded ``(B, S)`` with its padding
    slots, and packed values ``(T,)`` with the offsets under them. Each token
    shows its position in its sequence; each sequence has its own color."""
    import matplotlib.pyplot as plt

    offsets = offsets_from_lengths(lengths)
    seq, pos = token_index(offsets)
    B, S, T = len(lengths), max(lengths), len(seq)
    colors = plt.get_cmap("tab10")(np.arange(B) % 10)
    fig, (ax_pad, ax_pack) = plt.subplots(2, 1, figsize=(8, 1.1 * B + 2.4), height_ratios=[B, 1.6])
    for b, n in enumerate(lengths):
        for s in range(S):
            real = s < n
            _cell(ax_pad, s, b, colors[b] if real else "0.88", f"{s}" if real else "pad",
                  "white" if real else "0.45")
    for t in range(T):
        _cell(ax_pack, t, 0, colors[int(seq[t])], f"{int(pos[t])}")
    ax_pad.set(xlim=(0, S), ylim=(B, 0),
               title=f"padded (B, S) = ({B}, {S}) and a mask: {B * S - T} of {B * S} slots are padding")
    ax_pad.axis("off")
    ax_pack.set(xlim=(0, T), ylim=(1, -0.1), yticks=[], xticks=offsets.tolist(),
                title=f"packed values (T,) = ({T},), offsets {offsets.tolist()}")
    ax_pack.set_xlabel("offsets: where each sequence starts, then where the last one ends")
    fig.tight_layout()
    return fig
