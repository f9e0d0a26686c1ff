"""The pictures the pages draw from the toolkit's own objects, and the style
of every figure on the site. Matplotlib is imported when a picture is drawn."""

import numpy as np

from ragged_toolkit.batches import offsets_from_lengths, token_index

__all__ = [
    "FIGURE_STYLE",
    "draw_batch",
    "draw_block_mask",
    "draw_scores",
    "draw_kv_cache",
    "draw_cache_memory",
    "draw_token_budget",
    "draw_speedups",
    "draw_speedup_cases",
    "draw_paged_cache",
    "draw_floor",
]

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


def draw_floor(ax, floor):
    """On ``ax``, a log axis of differences drawn at least at ``floor``
    (``max(d, floor)``): a dashed line at the floor, labelled for the legend
    with its value, and a gray band below it, so that a difference drawn at
    the floor (zero included) reads as "at most this", never as a value."""
    mantissa, exponent = f"{floor:e}".split("e")
    ax.axhspan(floor / 10, floor, color="0.93", zorder=0, lw=0)
    ax.axhline(
        floor,
        color="k",
        ls="--",
        lw=1,
        zorder=4,
        label=f"floor {float(mantissa):g}e{int(exponent)}: differences at or below it,"
        " zero included, are drawn here",
    )


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
            _cell(
                ax_pad,
                s,
                b,
                colors[b] if real else "0.88",
                f"{s}" if real else "pad",
                "white" if real else "0.45",
            )
    for t in range(T):
        _cell(ax_pack, t, 0, colors[int(seq[t])], f"{int(pos[t])}")
    ax_pad.set(
        xlim=(0, S),
        ylim=(B, 0),
        title=f"padded (B, S) = ({B}, {S}) and a mask: {B * S - T} of {B * S} slots are padding",
    )
    ax_pad.axis("off")
    ax_pack.set(
        xlim=(0, T),
        ylim=(1, -0.1),
        yticks=[],
        xticks=offsets.tolist(),
        title=f"packed values (T,) = ({T},), offsets {offsets.tolist()}",
    )
    ax_pack.set_xlabel("offsets: where each sequence starts, then where the last one ends")
    fig.tight_layout()
    return fig


def _block_grid(block_mask):
    """The blocks of a FlexAttention ``BlockMask`` (batch 0, head 0) as a
    (query blocks, key blocks) int grid: 2 where the whole block is computed
    with no mask, 1 where the mask runs inside it, 0 where it is skipped."""
    import torch

    grid = torch.zeros(
        block_mask.kv_num_blocks.shape[-1], block_mask.kv_indices.shape[-1], dtype=torch.long
    )
    for kind, (counts, indices) in (
        (1, (block_mask.kv_num_blocks, block_mask.kv_indices)),
        (2, (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)),
    ):
        if counts is None:
            continue
        for row, (n, cols) in enumerate(zip(counts[0, 0].tolist(), indices[0, 0].tolist())):
            grid[row, cols[:n]] = kind
    return grid


