"""Prefix caching on the paged KV cache: a full block is found by its key,
a fixed-size hash chained from its parent block's key and its own tokens,
so that a request whose prompt begins as an earlier one did reads that
request's blocks instead of computing their keys again. A hit is checked:
the block found must hold the same tokens after the same parent block, so
two prefixes whose hashes collide never share a block. Blocks carry
reference counts; a block whose last reader has left stays cached,
evictable in least-recently-used order, until its memory is needed. Only
full blocks are shared: a request's last, partial block is always its own,
so a shared block is never written.

:class:`PrefixCache` is a :class:`~ragged_toolkit.kv_cache.PagedKVCache`;
the continuous-batching scheduler asks it for a newcomer's cached prefix
(``take_prefix``), and :func:`retire_caching`, the server's step end, keys
the blocks that the step filled. What admissions found (the hit rate) is
counted outside the cache, by a :class:`PrefixStats` it reports to."""

from __future__ import annotations

from collections import OrderedDict

from ..kv_cache import PagedKVCache
from .requests import next_tokens
from .schedulers import retire_finished

__all__ = ["block_hash", "PrefixStats", "PrefixCache", "retire_caching"]


def block_hash(parent, tokens):
    """The key of a full block: one number hashed from its parent's key
    (``None`` for a first block) and its own tokens, so hashing a block costs
    its own tokens, whatever its depth (vLLM and nano-vllm chain their keys
    the same way). Equal prefixes have equal keys; unequal ones almost never
    do, and :class:`PrefixCache` checks a hit's tokens and parent, so a
    collision costs a miss, never a wrong block."""
    return hash((-1 if parent is None else parent, tuple(tokens)))


class PrefixStats:
    """What a :class:`PrefixCache`'s admissions found, counted outside it:
    ``hit_tokens`` and ``asked_tokens`` (the prompt tokens admissions found
    cached, and asked for), ``first_hit[rid]`` (what request ``rid`` found at
    its first admission) and ``evictions``. An admission counts once its
    request runs a step (one undone by a full cache does not)."""

    def __init__(self):
        self.hit_tokens = self.asked_tokens = self.evictions = 0
        self.first_hit = {}

    def admitted(self, rid, found, asked):
        self.hit_tokens, self.asked_tokens = self.hit_tokens + found, self.asked_tokens + asked
        self.first_hit.setdefault(rid, found)

    def evicted(self, block):
        self.evictions += 1

    def hit_rate(self):
        """The share of the prompt tokens asked for that were found cached."""
        return self.hit_tokens / self.asked_tokens if self.asked_tokens else 0.0


