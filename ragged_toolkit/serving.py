"""Serving ragged requests: a request stream, a paged KV cache (blocks, a free
list, a block table per request), the layout through which a
:class:`~ragged_toolkit.gpt.GPT` attends to it, and two schedulers on one
engine: static batches, and continuous batching with chunked prefill and
preemption. A step feeds each request its next tokens (a prompt chunk, or
the token it generated last): prefill, decoding and recomputation are one
operation."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .attention import backend_support, ragged_attention
from .attention.flex import FLEX_BLOCK, compiled_flex_attention, flex_rows
from .attention.varlen import varlen_attn, varlen_keywords
from .batches import offsets_from_lengths, token_index
from .device import synchronize
from .gpt import Padded

# --- the request stream ------------------------------------------------------------------


@dataclass
class Request:
    """A prompt (token ids), how many tokens to generate (fixed, as benchmarks
    fix it by ignoring the end-of-sequence token), the arrival (seconds of the
    simulated clock); then the tokens generated, each with its logits (vocab,),
    how many of ``prompt + generated`` have keys in the cache, the clock at the
    first and last tokens, and the times it was preempted."""

    rid: int
    prompt: list
    n_out: int
    arrival: float = 0.0
    generated: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    computed: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    preempted: int = 0

    def length(self):
        """Tokens whose keys the request needs: prompt and generated."""
        return len(self.prompt) + len(self.generated)

    def pending(self):
        """Tokens to feed before its next token can be chosen."""
        return self.length() - self.computed

    def done(self):
        """Whether it generated all its tokens."""
        return len(self.generated) >= self.n_out


def output_lengths(rng, n, median, longest, sigma=1.0):
    """``n`` output lengths from a log-normal distribution (long-tailed, as
    chat outputs are) of the given ``median``, cut to ``[1, longest]``: (n,)."""
    drawn = rng.lognormal(np.log(median), sigma, size=n)
    return np.clip(np.round(drawn), 1, longest).astype(int)


def request_stream(documents, n, rng, *, prompt_max, out_median, out_max):
    """``n`` requests, all waiting at time 0: prompts are the openings, at
    most ``prompt_max`` tokens, of distinct documents drawn from
    ``documents`` (``bytes``, a token per byte); :func:`output_lengths`."""
    if n > len(documents):
        raise ValueError(f"{n} requests need {n} documents; the corpus has {len(documents)}")
    chosen = rng.choice(len(documents), size=n, replace=False)
    outs = output_lengths(rng, n, out_median, out_max)
    return [Request(i, list(documents[d][:prompt_max]), int(o))
            for i, (d, o) in enumerate(zip(chosen, outs))]


def poisson_arrivals(rng, n, rate):
    """Arrival times (n,), in seconds, of ``n`` requests at ``rate``
    requests/s on average: a Poisson process, its gaps exponential."""
    return np.cumsum(rng.exponential(1 / rate, size=n))


def fresh_requests(requests, arrivals=None):
    """Copies of ``requests`` with nothing served, arriving at ``arrivals``
    (seconds, one each; default: as they were)."""
    arrivals = [r.arrival for r in requests] if arrivals is None else arrivals
    return [Request(r.rid, r.prompt, r.n_out, float(a)) for r, a in zip(requests, arrivals)]


# --- the paged KV cache ------------------------------------------------------------------


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

    def slots(self, rid, positions):
        """The rows the keys of request ``rid`` at ``positions`` go to (a list)."""
        table, size = self.tables[rid], self.block_size
        return [table[p // size] * size + p % size for p in positions]

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


# --- attention through the block table ---------------------------------------------------


@dataclass
class PagedLayout:
    """A step of a :class:`~ragged_toolkit.gpt.GPT` over a
    :class:`PagedKVCache`: the new tokens packed with ``q_offsets`` (B + 1,),
    their rows ``slots`` (T,) and ``positions`` (T,); each sequence's keys in
    use ``kv_lengths`` (B,) and ``block_table`` (B, max_blocks), and the
    longest of each. ``path`` says how attention reads the keys
    (:data:`PAGED_PATHS`); ``prepared`` keeps what it builds once per step."""

    cache: PagedKVCache
    q_offsets: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    kv_lengths: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    max_kv: int
    path: str = "gathered"
    backend: str | None = None
    prepared: dict = field(default_factory=dict)

    def attend(self, q, k, v, layer):  # (T, H, D), (T, H_kv, D) -> (T, H, D)
        self.cache.write(layer, k, v, self.slots)
        return PAGED_PATHS[self.path](q, self, layer)


def gathered_attention(q, step, layer):
    """The keys in use, gathered through the block table into a packed
    batch, then ``ragged_attention``, causal (aligned bottom-right: the new
    queries are each sequence's last): q (T, H, D) -> (T, H, D)."""
    if "rows" not in step.prepared:  # once per step, for every layer
        step.prepared["rows"] = paged_rows(step.block_table, step.kv_lengths, step.cache.block_size)
        step.prepared["kv_offsets"] = offsets_from_lengths(step.kv_lengths, q.device)
    rows = step.prepared["rows"]
    k, v = step.cache.k[layer].index_select(0, rows), step.cache.v[layer].index_select(0, rows)
    return ragged_attention(q, k, v, step.q_offsets, step.prepared["kv_offsets"], is_causal=True,
                            backend=step.backend)


def paged_block_mask(step, device):
    """A FlexAttention ``BlockMask`` of the new queries (padded to
    :func:`~ragged_toolkit.attention.flex.flex_rows`) against every row of
    the cache: a query sees a row that its sequence's block table names, at
    a position up to its own."""
    from torch.nn.attention.flex_attention import create_block_mask

    n_rows, t_q = step.cache.k.shape[1], len(step.positions)
    n_q = flex_rows(t_q)
    rows = paged_rows(step.block_table, step.kv_lengths, step.cache.block_size)
    seq, pos = token_index(offsets_from_lengths(step.kv_lengths, device))
    owner = torch.full((n_rows,), -1, device=device).index_put_((rows,), seq)
    row_pos = torch.zeros(n_rows, dtype=torch.long, device=device).index_put_((rows,), pos)
    q_seq = F.pad(token_index(step.q_offsets)[0], (0, n_q - t_q), value=-2)  # padding sees nothing
    q_pos = F.pad(step.positions, (0, n_q - t_q))

    def paged_causal(b, h, q_idx, kv_idx):
        return (owner[kv_idx] == q_seq[q_idx]) & (row_pos[kv_idx] <= q_pos[q_idx])

    return create_block_mask(paged_causal, None, None, n_q, n_rows, device=device,
                             BLOCK_SIZE=FLEX_BLOCK)


def flex_paged_attention(q, step, layer):
    """FlexAttention reading the cache in place with :func:`paged_block_mask`,
    the new queries as one padded sequence: q (T, H, D) -> (T, H, D)."""
    if "mask" not in step.prepared:
        step.prepared["mask"] = paged_block_mask(step, q.device)
    mask = step.prepared["mask"]
    qf = F.pad(q, (0, 0, 0, 0, 0, mask.seq_lengths[0] - len(q))).transpose(0, 1)[None]
    kf, vf = (t[layer].transpose(0, 1)[None] for t in (step.cache.k, step.cache.v))
    out = compiled_flex_attention(qf, kf, vf, block_mask=mask,  # (1, H, n_q, D), (1, H_kv, rows, D)
                                  enable_gqa=q.shape[1] != kf.shape[1])
    return out[0, :, :len(q)].transpose(0, 1)


def varlen_paged_attention(q, step, layer):
    """``varlen_attn`` reading the cache in place through ``block_table``
    and ``seqused_k`` (FlashAttention's paged kernel): q (T, H, D) -> (T, H, D)."""
    c, lengths = step.cache, step.kv_lengths.to(torch.int32)
    k, v = (t[layer].view(c.n_blocks, c.block_size, *t.shape[2:]) for t in (c.k, c.v))  # pages
    return varlen_attn(q, k, v, step.q_offsets.to(torch.int32), offsets_from_lengths(lengths).int(),
                       step.max_q, step.max_kv, window_size=(-1, 0), seqused_k=lengths,
                       enable_gqa=q.shape[1] != k.shape[2], block_table=step.block_table)


#: How a :class:`PagedLayout` reads the cache: name -> ``fn(q, step, layer)``.
PAGED_PATHS = {"gathered": gathered_attention, "flex": flex_paged_attention,
               "varlen": varlen_paged_attention}


def paged_varlen_support(device, dtype, block_size):
    """None if ``varlen_attn`` can read a paged cache here, else why not."""
    why = backend_support("varlen", device, dtype, is_causal=True, gqa=True)
    if why:
        return why
    missing = {"block_table", "seqused_k", "window_size", "enable_gqa"} - varlen_keywords()
    if missing:
        return f"this release's varlen_attn has no {', '.join(sorted(missing))}"
    if block_size % 256:
        return f"blocks of {block_size} rows: FlashAttention's paged kernel needs a multiple of 256"
    return None


# --- one step of the engine --------------------------------------------------------------


def build_step(cache, work, device, path="gathered", backend=None):
    """The tokens (T,), positions (T,) and :class:`PagedLayout` of a step
    that feeds each ``(request, n)`` of ``work`` its next ``n`` tokens, into
    rows already reserved. ``n = 0``: an idle slot, one padding token at the
    request's next position, whose key nothing reads."""
    tokens, positions, slots, q_lengths, kv_lengths = [], [], [], [], []
    for req, n in work:
        start, m = req.computed, max(n, 1)
        tokens += (req.prompt + req.generated)[start:start + n] if n else [0]
        positions += range(start, start + m)
        slots += cache.slots(req.rid, range(start, start + m))
        q_lengths.append(m)
        kv_lengths.append(start + m)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    layout = PagedLayout(cache, offsets_from_lengths(q_lengths, device), as_tensor(slots),
                         as_tensor(positions), as_tensor(kv_lengths),
                         block_table_tensor(cache, [r.rid for r, _ in work], device),
                         max(q_lengths), max(kv_lengths), path, backend)
    return as_tensor(tokens), layout.positions, layout


@torch.no_grad()
def forward_step(model, cache, work, path="gathered", backend=None):
    """One forward pass over the packed tokens of ``work``, a list of
    ``(request, n)``; each request whose history is then all in the cache
    gets its next token, the greedy choice, and keeps the logits that chose it."""
    tokens, positions, layout = build_step(cache, work, cache.k.device, path, backend)
    last = model(tokens, positions, layout)[layout.q_offsets[1:] - 1]  # (B, vocab)
    choices = last.argmax(-1).tolist()
    for i, (req, n) in enumerate(work):
        req.computed += n
        if n and req.pending() == 0:
            req.generated.append(choices[i])
            req.logits.append(last[i].float())


# --- the schedulers ----------------------------------------------------------------------


def preempt(req, cache):
    """Free a request's blocks: when admitted again, it recomputes its keys
    from position 0 of ``prompt + generated``."""
    cache.release(req.rid)
    req.computed = 0
    req.preempted += 1


def plan_continuous(running, waiting, cache, now, *, max_running, token_budget):
    """Continuous batching: one step's work, a list of ``(request, n)``.
    Running requests first, in admission order (a decode token each, or
    their next prompt chunk); when no block is free, the most recently
    admitted is preempted to the front of ``waiting``. Then, if none was,
    requests that have arrived by ``now`` join while slots, free blocks and
    the step's token budget allow, a long prompt cut into chunks."""
    work, budget, i, preempted = [], token_budget, 0, False
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.pending(), budget)
        if cache.reserve(req.rid, req.computed + n):
            work.append((req, n))
            budget, i = budget - n, i + 1
            continue
        if len(running) == 1:
            raise RuntimeError(f"request {req.rid} alone needs more than the cache's blocks")
        victim = running.pop()  # the most recently admitted
        preempt(victim, cache)
        waiting.appendleft(victim)
        preempted = True
    while not preempted and waiting and waiting[0].arrival <= now and len(running) < max_running \
            and budget > 0:
        req = waiting[0]
        n = min(req.pending(), budget)
        if not cache.reserve(req.rid, req.computed + n):
            if not running:
                raise RuntimeError(f"request {req.rid} alone needs more than the cache's blocks")
            break
        running.append(waiting.popleft())
        work.append((req, n))
        budget -= n
    return work