def draw_block_mask(block_mask, title=""):
    """A FlexAttention ``BlockMask`` drawn block by block: computed whole,
    computed with the mask inside, skipped; the legend names only the kinds
    the mask has. Returns the figure and the fraction of blocks skipped."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    grid = _block_grid(block_mask).numpy()
    colors = ["#f4f4f4", "#f2a541", "#3b6ea5"]  # skipped, partial, full
    fig, ax = plt.subplots(figsize=(6.5, 6.5 * grid.shape[0] / grid.shape[1] + 1.2))
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=2)
    ax.set_xticks(np.arange(grid.shape[1] + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(grid.shape[0] + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    block = block_mask.BLOCK_SIZE[0]
    ax.set(xlabel=f"key block ({block} keys each)", ylabel=f"query block ({block} queries each)")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
    skipped = float((grid == 0).mean())
    ax.set_title(title or f"{skipped:.0%} of the blocks skipped")
    names = ("skipped", "computed, mask applied", "computed whole")
    drawn = [kind for kind in (2, 1, 0) if (grid == kind).any()]  # a legend lists only these
    ax.legend(
        handles=[Patch(color=colors[kind], label=names[kind]) for kind in drawn],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncols=len(drawn),
        fontsize=11,
        frameon=False,
    )
    fig.tight_layout()
    return fig, skipped


def draw_scores(lengths):
    """The query-key pairs causal attention scores for one batch, packed (one
    ``(T, T)`` matrix, a triangle per sequence on its diagonal) beside padded
    (a ``(S, S)`` matrix per sequence, with the pairs that touch padding).
    Each sequence has its color; gray pairs are computed and thrown away."""
    import matplotlib.pyplot as plt

    offsets = offsets_from_lengths(lengths)
    B, S, T = len(lengths), max(lengths), int(offsets[-1])
    colors = plt.get_cmap("tab10")(np.arange(B) % 10)
    fig, (ax_pack, ax_pad) = plt.subplots(1, 2, figsize=(8, 4.6), width_ratios=[T, S])
    packed = np.ones((T, T, 4))  # white: never computed
    for b, (start, n) in enumerate(zip(offsets[:-1].tolist(), lengths)):
        rows, cols = np.tril_indices(n)
        packed[start + rows, start + cols] = colors[b]
    ax_pack.imshow(packed)
    ax_pack.set_title(
        f"packed: {int(sum(n * (n + 1) // 2 for n in lengths))} pairs\n(T, T) = ({T}, {T})"
    )
    padded = np.ones((B * (S + 1) - 1, S, 4))
    for b, n in enumerate(lengths):
        rows, cols = np.tril_indices(S)
        real = (rows < n) & (cols < n)
        top = b * (S + 1)
        padded[top + rows, cols] = np.where(real[:, None], colors[b], (0.72, 0.72, 0.72, 1))
    ax_pad.imshow(padded)
    ax_pad.set_title(f"padded: {B * S * (S + 1) // 2} pairs\n{B} x (S, S) = {B} x ({S}, {S})")
    for ax in (ax_pack, ax_pad):
        ax.set(xticks=[], yticks=[], xlabel="keys", ylabel="queries")
    fig.suptitle(
        "causal scores: a color per sequence; gray, padding, computed and thrown away", fontsize=12
    )
    fig.tight_layout()
    return fig


def draw_kv_cache(kv_used, capacity, new=None):
    """A KV cache as packed rows: each sequence owns ``capacity`` rows and uses
    the first ``kv_used[b]`` of them; ``new`` (B,), the row each sequence's
    next token writes, is marked."""
    import matplotlib.pyplot as plt

    kv_used = [int(n) for n in kv_used]
    B = len(kv_used)
    colors = plt.get_cmap("tab10")(np.arange(B) % 10)
    fig, ax = plt.subplots(figsize=(8, 0.8 * B + 1.6))
    for b, n in enumerate(kv_used):
        for s in range(capacity):
            is_new = new is not None and s == int(new[b])
            color = colors[b] if s < n else ("white" if is_new else "0.88")
            _cell(ax, s, b, color, f"{b * capacity + s}", "white" if s < n else "0.35")
            if is_new:
                ax.add_patch(plt.Rectangle((s, b), 0.92, 0.86, fill=False, lw=2.5, ec=colors[b]))
        ax.text(capacity + 0.3, b + 0.43, f"kv_used {n}", va="center")
    ax.set(
        xlim=(0, capacity + 2.6),
        ylim=(B, -0.1),
        yticks=np.arange(B) + 0.43,
        yticklabels=[f"sequence {b}" for b in range(B)],
        xticks=[],
    )
    ax.set_title(
        f"packed rows: sequence b owns rows b x {capacity} ..."
        + ("; outlined, where its next token goes" if new is not None else "")
    )
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def draw_cache_memory(allocated, filled):
    """One group of bars per model: its KV cache's allocated MiB (from the
    buffers' shapes), and the MiB its tokens fill at each stage (``filled``:
    stage -> the fraction of the allocation in use), each bar labelled with
    its value."""
    import matplotlib.pyplot as plt

    models, stages = list(allocated), ["allocated", *filled]
    width = 0.8 / len(stages)
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for i, stage in enumerate(stages):
        share = 1.0 if stage == "allocated" else filled[stage]
        values = [allocated[m] * share for m in models]
        x = np.arange(len(models)) + (i - (len(stages) - 1) / 2) * width
        label = stage if stage == "allocated" else f"filled {stage} ({share:.0%})"
        bars = ax.bar(x, values, width, label=label, color=f"C{i}")
        ax.bar_label(bars, fmt="%.2f", padding=2)  # as the table above prints them
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("MiB, from the buffers' shapes")
    ax.set_ylim(0, max(allocated.values()) * 1.18)
    ax.set_title("KV cache: allocated, and filled by tokens")
    ax.legend(loc="upper right")
    return fig


def draw_token_budget(lengths, budget, micro_batches=None):
    """Documents of ``lengths`` end to end, cut every ``budget`` tokens into
    micro-batches (at most ``micro_batches`` of them drawn): each document
    its color, each cut that falls inside a document marked."""
    import matplotlib.pyplot as plt

    offsets = offsets_from_lengths(lengths).tolist()
    total = offsets[-1] // budget * budget
    rows = total // budget if micro_batches is None else min(micro_batches, total // budget)
    colors = plt.get_cmap("tab20")(np.arange(len(lengths)) % 20)
    fig, ax = plt.subplots(figsize=(8, 0.55 * rows + 1.5))
    cuts = 0
    for b, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        for r in range(start // budget, min((end - 1) // budget, rows - 1) + 1):
            lo, hi = max(start, r * budget), min(end, (r + 1) * budget)
            ax.barh(
                r, hi - lo, left=lo - r * budget, height=0.8, color=colors[b], edgecolor="white"
            )
            if hi == (r + 1) * budget and end > hi:  # the document goes on in the next row
                for x, y in ((budget, r), (0, r + 1))[: 1 + (r + 1 < rows)]:
                    ax.plot([x, x], [y - 0.45, y + 0.45], color="black", lw=4, clip_on=False)
                cuts += 1
    ax.set(
        xlim=(0, budget),
        ylim=(rows - 0.5, -0.5),
        xlabel=f"token position in the micro-batch (budget {budget})",
        yticks=range(rows),
        yticklabels=[f"{r}" for r in range(rows)],
        ylabel="micro-batch",
    )
    ax.set_title(
        f"{rows} micro-batches; a black edge: a document cut there ({cuts}), its rest opens the next"
    )
    fig.tight_layout()
    return fig


def draw_speedups(speedup, rows, columns, bounds, title=""):
    """Measured speedups over a baseline as a grid: ``speedup`` (rows,
    columns), NaN where a row cannot take a column's job, each cell colored
    on a log scale from 1/8 to 8 (green: faster than the baseline), with its
    speedup and, below it, its fraction of the column's work bound
    (``bounds``, one per column); the first row is the baseline itself."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, ax = plt.subplots(figsize=(8, 6))
    image = ax.imshow(speedup, cmap="RdYlGn", norm=LogNorm(1 / 8, 8), aspect="auto")
    for (i, j), s in np.ndenumerate(speedup):
        text = "n/a" if np.isnan(s) else f"{s:.{1 if s >= 1 else 2}f}x"  # 0.04x, not 0.0x
        if i and not np.isnan(s):
            text += f"\n({s / bounds[j]:.2f})"
        dark = not np.isnan(s) and abs(np.log2(s)) > 2  # white text on the darkest cells
        ax.text(j, i, text, ha="center", va="center", color="white" if dark else "black")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_title(title)
    bar = fig.colorbar(image, ax=ax, label="speedup (log scale)")
    bar.ax.minorticks_off()
    bar.set_ticks([2.0**e for e in range(-3, 4)], labels=["1/8", "1/4", "1/2", "1", "2", "4", "8"])
    fig.tight_layout()
    return fig