class PrefixCache(PagedKVCache):
    """A :class:`~ragged_toolkit.kv_cache.PagedKVCache` that keeps the full
    blocks of every prefix it computed. ``refs[b]``: the requests whose
    table holds block ``b``; ``block_of``/``key_of``: the cached blocks by
    key and the key of each; ``tokens_of``/``parent_of``: a cached block's
    tokens and the cached block before it (``None`` for a first block), which
    a hit must match; ``idle``: cached blocks no request holds, least
    recently used first, evicted (their keys forgotten) when the free list
    runs short. ``chains[rid]``: the keys of request ``rid``'s full
    blocks so far. ``stats``: a
    :class:`PrefixStats` told of each admission and eviction, if given;
    ``block_hash``: the key function (:func:`block_hash`)."""

    def __init__(
        self, cfg, n_blocks, block_size, device, dtype, *, stats=None, block_hash=block_hash
    ):
        super().__init__(cfg, n_blocks, block_size, device, dtype)
        self.refs = [0] * n_blocks
        self.block_of, self.key_of, self.tokens_of, self.parent_of = {}, {}, {}, {}
        self.idle = OrderedDict()  # block -> None, least recently used first
        self.chains = {}  # request id -> the keys of its full blocks so far
        self.stats, self.block_hash = stats, block_hash
        self._admitting = {}  # request id -> (tokens found, tokens asked), until it runs a step

    def find(self, key, tokens, parent):
        """The cached block of ``key`` if it holds ``tokens`` after block
        ``parent`` (``None``: a first block), else ``None``."""
        b = self.block_of.get(key)
        if b is None or self.tokens_of[b] != tuple(tokens) or self.parent_of[b] != parent:
            return None
        return b

    def take_prefix(self, rid, tokens):
        """Admission: request ``rid``'s table starts with the cached blocks of
        the longest prefix of ``tokens`` in whole blocks, leaving at least one
        token to compute (its logits choose the next token). Each block taken
        gains a reader and leaves the idle list. Returns the tokens covered."""
        size, key, table = self.block_size, None, []
        for i in range((len(tokens) - 1) // size):
            block_tokens = tokens[i * size : (i + 1) * size]
            key = self.block_hash(key, block_tokens)
            b = self.find(key, block_tokens, table[-1] if table else None)
            if b is None:
                break
            table.append(b)
        for b in table:
            self.refs[b] += 1
            self.idle.pop(b, None)
        self.tables[rid] = table
        self.chains[rid] = [self.key_of[b] for b in table]
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
        """Forget the least recently used idle block's key; free the block.
        (A cached block's children are idle no longer than it, so they went
        first: no cached block outlives its parent.)"""
        b, _ = self.idle.popitem(last=False)
        del self.block_of[self.key_of.pop(b)]
        del self.tokens_of[b], self.parent_of[b]
        self.free.append(b)
        if self.stats is not None:
            self.stats.evicted(b)

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
        self.chains.pop(rid, None)
        self._admitting.pop(rid, None)  # not admitted after all: not counted

    def note_computed(self, req):
        """After a step: key each block of ``req`` that its computed tokens now
        fill, so that later requests find it. If another request computed the
        same block first (in the same step), ``req`` reads that one instead
        and its own copy goes back to the free list. A block whose key
        another block has with other tokens (a hash collision) stays the
        request's own, and so do the blocks after it."""
        if req.rid in self._admitting and self.stats is not None:
            self.stats.admitted(req.rid, *self._admitting[req.rid])
        self._admitting.pop(req.rid, None)
        chain, size, table = (
            self.chains.setdefault(req.rid, []),
            self.block_size,
            self.tables[req.rid],
        )
        while (len(chain) + 1) * size <= req.computed:
            i = len(chain)
            tokens, parent = next_tokens(req, i * size, size), table[i - 1] if i else None
            key = self.block_hash(chain[-1] if chain else None, tokens)
            cached = self.find(key, tokens, parent)
            if cached is not None and cached != table[i]:  # read the first copy, free this one
                self.refs[cached] += 1
                self.idle.pop(cached, None)
                self.refs[table[i]] = 0
                self.free.append(table[i])
                table[i] = cached
            elif (
                cached is None
                and key not in self.block_of
                and (parent is None or parent in self.key_of)
            ):
                b = table[i]
                self.block_of[key], self.key_of[b] = b, key
                self.tokens_of[b], self.parent_of[b] = tuple(tokens), parent
            chain.append(key)

    def check_writable(self, rid, start, stop):
        """Raise ``RuntimeError`` unless request ``rid`` may write the keys of
        positions ``start`` to ``stop - 1``: its table reaches that far and
        none of those blocks is cached or shared (those are read-only: their
        readers rely on what they hold)."""
        super().check_writable(rid, start, stop)
        table = self.tables[rid]
        for b in table[start // self.block_size : -(-stop // self.block_size)]:
            if b in self.key_of or self.refs[b] != 1:
                raise RuntimeError(
                    f"request {rid} would write into block {b}, which is "
                    f"{'cached' if b in self.key_of else 'shared'} ({self.refs[b]} readers)"
                )

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
                raise RuntimeError(
                    f"block {b} is in {places} of: the free list, the idle list, a table"
                )
            if self.refs[b] != holders.get(b, 0):
                raise RuntimeError(
                    f"block {b} counts {self.refs[b]} readers; {holders.get(b, 0)} tables hold it"
                )
            if b in free and b in self.key_of or b in self.idle and b not in self.key_of:
                raise RuntimeError(
                    f"block {b} is {'free with' if b in free else 'idle without'} a key"
                )
        if any(self.key_of.get(b) != k for k, b in self.block_of.items()) or not len(
            self.block_of
        ) == len(self.key_of) == len(self.tokens_of) == len(self.parent_of):
            raise RuntimeError("a key and its block do not name each other")
        orphan = next(
            (
                b
                for b, parent in self.parent_of.items()
                if parent is not None and parent not in self.key_of
            ),
            None,
        )
        if orphan is not None:
            raise RuntimeError(
                f"cached block {orphan} follows block {self.parent_of[orphan]}, which is not cached"
            )


def retire_caching(running, cache):
    """The server's step end with a :class:`PrefixCache`: key the blocks each
    running request's computed tokens filled, then let finished requests
    leave (``retire_finished``)."""
    for req in running:
        cache.note_computed(req)
    retire_finished(running, cache)
