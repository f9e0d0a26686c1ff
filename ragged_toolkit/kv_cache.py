"""Key/value caches: :class:`KVCache`, room for a fixed number of tokens per
sequence (a packed batch with spare rows), read by a packed step or by a
fixed-shape one (``CachedStep``); and :class:`PagedKVCache`, blocks
handed out from a free list to each request's block table, as servers page
their caches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention.dense import shares_heads
from .batches import offsets_from_lengths, token_index

__all__ = ["KVCache", "PagedKVCache", "block_table_tensor"]


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
            raise RuntimeError(
                f"request {rid} writes position {stop - 1}, but its {held} blocks hold "
                f"{held * self.block_size} tokens: reserve its rows first"
            )

    def write(self, layer, k, v, rows):
        """New keys and values (T, H_kv, D) into their rows (T,)."""
        self.k[layer].index_copy_(0, rows, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, rows, v.to(self.v.dtype))

    def check(self):
        """Raise ``RuntimeError`` unless each block is free or in one table, once."""
        owner = {}
        for holder, table in [
            ("the free list", self.free),
            *((f"the table of request {r}", t) for r, t in self.tables.items()),
        ]:
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
    return torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    )


def paged_rows(block_table, kv_lengths, block_size):
    """The cache rows of every key each sequence uses, sequence after
    sequence, (sum(kv_lengths),) int64, from the block table (B, max_blocks)
    and the keys in use (B,)."""
    seq, pos = token_index(offsets_from_lengths(kv_lengths, block_table.device))
    return block_table[seq, pos // block_size].long() * block_size + pos % block_size