def draw_speedup_cases(cases, title, xlabel="speedup (higher is better)"):
    """One bar per case, its measured speedup, beside a mark at its work
    bound. ``cases``: label -> (speedup, bound, within noise). A case within
    the noise is hatched and says so in the legend; the dashed line at 1 is
    no gain."""
    import matplotlib.pyplot as plt

    labels = list(cases)
    fig, ax = plt.subplots(figsize=(8, 2.0 + 0.6 * len(labels)), layout="constrained")
    for y, label in enumerate(labels):
        speedup, bound, noisy = cases[label]
        hatch = dict(hatch="//", facecolor="white", edgecolor="C0") if noisy else dict(color="C0")
        ax.barh(y, speedup, height=0.6, label="within noise" if noisy else "measured", **hatch)
        ax.plot([bound, bound], [y - 0.38, y + 0.38], color="black", lw=3, label="work bound")
        ax.text(max(speedup, bound), y, f"  {speedup:.2f}x (bound {bound:.2f}x)", va="center")
    ax.axvline(1.0, color="0.4", ls="--", lw=1, label="1x: no gain")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))  # each label once, in the order first drawn
    fig.legend(unique.values(), unique.keys(), loc="outside lower center", ncols=len(unique))
    ax.set(
        yticks=range(len(labels)), yticklabels=labels, xlabel=xlabel, ylim=(len(labels) - 0.5, -0.5)
    )
    ax.set_xlim(0, max(max(c[0], c[1]) for c in cases.values()) * 1.5)  # room for the labels
    ax.set_title(title)
    return fig


