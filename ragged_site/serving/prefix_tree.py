"""The tree of a :class:`~ragged_toolkit.serving.prefix_cache.PrefixCache`'s
blocks: each cached or held block and the block before it in the prefixes
that hold it (:func:`cached_tree`), the tree at the step of a run where most
requests share blocks (:class:`MostSharedTree`), and its picture
(:func:`draw_cached_tree`, titled by :func:`draw_most_shared`): which
requests share which blocks at one step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "CachedBlock",
    "cached_tree",
    "MostSharedTree",
    "tree_rows",
    "draw_cached_tree",
    "draw_most_shared",
]


@dataclass
class CachedBlock:
    """A block of a :class:`~ragged_toolkit.serving.prefix_cache.PrefixCache`
    as a node of the tree of prefixes: its parent block (``None`` at a
    root), its depth (its place in the prefixes that hold it), its readers,
    and its kind: ``"cached"`` (it has a key), ``"copy"`` (full and
    computed, but not cached: its key is another block's, with other tokens,
    a hash collision, or it follows such a block) or ``"own"`` (a request's last blocks,
    not full or not computed yet)."""

    block: int
    parent: int | None
    depth: int
    readers: int
    kind: str


def cached_tree(cache):
    """The tree of a :class:`~ragged_toolkit.serving.prefix_cache.PrefixCache`:
    every cached block and every block a request holds, each with the block
    before it in the prefixes that hold it. Returns a list of
    :class:`CachedBlock`, shallowest first."""
    nodes = {}
    for b, parent in cache.parent_of.items():
        depth = 0
        while parent is not None:
            depth, parent = depth + 1, cache.parent_of[parent]
        nodes[b] = CachedBlock(b, cache.parent_of[b], depth, cache.refs[b], "cached")
    for rid, table in cache.tables.items():
        computed = len(cache.chains.get(rid, []))  # its full blocks whose keys it knows
        for depth, b in enumerate(table):
            if b not in nodes:
                nodes[b] = CachedBlock(
                    b,
                    table[depth - 1] if depth else None,
                    depth,
                    cache.refs[b],
                    "copy" if depth < computed else "own",
                )
    return sorted(nodes.values(), key=lambda n: (n.depth, n.block))


class MostSharedTree:
    """An observer of serving runs (``serve(..., observe=)``) that keeps the
    :func:`cached_tree` of the step, over all the runs it watched, where the
    blocks read by several requests had the most readers: ``nodes`` (empty
    until a step was seen), ``step`` (its index in its run) and ``running``
    (the requests running after it)."""

    def __init__(self):
        self.sharing, self.step, self.running, self.nodes = -1, None, 0, []

    def __call__(self, step, running, cache):
        sharing = sum(r for r in cache.refs if r > 1)  # readers of the blocks read by several
        if sharing > self.sharing:
            self.sharing, self.step, self.running, self.nodes = (
                sharing,
                step,
                len(running),
                cached_tree(cache),
            )


def tree_rows(nodes):
    """Where each node of :func:`cached_tree` sits in a drawing: a leaf on
    the next row, depth first, a parent at the mean row of its children.
    Returns block -> row."""
    by_block = {n.block: n for n in nodes}
    children = {n.block: [] for n in nodes}
    for n in nodes:
        if n.parent in by_block:
            children[n.parent].append(n.block)
    rows, stack = {}, [n.block for n in nodes if n.parent not in by_block][::-1]
    while stack:
        b = stack.pop()
        if not children[b]:
            rows[b] = len(rows)
        stack += children[b][::-1]
    for n in sorted(nodes, key=lambda n: -n.depth):
        if children[n.block]:
            rows[n.block] = float(np.mean([rows[c] for c in children[n.block]]))
    return rows


def draw_cached_tree(nodes, title):
    """A figure of the tree of cached blocks (:func:`cached_tree`): each
    block at its depth, linked to its parent; red if several requests read
    it (their count where it changes), blue if one, gray if idle; a copy
    (see :class:`CachedBlock`) hollow. Returns the figure."""
    import matplotlib.pyplot as plt

    by_block, rows = {n.block: n for n in nodes}, tree_rows(nodes)
    fig, ax = plt.subplots(figsize=(8, 6), layout="constrained")
    for n in nodes:
        if n.parent in by_block:
            ax.plot([n.depth - 1, n.depth], [rows[n.parent], rows[n.block]], color="0.6", lw=0.8)
    for n in nodes:
        color = "C3" if n.readers > 1 else "C0" if n.readers else "0.75"
        ax.scatter(
            n.depth,
            rows[n.block],
            s=14 + 6 * n.readers,
            zorder=3,
            c="white" if n.kind == "copy" else color,
            edgecolors=color,
        )
        if n.readers > 1 and (n.parent not in by_block or by_block[n.parent].readers != n.readers):
            ax.annotate(
                f"{n.readers} read",
                (n.depth, rows[n.block]),
                xytext=(3, 4),
                textcoords="offset points",
                fontsize=10,
            )
    ax.set(xlabel="block of the prefix", ylabel="prefixes (a row per leaf)", yticks=[], title=title)
    return fig


def draw_most_shared(tree, block_size):
    """:func:`draw_cached_tree` of a :class:`MostSharedTree`'s ``tree``,
    titled with its step, the requests then running, what each color
    means, the copies (or that there are none) and ``block_size``. Returns
    the figure."""
    copies = [n.kind for n in tree.nodes].count("copy")
    return draw_cached_tree(
        tree.nodes,
        f"Blocks at step {tree.step}, {tree.running} requests running: "
        f"shared (red),\nread by one (blue), idle (gray)"
        + (f", {copies} copies (hollow)" if copies else ", no copies at this step")
        + f"; blocks of {block_size} rows",
    )
