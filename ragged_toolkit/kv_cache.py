"""Key/value caches: :class:`KVCache`, room for a fixed number of tokens per
sequence (a packed batch with spare rows), read by a packed step or by a
fixed-shape one (:class:`CachedStep`); and :class:`PagedKVCache`, blocks
handed out from a free list to each request's block table, as servers page
their caches, and its picture (:func:`draw_paged_cache`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention.dense import shares_heads
from .batches import offsets_from_lengths, token_index

__all__ = ["KVCache", "CachedStep", "PagedKVCache", "block_table_tensor", "paged_rows", "draw_paged_cache"]


class KVCache:
    """Keys and values of every layer for ``batch`` sequences with room for
    ``capacity`` tokens each: (layers, batch, capacity, H_kv, D)."""

    def __init__(self, cfg, batch, capacity, device, dtype):
        shape = (cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        # seen as packed rows (batch * capacity, H_kv, D), sequence b owns rows
        # b * capacity ... (b + 1) * capacity - 1: these are its kv_offsets
        self.row_offsets = torch.arange(batch + 1, device=device) * capacity

    def write_rows(self, layer, k, v, rows):
        """Packed new keys (T, H_kv, D) into their rows; returns all rows."""
        k_all, v_all = self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)
        k_all.index_copy_(0, rows, k.to(k_all.dtype))  # autocast may hand us float32
        v_all.index_copy_(0, rows, v.to(v_all.dtype))
        return k_all, v_all

    def write_columns(self, layer, k, v, start):
        """Padded new keys (B, S, H_kv, D) into columns ``start ...``; returns
        every column up to the last one written."""
        end = start + k.shape[1]
        self.k[layer, :, start:end], self.v[layer, :, start:end] = k, v
        return self.k[layer, :, :end], self.v[layer, :, :end]


@dataclass
class CachedStep:
    """One new token for each of B sequences against a :class:`KVCache` of
    fixed capacity, in the style of gpt-fast: the slot each sequence's new
    keys go to is a tensor (``slots``, (B,)), and so is the first slot in
    use (``start``, (B,); left padding, or ``None`` for slot 0). Every shape
    is fixed, so one compiled graph serves every step, with no host sync.
    The kernel scores every slot of the cache and masks those not in use."""

    cache: KVCache
    slots: torch.Tensor  # (B,)
    start: torch.Tensor | None = None  # (B,)

    def attend(self, q, k, v, layer):  # (B, H, D), (B, H_kv, D)
        keys, values = self.cache.k[layer], self.cache.v[layer]  # (B, C, H_kv, D)
        batch = torch.arange(len(q), device=q.device)
        keys[batch, self.slots] = k.to(keys.dtype)
        values[batch, self.slots] = v.to(values.dtype)
        slot = torch.arange(self.cache.capacity, device=q.device)
        mask = slot <= self.slots[:, None]  # (B, C)
        if self.start is not None:
            mask = mask & (slot >= self.start[:, None])
        out = F.scaled_dot_product_attention(
            q[:, :, None].to(keys.dtype),  # (B, H, 1, D)
            keys.transpose(1, 2),  # (B, H_kv, C, D)
            values.transpose(1, 2),
            attn_mask=mask[:, None, None],
            enable_gqa=shares_heads(q[:, :, None], keys.transpose(1, 2)),
        )
        return out[:, :, 0]  # (B, H, D)


class PagedKVCache:
    """Keys and values of every layer in ``n_blocks`` blocks of
    ``block_size`` rows: ``k``, ``v`` (layers, n_blocks * block_size, H_kv, D).
    Free blocks wait on a free list; a request holds a block table, the list
    of its blocks: its token at position ``p`` lives in row
    ``table[p // block_size] * block_size + p % block_size``."""

    def __init__(self, cfg, n_blocks, block_size, device, dtype):
        shape = (cfg.n_layers, n_blocks * block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free = list(range(n_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.tables = {}  # request id -> its blocks, in the order of its tokens

    def reserve(self, rid, n_tokens):
        """Grow request ``rid``'s table to hold ``n_tokens`` tokens. Returns
        False, taking nothing, if the free list has too few blocks."""
        table = self.tables.get(rid, [])
        need = -(-n_tokens // self.block_size) - len(table)
        if need > len(self.free):
            return False
        self.tables[rid] = table + [self.free.pop() for _ in range(max(need, 0))]
        return True

    def release(self, rid):
        """Give request ``rid``'s blocks back to the free list."""
        self.free.extend(reversed(self.tables.pop(rid, [])))

    def take_prefix(self, rid, tokens):
        """Admission: start request ``rid``'s table with the longest prefix of
        ``tokens`` whose keys the cache already holds; returns how many tokens
        that covers. This cache keeps none: 0 (a prefix cache keeps them,
        :class:`~ragged_toolkit.serving.prefix_cache.PrefixCache`)."""
        return 0

    def slots(self, rid, positions):
        """The rows the keys of request ``rid`` at ``positions`` go to (a list)."""
        table, size = self.tables[rid], self.block_size
        return [table[p // size] * size + p % size for p in positions]

    def check_writable(self, rid, start, stop):
        """Raise ``RuntimeError`` unless request ``rid`` may write the keys of
        positions ``start`` to ``stop - 1``: its table reaches that far. (Here
        every block of a table is its own; a prefix cache also refuses the
        blocks it shares.)"""
        held = len(self.tables.get(rid, []))
        if stop > held * self.block_size:
            raise RuntimeError(f"request {rid} writes position {stop - 1}, but its {held} blocks hold "
                               f"{held * self.block_size} tokens: reserve its rows first")

    def write(self, layer, k, v, rows):
        """New keys and values (T, H_kv, D) into their rows (T,)."""
        self.k[layer].index_copy_(0, rows, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, rows, v.to(self.v.dtype))

    def check(self):
        """Raise ``RuntimeError`` unless each block is free or in one table, once."""
        owner = {}
        for holder, table in [("the free list", self.free),
                              *((f"the table of request {r}", t) for r, t in self.tables.items())]:
            for b in table:
                if b in owner:
                    raise RuntimeError(f"block {b} is in {owner[b]} and in {holder}")
                owner[b] = holder
        if len(owner) != self.n_blocks:
            raise RuntimeError(f"{self.n_blocks - len(owner)} blocks are neither free nor held")


def block_table_tensor(cache, rids, device):
    """The block tables of requests ``rids``: (B, max_blocks) int32, each
    row padded with zeros (never read: the lengths bound every read)."""
    tables = [cache.tables[r] for r in rids]
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                        device=device)


def paged_rows(block_table, kv_lengths, block_size):
    """The cache rows of every key each sequence uses, sequence after
    sequence, (sum(kv_lengths),) int64, from the block table (B, max_blocks)
    and the keys in use (B,)."""
    seq, pos = token_index(offsets_from_lengths(kv_lengths, block_table.device))
    return block_table[seq, pos // block_size].long() * block_size + pos % block_size


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
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), layout="constrained", height_ratios=[lines, len(chosen)])

    def cell(ax, x, y, color, text=""):
        ax.add_patch(plt.Rectangle((x, y), 0.92, 0.86, fc=color, ec="0.5"))
        ax.text(x + 0.46, y + 0.43, text, ha="center", va="center", color="white")

    for b in range(n_blocks):
        rid = owner.get(b)
        if rid in chosen:
            cell(ax1, b % per_row, b // per_row, f"C{chosen.index(rid)}", str(tables[rid].index(b)))
        else:
            cell(ax1, b % per_row, b // per_row, "white" if rid is None else "0.75")
    ax1.set(xlim=(0, per_row), ylim=(lines, 0), title=f"The cache: {n_blocks} blocks of {block_size} rows\n"
            f"{len(chosen)} requests (the logical block in each), {len(tables) - len(chosen)} others (gray), "
            f"{len(free)} free (white)")
    for row, rid in enumerate(chosen):
        for j, b in enumerate(tables[rid]):
            cell(ax2, j, row, f"C{row}", str(b))
    ax2.set(xlim=(0, max(map(len, tables.values()))), ylim=(len(chosen), 0),
            title="their block tables: the physical block of each logical block",
            yticks=[row + 0.43 for row in range(len(chosen))],
            yticklabels=[f"request {rid}, {keys[rid]} keys" for rid in chosen])
    for ax in (ax1, ax2):
        ax.set_xticks([])
        ax.spines[:].set_visible(False)
    ax1.set_yticks([])
    return fig