def plan_static(running, waiting, cache, now, *, batch_size, reserve, skip_finished=False):
    """Static batching: with no batch running, up to ``batch_size`` requests
    that have arrived by ``now`` start together, their whole prompts in one
    packed step, ``len(prompt) + reserve`` rows each reserved up front. Then
    each gets one token per step and none joins until all are done; a
    finished request's slot idles, computing a padding token as a batched
    ``generate`` (or a fixed-shape step) does, or nothing (``skip_finished``)."""
    if not running:
        while waiting and waiting[0].arrival <= now and len(running) < batch_size:
            req = waiting.popleft()
            if not cache.reserve(req.rid, len(req.prompt) + reserve):
                raise RuntimeError(f"the cache has no room for a static batch of {batch_size}")
            running.append(req)
    return [(req, 0 if req.done() else req.pending()) for req in running
            if not (skip_finished and req.done())]


def retire_finished(running, cache):
    """Continuous batching: finished requests leave, their blocks freed."""
    for req in [r for r in running if r.done()]:
        cache.release(req.rid)
        running.remove(req)


def retire_batch(running, cache):
    """Static batching: the batch leaves when its last request is done."""
    return all(r.done() for r in running) and retire_finished(running, cache)


# --- the simulated server ----------------------------------------------------------------


