"""Prefix caching on the paged KV cache: a full block is known by its key,
its parent block's key and its own tokens, so that a request whose prompt
begins as an earlier one did reads that request's blocks instead of
computing their keys again. Blocks carry reference counts; a block whose
last reader has left stays cached, evictable in least-recently-used order,
until its memory is needed. Only full blocks are shared: a request's last,
partial block is always its own, so a shared block is never written.

:class:`PrefixCache` is a :class:`~ragged_toolkit.kv_cache.PagedKVCache`;
the continuous-batching scheduler asks it for a newcomer's cached prefix
(``take_prefix``), and :func:`retire_caching`, the server's step end, keys
the blocks that the step filled."""

from __future__ import annotations

from collections import OrderedDict

from ..kv_cache import PagedKVCache
from .schedulers import retire_finished

__all__ = ["block_key", "PrefixCache", "retire_caching"]


def block_key(parent, tokens):
    """The key of a full block: its parent's key (``None`` for a first
    block) and its own tokens. The parent's key holds the grandparent's, and
    so on: equal keys mean equal tokens from position 0 to the block's end,
    hence equal keys and values in every layer. (vLLM and nano-vllm hash
    this pair into one number; here the pair itself is the key, so two
    prefixes never collide.)"""
    return (parent, tuple(tokens))


class PrefixCache(PagedKVCache):
    """A :class:`~ragged_toolkit.kv_cache.PagedKVCache` that keeps the full
    blocks of every prefix it computed. ``refs[b]``: the requests whose
    table holds block ``b``; ``block_of``/``key_of``: the cached blocks by
    key and the key of each; ``idle``: cached blocks no request holds, least
    recently used first, evicted (their keys forgotten) when the free list
    runs short. ``hit_tokens``/``asked_tokens`` count what admissions found
    in the cache and asked of it; ``first_hit[rid]``: the tokens request
    ``rid`` found at its first admission."""

    def __init__(self, cfg, n_blocks, block_size, device, dtype):
        super().__init__(cfg, n_blocks, block_size, device, dtype)
        self.refs = [0] * n_blocks
        self.block_of, self.key_of = {}, {}
        self.idle = OrderedDict()  # block -> None, least recently used first
        self.keys = {}  # request id -> the keys of its full blocks so far
        self.hit_tokens = self.asked_tokens = self.evictions = 0
        self.first_hit, self._admitting = {}, {}

    def take_prefix(self, rid, tokens):
        """Admission: request ``rid``'s table starts with the cached blocks of
        the longest prefix of ``tokens`` in whole blocks, leaving at least one
        token to compute (its logits choose the next token). Each block taken
        gains a reader and leaves the idle list. Returns the tokens covered."""
        size, key, table = self.block_size, None, []
        for i in range((len(tokens) - 1) // size):
            key = block_key(key, tokens[i * size:(i + 1) * size])
            if key not in self.block_of:
                break
            table.append(self.block_of[key])
            self.keys.setdefault(rid, []).append(key)
        for b in table:
            self.refs[b] += 1
            self.idle.pop(b, None)
        self.tables[rid] = table
        self._admitting[rid] = (len(table) * size, len(tokens))  # counted once it runs a step
        return len(table) * size

    def reserve(self, rid, n_tokens):
        """Grow request ``rid``'s table to ``n_tokens`` tokens with blocks of
        its own, from the free list, evicting idle cached blocks (least
        recently used first) when it runs short. Returns False, taking
        nothing, if free and idle blocks together are too few: a block that
        a request holds is never evicted."""
        need = -(-n_tokens // self.block_size) - len(self.tables.get(rid, []))
        if need > len(self.free) + len(self.idle):
            return False
        while need > len(self.free):
            self.evict()
        held = len(self.tables.get(rid, []))
        super().reserve(rid, n_tokens)
        for b in self.tables[rid][held:]:
            self.refs[b] = 1
        return True

    def evict(self):
        """Forget the least recently used idle block's key; free the block."""
        b, _ = self.idle.popitem(last=False)
        del self.block_of[self.key_of.pop(b)]
        self.free.append(b)
        self.evictions += 1

    def release(self, rid):
        """Request ``rid`` leaves (finished or preempted): each of its blocks
        loses a reader; one with none left stays cached, idle, if it has a key,
        else goes back to the free list. Its last blocks are released first,
        so that among them they are the first evicted (a child before its
        parent)."""
        for b in reversed(self.tables.pop(rid, [])):
            self.refs[b] -= 1
            if self.refs[b] == 0 and b in self.key_of:
                self.idle[b] = None
            elif self.refs[b] == 0:
                self.free.append(b)
        self.keys.pop(rid, None)
        self._admitting.pop(rid, None)  # not admitted after all: not counted

    def note_computed(self, req):
        """After a step: key each block of ``req`` that its computed tokens now
        fill, so that later requests find it. A block whose key another block
        already has stays the request's own (freed when it leaves)."""
        if req.rid in self._admitting:
            hit, asked = self._admitting.pop(req.rid)
            self.hit_tokens, self.asked_tokens = self.hit_tokens + hit, self.asked_tokens + asked
            self.first_hit.setdefault(req.rid, hit)
        keys, size = self.keys.setdefault(req.rid, []), self.block_size
        tokens = None
        while (len(keys) + 1) * size <= req.computed:
            tokens = req.prompt + req.generated if tokens is None else tokens
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else None, tokens[i * size:(i + 1) * size]))
            b = self.tables[req.rid][i]
            if keys[-1] not in self.block_of and b not in self.key_of:
                self.block_of[keys[-1]], self.key_of[b] = b, keys[-1]

    def slots(self, rid, positions):
        """The rows the keys of request ``rid`` at ``positions`` go to;
        raises ``RuntimeError`` if one is in a cached or shared block (those
        are read-only: their readers rely on what they hold)."""
        rows = super().slots(rid, positions)
        for b in {r // self.block_size for r in rows}:
            if b in self.key_of or self.refs[b] != 1:
                raise RuntimeError(f"request {rid} would write into block {b}, which is "
                                   f"{'cached' if b in self.key_of else 'shared'} ({self.refs[b]} readers)")
        return rows

    def check(self):
        """Raise ``RuntimeError`` unless every block is exactly one of: free,
        idle (cached, no reader), or held, its count of readers that of the
        tables holding it; and every key names one block and back."""
        holders, free = {}, set(self.free)
        for table in self.tables.values():
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        if len(free) != len(self.free):
            raise RuntimeError("a block is on the free list twice")
        for b in range(self.n_blocks):
            places = [b in free, b in self.idle, b in holders].count(True)
            if places != 1:
                raise RuntimeError(f"block {b} is in {places} of: the free list, the idle list, a table")
            if self.refs[b] != holders.get(b, 0):
                raise RuntimeError(f"block {b} counts {self.refs[b]} readers; {holders.get(b, 0)} tables hold it")
            if b in free and b in self.key_of or b in self.idle and b not in self.key_of:
                raise RuntimeError(f"block {b} is {'free with' if b in free else 'idle without'} a key")
        if any(self.key_of.get(b) != k for k, b in self.block_of.items()) or \
                len(self.block_of) != len(self.key_of):
            raise RuntimeError("a key and its block do not name each other")


def retire_caching(running, cache):
    """The server's step end with a :class:`PrefixCache`: key the blocks each
    running request's computed tokens filled, then let finished requests
    leave (:func:`~ragged_toolkit.serving.schedulers.retire_finished`)."""
    for req in running:
        cache.note_computed(req)
    retire_finished(running, cache)