def draw_paged_cache(tables, free, n_blocks, block_size, keys, shown=4):
    """A figure of a paged cache at one step, from its block ``tables``
    (request id -> blocks) and ``free`` list. Above, its ``n_blocks`` blocks
    of ``block_size`` rows, 20 a row: the ``shown`` requests with the most
    blocks each in its color, each block showing its place in the request's
    table (the logical block), the others gray, free blocks white. Below,
    those requests' block tables (the physical block of each logical block),
    labeled with their ``keys`` in use (request id -> keys). Returns the figure."""
    import matplotlib.pyplot as plt

    chosen = sorted(tables, key=lambda rid: -len(tables[rid]))[:shown]
    owner, per_row = {b: rid for rid, blocks in tables.items() for b in blocks}, 20
    lines = -(-n_blocks // per_row)
    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(8, 6.5), layout="constrained", height_ratios=[lines, len(chosen)]
    )

    def cell(ax, x, y, color, text=""):
        ax.add_patch(plt.Rectangle((x, y), 0.92, 0.86, fc=color, ec="0.5"))
        ax.text(x + 0.46, y + 0.43, text, ha="center", va="center", color="white")

    for b in range(n_blocks):
        rid = owner.get(b)
        if rid in chosen:
            cell(ax1, b % per_row, b // per_row, f"C{chosen.index(rid)}", str(tables[rid].index(b)))
        else:
            cell(ax1, b % per_row, b // per_row, "white" if rid is None else "0.75")
    ax1.set(
        xlim=(0, per_row),
        ylim=(lines, 0),
        title=f"The cache: {n_blocks} blocks of {block_size} rows\n"
        f"{len(chosen)} requests (the logical block in each), {len(tables) - len(chosen)} others (gray), "
        f"{len(free)} free (white)",
    )
    for row, rid in enumerate(chosen):
        for j, b in enumerate(tables[rid]):
            cell(ax2, j, row, f"C{row}", str(b))
    ax2.set(
        xlim=(0, max(map(len, tables.values()))),
        ylim=(len(chosen), 0),
        title="their block tables: the physical block of each logical block",
        yticks=[row + 0.43 for row in range(len(chosen))],
        yticklabels=[f"request {rid}, {keys[rid]} keys" for rid in chosen],
    )
    for ax in (ax1, ax2):
        ax.set_xticks([])
        ax.spines[:].set_visible(False)
    ax1.set_yticks([])
    return fig