@dataclass
class StepRecord:
    """A step's measured seconds, prompt (or recomputed) and decode tokens,
    slots taken; after it, requests waiting (arrived), rows used, blocks held."""

    seconds: float
    prefill: int
    decode: int
    running: int
    waiting: int
    used_rows: int
    held_blocks: int


@dataclass
class ServingRun:
    """What a run of :func:`serve` did: its requests and its steps."""

    requests: list
    steps: list


def record_step(seconds, fed, slots, running, waiting, cache, now):
    """The :class:`StepRecord` of a step that fed ``fed``, a list of
    ``(request, n, whether that was a decode token)``, in ``slots`` slots."""
    decode = sum(n for _, n, was_decode in fed if was_decode)
    arrived = sum(r.arrival <= now for r in waiting)
    return StepRecord(seconds, sum(n for _, n, _ in fed) - decode, decode, slots, arrived,
                      sum(r.computed for r in running), sum(map(len, cache.tables.values())))


def stamp_clock(requests, now):
    """Note the clock on each request's first token and on its last."""
    for req in requests:
        if req.generated and req.first_token_s is None:
            req.first_token_s = now
        if req.done() and req.finish_s is None:
            req.finish_s = now


def serve(model, requests, cache, plan, retire_step=retire_finished, *, path="gathered",
          backend=None, check=False, observe=None):
    """Serve ``requests`` on a simulated clock that advances by each step's
    measured time and jumps to the next arrival when nothing runs. A generator
    yielding after each step (:func:`take_turns`), returning a
    :class:`ServingRun`. ``plan(running, waiting, cache, now)`` picks a step's
    work, ``retire_step(running, cache)`` ends it; ``check``: verify the
    blocks after each step; ``observe(step, running, cache)``: called after each."""
    waiting, running, steps, now = deque(sorted(requests, key=lambda r: r.arrival)), [], [], 0.0
    while waiting or running:
        if not running and waiting[0].arrival > now:
            now = waiting[0].arrival
        synchronize()
        start = time.perf_counter()
        work = plan(running, waiting, cache, now)
        fed = [(req, n, bool(req.generated) and req.pending() == 1) for req, n in work]
        slots = len(running)
        forward_step(model, cache, work, path, backend)
        retire_step(running, cache)
        synchronize()
        seconds = time.perf_counter() - start
        now += seconds
        stamp_clock([req for req, _ in work], now)
        steps.append(record_step(seconds, fed, slots, running, waiting, cache, now))
        if check:
            cache.check()
        if observe is not None:
            observe(len(steps) - 1, running, cache)
        yield
    return ServingRun(requests, steps)


def take_turns(*starts):
    """Runs of :func:`serve` one step each in turn. ``starts`` are functions
    that start a run (a fresh :func:`serve` generator); a run that ends
    starts again until each has ended once, so that all span the same
    stretch of time and whatever else the machine does weighs on them alike.
    Returns, for each, its finished :class:`ServingRun` s (a repeat still
    running at the end is dropped)."""
    finished, live = [[] for _ in starts], [start() for start in starts]
    while not all(finished):
        for i, run in enumerate(live):
            try:
                next(run)
            except StopIteration as end:
                finished[i].append(end.value)
                live[i] = starts[i]()
    return finished


# --- what a run measured, and its proof --------------------------------------------------


def tokens_per_second(runs):
    """Generated tokens over busy seconds (time stepping), over ``runs``."""
    tokens = sum(r.n_out for run in runs for r in run.requests)
    return tokens / sum(s.seconds for run in runs for s in run.steps)


def slot_bound(run):
    """What idle slots cost a static run: slot-steps (its slots times its
    steps) over the tokens it generated."""
    slots = max(s.running for s in run.steps)
    return slots * len(run.steps) / sum(r.n_out for r in run.requests)


def latency_ms(requests):
    """Percentiles 50 and 99, in ms, of the time to first token (from
    arrival) and of the time per output token after the first:
    ``{"ttft": (p50, p99), "tpot": (p50, p99)}``."""
    ttft = [r.first_token_s - r.arrival for r in requests]
    tpot = [(r.finish_s - r.first_token_s) / (r.n_out - 1) for r in requests if r.n_out > 1]
    return {name: tuple(np.percentile(np.array(x) * 1e3, [50, 99]).tolist())
            for name, x in (("ttft", ttft), ("tpot", tpot))}


@torch.no_grad()
def logits_alone(model, request):
    """The logits with which greedy decoding of ``request`` alone, without a
    cache, chooses each of its tokens: one causal pass, padded layout, over
    its prompt and its tokens but the last (teacher forcing). (n_out, vocab)."""
    device = next(model.parameters()).device
    ids = torch.tensor(request.prompt + request.generated[:-1], device=device)[None]  # (1, S)
    positions = torch.arange(ids.shape[1], device=device)[None]
    return model(ids, positions, Padded())[0, len(request.prompt) - 1:]


def check_against_alone(reference, requests, tolerance):
    """Prove each request's tokens are those of greedy decoding it alone with
    ``reference`` (a float32 model): the server's logits agree with
    :func:`logits_alone` within ``tolerance`` (``assert_close`` keywords),
    and each token is the reference's greedy choice or ties with it within
    ``tolerance["atol"]``; by induction on the tokens, the request then
    generated what decoding it alone generates. Raises ``AssertionError``
    naming the request; returns ``(largest logit difference, ties)``."""
    worst, ties = 0.0, 0
    for req in requests:
        assert req.done() and len(req.generated) == req.n_out, f"request {req.rid} did not finish"
        ref = logits_alone(reference, req).float()  # (n_out, vocab)
        got = torch.stack(req.logits).to(ref.device)
        torch.testing.assert_close(got, ref, **tolerance, msg=lambda m, r=req:
                                   f"request {r.rid}: logits differ from decoding it alone: {m}")
        chosen = ref.gather(1, torch.tensor(req.generated, device=ref.device)[:, None])[:, 0]
        gap = ref.max(-1).values - chosen  # 0 where the token is the reference's choice
        bad = (gap > tolerance["atol"]).nonzero().flatten().tolist()
        assert not bad, f"request {req.rid}: token {bad[0]} is not what decoding it alone chooses"
        ties += int((gap > 0).sum())
        worst = max(worst, float((got - ref).abs().max()))
    return worst, ties
